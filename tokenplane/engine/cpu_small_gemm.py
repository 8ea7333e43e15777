"""Few-row float32 linear on CPU (decode steps and vocabulary projections: 1-256 rows): one compiled pass over a
panel-packed copy of the weight.

Why a kernel of our own: at a handful of rows a linear is a stream over its weight matrix, and the step's time is how
fast that stream runs. On an AMD EPYC core (1 thread, AVX2, cold weights as in a decode step) oneDNN's packed path
(`layers.cpu_pack`, what vLLM's CPU backend also runs) streamed a 151936 x 512 vocabulary matrix at 4 rows in 15-20 ms
(vLLM's own oneDNN build: 16 ms; a plain sum over the same 311 MB: 15 ms), and a 1024 x 512 layer at 0.09-0.16 ms.
This kernel reads each weight panel once for all rows, keeps every row's partial sums in vector registers, and
prefetches the panel stream ahead: 11-14 ms at 1-4 rows for the vocabulary matrix; on the layer shapes (3072 x 512,
512 x 1536, 1024 x 512, 512 x 512) 1.15x (8 rows) to 2x and more (1 row) faster than oneDNN. Past 8 rows the 6-row
pass (12 accumulators, FMA-bound) carries it (benchmarks/results/small_gemm_rows.md; 1 thread, process CPU time,
alternated, load 2-4): on the three vocabulary shapes (151936 x 256 / 512, 49152 x 576; cold) 1.11-1.37x faster than
oneDNN at 12-32 rows, 0.96-1.06x at 48-64; on five layer shapes (warm) 1.08-1.63x at 12-16 rows and 0.88-1.35x at 24-32.
Against F.linear, the engine's other fp32 path (fp32 keeps no oneDNN copy; F.linear is faster than oneDNN from
~64 rows on), it is ahead at every row count measured up to 256 (benchmarks/results/small_gemm_rows_256.md: 16-256
rows, 3 vocabulary and 8 layer shapes, 1.02x at the least, 960 x 576 at 256 rows): on 151936 x 512 at 64 rows 146 vs
228 ms (cold, one call), on the layer shapes 1.1-1.25x at 64 rows and 1.02-1.06x at 256 (warm). Hence MAX_ROWS
(layers) and VOCAB_MAX_ROWS (vocabulary) of 256; larger inputs (prefill) take F.linear.

Layout: weight [N, K] -> panels [ceil(N / 16), K, 16] (16 output columns, contiguous along k), zero-padded past N.
A pass over one panel computes 6, 4, 2 or 1 rows x 16 columns into 12, 8, 4 or 2 vector registers (<8 x float>,
emitted through llvmlite because numba has no vector type), so the panel is read from memory once and from L1/L2 for
every further pass.

Numerics: every output is sum_k x[m, k] * w[n, k] in float32: blocks of `k_block(K)` k steps accumulated in
registers with fused multiply-adds from zero, each block's sum then added to the output (to the bias where there is
one); the same order in every pass, so a row's values do not depend on the row count or on which pass computed it.
That is F.linear's order (torch's CPU BLAS, what transformers runs) at 4+ rows, with the block size a probe finds
once per K (`k_block`): on this machine (MKL, AVX2) 192 from K = 385 on, K/2 from 193 to 384, one block up to 192.
So decode linears and vocabulary projections equal transformers' bit for bit (F.linear's own 1-3 row path sums
otherwise); SmolLM2-135M's logits vs transformers (benchmarks/peers/exactness.py) went from 1.37e-4 to 4.3e-5.
Where no candidate reproduces F.linear, K_BLOCK = 64, the most accurate order measured (error against float64 on
4 x 576..1536 inputs 2.4-4.1e-6, vs 1.5-3.3e-5 for one chain over all of k, oneDNN's 1.2-1.8e-5, MKL's 0.6-0.8e-5).

Width: the figures above are this module's 8-lane kernel on AVX2. On an AVX-512 host `linear` runs the 16-lane
kernel of cpu_small_gemm16.py over the same panels (equal sums bit for bit; there the 8-lane one falls behind oneDNN
and F.linear from ~8 rows on).

Threads: the kernel runs on the calling thread only; `applies` takes it only with 1 torch intra-op thread (the
sub-server setting), otherwise the caller runs F.linear (multi-threaded).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit

from tokenplane.engine import cpu_small_gemm16
from tokenplane.engine.cpu_malloc import huge_page_empty
from tokenplane.engine.cpu_simd import HOST_AVX512, _add8, _fma1, _fma8, _load8, _prefetch, _splat8, _store8, _zero8

PANEL = 16            # output columns per panel: two 8-float vectors (one 16-float vector in cpu_small_gemm16)
MAX_ROWS = 256        # layers: ahead of F.linear (the fallback) up to 256 rows on every measured shape (docstring)
VOCAB_MAX_ROWS = 256  # vocabulary projections: likewise (docstring)
K_BLOCK = 64          # k steps a register block sums where no size reproduces F.linear (see Numerics, `k_block`)
_K_CANDIDATES = (192, 128, 256, 96, 384, 512, 64)   # block sizes BLAS sgemm kernels use, tried in this order
PREFETCH = 1024       # floats ahead of the panel stream (64 k-steps, 4 KiB): at 4 rows 15-30% faster than none here

@njit(inline="always")
def _acc8(out, index, value, first):  # noqa: ANN001
    """out[index : index + 8] = value on a row's first k block, += value on the next ones."""
    if first:
        _store8(out, index, value)
    else:
        _store8(out, index, _add8(_load8(out, index), value))


