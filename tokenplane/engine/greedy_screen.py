"""Exact greedy tokens from a bfloat16 screen of the vocabulary projection: a fraction of the full projection's cost.

A greedy request needs the index of its largest logit, not every logit. At one to a few rows the fp32 vocabulary
projection is a stream over its weight (151936 x 256 fp32: 155 MB, ~10 of an ~11 ms tiny-model decode step on one
core); at tens of rows it is the step's largest GEMM (151936 x 512 at 64 rows: ~110 ms of fp32 FMAs on one core).
This module finds each row's argmax without computing the fp32 logits:

1. approximate logits over a bfloat16 copy of the matrix, by one of two passes (`STREAM_MAX_ROWS`):
   - stream (1-4 rows): h @ bf16(W)^T with float32 h and float32 sums over a bf16 panel copy (cpu_bf16_gemv: half
     the bytes of the fp32 stream);
   - oneDNN (more rows, where the CPU has bf16 dot products: AVX512-BF16, AMX): bf16(h) @ bf16(W)^T with
     float32 accumulation and bf16 output (oneDNN's packed bf16 matmul: 151936 x 512 at 64 rows in ~21 ms here,
     against ~86 ms for the stream and ~110 for the fp32 panel kernel);
2. a bound with |approx[r, i] - logits[r, i]| <= bound for every vocabulary row i, where `logits` is what the fp32
   path computes (cpu_small_gemm's panel kernel: the logits every other request gets); every i whose upper bound is
   below the largest lower bound is provably not the argmax;
3. the remaining candidates' logits computed with the fp32 kernel's own lane arithmetic from their weight rows alone
   (cpu_small_gemm.columns: bit for bit the values the full projection gives), and numpy's argmax among them (first
   maximum, as `sampler.greedy`).

So the token is the full fp32 path's token, by construction; where the screen cannot prove it cheaply (a non-finite
input or weight, logits that could overflow, too many candidates) it answers None and the caller projects in full.

The bound, for row i of W (wb: its bfloat16 rounding; hb: h's; u = 2**-24; g_K = K u / (1 - K u), Higham's bound
for a sum of K products in any order, fused or not, in float32):
  |fp32 kernel - h.w|        <= g_K |h| |w_i|
  stream: |pass - h.wb|      <= g_K |h| |wb_i|
          |h.wb - h.w|       <= |h| |wb_i - w_i|                              (Cauchy-Schwarz)
  oneDNN: |sum - hb.wb|      <= g_K |hb| |wb_i|                               (float32 accumulation, any order)
          |hb.wb - h.w|      <= |hb - h| |wb_i| + |h| |wb_i - w_i|
          |bf16(sum) - sum|  <= e |bf16(sum)|, e = 2**-7 / (1 - 2**-7)        (any rounding to 8 significant bits)
The row-independent part is taken over the worst row of W (maxima kept at build time), everything doubled for slack,
plus a term for flushed denormals; per-row norms then prune a large candidate set further. The approximate values
are compared as integer keys of their bit patterns (monotone in the value), scanning only the blocks of the
vocabulary whose maximum passes the threshold.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tokenplane.engine import cpu_bf16_gemv, cpu_small_gemm
from tokenplane.engine.cpu_simd import HOST_AVX512, _host_has
from tokenplane.engine.layers import cpu_pack, cpu_packed_linear, cpu_packing_supported
from tokenplane.engine.numbacache import njit

U32 = 2.0 ** -24
BF16_OUT = 2.0 ** -7 / (1 - 2.0 ** -7)   # relative error of a bf16 output, for round-to-nearest and truncation alike
DENORMAL = 2.0 ** -100   # covers flush-to-zero of denormal inputs, products and outputs (each < 2**-126 x the operands)
MAX_ROWS = cpu_small_gemm.VOCAB_MAX_ROWS   # as far as the fp32 panel kernel (the values reproduced) is the path
STREAM_MAX_ROWS = 4      # the stream ahead of oneDNN's bf16 matmul up to here (module docstring's shapes, 1 thread)
# oneDNN packs bf16 wherever the CPU converts bf16 (AVX-512), but multiplies it natively only with AVX512-BF16 or
# AMX; without them (Ice Lake, Cascade Lake) it widens to fp32, and its pass was the slowest of all on an Ice Lake
# server core (151936 x 256, 1 thread, CPU ms at 5 / 8 / 12 / 16 rows: screen through oneDNN 36.0 / 41.1 / 49.9 /
# 55.7, through the stream 10.0 / 10.8 / 13.0 / 13.6, no screen (fp32 panels) 15.2 / 17.9 / 13.2 / 16.6; 2.5-4.8x the
# stream from 2 rows on, all three shapes: benchmarks/results/vocab_screen_rows_xeon.md). There the stream screens
# every row count up to its own limit.
NATIVE_BF16 = _host_has("avx512bf16") or _host_has("amx-bf16")   # the CPU's, whatever our kernels' switches
# Without oneDNN bf16 the stream is the screen's only first pass; past these rows the full fp32 panel projection is
# faster. On 8-lane (AVX2) hosts the stream's passes of more than 4 rows outgrow the 16 vector registers: Zen 3, 1
# thread, the screen / fp32 panel CPU time was 0.69-0.81 at 4-5 rows and 1.18-1.28 at 6, 1.97-2.04 at 16, on all
# three vocabulary shapes (benchmarks/results/vocab_screen_rows_zen3.md); with the panel kernel's 5-row remainder
# padded, 0.95-0.98 at 5 and 1.28-1.87 at 6 (vocab_screen_rows_zen3_padded.md); with its 5-row pass (FIT),
# 0.89-0.99 at 5 and 1.34-1.46 at 6 (vocab_screen_rows_zen3_plans.md). AVX-512 hosts keep 16.
STREAM_ONLY_MAX_ROWS = 16 if HOST_AVX512 else 5
MAX_CANDIDATE_SHARE = 8  # more candidates than 1/8 of the vocabulary: the screen gains too little, project in full
OVERFLOW = 1e30          # |h| |w_i| past this could overflow a float32 partial sum: project in full
BLOCK = 128              # vocabulary entries per block maximum
PRUNE_ABOVE = 64         # candidates past which the rows' own norms prune the set


def _row_norms(x: torch.Tensor) -> np.ndarray:
    return torch.linalg.vector_norm(x.double(), dim=-1).numpy()


@njit(cache=True, nogil=True)
def _weight_norms(w, wb, n_w, n_wb, n_d):  # noqa: ANN001
    """Per row of w (float32 [R, K]) and its bfloat16 rounding wb (as float32, exact): |w_i|, |wb_i| and
    |wb_i - w_i| in float64, in one pass."""
    for i in range(w.shape[0]):
        a = 0.0
        b = 0.0
        d = 0.0
        for k in range(w.shape[1]):
            x = np.float64(w[i, k])
            y = np.float64(wb[i, k])
            a += x * x
            b += y * y
            d += (y - x) * (y - x)
        n_w[i] = np.sqrt(a)
        n_wb[i] = np.sqrt(b)
        n_d[i] = np.sqrt(d)


def weight_norms(w: torch.Tensor, chunk: int = 16384) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(|w_i|, |bf16(w_i)|, |bf16(w_i) - w_i|) per row of a float32 [V, K] weight, float64, a chunk of rows at a
    time (torch's float64 copies of a 151936 x 512 matrix took ~6 s and 1.7 GB here)."""
    v = w.shape[0]
    n_w, n_wb, n_d = np.empty(v, np.float64), np.empty(v, np.float64), np.empty(v, np.float64)
    for a in range(0, v, chunk):
        part = w[a:a + chunk].contiguous()
        _weight_norms(part.numpy(), part.to(torch.bfloat16).float().numpy(), n_w[a:a + chunk], n_wb[a:a + chunk],
                      n_d[a:a + chunk])
    return n_w, n_wb, n_d


