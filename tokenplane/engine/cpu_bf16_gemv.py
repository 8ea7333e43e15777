"""Few-row linear over a bfloat16 panel copy of a float32 weight, float32 inputs and outputs: the stream of the
greedy screen (greedy_screen.py), which reads the vocabulary matrix at half the fp32 bytes.

Layout: cpu_small_gemm's panels ([ceil(N / 16), K, 16], zero-padded past N) holding bfloat16 bits (uint16), so a
panel row (16 output columns) is one 32-byte load widened to 16 float32 lanes (cpu_simd._load16_bf16: exact). A pass
covers two panels of up to 8 rows (16 accumulators); each output is one chain of fused multiply-adds over k from zero
(out = sum_k x[m, k] * wb[n, k], rounded once per step: |error| <= g_K sum_k |x_k| |wb_k| for any order, the bound
the screen takes). The panels stream once for every 8 rows; prefetched ahead as cpu_small_gemm's.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from tokenplane.engine import cpu_small_gemm
from tokenplane.engine.cpu_simd import _fma16, _load16_bf16, _prefetch, _splat16, _store16, _zero16

PANEL = cpu_small_gemm.PANEL
PREFETCH = 2048       # bfloat16 elements ahead of the panel stream (4 KiB, as cpu_small_gemm's 1024 floats)


def pack_bf16(weight: torch.Tensor) -> np.ndarray:
    """bfloat16 bits (uint16) of a float32 [N, K] weight in cpu_small_gemm's panels [ceil(N / 16), K, 16], on 2 MiB
    pages."""
    return cpu_small_gemm.pack(weight, torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


@njit(inline="always")
def _pass(x, k_dim, m, r, wp, wb0, wb1, last, out, n_out, col):  # noqa: ANN001
    """out[m : m + r, col : col + 32] (r = 1..8 rows, a constant where inlined; wb1 < 0: one panel) = x[m : m + r] @
    the panels: 2r accumulators."""
    x0 = m * k_dim
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
    for k in range(k_dim):
        wi = wb0 + k * PANEL
        _prefetch(wp, min(wi + PREFETCH, last))
        w0 = _load16_bf16(wp, wi)
        w1 = w0
        if wb1 >= 0:
            wj = wb1 + k * PANEL
            _prefetch(wp, min(wj + PREFETCH, last))
            w1 = _load16_bf16(wp, wj)
        b = _splat16(x, x0 + k)
        a00 = _fma16(b, w0, a00)
        a01 = _fma16(b, w1, a01)
        if r > 1:
            b = _splat16(x, x0 + 1 * k_dim + k)
            a10 = _fma16(b, w0, a10)
            a11 = _fma16(b, w1, a11)
        if r > 2:
            b = _splat16(x, x0 + 2 * k_dim + k)
            a20 = _fma16(b, w0, a20)
            a21 = _fma16(b, w1, a21)
        if r > 3:
            b = _splat16(x, x0 + 3 * k_dim + k)
            a30 = _fma16(b, w0, a30)
            a31 = _fma16(b, w1, a31)
        if r > 4:
            b = _splat16(x, x0 + 4 * k_dim + k)
            a40 = _fma16(b, w0, a40)
            a41 = _fma16(b, w1, a41)
        if r > 5:
            b = _splat16(x, x0 + 5 * k_dim + k)
            a50 = _fma16(b, w0, a50)
            a51 = _fma16(b, w1, a51)
        if r > 6:
            b = _splat16(x, x0 + 6 * k_dim + k)
            a60 = _fma16(b, w0, a60)
            a61 = _fma16(b, w1, a61)
        if r > 7:
            b = _splat16(x, x0 + 7 * k_dim + k)
            a70 = _fma16(b, w0, a70)
            a71 = _fma16(b, w1, a71)
    o = m * n_out + col
    _store16(out, o, a00)
    if wb1 >= 0:
        _store16(out, o + PANEL, a01)
    if r > 1:
        _store16(out, o + 1 * n_out, a10)
        if wb1 >= 0:
            _store16(out, o + 1 * n_out + PANEL, a11)
    if r > 2:
        _store16(out, o + 2 * n_out, a20)
        if wb1 >= 0:
            _store16(out, o + 2 * n_out + PANEL, a21)
    if r > 3:
        _store16(out, o + 3 * n_out, a30)
        if wb1 >= 0:
            _store16(out, o + 3 * n_out + PANEL, a31)
    if r > 4:
        _store16(out, o + 4 * n_out, a40)
        if wb1 >= 0:
            _store16(out, o + 4 * n_out + PANEL, a41)
    if r > 5:
        _store16(out, o + 5 * n_out, a50)
        if wb1 >= 0:
            _store16(out, o + 5 * n_out + PANEL, a51)
    if r > 6:
        _store16(out, o + 6 * n_out, a60)
        if wb1 >= 0:
            _store16(out, o + 6 * n_out + PANEL, a61)
    if r > 7:
        _store16(out, o + 7 * n_out, a70)
        if wb1 >= 0:
            _store16(out, o + 7 * n_out + PANEL, a71)


@njit(cache=True, nogil=True)
def gemv_bf16(x, rows, k_dim, wp, panels, out, n_out):  # noqa: ANN001
    """out[rows, n_out] (flat float32, n_out = panels * 16) = x [rows, k_dim] (flat float32) @ the bfloat16 panels
    wp (flat uint16, `pack_bf16`)^T."""
    last = panels * k_dim * PANEL - 1
    for p in range(0, panels, 2):
        wb0 = p * k_dim * PANEL
        wb1 = wb0 + k_dim * PANEL if p + 1 < panels else -1
        col = p * PANEL
        m = 0
        while rows - m >= 8:
            _pass(x, k_dim, m, 8, wp, wb0, wb1, last, out, n_out, col)
            m += 8
        if rows - m == 7:
            _pass(x, k_dim, m, 7, wp, wb0, wb1, last, out, n_out, col)
        elif rows - m == 6:
            _pass(x, k_dim, m, 6, wp, wb0, wb1, last, out, n_out, col)
        elif rows - m == 5:
            _pass(x, k_dim, m, 5, wp, wb0, wb1, last, out, n_out, col)
        elif rows - m == 4:
            _pass(x, k_dim, m, 4, wp, wb0, wb1, last, out, n_out, col)
        elif rows - m == 3:
            _pass(x, k_dim, m, 3, wp, wb0, wb1, last, out, n_out, col)
        elif rows - m == 2:
            _pass(x, k_dim, m, 2, wp, wb0, wb1, last, out, n_out, col)
        elif rows - m == 1:
            _pass(x, k_dim, m, 1, wp, wb0, wb1, last, out, n_out, col)


def linear_bf16(x: torch.Tensor, wp: np.ndarray) -> np.ndarray:
    """x [rows, K] float32 (contiguous, CPU) @ W^T for `pack_bf16(W)`: float32 [rows, panels * 16] (columns past N
    are the zero padding's)."""
    rows, k = x.shape
    panels = wp.shape[0]
    out = np.empty((rows, panels * PANEL), np.float32)
    gemv_bf16(x.numpy().reshape(-1), rows, k, wp.reshape(-1), panels, out.reshape(-1), panels * PANEL)
    return out


__all__ = ["PANEL", "linear_bf16", "pack_bf16"]
