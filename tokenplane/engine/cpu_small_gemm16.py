"""cpu_small_gemm's kernel in 16-lane vectors, for hosts with AVX-512 (cpu_simd.HOST_AVX512): the same panel copy,
the same summation order, twice the lanes per instruction.

On AVX-512 the 8-lane kernel runs at half the core's fused multiply-add rate, and oneDNN (vLLM's CPU linear) and
F.linear pass it from ~8 rows on. Here one panel row (16 output columns) is one zmm register and a pass covers two
panels (32 columns) of up to 12 rows: 24 accumulators of the 32 registers, 2 panel loads and 12 broadcasts for 24
FMAs a k step. Measured on a Sapphire Rapids core (1 thread, best of 5; results/small_gemm16.md): 1.2-1.4x the
8-lane kernel from 8 rows on, equal at 1-4 rows (a stream over the weight either way); ahead of F.linear up to 64
rows and level with it at 256. Rows left over after the 12-row passes take passes of 6, 4, 2 and 1 rows, an odd
count of 3, 5, 9 or 11 padded with zero rows to one pass fewer (PAD_ODD; the padded rows' outputs are not stored).

Numerics: each output is the 8-lane kernel's sum in the same order (k blocks of `k_block(K)` steps, fused
multiply-adds from zero in k order, each block's sum added to the output), so the two kernels' results are equal
bit for bit (tests/test_cpu_small_gemm.py), and equal to F.linear's wherever the 8-lane one is.
"""
from __future__ import annotations

import numpy as np

from tokenplane.engine.cpu_simd import _add16, _fma16, _load16, _prefetch, _splat16, _store16, _zero16
from tokenplane.engine.numbacache import njit

PANEL = 16            # output columns per panel (cpu_small_gemm's layout): one 16-float vector
PREFETCH_BYTES = 4096  # ahead of each panel stream where panels are longer than SHORT_PANEL_BYTES (as cpu_small_gemm)
# A pass streams two panels side by side; where panels are short, 4 KiB ahead of the first stream lands in the second
# stream's panel, already on its way, so short panels prefetch min(two panels, SHORT_PREFETCH_BYTES) ahead, into the
# next pair. Measured alternated (cold, Zen 4, 1 thread, the same sums): 151936 x 256 fp32 at 1 / 2 / 4 / 6 / 12 rows
# 1.23 / 1.26 / 1.17 / 1.04 / 1.02x, 151936 x 128 1.16-1.41x; bf16 panels (cpu_bf16_gemv) K = 256-576 1.07-1.36x;
# longer panels measured 0.76-1.18x farther out, mixed, and keep 4 KiB.
SHORT_PANEL_BYTES = 18 * 1024
SHORT_PREFETCH_BYTES = 24 * 1024


@njit(cache=True, nogil=True)
def prefetch_elements(k_dim, itemsize):  # noqa: ANN001, ANN201
    """Elements ahead of each panel stream for panels of k_dim x 16 items of `itemsize` bytes."""
    panel = k_dim * PANEL * itemsize
    if panel <= SHORT_PANEL_BYTES:
        return min(2 * panel, SHORT_PREFETCH_BYTES) // itemsize
    return PREFETCH_BYTES // itemsize


@njit(inline="always")
def _acc16(out, index, value, first):  # noqa: ANN001
    """out[index : index + 16] = value on a row's first k block, += value on the next ones."""
    if first:
        _store16(out, index, value)
    else:
        _store16(out, index, _add16(_load16(out, index), value))


@njit(inline="always")
def _acc16_if(keep, out, index, value, first):  # noqa: ANN001
    """_acc16 for a row that exists (keep), nothing for a padded one."""
    if keep:
        _acc16(out, index, value, first)