@njit(inline="always")
def _acc_row(keep, out, index, lo, hi, first):  # noqa: ANN001
    """One output row's 16 panel columns (lo: the first 8, hi: the next 8) by `_acc8`, for a row that exists (keep);
    nothing for a zero row padding a remainder."""
    if keep:
        _acc8(out, index, lo, first)
        _acc8(out, index + 8, hi, first)


@njit(inline="always")
def _pass6(x, k_dim, m, wp, wbase, last, out, n_out, col, kb, acc, nv):  # noqa: ANN001
    """out[m : m + 6, col : col + 16] = x[m : m + 6] @ panel: 12 accumulators, 2 panel loads and 6 broadcasts for 12
    FMAs a k step (FMA-bound on AVX2's 16 vector registers; the 4-row pass is load-bound); only the first nv rows'
    outputs are stored (the rest pad a remainder)."""
    x0 = m * k_dim
    o = m * n_out + col
    for k0 in range(0, k_dim, kb):
        a00 = _zero8()
        a01 = _zero8()
        a10 = _zero8()
        a11 = _zero8()
        a20 = _zero8()
        a21 = _zero8()
        a30 = _zero8()
        a31 = _zero8()
        a40 = _zero8()
        a41 = _zero8()
        a50 = _zero8()
        a51 = _zero8()
        for k in range(k0, min(k0 + kb, k_dim)):
            wi = wbase + k * PANEL
            _prefetch(wp, min(wi + PREFETCH, last))
            w0 = _load8(wp, wi)
            w1 = _load8(wp, wi + 8)
            b = _splat8(x, x0 + k)
            a00 = _fma8(b, w0, a00)
            a01 = _fma8(b, w1, a01)
            b = _splat8(x, x0 + k_dim + k)
            a10 = _fma8(b, w0, a10)
            a11 = _fma8(b, w1, a11)
            b = _splat8(x, x0 + 2 * k_dim + k)
            a20 = _fma8(b, w0, a20)
            a21 = _fma8(b, w1, a21)
            b = _splat8(x, x0 + 3 * k_dim + k)
            a30 = _fma8(b, w0, a30)
            a31 = _fma8(b, w1, a31)
            b = _splat8(x, x0 + 4 * k_dim + k)
            a40 = _fma8(b, w0, a40)
            a41 = _fma8(b, w1, a41)
            b = _splat8(x, x0 + 5 * k_dim + k)
            a50 = _fma8(b, w0, a50)
            a51 = _fma8(b, w1, a51)
        first = k0 == 0 and not acc
        _acc_row(True, out, o, a00, a01, first)
        _acc_row(nv > 1, out, o + n_out, a10, a11, first)
        _acc_row(nv > 2, out, o + 2 * n_out, a20, a21, first)
        _acc_row(nv > 3, out, o + 3 * n_out, a30, a31, first)
        _acc_row(nv > 4, out, o + 4 * n_out, a40, a41, first)
        _acc_row(nv > 5, out, o + 5 * n_out, a50, a51, first)


