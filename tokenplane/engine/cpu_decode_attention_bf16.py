"""The bfloat16 decode-attention kernel on AVX-512 with every bf16 widened without a shuffle and the scores reduced
16 at a time (cpu_decode_attention_vec.py's math, arranged for 512-bit ports).

Why a third form: the vector kernel's bf16 path widens 16 cache elements per zero-extending shuffle and ends every
8 scores in a `_fold16` + `_sum8x8` tree (~4.7 shuffles per score, a third of the accumulators unused at GQA group
3); on Sapphire Rapids 512-bit FMAs share ports 0 and 5 with those shuffles. Measured there (SmolLM2's 3 KV heads x
group 3 x d 64, one row x 2100 tokens, 30 layers, 1 thread, caches L2-resident): the vector form 3.9 ms (3.4 once
it also took the softmax maximum 16 lanes at a time), this one 3.0-3.1 ms; alone (16 rows, random block tables)
11.1 -> 8.5-10.2 ms at 290 tokens and 115 -> 100-102 ms at 2100. Scores as AVX512-BF16 dot products (`vdpbf16ps`)
measured no faster (3.35 vs 3.04 ms) and are not used. Here:
  - widening: 32 elements are one 64-byte load read as 16 32-bit lanes; the even elements are the lanes shifted left
    by 16, the odd ones the lanes masked (`_load16_bf16_even/_odd`): one lane-wise op per 16, no shuffle. The
    kernel works in that order throughout: q is stored per 32-element chunk as its evens then its odds, the value
    accumulators likewise, and the output is written back in d order. A dot product is a sum over d, so only the
    order of its terms changes;
  - scores: KS keys x G heads (KS = 16 // G rounded down to a power of two, so that it divides the block size) are
    scored into up to 16 accumulators and reduced by one `_sum16x16` tree (~2 shuffles per score);
  - values: G heads x CP chunks of d per part stay in registers over a block's keys (AVX-512 has 32), each key's
    probabilities broadcast once per part.
The softmax is cpu_decode_paging.softmax_numerators(16), as the 16-lane vector form's; the output is
rounded to bfloat16 once. Keys past a row's context in its last block are scored with the rest of their group (the
slots belong to the row's block, so the loads stay inside the cache) and their scores dropped.

Applies to bfloat16 caches on AVX-512 hosts with d a multiple of 32, G <= 4 and a block size that KS divides
(`applies`); other shapes take cpu_decode_attention_vec's bf16 form or the generic kernel.
"""
from __future__ import annotations

from functools import cache

import numpy as np

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
    _fma16,
    _load16,
    _load16_bf16_even,
    _load16_bf16_odd,
    _splat16,
    _store16,
    _sum16x16,
    _zero16,
)
from tokenplane.engine.numbacache import njit


def keys_per_group(G: int) -> int:
    """Keys scored together: the largest power of two with KS * G <= 16 accumulators."""
    ks = 1
    while 2 * ks * G <= 16:
        ks *= 2
    return ks


def applies(d: int, group: int, block_size: int) -> bool:
    return HOST_AVX512 and d % 32 == 0 and 1 <= group <= 4 and block_size % keys_per_group(group) == 0


