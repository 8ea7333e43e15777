"""Decode attention over the paged KV cache on CPU: one compiled call per layer for every one-token row of a batch.

Why a kernel of our own: with PyTorch ops, a decode row costs one SDPA call per sequence per layer plus, whenever its
blocks are not consecutive (decode grows a block table one block at a time, interleaved with the other sequences),
an index_select copy of its whole K and V. At 64 sequences x 300 tokens that copy is most of the layer's attention
time, and the per-call overhead is the rest (see attention.py). Here each row's K/V is read in place through its block
table, once, as vLLM's CPU paged-attention kernel does, and the loop over sequences is compiled (numba), not Python.

Numerics: scores are q.k * scale accumulated in the cache dtype (float32 or float64), a max-subtracted softmax, then
the value sum divided by the exponent sum, the same math as SDPA's kernels with a different summation order (float32
results differ from SDPA's in the last bits, as SDPA's flash and math kernels differ from each other). GQA: the
`group` query heads of a KV head are scored against each key as it is loaded.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

DTYPES = (torch.float32, torch.float64)


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz", "arcp"})
def _paged_decode(q, k_cache, v_cache, block_tables, context_lens, rows, out, block_size, group, scale):  # noqa: ANN001
    """q [T, heads(+more), d] (only the first kvh * group heads are read); k/v_cache [kvh, slots, d];
    block_tables [B, max_blocks]; context_lens, rows [B] (the q/out row of batch entry b); out [T, heads * d]."""
    kvh = k_cache.shape[0]
    d = k_cache.shape[2]
    max_ctx = 0
    for b in range(context_lens.shape[0]):
        max_ctx = max(max_ctx, context_lens[b])
    scores = np.empty((group, max_ctx), dtype=k_cache.dtype)
    qbuf = np.empty((group, d), dtype=k_cache.dtype)
    acc = np.empty((group, d), dtype=k_cache.dtype)
    zero = np.zeros(1, dtype=k_cache.dtype)[0]   # accumulate dot products in the cache dtype (vectorizes)
    for b in range(context_lens.shape[0]):
        ctx = context_lens[b]
        row = rows[b]
        nblk = (ctx + block_size - 1) // block_size
        for h in range(kvh):
            for gi in range(group):
                for j in range(d):
                    qbuf[gi, j] = q[row, h * group + gi, j]
            # scores = q . k for every cached key, read through the block table
            t = 0
            for bi in range(nblk):
                base = block_tables[b, bi] * block_size
                n = min(block_size, ctx - t)
                for o in range(n):
                    slot = base + o
                    for gi in range(group):
                        s = zero
                        for j in range(d):
                            s += qbuf[gi, j] * k_cache[h, slot, j]
                        scores[gi, t + o] = s * scale
                t += n
            # softmax numerators and denominators per query head
            for gi in range(group):
                m = scores[gi, 0]
                for i in range(1, ctx):
                    m = max(m, scores[gi, i])
                total = 0.0
                for i in range(ctx):
                    e = math.exp(scores[gi, i] - m)
                    scores[gi, i] = e
                    total += e
                qbuf[gi, 0] = total   # qbuf is free now: keep each head's denominator in its first column
                for j in range(d):
                    acc[gi, j] = zero
            t = 0
            for bi in range(nblk):
                base = block_tables[b, bi] * block_size
                n = min(block_size, ctx - t)
                for o in range(n):
                    slot = base + o
                    for gi in range(group):
                        p = scores[gi, t + o]
                        for j in range(d):
                            acc[gi, j] += p * v_cache[h, slot, j]
                t += n
            for gi in range(group):
                inv = 1.0 / qbuf[gi, 0]
                col = (h * group + gi) * d
                for j in range(d):
                    out[row, col + j] = acc[gi, j] * inv


def available(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in DTYPES


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: np.ndarray,
                 context_lens: np.ndarray, rows: np.ndarray, out: torch.Tensor, block_size: int, group: int,
                 scale: float) -> None:
    """Writes out[rows[b]] = attention of q[rows[b]] over its context_lens[b] cached tokens, for every b. CPU tensors
    of one dtype in DTYPES; q [T, >= kvh * group, d], k/v_cache [kvh, slots, d] contiguous, out [T, heads * d]."""
    _paged_decode(q.numpy(), k_cache.numpy(), v_cache.numpy(), block_tables, context_lens, rows, out.numpy(),
                  block_size, group, scale)
