"""Decode attention over the paged KV cache on CPU: one compiled call per layer for every one-token row of a batch.

Why a kernel of our own: with PyTorch ops, a decode row costs one SDPA call per sequence per layer plus, whenever its
blocks are not consecutive (decode grows a block table one block at a time, interleaved with the other sequences),
an index_select copy of its whole K and V. At 64 sequences x 300 tokens that copy is most of the layer's attention
time, and the per-call overhead is the rest (see attention.py). Here each row's K/V is read in place through its block
table, once, as vLLM's CPU paged-attention kernel does, and the loop over sequences is compiled (numba), not Python.

Numerics: scores are q.k * scale accumulated in the cache dtype (float32 or float64; bfloat16 caches accumulate in
float32, as SDPA's CPU flash kernel does for bfloat16), a max-subtracted softmax, then the value sum divided by the
exponent sum, the same math as SDPA's kernels with a different summation order (float32 results differ from SDPA's in
the last bits, as SDPA's flash and math kernels differ from each other). GQA: the `group` query heads of a KV head
are scored against each key as it is loaded. bfloat16 reaches numba as its raw 16 bits (uint16): a load widens them
to float32 exactly (the bits are float32's top half), a store rounds to nearest even, as torch's own cast does.

Threads: the kernel runs on the calling thread only (measured and tuned for 1 intra-op thread, the per-sub-server
setting); with more torch threads the GEMMs around it run in parallel and it does not (not measured here).
"""
from __future__ import annotations

from functools import cache

import numpy as np
import torch

from tokenplane.engine import cpu_decode_attention_bf16 as bf16
from tokenplane.engine import cpu_decode_attention_vec as vec
from tokenplane.engine.cpu_decode_paging import (
    CACHE_LINE,
    _descending,
    _exp_nonpos,
    _prefetch_kv,
    _stream_block,
    _table_index,
)
from tokenplane.engine.cpu_elements import _load, _store, as_array
from tokenplane.engine.numbacache import njit

DTYPES = (torch.float32, torch.float64, torch.bfloat16)


