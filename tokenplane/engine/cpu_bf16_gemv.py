"""Few-row linear over a bfloat16 panel copy of a weight: float32 inputs and outputs for the stream of the greedy
screen (greedy_screen.py), which reads the vocabulary matrix at half the fp32 bytes; bfloat16 inputs and outputs for a
bf16 model's decode-sized linears and SwiGLU (`linear_bf16_io`, `swiglu_bf16_io`, 1-8 rows, 1 thread).

Why the bf16 decode path: at 1-8 rows a linear is a weight stream, and oneDNN's packed bf16 path (AMX) streams it at
~10.5 GB/s on this machine's core against 13.6-14.9 GB/s here (SmolLM2-135M's four linear shapes x 30 layers, 1 / 4
rows: 20.0 / 20.3 ms vs 14.2 / 15.6 ms a pass, measured side by side; at 16 rows the panels stream twice and oneDNN
is ahead, 21.2 vs 28.7 ms). The sums are float32 as oneDNN's, rounded to bfloat16 once per output, so results differ
from oneDNN's only where the summation order moves a value across a rounding boundary.

Layout: cpu_small_gemm's panels ([ceil(N / 16), K, 16], zero-padded past N) holding bfloat16 bits (uint16), so a
panel row (16 output columns) is one 32-byte load widened to 16 float32 lanes (cpu_simd._load16_bf16: exact). A pass
covers two panels of up to 8 rows (16 accumulators); each output is one chain of fused multiply-adds over k from zero
(out = sum_k x[m, k] * wb[n, k], rounded once per step: |error| <= g_K sum_k |x_k| |wb_k| for any order, the bound
the screen takes). The panels stream once for every 8 rows; prefetched ahead as cpu_small_gemm's.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tokenplane.engine import cpu_amx, cpu_small_gemm
from tokenplane.engine.cpu_decode_paging import _exp16_shifted
from tokenplane.engine.cpu_elements import _load, _round, _store, as_array
from tokenplane.engine.cpu_simd import (
    HOST_AVX512,
    _fma16,
    _load16_bf16,
    _load16_bf16_even,
    _load16_bf16_odd,
    _prefetch,
    _splat16,
    _store16,
    _zero16,
)
from tokenplane.engine.cpu_small_gemm16 import prefetch_elements
from tokenplane.engine.numbacache import njit

PANEL = cpu_small_gemm.PANEL
PREFETCH = 2048       # bfloat16 elements ahead of the VNNI stream (AMX hosts; 4 KiB, as cpu_small_gemm's 1024 floats)
# gemv_bf16's panels take cpu_small_gemm16.prefetch_elements instead (short panels prefetch into the next panel pair,
# measured on Zen 4); the VNNI stream keeps 4 KiB, not measured on an AMX host since.
# Rows the bf16 decode path takes. AVX-512: one pass of 8 rows streams each panel once; more rows stream it again.
# AMX: the weight streams once at any row count; ahead of oneDNN's packed linear up to 32 rows on every shape measured
# (benchmarks/peers/amx_linear_ab.py: SmolLM2's four linear shapes x 30 layers 1.44x at 1-16 rows, 1.35x at 17-32;
# vocabulary projections 151936 x 512 and 49152 x 576 level to 1.9x at 8-32 rows) and behind it at 64 on the
# vocabulary projections (the float32 sums of 64 x 151936 outputs: 25.9 vs 17.7 ms).
MAX_ROWS = 32 if cpu_amx.HOST_AMX else 8
# On AMX panels, rows up to here stream them through 16-lane vectors instead of the tiles (151936 x 512 at 1 / 4 rows:
# 8.9 / 9.5 ms against the tiles' 11.2 / 10.8 here); the same sums as over the AVX-512 panels, bit for bit
VNNI_STREAM_ROWS = 4
# [False] keeps bf16 linears on oneDNN at every row count (benchmarks compare the two on one code path). The panel
# copy is a second bf16 copy of each linear's weight beside oneDNN's.
DECODE_PANELS = [True]
_NO_BIAS = np.empty(0, np.float32)


def pack_bf16(weight: torch.Tensor) -> np.ndarray:
    """bfloat16 bits (uint16) of a float32 [N, K] weight in cpu_small_gemm's panels [ceil(N / 16), K, 16], on 2 MiB
    pages."""
    return cpu_small_gemm.pack(weight, torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


@njit(inline="always")
def _pass(x, k_dim, m, r, wp, wb0, wb1, last, out, n_out, col, pf):  # noqa: ANN001
    """out[m : m + r, col : col + 32] (r = 1..8 rows, a constant where inlined; wb1 < 0: one panel) = x[m : m + r] @
    the panels: 2r accumulators; pf: prefetch distance (elements)."""
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
        _prefetch(wp, min(wi + pf, last))
        w0 = _load16_bf16(wp, wi)
        w1 = w0
        if wb1 >= 0:
            wj = wb1 + k * PANEL
            _prefetch(wp, min(wj + pf, last))
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
def gemv_bf16_with(x, rows, k_dim, wp, panels, out, n_out, pf):  # noqa: ANN001
    """`gemv_bf16` prefetching pf elements ahead of each panel stream."""
    last = panels * k_dim * PANEL - 1
    for p in range(0, panels, 2):
        wb0 = p * k_dim * PANEL
        wb1 = wb0 + k_dim * PANEL if p + 1 < panels else -1
        col = p * PANEL
        m = 0
        while rows - m >= 8:
            _pass(x, k_dim, m, 8, wp, wb0, wb1, last, out, n_out, col, pf)
            m += 8
        if rows - m == 7:
            _pass(x, k_dim, m, 7, wp, wb0, wb1, last, out, n_out, col, pf)
        elif rows - m == 6:
            _pass(x, k_dim, m, 6, wp, wb0, wb1, last, out, n_out, col, pf)
        elif rows - m == 5:
            _pass(x, k_dim, m, 5, wp, wb0, wb1, last, out, n_out, col, pf)
        elif rows - m == 4:
            _pass(x, k_dim, m, 4, wp, wb0, wb1, last, out, n_out, col, pf)
        elif rows - m == 3:
            _pass(x, k_dim, m, 3, wp, wb0, wb1, last, out, n_out, col, pf)
        elif rows - m == 2:
            _pass(x, k_dim, m, 2, wp, wb0, wb1, last, out, n_out, col, pf)
        elif rows - m == 1:
            _pass(x, k_dim, m, 1, wp, wb0, wb1, last, out, n_out, col, pf)


@njit(cache=True, nogil=True)
def gemv_bf16(x, rows, k_dim, wp, panels, out, n_out):  # noqa: ANN001
    """out[rows, n_out] (flat float32, n_out = panels * 16) = x [rows, k_dim] (flat float32) @ the bfloat16 panels
    wp (flat uint16, `pack_bf16`)^T."""
    gemv_bf16_with(x, rows, k_dim, wp, panels, out, n_out, prefetch_elements(k_dim, 2))


def linear_bf16(x: torch.Tensor, wp: np.ndarray) -> np.ndarray:
    """x [rows, K] float32 (contiguous, CPU) @ W^T for `pack_bf16(W)`: float32 [rows, panels * 16] (columns past N
    are the zero padding's)."""
    rows, k = x.shape
    panels = wp.shape[0]
    out = np.empty((rows, panels * PANEL), np.float32)
    gemv_bf16(x.numpy().reshape(-1), rows, k, wp.reshape(-1), panels, out.reshape(-1), panels * PANEL)
    return out


def decode_panels_for(weight: torch.Tensor) -> np.ndarray | None:
    """The copy a bf16 Linear keeps for `linear_bf16_io` (None where that path is off or would not pay: not bf16, or a
    host without 16-lane vectors): AMX panels (cpu_amx.pack, 4-D) where the host has AMX and K allows, else the
    AVX-512 panels (3-D)."""
    if not (DECODE_PANELS[0] and HOST_AVX512 and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.device.type == "cpu"):
        return None
    if cpu_amx.HOST_AMX and cpu_amx.fits(int(weight.shape[1])):
        return cpu_amx.pack(weight)
    return pack_bf16(weight.detach().float())


def panel_shape(wp: np.ndarray) -> tuple[int, int, bool]:
    """(panels, K, whether AMX panels) of a `decode_panels_for` copy."""
    if wp.ndim == 4:
        return int(wp.shape[0]), 2 * int(wp.shape[1]), True
    return int(wp.shape[0]), int(wp.shape[1]), False


def applies(x: torch.Tensor) -> bool:
    """A CPU bfloat16 [rows, K] input of 1..MAX_ROWS rows, with 1 torch thread (the kernel is single-threaded)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and torch.get_num_threads() == 1)


@njit(cache=True, nogil=True)
def _widen(x, n):  # noqa: ANN001, ANN202
    """float32 of x[:n] (bf16 bits): the vector passes' input."""
    xf = np.empty(n, np.float32)
    for i in range(n):
        xf[i] = _load(x[i])
    return xf


@njit(cache=True, nogil=True)
def _add_bias(acc, rows, n_out, bias):  # noqa: ANN001
    if bias.shape[0]:
        for m in range(rows):
            for j in range(bias.shape[0]):
                acc[m * n_out + j] += bias[j]


@njit(cache=True, nogil=True)
def _sums(x, rows, k_dim, wp, panels, bias):  # noqa: ANN001, ANN202
    """float32 [rows * panels * 16] = bf16 bits x [rows * k_dim] @ the panels^T (+ bias where given)."""
    n_out = panels * PANEL
    acc = np.empty(rows * n_out, np.float32)
    gemv_bf16(_widen(x, rows * k_dim), rows, k_dim, wp, panels, acc, n_out)
    _add_bias(acc, rows, n_out, bias)
    return acc


@njit(inline="always")
def _vnni_pass(x, k_dim, m, r, wp, wb0, wb1, last, out, n_out, col):  # noqa: ANN001
    """`_pass` over AMX panels (cpu_amx.pack: 64 bytes per k pair, 16 columns x (k, k + 1)), r = 1..4 rows: the even
    and odd elements of a 64-byte load are k and k + 1 of 16 columns, so each output is the same chain of fused
    multiply-adds over k in order as `_pass` over its panels (bit for bit the same sums)."""
    x0 = m * k_dim
    a00 = _zero16()
    a01 = _zero16()
    a10 = _zero16()
    a11 = _zero16()
    a20 = _zero16()
    a21 = _zero16()
    a30 = _zero16()
    a31 = _zero16()
    for k in range(0, k_dim, 2):
        wi = wb0 + k * PANEL
        _prefetch(wp, min(wi + PREFETCH, last))
        e0 = _load16_bf16_even(wp, wi)
        o0 = _load16_bf16_odd(wp, wi)
        e1 = e0
        o1 = o0
        if wb1 >= 0:
            wj = wb1 + k * PANEL
            _prefetch(wp, min(wj + PREFETCH, last))
            e1 = _load16_bf16_even(wp, wj)
            o1 = _load16_bf16_odd(wp, wj)
        b = _splat16(x, x0 + k)
        c = _splat16(x, x0 + k + 1)
        a00 = _fma16(c, o0, _fma16(b, e0, a00))
        a01 = _fma16(c, o1, _fma16(b, e1, a01))
        if r > 1:
            b = _splat16(x, x0 + k_dim + k)
            c = _splat16(x, x0 + k_dim + k + 1)
            a10 = _fma16(c, o0, _fma16(b, e0, a10))
            a11 = _fma16(c, o1, _fma16(b, e1, a11))
        if r > 2:
            b = _splat16(x, x0 + 2 * k_dim + k)
            c = _splat16(x, x0 + 2 * k_dim + k + 1)
            a20 = _fma16(c, o0, _fma16(b, e0, a20))
            a21 = _fma16(c, o1, _fma16(b, e1, a21))
        if r > 3:
            b = _splat16(x, x0 + 3 * k_dim + k)
            c = _splat16(x, x0 + 3 * k_dim + k + 1)
            a30 = _fma16(c, o0, _fma16(b, e0, a30))
            a31 = _fma16(c, o1, _fma16(b, e1, a31))
    o = m * n_out + col
    _store16(out, o, a00)
    if wb1 >= 0:
        _store16(out, o + PANEL, a01)
    if r > 1:
        _store16(out, o + n_out, a10)
        if wb1 >= 0:
            _store16(out, o + n_out + PANEL, a11)
    if r > 2:
        _store16(out, o + 2 * n_out, a20)
        if wb1 >= 0:
            _store16(out, o + 2 * n_out + PANEL, a21)
    if r > 3:
        _store16(out, o + 3 * n_out, a30)
        if wb1 >= 0:
            _store16(out, o + 3 * n_out + PANEL, a31)


@njit(cache=True, nogil=True)
def gemv_vnni(x, rows, k_dim, wp, panels, out, n_out):  # noqa: ANN001
    """`gemv_bf16` over AMX panels (rows <= VNNI_STREAM_ROWS a pass)."""
    last = panels * k_dim * PANEL - 1
    for p in range(0, panels, 2):
        wb0 = p * k_dim * PANEL
        wb1 = wb0 + k_dim * PANEL if p + 1 < panels else -1
        col = p * PANEL
        m = 0
        while rows - m >= 4:
            _vnni_pass(x, k_dim, m, 4, wp, wb0, wb1, last, out, n_out, col)
            m += 4
        if rows - m == 3:
            _vnni_pass(x, k_dim, m, 3, wp, wb0, wb1, last, out, n_out, col)
        elif rows - m == 2:
            _vnni_pass(x, k_dim, m, 2, wp, wb0, wb1, last, out, n_out, col)
        elif rows - m == 1:
            _vnni_pass(x, k_dim, m, 1, wp, wb0, wb1, last, out, n_out, col)


@njit(cache=True, nogil=True)
def _sums_amx(x, rows, k_dim, wp, panels, bias):  # noqa: ANN001, ANN202
    """`_sums` on AMX panels (cpu_amx.pack): the tiles, or at up to VNNI_STREAM_ROWS rows the vector stream over the
    same copy (`gemv_vnni`). Compiled on first call only, so on hosts with AMX."""
    n_out = panels * PANEL
    acc = np.empty(rows * n_out, np.float32)
    if rows <= VNNI_STREAM_ROWS:
        gemv_vnni(_widen(x, rows * k_dim), rows, k_dim, wp, panels, acc, n_out)
    else:
        cpu_amx.sums(x, rows, k_dim, wp, panels, acc)
    _add_bias(acc, rows, n_out, bias)
    return acc


@njit(cache=True, nogil=True)
def _linear_out(acc, rows, n_out, out, n):  # noqa: ANN001
    like = out[0]
    for m in range(rows):
        for j in range(n):
            out[m * n + j] = _store(acc[m * n_out + j], like)


@njit(cache=True, nogil=True)
def _swiglu_out(acc, rows, n_out, out, ffn):  # noqa: ANN001
    """out = bf16(up * bf16(swish(gate))) per row of the float32 sums (gate columns first). The exponents 16 at a time
    (cpu_decode_paging._exp16_shifted of -|gate|, within 3 ulp of exp): libm's expf is a scalar call, 5.4 ns an
    element here (16 ms of a 64-row SmolLM2 step), these loops ~2 together."""
    like = out[0]
    width = (ffn + 15) // 16 * 16
    t = np.zeros(width, np.float32)
    e = np.empty(width, np.float32)
    z = _zero16()
    one = np.float32(1.0)
    for m in range(rows):
        base = m * n_out
        for j in range(ffn):
            t[j] = -abs(acc[base + j])
        for j in range(0, width, 16):
            _store16(e, j, _exp16_shifted(t, j, z))
        for j in range(ffn):
            # layers.cpu_swiglu's two oneDNN stages: swish on the gate's float32 sum (g * sigmoid(g), sigmoid from
            # e = exp(-|g|)), rounded to bf16; the up projection's float32 sum times that, rounded once more. Two
            # loops: each vectorizes (one loop with both measured 3.5 ns an element, these 2.0 together)
            g = acc[base + j]
            num = one if g >= np.float32(0.0) else e[j]
            e[j] = g * (num / (one + e[j]))
        for j in range(ffn):
            out[m * ffn + j] = _store(acc[base + ffn + j] * _round(e[j], like), like)


@njit(cache=True, nogil=True)
def linear_io(x, rows, k_dim, wp, panels, bias, out, n):  # noqa: ANN001
    """`linear_bf16_io` on flat arrays: out [rows * n] bf16 bits, x [rows * k_dim] bf16 bits, wp the flat panels,
    bias float32 (empty: none)."""
    _linear_out(_sums(x, rows, k_dim, wp, panels, bias), rows, panels * PANEL, out, n)


@njit(cache=True, nogil=True)
def swiglu_io(x, rows, k_dim, wp, panels, bias, out, ffn):  # noqa: ANN001
    """`swiglu_bf16_io` on flat arrays (as `linear_io`; out [rows * ffn])."""
    _swiglu_out(_sums(x, rows, k_dim, wp, panels, bias), rows, panels * PANEL, out, ffn)


@njit(cache=True, nogil=True)
def linear_io_amx(x, rows, k_dim, wp, panels, bias, out, n):  # noqa: ANN001
    """`linear_io` on AMX panels: past VNNI_STREAM_ROWS the tiles, the bias and the bf16 rounding applied to each tile
    pass as it leaves them."""
    if rows <= VNNI_STREAM_ROWS:
        _linear_out(_sums_amx(x, rows, k_dim, wp, panels, bias), rows, panels * PANEL, out, n)
    else:
        cpu_amx.linear(x, rows, k_dim, wp, panels, bias if bias.shape[0] else np.zeros(n, np.float32), out)


@njit(cache=True, nogil=True)
def swiglu_io_amx(x, rows, k_dim, wp, panels, bias, out, ffn):  # noqa: ANN001
    """`swiglu_io` on AMX panels: past VNNI_STREAM_ROWS (and for ffn a multiple of 16) gate and up panels paired in one
    tile pass and the swish product written from it."""
    if rows <= VNNI_STREAM_ROWS or ffn % PANEL:
        _swiglu_out(_sums_amx(x, rows, k_dim, wp, panels, bias), rows, panels * PANEL, out, ffn)
    else:
        cpu_amx.swiglu(x, rows, k_dim, wp, panels, bias if bias.shape[0] else np.zeros(2 * ffn, np.float32), out)


def io_kernels(amx: bool) -> tuple[Any, Any]:
    """(linear_io, swiglu_io) for AVX-512 or AMX panels (`panel_shape`)."""
    return (linear_io_amx, swiglu_io_amx) if amx else (linear_io, swiglu_io)


def bias_array(bias: torch.Tensor | None) -> np.ndarray:
    """A bias as the kernels take it: float32, empty for none."""
    return _NO_BIAS if bias is None else bias.detach().float().numpy()


def linear_bf16_io(x: torch.Tensor, wp: np.ndarray, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] bfloat16 (contiguous, CPU; `applies`) @ W^T (+ bias) for `decode_panels_for(W)`, W [n, K]:
    bfloat16 [rows, n], float32 sums rounded once."""
    rows = x.shape[0]
    panels, k, amx = panel_shape(wp)
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    io_kernels(amx)[0](as_array(x.contiguous()).reshape(-1), rows, k, wp.reshape(-1), panels, bias_array(bias),
                       as_array(out).reshape(-1), n)
    return out


def swiglu_bf16_io(x: torch.Tensor, wp: np.ndarray, ffn: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for `decode_panels_for` of the gate_up weight [2 * ffn, K] (gate rows first),
    rounded as layers.cpu_swiglu rounds: bfloat16 [rows, ffn]."""
    rows = x.shape[0]
    panels, k, amx = panel_shape(wp)
    out = torch.empty(rows, ffn, dtype=torch.bfloat16)
    io_kernels(amx)[1](as_array(x.contiguous()).reshape(-1), rows, k, wp.reshape(-1), panels, bias_array(bias),
                       as_array(out).reshape(-1), ffn)
    return out


__all__ = ["DECODE_PANELS", "MAX_ROWS", "PANEL", "applies", "bias_array", "decode_panels_for", "io_kernels",
           "linear_bf16", "linear_bf16_io", "linear_io", "linear_io_amx", "pack_bf16", "panel_shape", "swiglu_bf16_io",
           "swiglu_io", "swiglu_io_amx"]
