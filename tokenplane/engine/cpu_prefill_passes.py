"""The prefill kernel's score and value passes on float32 vectors (cpu_prefill_attention.py has the tiling, the
online softmax and the dispatch): 8-lane passes (ymm) and, on AVX-512 hosts, 16-lane ones (zmm) with twice the rows a
score pass and twice the columns a value pass, each lane's sums in the same order, so both widths give the same bits.

Softmax exponent: s[key, rows] = exp(s - the rows' running max) a row block at a time as vector operations
(cpu_decode_paging._exp_shifted, the same bits at both widths), with the block's sums over the tile's keys kept in a
register (in key order: the sums of a scalar loop over keys). LLVM's vectorization of the scalar loop ran at 0.5-0.7
ns a score against 0.3 here (8 lanes, Zen 3); SmolLM2's P = 2048 layer, paired in one process: 69.0 -> 66.0 ms.

Score pass: s[key, rows] = K row (broadcast, read in place from the cache; a bf16 cache is widened exactly as loaded)
. qt[:, rows] over d, 4 keys at a time with 12 accumulators (two FMA pipes x 4 cycles of latency need 8 in flight),
the row maximum taken while the scores are in registers where no key of the tile is masked. Value pass: o[6 rows,
columns] = alpha * o + sum over the tile's keys of p[key, row] (broadcast) . V[key, columns].
"""
from __future__ import annotations

from tokenplane.engine.cpu_decode_paging import _exp8_shifted, _exp16_shifted
from tokenplane.engine.cpu_simd import (
    _add8,
    _add16,
    _fma8,
    _fma16,
    _load8,
    _load16,
    _load16_kv,
    _max8,
    _max16,
    _splat8,
    _splat16,
    _splat16_kv,
    _store8,
    _store16,
    _zero8,
    _zero16,
)
from tokenplane.engine.numbacache import njit


@njit(inline="always")
def _track_max(mt, i, a, b, c, d):  # noqa: ANN001
    """mt[i : i + 8] = max(mt[i : i + 8], a, b, c, d)."""
    _store8(mt, i, _max8(_max8(_max8(a, b), _max8(c, d)), _load8(mt, i)))


@njit(inline="always")
def _scores4(kf, k0, k1, k2, k3, qt, rb, rp, d_dim, s, so, mt, track):  # noqa: ANN001
    """s[so + i * rp + rb : +24] = K row at kf[k_i] . qt[:, rb : rb + 24] for the 4 keys i (so = first key's row);
    with track, also mt[rb : rb + 24] = max(mt, those scores) while they are in registers. 12 accumulators: two FMA
    pipes x 4 cycles of latency need 8 in flight, and the loads (3 vectors, 4 broadcasts) stay under the FMAs."""
    a00 = _zero8()
    a01 = _zero8()
    a02 = _zero8()
    a10 = _zero8()
    a11 = _zero8()
    a12 = _zero8()
    a20 = _zero8()
    a21 = _zero8()
    a22 = _zero8()
    a30 = _zero8()
    a31 = _zero8()
    a32 = _zero8()
    for d in range(d_dim):
        qi = d * rp + rb
        q0 = _load8(qt, qi)
        q1 = _load8(qt, qi + 8)
        q2 = _load8(qt, qi + 16)
        b = _splat8(kf, k0 + d)
        a00 = _fma8(b, q0, a00)
        a01 = _fma8(b, q1, a01)
        a02 = _fma8(b, q2, a02)
        b = _splat8(kf, k1 + d)
        a10 = _fma8(b, q0, a10)
        a11 = _fma8(b, q1, a11)
        a12 = _fma8(b, q2, a12)
        b = _splat8(kf, k2 + d)
        a20 = _fma8(b, q0, a20)
        a21 = _fma8(b, q1, a21)
        a22 = _fma8(b, q2, a22)
        b = _splat8(kf, k3 + d)
        a30 = _fma8(b, q0, a30)
        a31 = _fma8(b, q1, a31)
        a32 = _fma8(b, q2, a32)
    o = so + rb
    _store8(s, o, a00)
    _store8(s, o + 8, a01)
    _store8(s, o + 16, a02)
    _store8(s, o + rp, a10)
    _store8(s, o + rp + 8, a11)
    _store8(s, o + rp + 16, a12)
    _store8(s, o + 2 * rp, a20)
    _store8(s, o + 2 * rp + 8, a21)
    _store8(s, o + 2 * rp + 16, a22)
    _store8(s, o + 3 * rp, a30)
    _store8(s, o + 3 * rp + 8, a31)
    _store8(s, o + 3 * rp + 16, a32)
    if track:
        _track_max(mt, rb, a00, a10, a20, a30)
        _track_max(mt, rb + 8, a01, a11, a21, a31)
        _track_max(mt, rb + 16, a02, a12, a22, a32)