@njit(inline="always")
def _pass12(x, k_dim, m, wp, wb0, wb1, last, out, n_out, col, kb, acc, nv, pf):  # noqa: ANN001
    """out[m : m + 12, col : col + 32] = x[m : m + 12] @ two panels (wb0, wb1; wb1 < 0: wb0 alone): 24
    accumulators, FMA-bound."""
    x0 = m * k_dim
    o = m * n_out + col
    for k0 in range(0, k_dim, kb):
        a00 = _zero16()
        a01 = _zero16()
        a10 = _zero16()
        a11 = _zero16()
        a20 = _zero16()
        a21 = _zero16()
        a30 = _zero16()
        a31 = _zero16()
        a40 = _zero16()
        a41 = _zero16()
        a50 = _zero16()
        a51 = _zero16()
        a60 = _zero16()
        a61 = _zero16()
        a70 = _zero16()
        a71 = _zero16()
        a80 = _zero16()
        a81 = _zero16()
        a90 = _zero16()
        a91 = _zero16()
        a100 = _zero16()
        a101 = _zero16()
        a110 = _zero16()
        a111 = _zero16()
        if wb1 >= 0:
            for k in range(k0, min(k0 + kb, k_dim)):
                wi = wb0 + k * PANEL
                wj = wb1 + k * PANEL
                _prefetch(wp, min(wi + pf, last))
                _prefetch(wp, min(wj + pf, last))
                w0 = _load16(wp, wi)
                w1 = _load16(wp, wj)
                b = _splat16(x, x0 + k)
                a00 = _fma16(b, w0, a00)
                a01 = _fma16(b, w1, a01)
                b = _splat16(x, x0 + k_dim + k)
                a10 = _fma16(b, w0, a10)
                a11 = _fma16(b, w1, a11)
                b = _splat16(x, x0 + 2 * k_dim + k)
                a20 = _fma16(b, w0, a20)
                a21 = _fma16(b, w1, a21)
                b = _splat16(x, x0 + 3 * k_dim + k)
                a30 = _fma16(b, w0, a30)
                a31 = _fma16(b, w1, a31)
                b = _splat16(x, x0 + 4 * k_dim + k)
                a40 = _fma16(b, w0, a40)
                a41 = _fma16(b, w1, a41)
                b = _splat16(x, x0 + 5 * k_dim + k)
                a50 = _fma16(b, w0, a50)
                a51 = _fma16(b, w1, a51)
                b = _splat16(x, x0 + 6 * k_dim + k)
                a60 = _fma16(b, w0, a60)
                a61 = _fma16(b, w1, a61)
                b = _splat16(x, x0 + 7 * k_dim + k)
                a70 = _fma16(b, w0, a70)
                a71 = _fma16(b, w1, a71)
                b = _splat16(x, x0 + 8 * k_dim + k)
                a80 = _fma16(b, w0, a80)
                a81 = _fma16(b, w1, a81)
                b = _splat16(x, x0 + 9 * k_dim + k)
                a90 = _fma16(b, w0, a90)
                a91 = _fma16(b, w1, a91)
                b = _splat16(x, x0 + 10 * k_dim + k)
                a100 = _fma16(b, w0, a100)
                a101 = _fma16(b, w1, a101)
                b = _splat16(x, x0 + 11 * k_dim + k)
                a110 = _fma16(b, w0, a110)
                a111 = _fma16(b, w1, a111)
        else:    # the last panel of an odd count
            for k in range(k0, min(k0 + kb, k_dim)):
                wi = wb0 + k * PANEL
                _prefetch(wp, min(wi + pf, last))
                w0 = _load16(wp, wi)
                a00 = _fma16(_splat16(x, x0 + k), w0, a00)
                a10 = _fma16(_splat16(x, x0 + k_dim + k), w0, a10)
                a20 = _fma16(_splat16(x, x0 + 2 * k_dim + k), w0, a20)
                a30 = _fma16(_splat16(x, x0 + 3 * k_dim + k), w0, a30)
                a40 = _fma16(_splat16(x, x0 + 4 * k_dim + k), w0, a40)
                a50 = _fma16(_splat16(x, x0 + 5 * k_dim + k), w0, a50)
                a60 = _fma16(_splat16(x, x0 + 6 * k_dim + k), w0, a60)
                a70 = _fma16(_splat16(x, x0 + 7 * k_dim + k), w0, a70)
                a80 = _fma16(_splat16(x, x0 + 8 * k_dim + k), w0, a80)
                a90 = _fma16(_splat16(x, x0 + 9 * k_dim + k), w0, a90)
                a100 = _fma16(_splat16(x, x0 + 10 * k_dim + k), w0, a100)
                a110 = _fma16(_splat16(x, x0 + 11 * k_dim + k), w0, a110)
        first = k0 == 0 and not acc
        _acc16(out, o, a00, first)
        _acc16_if(nv > 1, out, o + n_out, a10, first)
        _acc16_if(nv > 2, out, o + 2 * n_out, a20, first)
        _acc16_if(nv > 3, out, o + 3 * n_out, a30, first)
        _acc16_if(nv > 4, out, o + 4 * n_out, a40, first)
        _acc16_if(nv > 5, out, o + 5 * n_out, a50, first)
        _acc16_if(nv > 6, out, o + 6 * n_out, a60, first)
        _acc16_if(nv > 7, out, o + 7 * n_out, a70, first)
        _acc16_if(nv > 8, out, o + 8 * n_out, a80, first)
        _acc16_if(nv > 9, out, o + 9 * n_out, a90, first)
        _acc16_if(nv > 10, out, o + 10 * n_out, a100, first)
        _acc16_if(nv > 11, out, o + 11 * n_out, a110, first)
        if wb1 >= 0:
            _acc16(out, o + PANEL, a01, first)
            _acc16_if(nv > 1, out, o + n_out + PANEL, a11, first)
            _acc16_if(nv > 2, out, o + 2 * n_out + PANEL, a21, first)
            _acc16_if(nv > 3, out, o + 3 * n_out + PANEL, a31, first)
            _acc16_if(nv > 4, out, o + 4 * n_out + PANEL, a41, first)
            _acc16_if(nv > 5, out, o + 5 * n_out + PANEL, a51, first)
            _acc16_if(nv > 6, out, o + 6 * n_out + PANEL, a61, first)
            _acc16_if(nv > 7, out, o + 7 * n_out + PANEL, a71, first)
            _acc16_if(nv > 8, out, o + 8 * n_out + PANEL, a81, first)
            _acc16_if(nv > 9, out, o + 9 * n_out + PANEL, a91, first)
            _acc16_if(nv > 10, out, o + 10 * n_out + PANEL, a101, first)
            _acc16_if(nv > 11, out, o + 11 * n_out + PANEL, a111, first)


