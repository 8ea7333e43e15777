"""The float32 decode-attention kernel (cpu_decode_attention.py's math) written on explicit 8- or 16-float vectors.

Why a second form: at long contexts and big batches a decode step is mostly this kernel streaming the KV cache, and
the generic kernel's arithmetic did not hide under that stream. Measured here (1 thread, tiny-large's shape: 4 KV
heads x 2 query heads x d 64, 64 rows x 2080 tokens, 2 layers' caches): the generic kernel took 33 ms where a plain
sum over the same bytes takes 25, and 22 ms with every row reading the same (cache-resident) blocks, i.e. its
arithmetic alone was ~90% of the memory time. Its per-key dot products end in a horizontal sum each (a shuffle chain
per key and head), and its value accumulators live in memory (a load and a store per 8 floats per key).
Here:
  - scores: KS = 8 / G keys x G heads are scored together into 8 vector accumulators (each q chunk and each key
    chunk loaded once for all of them), then one transposing reduction turns the 8 accumulators into one vector of
    their 8 sums: ~1 shuffle-add per score instead of ~6;
  - values: the accumulators of G heads x (8 / G) chunks of d stay in registers over a block's keys (d is walked in
    parts of 8 / G chunks, so the accumulators never exceed 8 of AVX2's 16 registers), spilled once per block.
The softmax in between is cpu_decode_paging.softmax_numerators: on 8 lanes the generic kernel's (same max, same
exponent, same order of the denominator sum); on 16 lanes the same max, the exponent's polynomial on vectors and the
denominator summed in float32 lanes per 1,024 scores.

Numerics: the same formula as the generic kernel (scores q.k * scale in float32, max-subtracted exponent, value sum
over keys in key order divided by the exponent sum); only the order of each d-term dot product differs (8 lanes of
d / 8 terms each, then a tree), so results differ from it in the last bits, as SDPA's kernels differ from each other.

Vector width (`lanes`): 16 floats where the host has AVX-512 and d is a multiple of 16 (each accumulator a zmm
register, every 16-lane score accumulator folded to 8 lanes before the transposing reduction), else 8. The two
widths sum each dot product's d terms in different orders (16 lanes of d / 16 terms against 8 of d / 8), so they
differ in the last bits, as the 8-lane form differs from the generic kernel.

Applies to float32 with d a multiple of 8 and G <= 4 (`applies`); other shapes and dtypes run the generic kernel.
"""
from __future__ import annotations

from functools import cache

import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

from tokenplane.engine.cpu_decode_paging import (
    CACHE_LINE,
    _descending,
    _prefetch_kv,
    _stream_block,
    _table_index,
    softmax_numerators,
)
from tokenplane.engine.cpu_elements import _load, _store
from tokenplane.engine.cpu_simd import (
    HOST_AVX512,
    _fma8,
    _fma16,
    _load8,
    _load16,
    _load16_bf16,
    _splat8,
    _splat16,
    _store8,
    _store16,
    _vec8,
    _vec16,
    _zero8,
    _zero16,
)
from tokenplane.engine.numbacache import njit

_I32 = ir.IntType(32)