@njit(inline="always")
def _scores1(kf, k0, qt, rb, rp, d_dim, s, so, mt, track):  # noqa: ANN001
    a00 = _zero8()
    a01 = _zero8()
    a02 = _zero8()
    for d in range(d_dim):
        qi = d * rp + rb
        b = _splat8(kf, k0 + d)
        a00 = _fma8(b, _load8(qt, qi), a00)
        a01 = _fma8(b, _load8(qt, qi + 8), a01)
        a02 = _fma8(b, _load8(qt, qi + 16), a02)
    _store8(s, so + rb, a00)
    _store8(s, so + rb + 8, a01)
    _store8(s, so + rb + 16, a02)
    if track:
        _track_max(mt, rb, a00, a00, a00, a00)
        _track_max(mt, rb + 8, a01, a01, a01, a01)
        _track_max(mt, rb + 16, a02, a02, a02, a02)


@njit(inline="always")
def _rescaled(o, i, alpha, r):  # noqa: ANN001
    return _fma8(_load8(o, i), _splat8(alpha, r), _zero8())


@njit(inline="always")
def _values6(vf, ofs, nk, p, rp, r, o, d_dim, c, alpha):  # noqa: ANN001
    """o[r..r+5, c:c+16] = o * alpha[row] + sum_j p[j, row] * V[j, c:c+16] (V row j at vf[ofs[j]]): 12 accumulators,
    2 vector loads and 6 broadcasts a key."""
    i0 = r * d_dim + c
    a00 = _rescaled(o, i0, alpha, r)
    a01 = _rescaled(o, i0 + 8, alpha, r)
    a10 = _rescaled(o, i0 + d_dim, alpha, r + 1)
    a11 = _rescaled(o, i0 + d_dim + 8, alpha, r + 1)
    a20 = _rescaled(o, i0 + 2 * d_dim, alpha, r + 2)
    a21 = _rescaled(o, i0 + 2 * d_dim + 8, alpha, r + 2)
    a30 = _rescaled(o, i0 + 3 * d_dim, alpha, r + 3)
    a31 = _rescaled(o, i0 + 3 * d_dim + 8, alpha, r + 3)
    a40 = _rescaled(o, i0 + 4 * d_dim, alpha, r + 4)
    a41 = _rescaled(o, i0 + 4 * d_dim + 8, alpha, r + 4)
    a50 = _rescaled(o, i0 + 5 * d_dim, alpha, r + 5)
    a51 = _rescaled(o, i0 + 5 * d_dim + 8, alpha, r + 5)
    for j in range(nk):
        vb = ofs[j] + c
        v0 = _load8(vf, vb)
        v1 = _load8(vf, vb + 8)
        pj = j * rp + r
        b = _splat8(p, pj)
        a00 = _fma8(b, v0, a00)
        a01 = _fma8(b, v1, a01)
        b = _splat8(p, pj + 1)
        a10 = _fma8(b, v0, a10)
        a11 = _fma8(b, v1, a11)
        b = _splat8(p, pj + 2)
        a20 = _fma8(b, v0, a20)
        a21 = _fma8(b, v1, a21)
        b = _splat8(p, pj + 3)
        a30 = _fma8(b, v0, a30)
        a31 = _fma8(b, v1, a31)
        b = _splat8(p, pj + 4)
        a40 = _fma8(b, v0, a40)
        a41 = _fma8(b, v1, a41)
        b = _splat8(p, pj + 5)
        a50 = _fma8(b, v0, a50)
        a51 = _fma8(b, v1, a51)
    _store8(o, i0, a00)
    _store8(o, i0 + 8, a01)
    _store8(o, i0 + d_dim, a10)
    _store8(o, i0 + d_dim + 8, a11)
    _store8(o, i0 + 2 * d_dim, a20)
    _store8(o, i0 + 2 * d_dim + 8, a21)
    _store8(o, i0 + 3 * d_dim, a30)
    _store8(o, i0 + 3 * d_dim + 8, a31)
    _store8(o, i0 + 4 * d_dim, a40)
    _store8(o, i0 + 4 * d_dim + 8, a41)
    _store8(o, i0 + 5 * d_dim, a50)
    _store8(o, i0 + 5 * d_dim + 8, a51)