@njit(inline="always")
def _pass6(x, k_dim, m, wp, wb0, wb1, last, out, n_out, col, kb, acc, nv, pf):  # noqa: ANN001
    """6 rows, as _pass12."""
    x0 = m * k_dim
    o = m * n_out + col
    for k0 in range(0, k_dim, kb):
        a00 = _zero16()
        a01 = _zero16()
        a10 = _zero16()
        a11 = _zero16()
        a20 = _zero16()
        a21 = _zero16()
        a30 = _zero16()
        a31 = _zero16()
        a40 = _zero16()
        a41 = _zero16()
        a50 = _zero16()
        a51 = _zero16()
        if wb1 >= 0:
            for k in range(k0, min(k0 + kb, k_dim)):
                wi = wb0 + k * PANEL
                wj = wb1 + k * PANEL
                _prefetch(wp, min(wi + pf, last))
                _prefetch(wp, min(wj + pf, last))
                w0 = _load16(wp, wi)
                w1 = _load16(wp, wj)
                b = _splat16(x, x0 + k)
                a00 = _fma16(b, w0, a00)
                a01 = _fma16(b, w1, a01)
                b = _splat16(x, x0 + k_dim + k)
                a10 = _fma16(b, w0, a10)
                a11 = _fma16(b, w1, a11)
                b = _splat16(x, x0 + 2 * k_dim + k)
                a20 = _fma16(b, w0, a20)
                a21 = _fma16(b, w1, a21)
                b = _splat16(x, x0 + 3 * k_dim + k)
                a30 = _fma16(b, w0, a30)
                a31 = _fma16(b, w1, a31)
                b = _splat16(x, x0 + 4 * k_dim + k)
                a40 = _fma16(b, w0, a40)
                a41 = _fma16(b, w1, a41)
                b = _splat16(x, x0 + 5 * k_dim + k)
                a50 = _fma16(b, w0, a50)
                a51 = _fma16(b, w1, a51)
        else:    # the last panel of an odd count
            for k in range(k0, min(k0 + kb, k_dim)):
                wi = wb0 + k * PANEL
                _prefetch(wp, min(wi + pf, last))
                w0 = _load16(wp, wi)
                a00 = _fma16(_splat16(x, x0 + k), w0, a00)
                a10 = _fma16(_splat16(x, x0 + k_dim + k), w0, a10)
                a20 = _fma16(_splat16(x, x0 + 2 * k_dim + k), w0, a20)
                a30 = _fma16(_splat16(x, x0 + 3 * k_dim + k), w0, a30)
                a40 = _fma16(_splat16(x, x0 + 4 * k_dim + k), w0, a40)
                a50 = _fma16(_splat16(x, x0 + 5 * k_dim + k), w0, a50)
        first = k0 == 0 and not acc
        _acc16(out, o, a00, first)
        _acc16_if(nv > 1, out, o + n_out, a10, first)
        _acc16_if(nv > 2, out, o + 2 * n_out, a20, first)
        _acc16_if(nv > 3, out, o + 3 * n_out, a30, first)
        _acc16_if(nv > 4, out, o + 4 * n_out, a40, first)
        _acc16_if(nv > 5, out, o + 5 * n_out, a50, first)
        if wb1 >= 0:
            _acc16(out, o + PANEL, a01, first)
            _acc16_if(nv > 1, out, o + n_out + PANEL, a11, first)
            _acc16_if(nv > 2, out, o + 2 * n_out + PANEL, a21, first)
            _acc16_if(nv > 3, out, o + 3 * n_out + PANEL, a31, first)
            _acc16_if(nv > 4, out, o + 4 * n_out + PANEL, a41, first)
            _acc16_if(nv > 5, out, o + 5 * n_out + PANEL, a51, first)


