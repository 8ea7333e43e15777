"""Exact greedy tokens from a bf16 screen of the vocabulary projection: half the bytes a decode step streams.

At one to a few rows the fp32 vocabulary projection is a stream over its weight (151936 x 256 fp32: 155 MB, ~10 ms
of an ~11 ms tiny-model decode step on one core), and a greedy request needs only the index of its largest logit,
not every logit. This module finds that index without reading the fp32 matrix:

1. approx = h @ bf16(W)^T over a bfloat16 panel copy of the matrix (cpu_bf16_gemv: half the bytes, float32 sums);
2. a bound B_r with |approx[r, i] - logits[r, i]| <= B_r for every vocabulary row i, where `logits` is what the fp32
   path (cpu_small_gemm's panel kernel, the logits every other request gets) computes; every i with
   approx[r, i] < max_i approx[r, i] - 2 B_r is then provably not the argmax (its logit is below the lower bound of
   the maximum);
3. the remaining candidates' logits computed with the fp32 kernel's own lane arithmetic from their weight rows alone
   (cpu_small_gemm.columns: bit for bit the values the full projection gives), and numpy's argmax among them (first
   maximum, as `sampler.greedy`).

So the token is the full fp32 path's token, by construction; where the screen cannot prove that cheaply (a
non-finite input, logits near overflow, too many candidates) it answers None and the caller projects in full.

The bound, for row i of W (wb: its bfloat16 rounding; u = 2**-24; g_K = K u / (1 - K u), Higham's bound for a sum
of K products in any order, fused or not):
  |fp32 kernel - h.w|   <= g_K |h| |w_i|
  |bf16 pass - h.wb|    <= g_K |h| |wb_i|
  |h.wb - h.w|          <= |h| |wb_i - w_i|             (Cauchy-Schwarz)
so B = |h| (g_K (|wb_i| + |w_i|) + |wb_i - w_i|), taken over the worst row of W (three maxima kept at build time),
doubled for slack, plus 1e-30 for flushed denormals. Per-row norms then prune a large candidate set further.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from tokenplane.engine import cpu_bf16_gemv, cpu_small_gemm

U32 = 2.0 ** -24
MAX_ROWS = 16           # the rows measured ahead of the fp32 stream (cpu_bf16_gemv; decode-sized steps)
MAX_CANDIDATE_SHARE = 8  # more candidates than 1/8 of the vocabulary: the screen gains too little, project in full
BLOCK = 128             # block maxima for the k-th largest approximate value's lower bound
PRUNE_ABOVE = 64        # candidates past which the rows' own norms prune the set


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


def _kth_lower_bound(approx: np.ndarray, k: int) -> np.ndarray:
    """Per row, a value <= its k-th largest entry: the k-th largest of its block maxima (k blocks hold an entry >=
    it), the whole row's k-th largest where it has fewer than k blocks. float64 [B]."""
    b, v = approx.shape
    n = v // BLOCK
    if n < k:
        return np.partition(approx, v - k, axis=1)[:, v - k].astype(np.float64)
    maxima = approx[:, :n * BLOCK].reshape(b, n, BLOCK).max(axis=2)
    return np.partition(maxima, n - k, axis=1)[:, n - k].astype(np.float64)


class GreedyScreen:
    """Built beside a VocabProjection's fp32 panel copy: a bfloat16 panel copy of W (half of the fp32 matrix's
    bytes) and W's row norms (float64)."""

    def __init__(self, weight: torch.Tensor, panels: torch.Tensor) -> None:
        w = weight.detach()
        self.out_features, self.k = w.shape
        self.panels = panels
        self.weight = w
        self.bf16 = cpu_bf16_gemv.pack_bf16(w)
        self.n_w, self.n_wb, self.n_d = weight_norms(w)
        g = self.k * U32
        self.gamma = g / (1 - g)
        self.row_bound = self.gamma * (self.n_wb + self.n_w) + self.n_d     # B / |h| per vocabulary row
        self.worst = float(self.row_bound.max())

    def argmax(self, hidden: torch.Tensor) -> list[int] | None:
        """numpy's argmax of each row of the fp32 projection of `hidden` [B, K] (float32, CPU), or None where the
        screen cannot prove it cheaply (the caller then projects in full)."""
        got = self.screen(hidden, 0)
        return None if got is None else got[0]

    def screen(self, hidden: torch.Tensor, k: int) -> tuple[list[int], np.ndarray | None] | None:
        """(each row's argmax, and with k > 0 each row's k largest fp32 logits sorted descending [B, min(k, V)], the
        values torch.topk(logits, k) gives), or None where the screen cannot prove them cheaply.

        Top-k: with L <= the k-th largest approx value (the k-th largest block maximum: k blocks hold a value >= it),
        k rows have logits >= L - B, so the k-th largest logit is >= L - B, and every row with approx < L - 2 B lies
        strictly below it: the candidates (approx >= L - 2 B, a superset of the argmax's) hold every top-k value."""
        h = hidden.detach().contiguous()
        if not np.isfinite(self.worst) or not bool(torch.isfinite(h).all()):   # a non-finite weight or input
            return None
        v_all = self.out_features
        k = min(k, v_all)
        approx = cpu_bf16_gemv.linear_bf16(h, self.bf16)[:, :v_all]
        n_h = _row_norms(h)
        top_value = approx.max(axis=1)
        if not np.all(np.abs(top_value) < 1e30):     # logits near float32 overflow: project in full
            return None
        level = top_value.astype(np.float64)
        if k > 1:
            level = _kth_lower_bound(approx, k)
        bound = 2.0 * n_h * self.worst + 1e-30
        tokens: list[int] = []
        top = np.empty((h.shape[0], k), np.float32) if k > 0 else None
        budget = v_all // MAX_CANDIDATE_SHARE
        for r in range(h.shape[0]):
            # approx_i >= level - 2 B, the threshold rounded down to float32 so no candidate is lost to rounding
            thr = np.nextafter(np.float32(level[r] - 2.0 * bound[r]), np.float32(-np.inf))
            c = np.flatnonzero(approx[r] >= thr)
            if c.shape[0] > max(PRUNE_ABOVE, 2 * k):    # each row's own bound (the one above takes the worst row)
                b = 2.0 * n_h[r] * self.row_bound[c] + 1e-30
                v = approx[r, c].astype(np.float64)
                low = np.max(v - b) if k <= 1 else np.partition(v - b, v.shape[0] - k)[v.shape[0] - k]
                c = c[v + b >= low]
            if c.shape[0] < max(k, 1) or c.shape[0] > budget:
                return None
            vals = cpu_small_gemm.columns(h[r], self.weight, c)   # the fp32 kernel's own values for these rows
            tokens.append(int(c[int(np.argmax(vals))]))    # c ascends: the first maximum is the lowest index
            if top is not None:
                top[r] = np.sort(vals)[::-1][:k]
        return tokens, top


__all__ = ["GreedyScreen", "MAX_ROWS"]