# Keys: a float's bit pattern as a signed integer is monotone in the value for non-negative floats and reversed for
# negative ones; flipping every bit but the sign of the negative ones makes it monotone throughout (NaN aside: the
# screen declines before any can arise). `mask` is 0x7FFF for bf16 bits (int16), 0x7FFFFFFF for float32 (int32).

@njit(nogil=True, inline="always")
def _extremes(row, lo, hi):  # noqa: ANN001
    """(max, min) of the raw bit patterns row[lo:hi] as signed integers."""
    m = row[lo]
    mn = row[lo]
    for i in range(lo, hi):
        m = max(m, row[i])
        mn = min(mn, row[i])
    return m, mn


@njit(nogil=True, inline="always")
def _extremes_block(row, lo):  # noqa: ANN001
    """_extremes(row, lo, lo + BLOCK), a constant trip count: LLVM unrolls it into a few vector max/min (6x faster
    than the variable-length loop on 64 x 151936 bf16 here)."""
    m = row[lo]
    mn = row[lo]
    for j in range(BLOCK):
        m = max(m, row[lo + j])
        mn = min(mn, row[lo + j])
    return m, mn


@njit(cache=True, nogil=True)
def _block_max(bits, v, out):  # noqa: ANN001
    """out[r, b] = the bit pattern of the largest value in bits[r, b * BLOCK : min((b + 1) * BLOCK, v)]: the largest
    signed pattern where any is non-negative (the non-negative floats order as their patterns), else the smallest
    (the negative floats order against their patterns)."""
    full = v // BLOCK
    for r in range(bits.shape[0]):
        row = bits[r]
        for b in range(full):
            m, mn = _extremes_block(row, b * BLOCK)
            out[r, b] = m if m >= 0 else mn
        if full < out.shape[1]:
            m, mn = _extremes(row, full * BLOCK, v)
            out[r, full] = m if m >= 0 else mn