@njit(inline="always")
def _pass4(x, k_dim, m, wp, wb0, wb1, last, out, n_out, col, kb, acc, nv, pf):  # noqa: ANN001
    """4 rows, as _pass12."""
    x0 = m * k_dim
    o = m * n_out + col
    for k0 in range(0, k_dim, kb):
        a00 = _zero16()
        a01 = _zero16()
        a10 = _zero16()
        a11 = _zero16()
        a20 = _zero16()
        a21 = _zero16()
        a30 = _zero16()
        a31 = _zero16()
        if wb1 >= 0:
            for k in range(k0, min(k0 + kb, k_dim)):
                wi = wb0 + k * PANEL
                wj = wb1 + k * PANEL
                _prefetch(wp, min(wi + pf, last))
                _prefetch(wp, min(wj + pf, last))
                w0 = _load16(wp, wi)
                w1 = _load16(wp, wj)
                b = _splat16(x, x0 + k)
                a00 = _fma16(b, w0, a00)
                a01 = _fma16(b, w1, a01)
                b = _splat16(x, x0 + k_dim + k)
                a10 = _fma16(b, w0, a10)
                a11 = _fma16(b, w1, a11)
                b = _splat16(x, x0 + 2 * k_dim + k)
                a20 = _fma16(b, w0, a20)
                a21 = _fma16(b, w1, a21)
                b = _splat16(x, x0 + 3 * k_dim + k)
                a30 = _fma16(b, w0, a30)
                a31 = _fma16(b, w1, a31)
        else:    # the last panel of an odd count
            for k in range(k0, min(k0 + kb, k_dim)):
                wi = wb0 + k * PANEL
                _prefetch(wp, min(wi + pf, last))
                w0 = _load16(wp, wi)
                a00 = _fma16(_splat16(x, x0 + k), w0, a00)
                a10 = _fma16(_splat16(x, x0 + k_dim + k), w0, a10)
                a20 = _fma16(_splat16(x, x0 + 2 * k_dim + k), w0, a20)
                a30 = _fma16(_splat16(x, x0 + 3 * k_dim + k), w0, a30)
        first = k0 == 0 and not acc
        _acc16(out, o, a00, first)
        _acc16_if(nv > 1, out, o + n_out, a10, first)
        _acc16_if(nv > 2, out, o + 2 * n_out, a20, first)
        _acc16_if(nv > 3, out, o + 3 * n_out, a30, first)
        if wb1 >= 0:
            _acc16(out, o + PANEL, a01, first)
            _acc16_if(nv > 1, out, o + n_out + PANEL, a11, first)
            _acc16_if(nv > 2, out, o + 2 * n_out + PANEL, a21, first)
            _acc16_if(nv > 3, out, o + 3 * n_out + PANEL, a31, first)