@njit(inline="always")
def _pass4(x, k_dim, m, wp, wbase, last, out, n_out, col, kb, acc, nv):  # noqa: ANN001
    """out[m : m + 4, col : col + 16] = x[m : m + 4] @ panel, the panel starting at wp[wbase]; the first nv rows'
    outputs stored."""
    x0 = m * k_dim
    o = m * n_out + col
    for k0 in range(0, k_dim, kb):
        a00 = _zero8()
        a01 = _zero8()
        a10 = _zero8()
        a11 = _zero8()
        a20 = _zero8()
        a21 = _zero8()
        a30 = _zero8()
        a31 = _zero8()
        for k in range(k0, min(k0 + kb, k_dim)):
            wi = wbase + k * PANEL
            _prefetch(wp, min(wi + PREFETCH, last))
            w0 = _load8(wp, wi)
            w1 = _load8(wp, wi + 8)
            b = _splat8(x, x0 + k)
            a00 = _fma8(b, w0, a00)
            a01 = _fma8(b, w1, a01)
            b = _splat8(x, x0 + k_dim + k)
            a10 = _fma8(b, w0, a10)
            a11 = _fma8(b, w1, a11)
            b = _splat8(x, x0 + 2 * k_dim + k)
            a20 = _fma8(b, w0, a20)
            a21 = _fma8(b, w1, a21)
            b = _splat8(x, x0 + 3 * k_dim + k)
            a30 = _fma8(b, w0, a30)
            a31 = _fma8(b, w1, a31)
        first = k0 == 0 and not acc
        _acc_row(True, out, o, a00, a01, first)
        _acc_row(nv > 1, out, o + n_out, a10, a11, first)
        _acc_row(nv > 2, out, o + 2 * n_out, a20, a21, first)
        _acc_row(nv > 3, out, o + 3 * n_out, a30, a31, first)


@njit(inline="always")
def _pass2(x, k_dim, m, wp, wbase, last, out, n_out, col, kb, acc):  # noqa: ANN001
    x0 = m * k_dim
    o = m * n_out + col
    for k0 in range(0, k_dim, kb):
        a00 = _zero8()
        a01 = _zero8()
        a10 = _zero8()
        a11 = _zero8()
        for k in range(k0, min(k0 + kb, k_dim)):
            wi = wbase + k * PANEL
            _prefetch(wp, min(wi + PREFETCH, last))
            w0 = _load8(wp, wi)
            w1 = _load8(wp, wi + 8)
            b = _splat8(x, x0 + k)
            a00 = _fma8(b, w0, a00)
            a01 = _fma8(b, w1, a01)
            b = _splat8(x, x0 + k_dim + k)
            a10 = _fma8(b, w0, a10)
            a11 = _fma8(b, w1, a11)
        first = k0 == 0 and not acc
        _acc_row(True, out, o, a00, a01, first)
        _acc_row(True, out, o + n_out, a10, a11, first)


@njit(inline="always")
def _pass1(x, k_dim, m, wp, wbase, last, out, n_out, col, kb, acc):  # noqa: ANN001
    x0 = m * k_dim
    o = m * n_out + col
    for k0 in range(0, k_dim, kb):
        a00 = _zero8()
        a01 = _zero8()
        for k in range(k0, min(k0 + kb, k_dim)):
            wi = wbase + k * PANEL
            _prefetch(wp, min(wi + PREFETCH, last))
            a00 = _fma8(_splat8(x, x0 + k), _load8(wp, wi), a00)
            a01 = _fma8(_splat8(x, x0 + k), _load8(wp, wi + 8), a01)
        first = k0 == 0 and not acc
        _acc_row(True, out, o, a00, a01, first)