@intrinsic
def _sum8x8(typingctx, a0, a1, a2, a3, a4, a5, a6, a7):  # noqa: ANN001
    """[sum(a0), sum(a1), ..., sum(a7)]: the 8 horizontal sums as one vector (pairwise adds within 128-bit halves,
    then the halves' sums added across: LLVM selects vhaddps / vperm2f128 on AVX)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        def hadd(x, y):  # noqa: ANN001, ANN202
            even = builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, 8), [0, 2, 8, 10, 4, 6, 12, 14]))
            odd = builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, 8), [1, 3, 9, 11, 5, 7, 13, 15]))
            return builder.fadd(even, odd)
        t0, t1, t2, t3 = hadd(args[0], args[1]), hadd(args[2], args[3]), hadd(args[4], args[5]), hadd(args[6], args[7])
        u0, u1 = hadd(t0, t1), hadd(t2, t3)
        # u0 = [a0 a1 a2 a3 | a0 a1 a2 a3] (low-half sums | high-half sums), u1 likewise for a4..a7
        lo = builder.shuffle_vector(u0, u1, ir.Constant(ir.VectorType(_I32, 8), [0, 1, 2, 3, 8, 9, 10, 11]))
        hi = builder.shuffle_vector(u0, u1, ir.Constant(ir.VectorType(_I32, 8), [4, 5, 6, 7, 12, 13, 14, 15]))
        return builder.fadd(lo, hi)
    return _vec8(_vec8, _vec8, _vec8, _vec8, _vec8, _vec8, _vec8, _vec8), codegen


@intrinsic
def _fold16(typingctx, a):  # noqa: ANN001
    """A 16-lane vector's low and high 8 lanes added: the same total as 8 lanes (for `_sum8x8`)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        lo = builder.shuffle_vector(args[0], args[0], ir.Constant(ir.VectorType(_I32, 8), list(range(8))))
        hi = builder.shuffle_vector(args[0], args[0], ir.Constant(ir.VectorType(_I32, 8), list(range(8, 16))))
        return builder.fadd(lo, hi)
    return _vec8(_vec16), codegen


@njit(inline="always")
def _fold8(a):  # noqa: ANN001, ANN202
    return a


def applies(d: int, group: int) -> bool:
    return d % 8 == 0 and 1 <= group <= 4


def lanes(D: int) -> int:
    """The vector width the kernel takes for head size D: 16 floats (a zmm register) on AVX-512 hosts where D allows,
    else 8."""
    return 16 if HOST_AVX512 and D % 16 == 0 else 8


def applies_bf16(d: int, group: int) -> bool:
    """bfloat16 caches take the vector form where it runs on 16 lanes (a 32-byte load widened to one zmm register)."""
    return applies(d, group) and lanes(d) == 16