@njit(inline="always")
def _pass2(x, k_dim, m, wp, wb0, wb1, last, out, n_out, col, kb, acc, pf):  # noqa: ANN001
    """2 rows, as _pass12."""
    x0 = m * k_dim
    o = m * n_out + col
    for k0 in range(0, k_dim, kb):
        a00 = _zero16()
        a01 = _zero16()
        a10 = _zero16()
        a11 = _zero16()
        if wb1 >= 0:
            for k in range(k0, min(k0 + kb, k_dim)):
                wi = wb0 + k * PANEL
                wj = wb1 + k * PANEL
                _prefetch(wp, min(wi + pf, last))
                _prefetch(wp, min(wj + pf, last))
                w0 = _load16(wp, wi)
                w1 = _load16(wp, wj)
                b = _splat16(x, x0 + k)
                a00 = _fma16(b, w0, a00)
                a01 = _fma16(b, w1, a01)
                b = _splat16(x, x0 + k_dim + k)
                a10 = _fma16(b, w0, a10)
                a11 = _fma16(b, w1, a11)
        else:    # the last panel of an odd count
            for k in range(k0, min(k0 + kb, k_dim)):
                wi = wb0 + k * PANEL
                _prefetch(wp, min(wi + pf, last))
                w0 = _load16(wp, wi)
                a00 = _fma16(_splat16(x, x0 + k), w0, a00)
                a10 = _fma16(_splat16(x, x0 + k_dim + k), w0, a10)
        first = k0 == 0 and not acc
        _acc16(out, o, a00, first)
        _acc16(out, o + n_out, a10, first)
        if wb1 >= 0:
            _acc16(out, o + PANEL, a01, first)
            _acc16(out, o + n_out + PANEL, a11, first)


@njit(inline="always")
def _pass1(x, k_dim, m, wp, wb0, wb1, last, out, n_out, col, kb, acc, pf):  # noqa: ANN001
    """1 row, as _pass12 (a stream over the panels: memory-bound)."""
    x0 = m * k_dim
    o = m * n_out + col
    for k0 in range(0, k_dim, kb):
        a00 = _zero16()
        a01 = _zero16()
        if wb1 >= 0:
            for k in range(k0, min(k0 + kb, k_dim)):
                wi = wb0 + k * PANEL
                wj = wb1 + k * PANEL
                _prefetch(wp, min(wi + pf, last))
                _prefetch(wp, min(wj + pf, last))
                w0 = _load16(wp, wi)
                w1 = _load16(wp, wj)
                b = _splat16(x, x0 + k)
                a00 = _fma16(b, w0, a00)
                a01 = _fma16(b, w1, a01)
        else:    # the last panel of an odd count
            for k in range(k0, min(k0 + kb, k_dim)):
                wi = wb0 + k * PANEL
                _prefetch(wp, min(wi + pf, last))
                w0 = _load16(wp, wi)
                a00 = _fma16(_splat16(x, x0 + k), w0, a00)
        first = k0 == 0 and not acc
        _acc16(out, o, a00, first)
        if wb1 >= 0:
            _acc16(out, o + PANEL, a01, first)


@njit(inline="always")
def padded_remainder(x, rows, k_dim, out, n_out, step, cover):  # noqa: ANN001
    """The remainder of `gemm_with`'s pass schedule: (rows the step-row passes cover, the r rows left,
    the row count cover[r] they run as, those rows' inputs (x itself, or a zero-padded copy of the r rows where
    cover[r] != r), out from the first remainder row)."""
    full = rows - rows % step
    r = rows - full
    size = cover[r]
    xs = x
    if size != r:
        xs = np.zeros(size * k_dim, np.float32)
        xs[:r * k_dim] = x[full * k_dim:rows * k_dim]
    return full, r, size, xs, out[full * n_out:]