@cache
def kernel(D: int, G: int):  # noqa: ANN201
    """The kernel for head size D and GQA group G (compile-time constants), with the generic kernel's signature
    (cpu_decode_attention._kernel); q, the caches and out hold bfloat16 bits."""
    KS = keys_per_group(G)
    NA = KS * G                  # score accumulators in use
    chunks = D // 16
    # value chunks of 16 per part: an even count (a 64-byte load gives two), dividing the chunks, G * CP <= 16
    CP = max(c for c in range(2, min(16 // G, chunks) + 1, 2) if chunks % c == 0)
    PART = 16 * CP
    NV = G * CP                  # value accumulators in use
    softmax = softmax_numerators(16)

    @njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz", "arcp"})
    def _paged_decode_bf16(q, k_cache, v_cache, block_tables, context_lens, rows, out, block_size, scale,  # noqa: ANN001
                           prefetch, acc_like):
        kvh = k_cache.shape[0]
        slots = k_cache.shape[1]
        kf = k_cache.reshape(-1)
        vf = v_cache.reshape(-1)
        step = CACHE_LINE // 2
        max_ctx = 0
        for b in range(context_lens.shape[0]):
            max_ctx = max(max_ctx, context_lens[b])
        scores = np.empty(G * max_ctx, dtype=np.float32)
        qbuf = np.empty(G * D, dtype=np.float32)     # per head, per 32-chunk: its even elements, then its odd ones
        acc = np.empty(G * D, dtype=np.float32)      # the same order
        tmp = np.empty(16, dtype=np.float32)
        total = np.empty(G, dtype=np.float64)
        sc = np.float32(scale)
        z = _zero16()
        for b in range(context_lens.shape[0]):
            ctx = context_lens[b]
            row = rows[b]
            nblk = (ctx + block_size - 1) // block_size
            rev = _descending(block_tables, b, nblk)
            for h in range(kvh):
                for gi in range(G):
                    for j0 in range(0, D, 32):
                        for i in range(16):
                            qbuf[gi * D + j0 + i] = _load(q[row, h * G + gi, j0 + 2 * i])
                            qbuf[gi * D + j0 + 16 + i] = _load(q[row, h * G + gi, j0 + 2 * i + 1])
                for bi in range(nblk):
                    ti = _table_index(bi, nblk, rev)
                    base = (h * slots + block_tables[b, ti] * block_size) * D
                    t = ti * block_size
                    n = min(block_size, ctx - t)
                    nxt_v, nxt = _stream_block(block_tables, context_lens, b, h, kvh, slots, block_size, D, bi + 1, rev)
                    for o in range(0, n, KS):
                        if prefetch:   # the next block's lines for as many keys, spread over this block
                            for i in range(0, KS * D, step):
                                _prefetch_kv(kf, vf, nxt_v, nxt + o * D + i)
                        kb = base + o * D
                        # accumulator a: head a // KS against key o + a % KS (constant indices: LLVM loads each
                        # q chunk and each 64 bytes of a key once per c and drops the accumulators not in use)
                        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = z
                        a8 = a9 = a10 = a11 = a12 = a13 = a14 = a15 = z
                        for c in range(0, D, 32):
                            for half in range(2):
                                qc = c + 16 * half
                                a0 = _fma16(_load16(qbuf, (0 // KS) * D + qc),
                                            _kload(kf, kb + (0 % KS) * D + c, half), a0)
                                if NA > 1:
                                    a1 = _fma16(_load16(qbuf, (1 // KS) * D + qc),
                                                _kload(kf, kb + (1 % KS) * D + c, half), a1)
                                if NA > 2:
                                    a2 = _fma16(_load16(qbuf, (2 // KS) * D + qc),
                                                _kload(kf, kb + (2 % KS) * D + c, half), a2)
                                if NA > 3:
                                    a3 = _fma16(_load16(qbuf, (3 // KS) * D + qc),
                                                _kload(kf, kb + (3 % KS) * D + c, half), a3)
                                if NA > 4:
                                    a4 = _fma16(_load16(qbuf, (4 // KS) * D + qc),
                                                _kload(kf, kb + (4 % KS) * D + c, half), a4)
                                if NA > 5:
                                    a5 = _fma16(_load16(qbuf, (5 // KS) * D + qc),
                                                _kload(kf, kb + (5 % KS) * D + c, half), a5)
                                if NA > 6:
                                    a6 = _fma16(_load16(qbuf, (6 // KS) * D + qc),
                                                _kload(kf, kb + (6 % KS) * D + c, half), a6)
                                if NA > 7:
                                    a7 = _fma16(_load16(qbuf, (7 // KS) * D + qc),
                                                _kload(kf, kb + (7 % KS) * D + c, half), a7)
                                if NA > 8:
                                    a8 = _fma16(_load16(qbuf, (8 // KS) * D + qc),
                                                _kload(kf, kb + (8 % KS) * D + c, half), a8)
                                if NA > 9:
                                    a9 = _fma16(_load16(qbuf, (9 // KS) * D + qc),
                                                _kload(kf, kb + (9 % KS) * D + c, half), a9)
                                if NA > 10:
                                    a10 = _fma16(_load16(qbuf, (10 // KS) * D + qc),
                                                 _kload(kf, kb + (10 % KS) * D + c, half), a10)
                                if NA > 11:
                                    a11 = _fma16(_load16(qbuf, (11 // KS) * D + qc),
                                                 _kload(kf, kb + (11 % KS) * D + c, half), a11)
                                if NA > 12:
                                    a12 = _fma16(_load16(qbuf, (12 // KS) * D + qc),
                                                 _kload(kf, kb + (12 % KS) * D + c, half), a12)
                                if NA > 13:
                                    a13 = _fma16(_load16(qbuf, (13 // KS) * D + qc),
                                                 _kload(kf, kb + (13 % KS) * D + c, half), a13)
                                if NA > 14:
                                    a14 = _fma16(_load16(qbuf, (14 // KS) * D + qc),
                                                 _kload(kf, kb + (14 % KS) * D + c, half), a14)
                                if NA > 15:
                                    a15 = _fma16(_load16(qbuf, (15 // KS) * D + qc),
                                                 _kload(kf, kb + (15 % KS) * D + c, half), a15)
                        _store16(tmp, 0, _sum16x16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14,
                                                   a15))
                        m = min(KS, n - o)     # keys of the group inside the context
                        for a in range(NA):
                            if a % KS < m:
                                scores[(a // KS) * max_ctx + t + o + a % KS] = tmp[a] * sc
                for gi in range(G):
                    total[gi] = softmax(scores, gi * max_ctx, ctx, tmp)
                for i in range(G * D):
                    acc[i] = np.float32(0.0)
                for bi in range(nblk):
                    ti = _table_index(bi, nblk, rev)
                    base = (h * slots + block_tables[b, ti] * block_size) * D
                    t = ti * block_size
                    n = min(block_size, ctx - t)
                    nxt_v, nxt = _stream_block(block_tables, context_lens, b, h, kvh, slots, block_size,
                                               D, nblk + bi + 1, rev)
                    for part in range(0, D, PART):
                        # accumulator a: head a // CP, elements part + 16 * (a % CP) of the even/odd order; an even
                        # a % CP takes a 64-byte load's evens, the next one its odds
                        c0 = _load16(acc, (0 // CP) * D + part + 16 * (0 % CP))
                        c1 = c2 = c3 = c4 = c5 = c6 = c7 = c8 = c9 = c10 = c11 = c12 = c13 = c14 = c15 = c0
                        if NV > 1:
                            c1 = _load16(acc, (1 // CP) * D + part + 16 * (1 % CP))
                        if NV > 2:
                            c2 = _load16(acc, (2 // CP) * D + part + 16 * (2 % CP))
                        if NV > 3:
                            c3 = _load16(acc, (3 // CP) * D + part + 16 * (3 % CP))
                        if NV > 4:
                            c4 = _load16(acc, (4 // CP) * D + part + 16 * (4 % CP))
                        if NV > 5:
                            c5 = _load16(acc, (5 // CP) * D + part + 16 * (5 % CP))
                        if NV > 6:
                            c6 = _load16(acc, (6 // CP) * D + part + 16 * (6 % CP))
                        if NV > 7:
                            c7 = _load16(acc, (7 // CP) * D + part + 16 * (7 % CP))
                        if NV > 8:
                            c8 = _load16(acc, (8 // CP) * D + part + 16 * (8 % CP))
                        if NV > 9:
                            c9 = _load16(acc, (9 // CP) * D + part + 16 * (9 % CP))
                        if NV > 10:
                            c10 = _load16(acc, (10 // CP) * D + part + 16 * (10 % CP))
                        if NV > 11:
                            c11 = _load16(acc, (11 // CP) * D + part + 16 * (11 % CP))
                        if NV > 12:
                            c12 = _load16(acc, (12 // CP) * D + part + 16 * (12 % CP))
                        if NV > 13:
                            c13 = _load16(acc, (13 // CP) * D + part + 16 * (13 % CP))
                        if NV > 14:
                            c14 = _load16(acc, (14 // CP) * D + part + 16 * (14 % CP))
                        if NV > 15:
                            c15 = _load16(acc, (15 // CP) * D + part + 16 * (15 % CP))
                        for o in range(n):
                            if prefetch and part == 0:
                                for i in range(0, D, step):
                                    _prefetch_kv(kf, vf, nxt_v, nxt + o * D + i)
                            vb = base + o * D + part
                            pi = t + o
                            c0 = _fma16(_splat16(scores, (0 // CP) * max_ctx + pi), _vload(vf, vb, 0 % CP), c0)
                            if NV > 1:
                                c1 = _fma16(_splat16(scores, (1 // CP) * max_ctx + pi), _vload(vf, vb, 1 % CP), c1)
                            if NV > 2:
                                c2 = _fma16(_splat16(scores, (2 // CP) * max_ctx + pi), _vload(vf, vb, 2 % CP), c2)
                            if NV > 3:
                                c3 = _fma16(_splat16(scores, (3 // CP) * max_ctx + pi), _vload(vf, vb, 3 % CP), c3)
                            if NV > 4:
                                c4 = _fma16(_splat16(scores, (4 // CP) * max_ctx + pi), _vload(vf, vb, 4 % CP), c4)
                            if NV > 5:
                                c5 = _fma16(_splat16(scores, (5 // CP) * max_ctx + pi), _vload(vf, vb, 5 % CP), c5)
                            if NV > 6:
                                c6 = _fma16(_splat16(scores, (6 // CP) * max_ctx + pi), _vload(vf, vb, 6 % CP), c6)
                            if NV > 7:
                                c7 = _fma16(_splat16(scores, (7 // CP) * max_ctx + pi), _vload(vf, vb, 7 % CP), c7)
                            if NV > 8:
                                c8 = _fma16(_splat16(scores, (8 // CP) * max_ctx + pi), _vload(vf, vb, 8 % CP), c8)
                            if NV > 9:
                                c9 = _fma16(_splat16(scores, (9 // CP) * max_ctx + pi), _vload(vf, vb, 9 % CP), c9)
                            if NV > 10:
                                c10 = _fma16(_splat16(scores, (10 // CP) * max_ctx + pi), _vload(vf, vb, 10 % CP),
                                             c10)
                            if NV > 11:
                                c11 = _fma16(_splat16(scores, (11 // CP) * max_ctx + pi), _vload(vf, vb, 11 % CP),
                                             c11)
                            if NV > 12:
                                c12 = _fma16(_splat16(scores, (12 // CP) * max_ctx + pi), _vload(vf, vb, 12 % CP),
                                             c12)
                            if NV > 13:
                                c13 = _fma16(_splat16(scores, (13 // CP) * max_ctx + pi), _vload(vf, vb, 13 % CP),
                                             c13)
                            if NV > 14:
                                c14 = _fma16(_splat16(scores, (14 // CP) * max_ctx + pi), _vload(vf, vb, 14 % CP),
                                             c14)
                            if NV > 15:
                                c15 = _fma16(_splat16(scores, (15 // CP) * max_ctx + pi), _vload(vf, vb, 15 % CP),
                                             c15)
                        _store16(acc, (0 // CP) * D + part + 16 * (0 % CP), c0)
                        if NV > 1:
                            _store16(acc, (1 // CP) * D + part + 16 * (1 % CP), c1)
                        if NV > 2:
                            _store16(acc, (2 // CP) * D + part + 16 * (2 % CP), c2)
                        if NV > 3:
                            _store16(acc, (3 // CP) * D + part + 16 * (3 % CP), c3)
                        if NV > 4:
                            _store16(acc, (4 // CP) * D + part + 16 * (4 % CP), c4)
                        if NV > 5:
                            _store16(acc, (5 // CP) * D + part + 16 * (5 % CP), c5)
                        if NV > 6:
                            _store16(acc, (6 // CP) * D + part + 16 * (6 % CP), c6)
                        if NV > 7:
                            _store16(acc, (7 // CP) * D + part + 16 * (7 % CP), c7)
                        if NV > 8:
                            _store16(acc, (8 // CP) * D + part + 16 * (8 % CP), c8)
                        if NV > 9:
                            _store16(acc, (9 // CP) * D + part + 16 * (9 % CP), c9)
                        if NV > 10:
                            _store16(acc, (10 // CP) * D + part + 16 * (10 % CP), c10)
                        if NV > 11:
                            _store16(acc, (11 // CP) * D + part + 16 * (11 % CP), c11)
                        if NV > 12:
                            _store16(acc, (12 // CP) * D + part + 16 * (12 % CP), c12)
                        if NV > 13:
                            _store16(acc, (13 // CP) * D + part + 16 * (13 % CP), c13)
                        if NV > 14:
                            _store16(acc, (14 // CP) * D + part + 16 * (14 % CP), c14)
                        if NV > 15:
                            _store16(acc, (15 // CP) * D + part + 16 * (15 % CP), c15)
                for gi in range(G):
                    inv = 1.0 / total[gi]
                    col = (h * G + gi) * D
                    for j0 in range(0, D, 32):
                        for i in range(16):
                            out[row, col + j0 + 2 * i] = _store(acc[gi * D + j0 + i] * inv,
                                                                out[row, col + j0 + 2 * i])
                            out[row, col + j0 + 2 * i + 1] = _store(acc[gi * D + j0 + 16 + i] * inv,
                                                                    out[row, col + j0 + 2 * i + 1])
    return _paged_decode_bf16


@njit(inline="always")
def _kload(kf, index, half):  # noqa: ANN001, ANN202
    """The evens (half 0) or odds (half 1) of the 32 key elements at kf[index]."""
    if half:
        return _load16_bf16_odd(kf, index)
    return _load16_bf16_even(kf, index)


@njit(inline="always")
def _vload(vf, vb, chunk):  # noqa: ANN001, ANN202
    """Value chunk `chunk` of a part in the even/odd order: chunk 2j is the evens of the part's j-th 32 elements,
    chunk 2j + 1 their odds."""
    if chunk % 2:
        return _load16_bf16_odd(vf, vb + 16 * (chunk - 1))
    return _load16_bf16_even(vf, vb + 16 * chunk)


__all__ = ["applies", "kernel", "keys_per_group"]
