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
A pass over one panel computes 1-6 rows x 16 columns into 2-12 vector registers (<8 x float>, emitted through
llvmlite because numba has no vector type), so the panel is read from memory once and from L1/L2 for every further
pass; which passes cover a row count is the pass plan's (FIT: 6-row passes, then one pass of the rows left).

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

from tokenplane.engine import cpu_small_gemm16
from tokenplane.engine.cpu_malloc import huge_page_empty
from tokenplane.engine.cpu_simd import HOST_AVX512, _add8, _fma1, _fma8, _load8, _prefetch, _splat8, _store8, _zero8
from tokenplane.engine.numbacache import njit

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


def _pass_src(rows: int) -> str:
    """Source of `_pass{rows}`: out[m : m + rows, col : col + 16] = x[m : m + rows] @ the panel at wp[wbase]; 2 * rows
    accumulators (<8 x float>), 2 panel loads and `rows` broadcasts for 2 * rows FMAs a k step. Written out per row
    count (numba keeps no vector in an array), generated so the six passes cannot drift apart: each row's lanes sum
    the same products in the same order in every pass."""
    acc = [f"a{r}{h}" for r in range(rows) for h in (0, 1)]
    body = [f"def _pass{rows}(x, k_dim, m, wp, wbase, last, out, n_out, col, kb, acc):",
            "    x0 = m * k_dim",
            "    o = m * n_out + col",
            "    for k0 in range(0, k_dim, kb):",
            *(f"        {a} = _zero8()" for a in acc),
            "        for k in range(k0, min(k0 + kb, k_dim)):",
            "            wi = wbase + k * PANEL",
            "            _prefetch(wp, min(wi + PREFETCH, last))",
            "            w0 = _load8(wp, wi)",
            "            w1 = _load8(wp, wi + 8)"]
    for r in range(rows):
        body += [f"            b = _splat8(x, x0 + {r} * k_dim + k)",
                 f"            a{r}0 = _fma8(b, w0, a{r}0)",
                 f"            a{r}1 = _fma8(b, w1, a{r}1)"]
    body.append("        first = k0 == 0 and not acc")
    for r in range(rows):
        body += [f"        _acc8(out, o + {r} * n_out, a{r}0, first)",
                 f"        _acc8(out, o + {r} * n_out + 8, a{r}1, first)"]
    return "\n".join(body) + "\n"


def _make_pass(rows: int) -> Callable[..., None]:
    env = {"PANEL": PANEL, "PREFETCH": PREFETCH, "_zero8": _zero8, "_prefetch": _prefetch, "_load8": _load8,
           "_splat8": _splat8, "_fma8": _fma8, "_acc8": _acc8}
    exec(compile(_pass_src(rows), f"<cpu_small_gemm._pass{rows}>", "exec"), env)
    return njit(inline="always")(env[f"_pass{rows}"])


_pass1, _pass2, _pass3, _pass4, _pass5, _pass6 = (_make_pass(r) for r in range(1, 7))


@njit(cache=True, nogil=True)
def _tail_rows(rows, plan):  # noqa: ANN001
    """Rows left to the plan's tail passes: the largest t <= rows, t = rows mod 6 (mod 6), that `plan` lists (t < 6
    always is); the rows before them run as 6-row passes."""
    t = rows % 6
    c = t
    while c + 6 < plan.shape[0] and c + 6 <= rows:
        c += 6
        if plan[c, 0] > 0:
            t = c
    return t


@njit(cache=True, nogil=True)
def gemm_with(x, rows, k_dim, wp, panels, out, n_out, kb, acc, plan):  # noqa: ANN001
    """`_gemm` with the pass plan given: 6-row passes, then the passes plan[t] lists (sizes 1-6, 0 past the last) for
    the t = `_tail_rows` rows left, in turn, over each panel."""
    last = panels * k_dim * PANEL - 1
    t = _tail_rows(rows, plan)
    full = rows - t
    for p in range(panels):
        wbase = p * k_dim * PANEL
        col = p * PANEL
        m = 0
        while m < full:
            _pass6(x, k_dim, m, wp, wbase, last, out, n_out, col, kb, acc)
            m += 6
        for j in range(plan.shape[1]):
            size = plan[t, j]
            if size == 0:
                break
            if size == 6:
                _pass6(x, k_dim, m, wp, wbase, last, out, n_out, col, kb, acc)
            elif size == 5:
                _pass5(x, k_dim, m, wp, wbase, last, out, n_out, col, kb, acc)
            elif size == 4:
                _pass4(x, k_dim, m, wp, wbase, last, out, n_out, col, kb, acc)
            elif size == 3:
                _pass3(x, k_dim, m, wp, wbase, last, out, n_out, col, kb, acc)
            elif size == 2:
                _pass2(x, k_dim, m, wp, wbase, last, out, n_out, col, kb, acc)
            else:
                _pass1(x, k_dim, m, wp, wbase, last, out, n_out, col, kb, acc)
            m += size


def _plan(tails: dict[int, tuple[int, ...]]) -> np.ndarray:
    """A pass plan: row t lists the passes of a tail of t rows (t < 14), zero rows for tails the plan does not use."""
    plan = np.zeros((14, 3), np.int64)
    for t, sizes in tails.items():
        assert sum(sizes) == t and all(1 <= s <= 6 for s in sizes)
        plan[t, :len(sizes)] = sizes
    return plan


# Pass plans. A pass over a panel after the first reads it from L1 and costs max(rows, 4) cycles a k step on AVX2
# (2 * rows FMAs on two pipes, or below 4 rows the 4-cycle latency of 2 * rows FMA chains); the first pass streams the
# panel from memory, and where the weight is cold (a vocabulary matrix, every step) a 6-row first pass hides that
# stream best. SPLIT (the rows after the 6-row passes through passes of 4, 2 and 1 rows) pays 4 + 4 for 5 rows left
# and 4 + 4 for 3; FIT runs what the 6-row passes leave as one pass of its own count (1-5 rows) and 15 rows as
# 6 + 5 + 4 (9 = 5 + 4). Passes of 4-6 rows only (8 = 4 + 4, 13 = 5 + 4 + 4) were faster on warm layer weights
# (1.07-1.16x at 7, 8, 13, 14 rows) but slower on cold vocabulary matrices (0.86-0.96x at 7, 8, 13), so they are not
# taken (benchmarks/results/small_gemm_plans_8lane_zen3.md).
SPLIT = _plan({1: (1,), 2: (2,), 3: (2, 1), 4: (4,), 5: (4, 1)})
FIT = _plan({1: (1,), 2: (2,), 3: (3,), 4: (4,), 5: (5,), 9: (5, 4)})


@njit(cache=True, nogil=True)
def _gemm(x, rows, k_dim, wp, panels, out, n_out, kb, acc):  # noqa: ANN001
    """x [rows, k_dim] flat float32, wp [panels, k_dim, 16] flat, out [rows, n_out] flat (n_out = panels * 16); kb: k
    steps a register block sums before it is added to the output (`k_block`); acc: add every block to out's values
    (the bias, as F.linear starts from it) instead of storing the first. Passes as FIT plans them."""
    gemm_with(x, rows, k_dim, wp, panels, out, n_out, kb, acc, FIT)


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


__all__ = ["FIT", "MAX_ROWS", "PANEL", "SPLIT", "VOCAB_MAX_ROWS", "applies", "available", "columns", "gemm_with",
           "k_block", "kernel", "linear", "pack", "probe_k_block"]