@njit(cache=True, nogil=True)
def gemm_with(x, rows, k_dim, wp, panels, out, n_out, kb, acc, cover, pf):  # noqa: ANN001
    """`gemm` with the remainder policy given: cover[r] (r < 12 rows left after the 12-row passes) is r itself (the
    passes of 6, 4, 2 and 1 rows in turn) or the row count 4, 6, 10 or 12 it is padded to: the passes of 12, 6 and 4
    rows over a zero-padded copy of the r rows' inputs, storing only their r rows of output; pf: floats prefetched
    ahead of each panel stream (`prefetch_elements`)."""
    last = panels * k_dim * PANEL - 1
    full, r, size, xs, tail = padded_remainder(x, rows, k_dim, out, n_out, 12, cover)
    for p in range(0, panels, 2):
        wb0 = p * k_dim * PANEL
        wb1 = wb0 + k_dim * PANEL if p + 1 < panels else -1
        col = p * PANEL
        m = 0
        while m < full:
            _pass12(x, k_dim, m, wp, wb0, wb1, last, out, n_out, col, kb, acc, 12, pf)
            m += 12
        if size != r:      # sizes 4, 6, 10 (6 + 4) or 12 over the padded rows, storing the first r
            if size == 12:
                _pass12(xs, k_dim, 0, wp, wb0, wb1, last, tail, n_out, col, kb, acc, r, pf)
                continue
            j = 0
            if size >= 6:
                _pass6(xs, k_dim, 0, wp, wb0, wb1, last, tail, n_out, col, kb, acc, min(r, 6), pf)
                j = 6
            if size - j == 4:
                _pass4(xs, k_dim, j, wp, wb0, wb1, last, tail, n_out, col, kb, acc, r - j, pf)
            continue
        if rows - m >= 6:
            _pass6(x, k_dim, m, wp, wb0, wb1, last, out, n_out, col, kb, acc, 6, pf)
            m += 6
        if rows - m >= 4:
            _pass4(x, k_dim, m, wp, wb0, wb1, last, out, n_out, col, kb, acc, 4, pf)
            m += 4
        if rows - m >= 2:
            _pass2(x, k_dim, m, wp, wb0, wb1, last, out, n_out, col, kb, acc, pf)
            m += 2
        if rows - m == 1:
            _pass1(x, k_dim, m, wp, wb0, wb1, last, out, n_out, col, kb, acc, pf)


# Remainder policies (`gemm_with`'s cover): SPLIT runs every remainder through the passes of 6, 4, 2 and 1 rows;
# PAD_ODD (`gemm`'s) pads 3, 5, 9 and 11 to 4, 6, 10 and 12 rows, one pass fewer. Each pass over a panel pair after
# the first reads it from cache while the weight stream waits, and a one-row pass is bound by its two FMA chains'
# latency. Measured alternated (benchmarks/results/small_gemm_remainders.md, Zen 4, 1 thread, the same bits): at 3, 5,
# 9, 11 rows 1.06-1.24x on the cold vocabulary shapes, 1.01-1.41x on warm layer shapes; the counts it leaves alone
# 0.97-1.03x (noise). Padding 7 and 8 rows to one 12-row pass (ONE_PASS there) measured 0.69-0.97x: the zero rows'
# FMAs cost more than the pass they save.
SPLIT = np.arange(12, dtype=np.int64)
PAD_ODD = np.array([0, 1, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12], np.int64)


@njit(cache=True, nogil=True)
def gemm(x, rows, k_dim, wp, panels, out, n_out, kb, acc):  # noqa: ANN001
    """cpu_small_gemm._gemm's contract (x [rows, k_dim] flat float32, wp [panels, k_dim, 16] flat, out [rows, n_out]
    flat, kb: k steps a register block sums, acc: add to out's values), two panels at a time, remainders padded to
    one pass fewer where that measured faster (PAD_ODD)."""
    gemm_with(x, rows, k_dim, wp, panels, out, n_out, kb, acc, PAD_ODD, prefetch_elements(k_dim, 4))