@njit(inline="always")
def _track_max16(mt, i, a, b, c, d):  # noqa: ANN001
    _store16(mt, i, _max16(_max16(_max16(a, b), _max16(c, d)), _load16(mt, i)))


@njit(inline="always")
def _scores4w(kf, k0, k1, k2, k3, qt, rb, rp, d_dim, s, so, mt, track):  # noqa: ANN001
    """_scores4 on 16-float vectors: 4 keys x 48 rows, 12 accumulators."""
    a00 = _zero16()
    a01 = _zero16()
    a02 = _zero16()
    a10 = _zero16()
    a11 = _zero16()
    a12 = _zero16()
    a20 = _zero16()
    a21 = _zero16()
    a22 = _zero16()
    a30 = _zero16()
    a31 = _zero16()
    a32 = _zero16()
    for d in range(d_dim):
        qi = d * rp + rb
        q0 = _load16(qt, qi)
        q1 = _load16(qt, qi + 16)
        q2 = _load16(qt, qi + 32)
        b = _splat16_kv(kf, k0 + d)
        a00 = _fma16(b, q0, a00)
        a01 = _fma16(b, q1, a01)
        a02 = _fma16(b, q2, a02)
        b = _splat16_kv(kf, k1 + d)
        a10 = _fma16(b, q0, a10)
        a11 = _fma16(b, q1, a11)
        a12 = _fma16(b, q2, a12)
        b = _splat16_kv(kf, k2 + d)
        a20 = _fma16(b, q0, a20)
        a21 = _fma16(b, q1, a21)
        a22 = _fma16(b, q2, a22)
        b = _splat16_kv(kf, k3 + d)
        a30 = _fma16(b, q0, a30)
        a31 = _fma16(b, q1, a31)
        a32 = _fma16(b, q2, a32)
    o = so + rb
    _store16(s, o, a00)
    _store16(s, o + 16, a01)
    _store16(s, o + 32, a02)
    _store16(s, o + rp, a10)
    _store16(s, o + rp + 16, a11)
    _store16(s, o + rp + 32, a12)
    _store16(s, o + 2 * rp, a20)
    _store16(s, o + 2 * rp + 16, a21)
    _store16(s, o + 2 * rp + 32, a22)
    _store16(s, o + 3 * rp, a30)
    _store16(s, o + 3 * rp + 16, a31)
    _store16(s, o + 3 * rp + 32, a32)
    if track:
        _track_max16(mt, rb, a00, a10, a20, a30)
        _track_max16(mt, rb + 16, a01, a11, a21, a31)
        _track_max16(mt, rb + 32, a02, a12, a22, a32)


@njit(inline="always")
def _scores1w(kf, k0, qt, rb, rp, d_dim, s, so, mt, track):  # noqa: ANN001
    a00 = _zero16()
    a01 = _zero16()
    a02 = _zero16()
    for d in range(d_dim):
        qi = d * rp + rb
        b = _splat16_kv(kf, k0 + d)
        a00 = _fma16(b, _load16(qt, qi), a00)
        a01 = _fma16(b, _load16(qt, qi + 16), a01)
        a02 = _fma16(b, _load16(qt, qi + 32), a02)
    _store16(s, so + rb, a00)
    _store16(s, so + rb + 16, a01)
    _store16(s, so + rb + 32, a02)
    if track:
        _track_max16(mt, rb, a00, a00, a00, a00)
        _track_max16(mt, rb + 16, a01, a01, a01, a01)
        _track_max16(mt, rb + 32, a02, a02, a02, a02)


@njit(inline="always")
def _rescaled16(o, i, alpha, r):  # noqa: ANN001
    return _fma16(_load16(o, i), _splat16(alpha, r), _zero16())