@cache
def _kernel(D: int, G: int):  # noqa: ANN202
    """The kernel for head size D and GQA group G, both compile-time constants: the per-key dot products and value
    updates unroll into whole vector registers with the G heads sharing each K/V load (measured 1.05-1.3x over
    the same loops on run-time sizes). numba caches each (D, G) on disk: its cache key includes the closure's
    values."""

    @njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz", "arcp"})
    def _paged_decode(q, k_cache, v_cache, block_tables, context_lens, rows, out, block_size, scale,  # noqa: ANN001
                      prefetch, acc_like):
        """q [T, heads(+more), d] (only the first kvh * G heads are read); k/v_cache [kvh, slots, d];
        block_tables [B, max_blocks]; context_lens, rows [B] (the q/out row of batch entry b); out [T, heads * d];
        acc_like: an empty array of the accumulation dtype."""
        kvh = k_cache.shape[0]
        slots = k_cache.shape[1]
        d = D
        # Software prefetch of the next block while this one is computed, one row (d values) per row computed, so the
        # requests are spread over the block instead of bursting: a block of one head is block_size * d contiguous
        # values (4 KiB in float32), and the blocks of a sequence lie anywhere in the cache, so the hardware prefetcher
        # restarts at each one.
        k_flat = k_cache.reshape(-1)
        v_flat = v_cache.reshape(-1)
        step = max(1, CACHE_LINE // k_cache.itemsize)
        max_ctx = 0
        for b in range(context_lens.shape[0]):
            max_ctx = max(max_ctx, context_lens[b])
        scores = np.empty((G, max_ctx), dtype=acc_like.dtype)
        qbuf = np.empty((G, d), dtype=acc_like.dtype)
        acc = np.empty((G, d), dtype=acc_like.dtype)
        zero = np.zeros(1, dtype=acc_like.dtype)[0]   # accumulate dot products in this dtype, not float64 (vectorizes)
        for b in range(context_lens.shape[0]):
            ctx = context_lens[b]
            row = rows[b]
            nblk = (ctx + block_size - 1) // block_size
            rev = _descending(block_tables, b, nblk)
            for h in range(kvh):
                for gi in range(G):
                    for j in range(d):
                        qbuf[gi, j] = _load(q[row, h * G + gi, j])
                # scores = q . k for every cached key, read through the block table
                for bi in range(nblk):
                    ti = _table_index(bi, nblk, rev)
                    base = block_tables[b, ti] * block_size
                    t = ti * block_size
                    n = min(block_size, ctx - t)
                    nxt_v, nxt = _stream_block(block_tables, context_lens, b, h, kvh, slots, block_size, d, bi + 1, rev)
                    for o in range(n):
                        slot = base + o
                        if prefetch:
                            for i in range(0, d, step):
                                _prefetch_kv(k_flat, v_flat, nxt_v, nxt + o * d + i)
                        for gi in range(G):
                            s = zero
                            for j in range(d):
                                s += qbuf[gi, j] * _load(k_cache[h, slot, j])
                            scores[gi, t + o] = s * scale
                # softmax numerators and denominators per query head
                for gi in range(G):
                    m = scores[gi, 0]
                    for i in range(1, ctx):
                        m = max(m, scores[gi, i])
                    total = 0.0
                    for i in range(ctx):
                        e = _exp_nonpos(scores[gi, i] - m)
                        scores[gi, i] = e
                        total += e
                    qbuf[gi, 0] = total   # qbuf is free now: keep each head's denominator in its first column
                    for j in range(d):
                        acc[gi, j] = zero
                for bi in range(nblk):
                    ti = _table_index(bi, nblk, rev)
                    base = block_tables[b, ti] * block_size
                    t = ti * block_size
                    n = min(block_size, ctx - t)
                    nxt_v, nxt = _stream_block(block_tables, context_lens, b, h, kvh, slots,
                                               block_size, d, nblk + bi + 1, rev)
                    for o in range(n):
                        slot = base + o
                        if prefetch:
                            for i in range(0, d, step):
                                _prefetch_kv(k_flat, v_flat, nxt_v, nxt + o * d + i)
                        for gi in range(G):
                            p = scores[gi, t + o]
                            for j in range(d):
                                acc[gi, j] += p * _load(v_cache[h, slot, j])
                for gi in range(G):
                    inv = 1.0 / qbuf[gi, 0]
                    col = (h * G + gi) * d
                    for j in range(d):
                        out[row, col + j] = _store(acc[gi, j] * inv, out[row, col + j])
    return _paged_decode


@cache
def kernel_for(dtype: torch.dtype, D: int, G: int, block_size: int = 0, bf16_form: bool = True):  # noqa: ANN201
    """The compiled kernel for a cache of `dtype`, head size D and group G: bfloat16 shapes that
    cpu_decode_attention_bf16 takes (`block_size` given) run it unless `bf16_form` is off; float32 (and, on 16 lanes,
    bfloat16) shapes that cpu_decode_attention_vec takes run its explicit-vector form, everything else `_kernel`."""
    if dtype == torch.float32:
        if vec.applies(D, G):
            return vec.kernel(D, G)
    if dtype == torch.bfloat16 and bf16_form and block_size and bf16.applies(D, G, block_size):
        return bf16.kernel(D, G)
    if dtype == torch.bfloat16 and vec.applies_bf16(D, G):
        return vec.kernel(D, G, 16, True)
    return _kernel(D, G)


def available(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in DTYPES


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: np.ndarray,
                 context_lens: np.ndarray, rows: np.ndarray, out: torch.Tensor, block_size: int, group: int,
                 scale: float, prefetch: bool = True) -> None:
    """Writes out[rows[b]] = attention of q[rows[b]] over its context_lens[b] cached tokens, for every b. CPU tensors
    of one dtype in DTYPES; q [T, >= kvh * group, d], k/v_cache [kvh, slots, d] contiguous, out [T, heads * d]."""
    if q.dtype == torch.bfloat16:
        acc_like = _EMPTY[torch.float32]
    else:
        acc_like = _EMPTY[q.dtype]
    qa, ka, va, oa = (as_array(t) for t in (q, k_cache, v_cache, out))
    kernel = kernel_for(q.dtype, int(k_cache.shape[2]), int(group), block_size, BF16_FORM[0])
    kernel(qa, ka, va, block_tables, context_lens, rows, oa, block_size, scale, prefetch, acc_like)


# bfloat16 caches take cpu_decode_attention_bf16 where it applies; [False] runs the vector form instead (benchmarks
# compare the two on one code path)
BF16_FORM = [True]
_EMPTY = {torch.float32: np.empty(0, np.float32), torch.float64: np.empty(0, np.float64)}

