"""The prefill kernel's score pass on bfloat16 pairs (vdpbf16ps), for bf16 caches on AVX512-BF16 hosts without AMX.

cpu_prefill_attention's 16-lane score pass widens each bf16 K element to float32 and runs one 16-lane FMA per (key,
d): the float32 FMA rate caps it. vdpbf16ps multiplies two bf16 pairs per 32-bit lane and adds both products to a
float32 lane in one instruction at the FMA's issue rate, so the same scores take half the instructions (one score
tile, 4 keys x 48 rows x d 64, measured on Zen 4: 218 vs 116 GFLOP/s). Layout, as the FMA pass's with d halved:
  s[j, r:r+48] = scale * sum_{d2} Kpair[j, d2] (broadcast 32-bit word, read in place from the cache) . Qpair[d2, r:r+48]
where a pair is the bf16 elements 2 d2 and 2 d2 + 1 of a row (adjacent in the cache and in q, so a pair is one
32-bit word of either, read through a float32 view of the uint16 data). q enters as its bf16 bits, unscaled, and the
scale multiplies the float32 sums (SDPA's order), so no rounding happens before the products.

Numerics: products of bf16 values are exact in float32; the sums are float32 in another order than the FMA pass's
(pairs, then across d), and bf16 denormals (below 1.2e-38, never seen in attention inputs) read as zero. The output
differs from the FMA pass's in the last bits of the float32 scores, and after the final rounding to bf16 by at most
one bf16 unit in a few elements (tests/test_cpu_prefill_attention.py bounds both against float64).
"""
from __future__ import annotations

from functools import cache

import numpy as np

from tokenplane.engine.cpu_prefill_passes import _track_max16
from tokenplane.engine.cpu_simd import (
    HOST_AVX512_BF16,
    _dpbf16x16,
    _load16,
    _mul16,
    _splat16,
    _store16,
    _zero16,
)
from tokenplane.engine.numbacache import njit


@njit(inline="always")
def scores4(kw, k0, k1, k2, k3, qp, rb, rp, half_d, s, so, mt, track, vsc):  # noqa: ANN001
    """s[so + i * rp + rb : +48] = scale * K row i . q rows rb .. rb + 47 for the 4 keys i, from pair offsets k0..k3
    into kw (the cache as float32 words, one bf16 pair each) and qp [half_d, rp] (q's pairs, transposed); vsc: the
    scale in every lane. With track, mt[rb : rb + 48] = max(mt, those scores) while they are in registers."""
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
    for d2 in range(half_d):
        qi = d2 * rp + rb
        q0 = _load16(qp, qi)
        q1 = _load16(qp, qi + 16)
        q2 = _load16(qp, qi + 32)
        b = _splat16(kw, k0 + d2)
        a00 = _dpbf16x16(a00, b, q0)
        a01 = _dpbf16x16(a01, b, q1)
        a02 = _dpbf16x16(a02, b, q2)
        b = _splat16(kw, k1 + d2)
        a10 = _dpbf16x16(a10, b, q0)
        a11 = _dpbf16x16(a11, b, q1)
        a12 = _dpbf16x16(a12, b, q2)
        b = _splat16(kw, k2 + d2)
        a20 = _dpbf16x16(a20, b, q0)
        a21 = _dpbf16x16(a21, b, q1)
        a22 = _dpbf16x16(a22, b, q2)
        b = _splat16(kw, k3 + d2)
        a30 = _dpbf16x16(a30, b, q0)
        a31 = _dpbf16x16(a31, b, q1)
        a32 = _dpbf16x16(a32, b, q2)
    a00 = _mul16(a00, vsc)
    a01 = _mul16(a01, vsc)
    a02 = _mul16(a02, vsc)
    a10 = _mul16(a10, vsc)
    a11 = _mul16(a11, vsc)
    a12 = _mul16(a12, vsc)
    a20 = _mul16(a20, vsc)
    a21 = _mul16(a21, vsc)
    a22 = _mul16(a22, vsc)
    a30 = _mul16(a30, vsc)
    a31 = _mul16(a31, vsc)
    a32 = _mul16(a32, vsc)
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
def scores1(kw, k0, qp, rb, rp, half_d, s, so, mt, track, vsc):  # noqa: ANN001
    """`scores4` for one key."""
    a00 = _zero16()
    a01 = _zero16()
    a02 = _zero16()
    for d2 in range(half_d):
        qi = d2 * rp + rb
        b = _splat16(kw, k0 + d2)
        a00 = _dpbf16x16(a00, b, _load16(qp, qi))
        a01 = _dpbf16x16(a01, b, _load16(qp, qi + 16))
        a02 = _dpbf16x16(a02, b, _load16(qp, qi + 32))
    a00 = _mul16(a00, vsc)
    a01 = _mul16(a01, vsc)
    a02 = _mul16(a02, vsc)
    _store16(s, so + rb, a00)
    _store16(s, so + rb + 16, a01)
    _store16(s, so + rb + 32, a02)
    if track:
        _track_max16(mt, rb, a00, a00, a00, a00)
        _track_max16(mt, rb + 16, a01, a01, a01, a01)
        _track_max16(mt, rb + 32, a02, a02, a02, a02)


@njit(cache=True)
def _probe(a, b, out):  # noqa: ANN001
    _store16(out, 0, _dpbf16x16(_zero16(), _load16(a, 0), _load16(b, 0)))


@cache
def works() -> bool:
    """Whether this host compiles and runs the pair product correctly (checked once: 16 lanes of known pairs), so a
    numba / LLVM that cannot emit vdpbf16ps falls back to the FMA passes instead of failing a prefill."""
    if not HOST_AVX512_BF16:
        return False
    lo = np.arange(1, 17, dtype=np.float32)
    hi = np.full(16, 0.5, dtype=np.float32)
    # bf16 pairs: (lo, hi) in a, (hi, 2) in b; every value is exact in bf16, so lane j = lo[j] * 0.5 + 0.5 * 2
    a = ((lo.view(np.uint32) >> 16) | (hi.view(np.uint32) & 0xFFFF0000)).view(np.float32)
    two = np.full(16, 2.0, dtype=np.float32)
    b = ((hi.view(np.uint32) >> 16) | (two.view(np.uint32) & 0xFFFF0000)).view(np.float32)
    out = np.zeros(16, dtype=np.float32)
    try:
        _probe(a, b, out)
    except Exception:   # noqa: BLE001 - any compile or run failure means: do not use the pair passes here
        return False
    return bool(np.array_equal(out, lo * 0.5 + 1.0))