@njit(cache=True, nogil=True)
def _collect(bits, v, mask, block_max, thr, cands, counts):  # noqa: ANN001
    """Per row r, the indices i < v with key >= thr[r] into cands[r, :counts[r]] (ascending), scanning only the blocks
    whose maximum reaches thr[r]; counts[r] keeps counting past cands' width (the caller declines then)."""
    cap = cands.shape[1]
    for r in range(bits.shape[0]):
        n = 0
        t = thr[r]
        for b in range(block_max.shape[1]):
            if block_max[r, b] < t:
                continue
            for i in range(b * BLOCK, min((b + 1) * BLOCK, v)):
                x = np.int64(bits[r, i])
                if x ^ ((x >> 63) & mask) >= t:
                    if n < cap:
                        cands[r, n] = i
                    n += 1
        counts[r] = n


def _mask(bf16: bool) -> int:
    return 0x7FFF if bf16 else 0x7FFFFFFF


def _flip(x: np.ndarray, bf16: bool) -> np.ndarray:
    """Signed bit patterns (int64) <-> their keys: the negative ones' bits but the sign flipped (its own inverse)."""
    return np.where(x >= 0, x, x ^ _mask(bf16))


def _keys(bits: np.ndarray, bf16: bool) -> np.ndarray:
    """The keys (int64) of bf16 (int16) or float32 (int32) bit patterns."""
    return _flip(bits.astype(np.int64), bf16)