@njit(cache=True, nogil=True)
def gemm_with(x, rows, k_dim, wp, panels, out, n_out, kb, acc, cover):  # noqa: ANN001
    """`_gemm` with the remainder policy given: cover[r] (r < 6 rows left after the 6-row passes) is r itself (the
    passes of 4, 2 and 1 rows in turn) or the row count 4 or 6 it is padded to: one pass over a zero-padded copy of
    the r rows' inputs, storing only their r rows of output."""
    last = panels * k_dim * PANEL - 1
    full, r, size, xs, tail = cpu_small_gemm16.padded_remainder(x, rows, k_dim, out, n_out, 6, cover)
    for p in range(panels):
        wbase = p * k_dim * PANEL
        col = p * PANEL
        m = 0
        while m < full:
            _pass6(x, k_dim, m, wp, wbase, last, out, n_out, col, kb, acc, 6)
            m += 6
        if size != r:       # one pass of 6 or 4 rows over the padded rows, storing the first r
            if size == 6:
                _pass6(xs, k_dim, 0, wp, wbase, last, tail, n_out, col, kb, acc, r)
            else:
                _pass4(xs, k_dim, 0, wp, wbase, last, tail, n_out, col, kb, acc, r)
            continue
        if rows - m >= 4:
            _pass4(x, k_dim, m, wp, wbase, last, out, n_out, col, kb, acc, 4)
            m += 4
        if rows - m >= 2:
            _pass2(x, k_dim, m, wp, wbase, last, out, n_out, col, kb, acc)
            m += 2
        if rows - m == 1:
            _pass1(x, k_dim, m, wp, wbase, last, out, n_out, col, kb, acc)


# Remainder policies (`gemm_with`'s cover, rows left after the 6-row passes): SPLIT runs them through the passes of
# 4, 2 and 1 rows; PAD_ODD (`_gemm`'s) pads 3 to one 4-row pass and 5 to one 6-row pass. A pass after the first over
# a panel reads it from cache, but the 1- and 2-row passes are bound by their FMA chains' latency (2 and 4 chains
# of 4 cycles a k step), so 3 = 2 + 1 and 5 = 4 + 1 rows cost a second pass that the zero rows of one wider pass do
# not (benchmarks/results/small_gemm_remainders_8lane_zen3.md: Zen 3, 1 thread, the same bits).
SPLIT = np.arange(6, dtype=np.int64)
PAD_ODD = np.array([0, 1, 2, 4, 4, 6], np.int64)


@njit(cache=True, nogil=True)
def _gemm(x, rows, k_dim, wp, panels, out, n_out, kb, acc):  # noqa: ANN001
    """x [rows, k_dim] flat float32, wp [panels, k_dim, 16] flat, out [rows, n_out] flat (n_out = panels * 16); kb: k
    steps a register block sums before it is added to the output (`k_block`); acc: add every block to out's values
    (the bias, as F.linear starts from it) instead of storing the first. Remainders of 3 and 5 rows padded (PAD_ODD)."""
    gemm_with(x, rows, k_dim, wp, panels, out, n_out, kb, acc, PAD_ODD)


# The kernel `linear` runs: the 16-lane one where the host has AVX-512 (cpu_small_gemm16.py; same layout, same sums
# bit for bit), this module's 8-lane one elsewhere. A one-item list, so tests can run both on one host.
_KERNEL = [cpu_small_gemm16.gemm if HOST_AVX512 else _gemm]


def kernel() -> Callable[..., None]:
    """The compiled kernel `linear` runs (`_gemm`'s arguments), for callers that hold flat arrays themselves
    (cpu_decode_stack.py)."""
    return _KERNEL[0]


