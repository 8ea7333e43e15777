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

import math
from functools import cache

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
CACHE_LINE = 64


@intrinsic
def _prefetch(typingctx, flat, index):  # noqa: ANN001
    """llvm.prefetch (read, high locality) of flat[index], a 1-D array: numba has no prefetch of its own."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(flat, index), codegen


@intrinsic
def _f32_from_bits(typingctx, bits):  # noqa: ANN001
    """Reinterpret a uint32 as the float32 with those bits."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _bits_from_f32(typingctx, value):  # noqa: ANN001
    """Reinterpret a float32 as the uint32 with its bits."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


def _load(x):  # noqa: ANN001, ANN202
    """A cache or query element as the value to compute with (bfloat16 bits -> float32; floats as they are)."""


@overload(_load, inline="always")
def _load_impl(x):  # noqa: ANN001, ANN202
    if x == types.uint16:
        return lambda x: _f32_from_bits(types.uint32(x) << types.uint32(16))
    return lambda x: x


def _store(value, like):  # noqa: ANN001, ANN202
    """`value` as an element of an output array whose elements look like `like`."""


@overload(_store, inline="always")
def _store_impl(value, like):  # noqa: ANN001, ANN202
    if like == types.uint16:
        def to_bf16(value, like):  # noqa: ANN001, ANN202
            f = types.float32(value)
            if f != f:
                return types.uint16(0x7FC0)   # a quiet NaN, as torch's cast gives
            u = _bits_from_f32(f)
            return types.uint16((u + types.uint32(0x7FFF) + ((u >> types.uint32(16)) & types.uint32(1)))
                                >> types.uint32(16))
        return to_bf16
    return lambda value, like: value


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)       # ln 2 split in two (Cody-Waite): n * _LN2_HI is exact for |n| < 2^9
_LN2_LO = np.float32(-2.12194440e-4)


def _exp_nonpos(x):  # noqa: ANN001, ANN202
    """exp(x) for x <= 0, a softmax numerator (a score minus its row's maximum)."""


@overload(_exp_nonpos, inline="always")
def _exp_nonpos_impl(x):  # noqa: ANN001, ANN202
    if x == types.float32:
        # libm's expf is a scalar call (~4.7 ns per score here, ~20% of a decode row at 2K tokens); this form
        # vectorizes (~1 ns): n = round(x / ln 2), r = x - n ln 2, a degree-6 Taylor polynomial of e^r on
        # |r| <= ln 2 / 2, times 2^n from the exponent bits. At most 3 ulp from exp in float64 over [-87, 0]
        # (libm's expf: 2.4); below -87 it answers e^-87 (~1.6e-38) instead of less, against a row sum >= 1.
        def exp_f32(x):  # noqa: ANN001, ANN202
            x = max(x, types.float32(-87.0))
            n = np.floor(x * _LOG2E + types.float32(0.5))
            r = (x - n * _LN2_HI) - n * _LN2_LO
            p = types.float32(1.0 / 720)
            p = p * r + types.float32(1.0 / 120)
            p = p * r + types.float32(1.0 / 24)
            p = p * r + types.float32(1.0 / 6)
            p = p * r + types.float32(0.5)
            p = p * r + types.float32(1.0)
            p = p * r + types.float32(1.0)
            return p * _f32_from_bits(types.uint32(types.int32(n) + types.int32(127)) << types.uint32(23))
        return exp_f32
    return lambda x: math.exp(x)


@njit(inline="always")
def _prefetch_block(flat, start, n, step):  # noqa: ANN001
    for i in range(0, n, step):
        _prefetch(flat, start + i)


@njit(inline="always")
def _descending(block_tables, b, nblk):  # noqa: ANN001, ANN202
    """Whether row b's blocks mostly lie at falling addresses. The block manager frees a sequence's blocks last first
    (so a prefix outlives its tail in the LRU), so a prompt admitted after another sequence finished gets that
    sequence's run of blocks in falling order: in engine_vs_vllm's P=2048 N=64 decode steps 78-95% of adjacent table
    entries are one block apart downwards. Read in table order, each 4 KiB block sits just below the one before, where
    the hardware prefetcher (running upwards) has not been; read in the reverse order the stream climbs through
    memory. Attention is a sum over keys, so the order only changes rounding. Measured (tiny-large's shape, 64 rows x
    2080 tokens, falling runs): 1.30x a plain sum of the same bytes in table order, ~1.0x reversed."""
    up = 0
    down = 0
    for i in range(1, nblk):
        step = block_tables[b, i] - block_tables[b, i - 1]
        if step > 0:
            up += 1
        elif step < 0:
            down += 1
    return down > up


@njit(inline="always")
def _table_index(i, nblk, rev):  # noqa: ANN001, ANN202
    """The table entry read i-th (reversed order when rev)."""
    return nblk - 1 - i if rev else i


@njit(inline="always")
def _stream_block(kf, vf, block_tables, context_lens, b, h, kvh, slots, block_size, d, pos, rev):  # noqa: ANN001, ANN202
    """Where the kernel reads `pos` blocks after the start of row b's head h (read order `rev`): its K blocks, then its
    V blocks, then the next head's (or the next row's first head's) K blocks. Returns (cache, flat offset): what to
    prefetch."""
    nblk = (context_lens[b] + block_size - 1) // block_size
    if pos < nblk:
        return kf, (h * slots + block_tables[b, _table_index(pos, nblk, rev)] * block_size) * d
    if pos < 2 * nblk:
        return vf, (h * slots + block_tables[b, _table_index(pos - nblk, nblk, rev)] * block_size) * d
    pos -= 2 * nblk
    if h + 1 < kvh:
        h += 1
    elif b + 1 < context_lens.shape[0]:
        b += 1
        h = 0
        nblk = (context_lens[b] + block_size - 1) // block_size
        rev = _descending(block_tables, b, nblk)
    pos = min(pos, nblk - 1)
    return kf, (h * slots + block_tables[b, _table_index(pos, nblk, rev)] * block_size) * d


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
                    nxt_flat, nxt = _stream_block(k_flat, v_flat, block_tables, context_lens, b, h, kvh, slots,
                                                  block_size, d, bi + 1, rev)
                    for o in range(n):
                        slot = base + o
                        if prefetch:
                            _prefetch_block(nxt_flat, nxt + o * d, d, step)
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
                    nxt_flat, nxt = _stream_block(k_flat, v_flat, block_tables, context_lens, b, h, kvh, slots,
                                                  block_size, d, nblk + bi + 1, rev)
                    for o in range(n):
                        slot = base + o
                        if prefetch:
                            _prefetch_block(nxt_flat, nxt + o * d, d, step)
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
def kernel_for(dtype: torch.dtype, D: int, G: int):  # noqa: ANN201
    """The compiled kernel for a cache of `dtype`, head size D and group G: float32 shapes that
    cpu_decode_attention_vec takes run its explicit-vector form, everything else `_kernel`."""
    if dtype == torch.float32:
        from tokenplane.engine import cpu_decode_attention_vec as vec  # built on this module's helpers
        if vec.applies(D, G):
            return vec.kernel(D, G)
    return _kernel(D, G)


def available(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in DTYPES


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: np.ndarray,
                 context_lens: np.ndarray, rows: np.ndarray, out: torch.Tensor, block_size: int, group: int,
                 scale: float, prefetch: bool = True) -> None:
    """Writes out[rows[b]] = attention of q[rows[b]] over its context_lens[b] cached tokens, for every b. CPU tensors
    of one dtype in DTYPES; q [T, >= kvh * group, d], k/v_cache [kvh, slots, d] contiguous, out [T, heads * d]."""
    if q.dtype == torch.bfloat16:
        arrays = [t.view(torch.int16).numpy().view(np.uint16) for t in (q, k_cache, v_cache, out)]
        acc_like = _EMPTY[torch.float32]
    else:
        arrays = [t.numpy() for t in (q, k_cache, v_cache, out)]
        acc_like = _EMPTY[q.dtype]
    qa, ka, va, oa = arrays
    kernel_for(q.dtype, int(k_cache.shape[2]), int(group))(qa, ka, va, block_tables, context_lens, rows, oa,
                                                            block_size, scale, prefetch, acc_like)


_EMPTY = {torch.float32: np.empty(0, np.float32), torch.float64: np.empty(0, np.float64)}