def _bit_values(bits: np.ndarray, bf16: bool) -> np.ndarray:
    """The float64 values of signed bf16 or float32 bit patterns (any integer dtype)."""
    bits = bits.astype(np.int64)
    if bf16:
        return ((bits & 0xFFFF).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return (bits & 0xFFFFFFFF).astype(np.uint32).view(np.float32).astype(np.float64)


def _values(keys: np.ndarray, bf16: bool) -> np.ndarray:
    """The float64 values of keys (int64)."""
    return _bit_values(_flip(keys, bf16), bf16)


def _key_at_most(x: np.ndarray, bf16: bool) -> np.ndarray:
    """Per value of x (float64, finite), the key of the largest float32 (bf16) value <= it."""
    f = x.astype(np.float32)
    f = np.where(f.astype(np.float64) > x, np.nextafter(f, np.float32(-np.inf)), f)
    u = f.view(np.uint32).astype(np.int64)
    if bf16:
        neg = u >> 31
        b = (u >> 16) + (neg & ((u & 0xFFFF) != 0))    # a negative value's dropped bits round it away from zero
        b = np.where(b >= 0x8000, b - 0x10000, b)       # as int16
    else:
        b = np.where(u >= 0x80000000, u - 0x100000000, u)
    return _flip(b, bf16)


@dataclass
class _Approx:
    """One pass's approximate logits and their bound: |approx - logits| <= 2 (bound_c + e |approx|) per entry, with
    bound_c[r] the worst vocabulary row's and per_row(r, c) each of the rows c's."""
    bits: np.ndarray          # [B, >= V] int16 (bf16 bits) or int32 (float32 bits)
    bf16: bool
    e: float
    bound_c: np.ndarray       # float64 [B]
    per_row: Callable[[int, np.ndarray], np.ndarray]


class GreedyScreen:
    """Built beside a VocabProjection's fp32 panel copy: a bfloat16 panel copy of W for the stream (half of the fp32
    matrix's bytes), oneDNN's packed bf16 copy for more rows (the same again, made on the first such step), and W's row
    norms (float64)."""

    def __init__(self, weight: torch.Tensor, panels: torch.Tensor) -> None:
        w = weight.detach()
        self.out_features, self.k = w.shape
        self.panels = panels
        self.weight = w
        self.bf16 = cpu_bf16_gemv.pack_bf16(w)
        self.packed: torch.Tensor | None = None
        self.onednn = NATIVE_BF16 and cpu_packing_supported(torch.bfloat16)
        self.n_w, self.n_wb, self.n_d = weight_norms(w)
        g = self.k * U32
        self.gamma = g / (1 - g)
        self.row_bound = self.gamma * (self.n_wb + self.n_w) + self.n_d     # the stream's bound / |h| per row
        self.worst = float(self.row_bound.max())
        self.max_w, self.max_wb, self.max_d = float(self.n_w.max()), float(self.n_wb.max()), float(self.n_d.max())
        self.max_abs_w = float(w.abs().max()) if w.numel() else 0.0

    def argmax(self, hidden: torch.Tensor) -> list[int] | None:
        """numpy's argmax of each row of the fp32 projection of `hidden` [B, K] (float32, CPU), or None where the
        screen cannot prove it cheaply (the caller then projects in full)."""
        got = self.screen(hidden, 0)
        return None if got is None else got[0]

    def _stream(self, h: torch.Tensor, n_h: np.ndarray) -> _Approx:
        out = cpu_bf16_gemv.linear_bf16(h, self.bf16)
        return _Approx(out.view(np.int32), False, 0.0, n_h * self.worst,
                       lambda r, c: n_h[r] * self.row_bound[c])

    def _onednn(self, h: torch.Tensor, n_h: np.ndarray) -> _Approx:
        if self.packed is None:
            self.packed = cpu_pack(self.weight.to(torch.bfloat16))
        hb = h.to(torch.bfloat16)
        out = cpu_packed_linear(hb, self.packed, None)
        n_hb = _row_norms(hb)
        n_e = _row_norms(hb.float() - h)
        g = self.gamma
        bound_c = g * (n_h * self.max_w + n_hb * self.max_wb) + n_e * self.max_wb + n_h * self.max_d
        return _Approx(out.view(torch.int16).numpy(), True, BF16_OUT, bound_c,
                       lambda r, c: g * (n_h[r] * self.n_w[c] + n_hb[r] * self.n_wb[c]) + n_e[r] * self.n_wb[c]
                       + n_h[r] * self.n_d[c])

    def screen(self, hidden: torch.Tensor, k: int) -> tuple[list[int], np.ndarray | None] | None:
        """(each row's argmax, and with k > 0 each row's k largest fp32 logits sorted descending [B, min(k, V)], the
        values torch.topk(logits, k) gives), or None where the screen cannot prove them cheaply.

        With lo(a) and hi(a) the bounds of the logit behind an approximate value a, and L <= the k-th largest approx
        value (the row's maximum for k <= 1; else the k-th largest block maximum: k blocks hold a value >= it), k
        rows have logits >= lo(L), so the k-th largest logit is >= lo(L), and every row with hi(approx) < lo(L)
        lies strictly below it: the candidates (hi(approx) >= lo(L), hi increasing) hold the argmax and every top-k
        value."""
        h = hidden.detach().contiguous()
        rows = h.shape[0]
        v_all = self.out_features
        k = min(k, v_all)
        if not np.isfinite(self.worst) or not bool(torch.isfinite(h).all()):   # a non-finite weight or input
            return None
        n_h = _row_norms(h)
        h_max = float(h.abs().max()) if h.numel() else 0.0
        # |partial sums| <= sum_k |h_k| |w_k| <= |h| |w_i| (and likewise for the bf16 roundings, at most 2**-8
        # larger): below OVERFLOW nothing overflows, so no inf or NaN can appear in either computation (h itself
        # too: its bf16 rounding cannot overflow)
        if not (np.all(n_h * max(self.max_w, self.max_wb) < OVERFLOW) and h_max < OVERFLOW):
            return None
        if rows > STREAM_MAX_ROWS and self.onednn:
            ap = self._onednn(h, n_h)
        elif rows <= max(STREAM_ONLY_MAX_ROWS, STREAM_MAX_ROWS):
            ap = self._stream(h, n_h)
        else:   # past the stream's gain: the full projection
            return None
        mask = _mask(ap.bf16)
        nb = -(-v_all // BLOCK)
        raw_max = np.empty((rows, nb), ap.bits.dtype)
        _block_max(ap.bits, v_all, raw_max)
        block_max = _keys(raw_max, ap.bf16)
        if k <= 1 or nb >= k:
            level_key = block_max.max(axis=1) if k <= 1 else np.partition(block_max, nb - k, axis=1)[:, nb - k]
        else:   # fewer blocks than k: the row's own k-th largest
            level_key = np.partition(_keys(ap.bits[:, :v_all], ap.bf16), v_all - k, axis=1)[:, v_all - k]
        level = _values(level_key, ap.bf16)
        tiny = DENORMAL * (self.k + 2) * (1.0 + self.max_abs_w) * (1.0 + h_max)
        bc = 2.0 * (ap.bound_c + tiny)
        e2 = 2.0 * ap.e
        low = level - e2 * np.abs(level) - bc                                  # lo(L)
        thr = np.where(low - bc >= 0, (low - bc) / (1 + e2), (low - bc) / (1 - e2))   # hi(a) >= lo(L) <=> a >= thr
        budget = max(v_all // MAX_CANDIDATE_SHARE, 1)
        cands = np.empty((rows, budget), np.int64)
        counts = np.empty(rows, np.int64)
        _collect(ap.bits, v_all, mask, block_max, _key_at_most(thr, ap.bf16), cands, counts)
        tokens: list[int] = []
        top = np.empty((rows, k), np.float32) if k > 0 else None
        for r in range(rows):
            n = int(counts[r])
            if n < max(k, 1) or n > budget:
                return None
            c = cands[r, :n]
            if n > max(PRUNE_ABOVE, 2 * k):    # each vocabulary row's own bound (the one above takes the worst)
                a = _bit_values(ap.bits[r, c], ap.bf16)
                b = 2.0 * (ap.per_row(r, c) + tiny + ap.e * np.abs(a))
                lows = a - b
                lo = np.max(lows) if k <= 1 else np.partition(lows, n - k)[n - k]
                c = c[a + b >= lo]
            vals = cpu_small_gemm.columns(h[r], self.weight, c)   # the fp32 kernel's own values for these rows
            tokens.append(int(c[int(np.argmax(vals))]))    # c ascends: the first maximum is the lowest index
            if top is not None:
                top[r] = np.sort(vals)[::-1][:k]
        return tokens, top


__all__ = ["GreedyScreen", "MAX_ROWS", "STREAM_MAX_ROWS"]