@cache
def kernel(D: int, G: int, W: int = 0, bf16: bool = False):  # noqa: ANN202
    """The kernel for head size D and GQA group G (compile-time constants; `applies(D, G)`) on W-float vectors
    (`lanes(D)` by default), with the generic kernel's signature (cpu_decode_attention._kernel). bf16: q, the caches
    and out hold bfloat16 bits (`applies_bf16`); every load widens them to float32 exactly, the arithmetic is the
    float32 kernel's, and the output is rounded to bfloat16 once (as the generic kernel's bf16 form)."""
    W = W or lanes(D)
    if bf16 and W != 16:
        raise ValueError("the bfloat16 form runs on 16 lanes only")
    load, store, splat, zero, fma, fold = ((_load16, _store16, _splat16, _zero16, _fma16, _fold16) if W == 16 else
                                           (_load8, _store8, _splat8, _zero8, _fma8, _fold8))
    kload = _load16_bf16 if bf16 else load     # K and V rows (the caches' own dtype)
    softmax = softmax_numerators(W)
    ELEM = 2 if bf16 else 4                    # bytes per cache element
    KS = 8 // G                  # keys scored together: KS * G <= 8 accumulators
    chunks = D // W
    # chunks of W floats of d per value part: G * CP <= 8 accumulators, and CP divides the chunks (parts tile d)
    CP = max(c for c in range(1, min(8 // G, chunks) + 1) if chunks % c == 0)
    PART = W * CP                # floats of d per value part
    NA_S = KS * G                # accumulators in use (scores)
    NA_V = CP * G                # accumulators in use (values)

    @njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz", "arcp"})
    def _paged_decode_vec(q, k_cache, v_cache, block_tables, context_lens, rows, out, block_size, scale,  # noqa: ANN001
                          prefetch, acc_like):
        kvh = k_cache.shape[0]
        slots = k_cache.shape[1]
        kf = k_cache.reshape(-1)
        vf = v_cache.reshape(-1)
        step = CACHE_LINE // ELEM
        max_ctx = 0
        for b in range(context_lens.shape[0]):
            max_ctx = max(max_ctx, context_lens[b])
        scores = np.empty(G * max_ctx, dtype=np.float32)    # [G, max_ctx] flat: _splat8 reads it by index
        qbuf = np.empty(G * D, dtype=np.float32)
        acc = np.empty(G * D, dtype=np.float32)
        tmp = np.empty(16, dtype=np.float32)
        total = np.empty(G, dtype=np.float64)
        sc = np.float32(scale)
        for b in range(context_lens.shape[0]):
            ctx = context_lens[b]
            row = rows[b]
            nblk = (ctx + block_size - 1) // block_size
            rev = _descending(block_tables, b, nblk)   # read order: see _descending
            for h in range(kvh):
                for gi in range(G):
                    for j in range(D):
                        qbuf[gi * D + j] = _load(q[row, h * G + gi, j])
                # scores: KS keys x G heads at a time; the next block is prefetched, spread over this one's keys
                for bi in range(nblk):
                    ti = _table_index(bi, nblk, rev)
                    base = (h * slots + block_tables[b, ti] * block_size) * D
                    t = ti * block_size
                    n = min(block_size, ctx - t)
                    nxt_v, nxt = _stream_block(block_tables, context_lens, b, h, kvh, slots, block_size, D, bi + 1, rev)
                    o = 0
                    while o + KS <= n:
                        if prefetch:
                            for i in range(0, KS * D, step):
                                _prefetch_kv(kf, vf, nxt_v, nxt + o * D + i)
                        kb = base + o * D
                        a0 = zero()
                        a1 = zero()
                        a2 = zero()
                        a3 = zero()
                        a4 = zero()
                        a5 = zero()
                        a6 = zero()
                        a7 = zero()
                        # accumulator a holds head a // KS against key a % KS (constant indices: LLVM loads each
                        # q chunk and key chunk once per c and drops the unused accumulators)
                        for c in range(0, D, W):
                            a0 = fma(load(qbuf, (0 // KS) * D + c), kload(kf, kb + (0 % KS) * D + c), a0)
                            if NA_S > 1:
                                a1 = fma(load(qbuf, (1 // KS) * D + c), kload(kf, kb + (1 % KS) * D + c), a1)
                            if NA_S > 2:
                                a2 = fma(load(qbuf, (2 // KS) * D + c), kload(kf, kb + (2 % KS) * D + c), a2)
                            if NA_S > 3:
                                a3 = fma(load(qbuf, (3 // KS) * D + c), kload(kf, kb + (3 % KS) * D + c), a3)
                            if NA_S > 4:
                                a4 = fma(load(qbuf, (4 // KS) * D + c), kload(kf, kb + (4 % KS) * D + c), a4)
                            if NA_S > 5:
                                a5 = fma(load(qbuf, (5 // KS) * D + c), kload(kf, kb + (5 % KS) * D + c), a5)
                            if NA_S > 6:
                                a6 = fma(load(qbuf, (6 // KS) * D + c), kload(kf, kb + (6 % KS) * D + c), a6)
                            if NA_S > 7:
                                a7 = fma(load(qbuf, (7 // KS) * D + c), kload(kf, kb + (7 % KS) * D + c), a7)
                        _store8(tmp, 0, _sum8x8(fold(a0), fold(a1), fold(a2), fold(a3), fold(a4), fold(a5), fold(a6),
                                                fold(a7)))
                        for a in range(NA_S):
                            scores[(a // KS) * max_ctx + t + o + a % KS] = tmp[a] * sc
                        o += KS
                    while o < n:   # a block's last keys when fewer than KS remain
                        if prefetch:
                            for i in range(0, D, step):
                                _prefetch_kv(kf, vf, nxt_v, nxt + o * D + i)
                        kb = base + o * D
                        for gi in range(G):
                            s = np.float32(0.0)
                            for j in range(D):
                                s += qbuf[gi * D + j] * _load(kf[kb + j])
                            scores[gi * max_ctx + t + o] = s * sc
                        o += 1
                # softmax numerators and denominators per query head
                for gi in range(G):
                    total[gi] = softmax(scores, gi * max_ctx, ctx, tmp)
                for i in range(G * D):
                    acc[i] = np.float32(0.0)
                # values: per block and part of d, G x CP accumulators in registers over the block's keys
                for bi in range(nblk):
                    ti = _table_index(bi, nblk, rev)
                    base = (h * slots + block_tables[b, ti] * block_size) * D
                    t = ti * block_size
                    n = min(block_size, ctx - t)
                    nxt_v, nxt = _stream_block(block_tables, context_lens, b, h, kvh, slots, block_size, D,
                                               nblk + bi + 1, rev)
                    for part in range(0, D, PART):
                        # accumulator a: head a // CP, chunk part + W * (a % CP)
                        c0 = load(acc, (0 // CP) * D + part + W * (0 % CP))
                        c1 = c2 = c3 = c4 = c5 = c6 = c7 = c0
                        if NA_V > 1:
                            c1 = load(acc, (1 // CP) * D + part + W * (1 % CP))
                        if NA_V > 2:
                            c2 = load(acc, (2 // CP) * D + part + W * (2 % CP))
                        if NA_V > 3:
                            c3 = load(acc, (3 // CP) * D + part + W * (3 % CP))
                        if NA_V > 4:
                            c4 = load(acc, (4 // CP) * D + part + W * (4 % CP))
                        if NA_V > 5:
                            c5 = load(acc, (5 // CP) * D + part + W * (5 % CP))
                        if NA_V > 6:
                            c6 = load(acc, (6 // CP) * D + part + W * (6 % CP))
                        if NA_V > 7:
                            c7 = load(acc, (7 // CP) * D + part + W * (7 % CP))
                        for o in range(n):
                            if prefetch and part == 0:
                                for i in range(0, D, step):
                                    _prefetch_kv(kf, vf, nxt_v, nxt + o * D + i)
                            vb = base + o * D + part
                            pi = t + o
                            c0 = fma(splat(scores, (0 // CP) * max_ctx + pi), kload(vf, vb + W * (0 % CP)), c0)
                            if NA_V > 1:
                                c1 = fma(splat(scores, (1 // CP) * max_ctx + pi), kload(vf, vb + W * (1 % CP)),
                                           c1)
                            if NA_V > 2:
                                c2 = fma(splat(scores, (2 // CP) * max_ctx + pi), kload(vf, vb + W * (2 % CP)),
                                           c2)
                            if NA_V > 3:
                                c3 = fma(splat(scores, (3 // CP) * max_ctx + pi), kload(vf, vb + W * (3 % CP)),
                                           c3)
                            if NA_V > 4:
                                c4 = fma(splat(scores, (4 // CP) * max_ctx + pi), kload(vf, vb + W * (4 % CP)),
                                           c4)
                            if NA_V > 5:
                                c5 = fma(splat(scores, (5 // CP) * max_ctx + pi), kload(vf, vb + W * (5 % CP)),
                                           c5)
                            if NA_V > 6:
                                c6 = fma(splat(scores, (6 // CP) * max_ctx + pi), kload(vf, vb + W * (6 % CP)),
                                           c6)
                            if NA_V > 7:
                                c7 = fma(splat(scores, (7 // CP) * max_ctx + pi), kload(vf, vb + W * (7 % CP)),
                                           c7)
                        store(acc, (0 // CP) * D + part + W * (0 % CP), c0)
                        if NA_V > 1:
                            store(acc, (1 // CP) * D + part + W * (1 % CP), c1)
                        if NA_V > 2:
                            store(acc, (2 // CP) * D + part + W * (2 % CP), c2)
                        if NA_V > 3:
                            store(acc, (3 // CP) * D + part + W * (3 % CP), c3)
                        if NA_V > 4:
                            store(acc, (4 // CP) * D + part + W * (4 % CP), c4)
                        if NA_V > 5:
                            store(acc, (5 // CP) * D + part + W * (5 % CP), c5)
                        if NA_V > 6:
                            store(acc, (6 // CP) * D + part + W * (6 % CP), c6)
                        if NA_V > 7:
                            store(acc, (7 // CP) * D + part + W * (7 % CP), c7)
                for gi in range(G):
                    inv = 1.0 / total[gi]
                    col = (h * G + gi) * D
                    for j in range(D):
                        out[row, col + j] = _store(acc[gi * D + j] * inv, out[row, col + j])
    return _paged_decode_vec


__all__ = ["applies", "applies_bf16", "kernel"]