def available(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


def pack(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The panel copy [ceil(N / 16), K, 16] of a float32 [N, K] weight (a snapshot: pack again after changing it), in
    `dtype` (bfloat16: cpu_bf16_gemv's copy)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    w = weight.detach().to(dtype)
    if n % PANEL:
        w = torch.cat([w, w.new_zeros(panels * PANEL - n, k)])
    src = w.reshape(panels, PANEL, k).transpose(1, 2)
    # 2 MiB pages: a decode step streams every panel copy once (cpu_malloc.huge_page_empty)
    return huge_page_empty(src.numel(), dtype).view(src.shape).copy_(src)


def applies(x: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """A CPU float32 [rows, K] input of 1..max_rows rows, with 1 torch thread. The kernel takes any row count (each
    panel is read from memory once, then from cache for every further 6 rows); MAX_ROWS is as far as it was measured
    ahead of F.linear."""
    return (x.dim() == 2 and 0 < x.shape[0] <= max_rows and x.dtype == torch.float32 and x.device.type == "cpu"
            and torch.get_num_threads() == 1)


def k_block(k: int) -> int:
    """k steps per register block at inner size k: the size that reproduces F.linear's order (`probe_k_block`), else
    K_BLOCK."""
    return probe_k_block(k) or K_BLOCK


@functools.cache
def probe_k_block(k: int) -> int | None:
    """The k-block size whose summation order reproduces F.linear's float32 results bit for bit at inner size k (at 4+
    rows), found once per k: each candidate (one chain over all of k, K/2, the sizes BLAS kernels use) runs on a
    16-row product and is compared with F.linear's; None where none matches."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(16, k, generator=g)
    w = torch.randn(2 * PANEL, k, generator=g)
    with torch.no_grad():
        ref = F.linear(x, w)
    panels = pack(w)
    for kb in dict.fromkeys((k, -(-k // 2), *_K_CANDIDATES)):
        if kb <= k and torch.equal(_linear(x, panels, kb, None), ref):
            return kb
    return None


def _linear(x: torch.Tensor, panels: torch.Tensor, kb: int, bias: torch.Tensor | None) -> torch.Tensor:
    rows, k = x.shape
    n_panels = panels.shape[0]
    if bias is None:
        out = torch.empty(rows, n_panels * PANEL, dtype=torch.float32)
    else:   # F.linear's order: the bias first, then each k block's sum added to it
        out = torch.zeros(rows, n_panels * PANEL, dtype=torch.float32)
        out[:, :bias.shape[0]] = bias
    _KERNEL[0](x.numpy().reshape(-1), rows, k, panels.numpy().reshape(-1), n_panels, out.numpy().reshape(-1),
          n_panels * PANEL, kb, bias is not None)
    return out


@njit(cache=True, nogil=True)
def _columns(x, k_dim, w, cols, kb, out):  # noqa: ANN001
    """out[j] = the kernels' sum for output column cols[j] of one input row x (float32 [k_dim]) over the unpacked
    weight w (float32 [N, k_dim], flat): each lane's arithmetic, one lane at a time (k blocks of kb steps, each a
    chain of fused multiply-adds from zero; the first block's sum stored, each next one added), so the same bits as
    the panel kernels' output for that row and column (cpu_small_gemm16 is the same lane arithmetic)."""
    for j in range(cols.shape[0]):
        base = cols[j] * k_dim
        total = np.float32(0.0)
        for k0 in range(0, k_dim, kb):
            acc = np.float32(0.0)
            for k in range(k0, min(k0 + kb, k_dim)):
                acc = _fma1(x[k], w[base + k], acc)
            total = acc if k0 == 0 else np.float32(total + acc)
        out[j] = total


def columns(x: torch.Tensor, weight: torch.Tensor, cols: np.ndarray) -> np.ndarray:
    """float32 values of `linear(x[None], pack(weight), N)[0, cols]` (bit for bit, no bias) for one row x [K],
    reading only the weight rows `cols` (int64): a few logits of a vocabulary projection."""
    k = x.shape[0]
    out = np.empty(cols.shape[0], np.float32)
    _columns(x.detach().contiguous().numpy(), k, weight.detach().contiguous().numpy().reshape(-1), cols,
             k_block(k), out)
    return out


def linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) for `applies(x)` inputs, W given as `pack(W)`; returns a contiguous [rows, out_features]."""
    k = x.shape[1]
    if panels.shape[1] != k:
        raise ValueError(f"input has {k} features, the weight {panels.shape[1]}")
    out = _linear(x.detach().contiguous(), panels, k_block(k), None if bias is None else bias.detach())
    if out.shape[1] != out_features:
        out = out[:, :out_features].contiguous()
    return out


__all__ = ["MAX_ROWS", "PAD_ODD", "PANEL", "SPLIT", "VOCAB_MAX_ROWS", "applies", "available", "columns", "gemm_with",
           "k_block", "kernel", "linear", "pack", "probe_k_block"]