@njit(inline="always")
def _values6w(vf, ofs, nk, p, rp, r, o, d_dim, c, alpha):  # noqa: ANN001
    """_values6 on 16-float vectors: 6 rows x 32 columns, 12 accumulators."""
    i0 = r * d_dim + c
    a00 = _rescaled16(o, i0, alpha, r)
    a01 = _rescaled16(o, i0 + 16, alpha, r)
    a10 = _rescaled16(o, i0 + d_dim, alpha, r + 1)
    a11 = _rescaled16(o, i0 + d_dim + 16, alpha, r + 1)
    a20 = _rescaled16(o, i0 + 2 * d_dim, alpha, r + 2)
    a21 = _rescaled16(o, i0 + 2 * d_dim + 16, alpha, r + 2)
    a30 = _rescaled16(o, i0 + 3 * d_dim, alpha, r + 3)
    a31 = _rescaled16(o, i0 + 3 * d_dim + 16, alpha, r + 3)
    a40 = _rescaled16(o, i0 + 4 * d_dim, alpha, r + 4)
    a41 = _rescaled16(o, i0 + 4 * d_dim + 16, alpha, r + 4)
    a50 = _rescaled16(o, i0 + 5 * d_dim, alpha, r + 5)
    a51 = _rescaled16(o, i0 + 5 * d_dim + 16, alpha, r + 5)
    for j in range(nk):
        vb = ofs[j] + c
        v0 = _load16_kv(vf, vb)
        v1 = _load16_kv(vf, vb + 16)
        pj = j * rp + r
        b = _splat16(p, pj)
        a00 = _fma16(b, v0, a00)
        a01 = _fma16(b, v1, a01)
        b = _splat16(p, pj + 1)
        a10 = _fma16(b, v0, a10)
        a11 = _fma16(b, v1, a11)
        b = _splat16(p, pj + 2)
        a20 = _fma16(b, v0, a20)
        a21 = _fma16(b, v1, a21)
        b = _splat16(p, pj + 3)
        a30 = _fma16(b, v0, a30)
        a31 = _fma16(b, v1, a31)
        b = _splat16(p, pj + 4)
        a40 = _fma16(b, v0, a40)
        a41 = _fma16(b, v1, a41)
        b = _splat16(p, pj + 5)
        a50 = _fma16(b, v0, a50)
        a51 = _fma16(b, v1, a51)
    _store16(o, i0, a00)
    _store16(o, i0 + 16, a01)
    _store16(o, i0 + d_dim, a10)
    _store16(o, i0 + d_dim + 16, a11)
    _store16(o, i0 + 2 * d_dim, a20)
    _store16(o, i0 + 2 * d_dim + 16, a21)
    _store16(o, i0 + 3 * d_dim, a30)
    _store16(o, i0 + 3 * d_dim + 16, a31)
    _store16(o, i0 + 4 * d_dim, a40)
    _store16(o, i0 + 4 * d_dim + 16, a41)
    _store16(o, i0 + 5 * d_dim, a50)
    _store16(o, i0 + 5 * d_dim + 16, a51)


def _softmax_exps(lanes: int):  # noqa: ANN202
    """(exp_rows, exp_sum_rows) on `lanes`-float vectors: s[j * rp + rb : + lanes] = exp(s - mt[rb : + lanes]) for the
    tile's nk keys j; exp_sum_rows also writes part[rb : + lanes] = the sum of those exponents over the keys."""
    load, store, zero, add = (_load16, _store16, _zero16, _add16) if lanes == 16 else (_load8, _store8, _zero8, _add8)
    exp = _exp16_shifted if lanes == 16 else _exp8_shifted

    @njit(inline="always")
    def exp_rows(s, rp, rb, nk, mt):  # noqa: ANN001, ANN202
        m = load(mt, rb)
        for j in range(nk):
            store(s, j * rp + rb, exp(s, j * rp + rb, m))

    @njit(inline="always")
    def exp_sum_rows(s, rp, rb, nk, mt, part):  # noqa: ANN001, ANN202
        m = load(mt, rb)
        acc = zero()
        for j in range(nk):
            e = exp(s, j * rp + rb, m)
            store(s, j * rp + rb, e)
            acc = add(acc, e)
        store(part, rb, acc)
    return exp_rows, exp_sum_rows


_exp_rows8, _exp_sum_rows8 = _softmax_exps(8)
_exp_rows16, _exp_sum_rows16 = _softmax_exps(16)
