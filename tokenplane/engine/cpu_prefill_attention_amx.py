"""Causal bfloat16 prefill attention over the paged KV cache on AMX tiles (TDPBF16PS): multi-token rows, flash-style.

Why: PyTorch's CPU flash SDPA spends half of a bf16 2048-token SmolLM2-135M prefill in attention (498 of 1020 ms,
torch.profiler, 1 thread, Sapphire Rapids; ~290 GFLOP/s, where the linears around it run on AMX at ~1 TFLOP/s).
Both products of attention are bf16 x bf16 -> float32 sums, which is what a tile multiply computes. Measured here
(SmolLM2's 3 KV heads x group 3 x d 64, one layer, alternated in one process, medians): 2048 tokens 13.6 ms vs
SDPA 20.2; 1024 tokens 4.8 vs 6.2; 256 tokens 0.43 vs 0.53. What bounds it is vector work, not the tiles: the
softmax exponents (~1/3 of the time), then the value product's tile loads. A whole 2048-token prefill with the first
form of this kernel (14.8-16.6 ms a layer), previous tree and this one alternated: SmolLM2 1078 / 1135 -> 978 / 1002
ms, tiny-large (4 x 2 heads, d 64) 285 -> 229 ms; benchmarks/peers/prefill_ab.py's both_sdpa_prefill variant runs
the same tree with SDPA for these rows.

Layout: rows are a query tile (TQ = 16 // G positions x the G query heads of one KV head, row r = position r // G,
head r % G, as cpu_prefill_attention's float32 tiles); everything is kept transposed so that the 16 rows are the 16
lanes of a vector, and the online softmax's per-row max, rescale and sum are plain vector operations down a column:
  S^T [16 keys x 16 rows]  = K tile (16 cache slots x 32 d, loaded in place: a 16-key tile is one run of a block)
                             . Q^T (packed once per query tile in the pair layout a B tile wants)
  O^T [16 d x 16 rows]    += V^T tile (16 d x 32 keys) . P^T (32 keys of probabilities, bf16, in pairs)
V^T is one copy per (sequence, KV head), made once and read by every query tile; K, Q and P need no transpose. Two
query tiles go through a pass together (C tiles 0-3 hold two key tiles or two d panels x the two), so each K and V^T
tile loaded from L2 serves 32 rows: 2048 tokens 14.3 -> 13.6 ms a layer, 256 tokens 0.40 -> 0.43 (alternated).
Keys are taken KB at a time: their scores land in an L1 block, the block's row max updates the running max once,
the exponents are written back as bf16 pairs, and the block's O^T tiles are merged into the float32 accumulator with
the rescale (so the tiles never hold a rescaled sum).

Numerics (as PyTorch's flash kernel for bf16 inputs on CPU): scores are float32 sums of exact bf16 products (tile
order); the numerators exp(scale * (s - max)) in float32 as 2^(s * c - max * c), c = scale / ln 2 (`_exp2_scores`,
relative error ~1.3e-7), summed in float32 for the row sum; the probabilities enter the value product rounded to
bf16 (nearest even); the output is the float32 sum divided by the row sum, rounded to bf16 once. Keys after a row's
position score -inf and weigh exactly 0.

Applies (`applies`) on AMX hosts (cpu_amx.HOST_AMX) to head sizes a multiple of 32, groups of 1-16 query heads per
KV head and block sizes a multiple of 16.
"""
from __future__ import annotations

import math
from functools import cache

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tokenplane.engine.cpu_amx import HOST_AMX, _tile_config, _tile_dot, _tile_memory, _tile_release, _tile_zero
from tokenplane.engine.cpu_elements import _store
from tokenplane.engine.cpu_simd import (
    _I32,
    _add16,
    _BFloat,
    _load16,
    _max16,
    _mul16,
    _pointer,
    _store16,
    _vec16,
    _zero16,
)
from tokenplane.engine.numbacache import njit

KB = 256                  # keys per softmax block (a multiple of 32)
NEG_INF = np.float32(-np.inf)
TILE_BYTES = 64           # every tile here: 16 rows of 64 bytes


@intrinsic
def _store16_bf16_pairs(typingctx, flat, index, a, b):  # noqa: ANN001, ANN202
    """flat[index + 2n] = bf16(a[n]), flat[index + 2n + 1] = bf16(b[n]) for n < 16 (a uint16 array; nearest even,
    as torch's cast for these finite values): one row of a B tile of bf16 pairs, 64 bytes."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        bt = ir.VectorType(_BFloat(), 16)
        vi16 = ir.VectorType(ir.IntType(16), 16)
        x = builder.bitcast(builder.fptrunc(args[2], bt), vi16)
        y = builder.bitcast(builder.fptrunc(args[3], bt), vi16)
        pair = builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, 32), [v for n in range(16)
                                                                                  for v in (n, n + 16)]))
        p = _pointer(context, builder, signature.args[0], args[0], args[1])
        builder.store(pair, builder.bitcast(p, ir.VectorType(ir.IntType(16), 32).as_pointer()), align=2)
        return context.get_dummy_value()
    return types.void(flat, index, _vec16, _vec16), codegen


# 2^f on [-1/2, 1/2]: Taylor coefficients of e^(f ln 2), highest degree first (degree 6: relative error ~1.3e-7,
# four orders below the bf16 rounding the probabilities take for the value product)
_EXP2 = tuple(math.log(2.0) ** k / math.factorial(k) for k in range(6, -1, -1))
# Below 2^-126 the numerator is 0 (a -inf score, masked, weighs exactly 0): a result in float32's subnormal range
# costs a microcode assist per instruction (measured: the kernel's exponents ran at half their speed alone when the
# masked rows of each block underflowed); what this drops is < 1.2e-38 against a row sum >= 1
_EXP2_FLOOR = -126.0


@intrinsic
def _exp2_scores(typingctx, flat, index, c, nmc):  # noqa: ANN001, ANN202
    """2^(flat[index : index + 16] * c + nmc) on 16 lanes (c = scale / ln 2, nmc = -(row max) * c): the softmax
    numerators exp(scale * (s - max)) in one fused multiply-add, a rounding to the nearest integer n, a degree-6
    polynomial of 2^(t - n) and vscalefps for the 2^n (no integer exponent arithmetic); t <= -126 (-inf: masked)
    gives 0."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        vt = ir.VectorType(ir.FloatType(), 16)
        p = _pointer(context, builder, signature.args[0], args[0], args[1])
        x = builder.load(builder.bitcast(p, vt.as_pointer()), align=4)

        def fn(name: str, n: int):  # noqa: ANN202
            return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt] * n), name)

        def splat(v: float):  # noqa: ANN202
            return ir.Constant(vt, [float(np.float32(v))] * 16)
        fma = fn("llvm.fma.v16f32", 3)
        t = builder.call(fma, [x, args[2], args[3]])
        keep = builder.fcmp_ordered(">", t, splat(_EXP2_FLOOR))
        t = builder.select(keep, t, splat(_EXP2_FLOOR))
        n = builder.call(fn("llvm.roundeven.v16f32", 1), [t])
        f = builder.fsub(t, n)
        poly = splat(_EXP2[0])
        for k in _EXP2[1:]:
            poly = builder.call(fma, [poly, f, splat(k)])
        scalef = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt, vt, vt, ir.IntType(16), _I32]),
                                                "llvm.x86.avx512.mask.scalef.ps.512")
        r = builder.call(scalef, [poly, n, poly, ir.Constant(ir.IntType(16), -1), ir.Constant(_I32, 4)])
        return builder.select(keep, r, splat(0.0))
    return _vec16(flat, index, _vec16, _vec16), codegen


# Tiles: A 4, 5 (K or V^T: two key tiles, or two d panels), B 6, 7 (Q^T or P^T pairs of query tiles 0 and 1), C 0-3
# = A4.B6, A4.B7, A5.B6, A5.B7.
_zero0, _zero1, _zero2, _zero3 = (_tile_zero(t) for t in range(4))
_store0, _store1, _store2, _store3 = (_tile_memory(t, "llvm.x86.tilestored64") for t in range(4))
_load_a, _load_a1 = _tile_memory(4, "llvm.x86.tileloadd64"), _tile_memory(5, "llvm.x86.tileloadd64")
_load_b, _load_b1 = _tile_memory(6, "llvm.x86.tileloadd64"), _tile_memory(7, "llvm.x86.tileloadd64")
_dot0, _dot_a4b7_1 = _tile_dot(0, 4, 6), _tile_dot(1, 4, 7)
_dot_a5b6_2, _dot_a5b7_3 = _tile_dot(2, 5, 6), _tile_dot(3, 5, 7)


@njit(cache=True, nogil=True)
def _configure(cfg):  # noqa: ANN001
    """Palette 1, tiles 0-7 all 16 rows x 64 bytes."""
    for i in range(64):
        cfg[i] = 0
    cfg[0] = 1
    for t in range(8):
        cfg[16 + 2 * t] = TILE_BYTES
        cfg[48 + t] = 16


def applies(head_dim: int, group: int, block_size: int) -> bool:
    return HOST_AMX and head_dim % 32 == 0 and 1 <= group <= 16 and block_size % 16 == 0


@cache
def kernel(D: int, G: int):  # noqa: ANN201
    """The kernel for head size D (a multiple of 32) and group G (1-16), compile-time constants, with
    cpu_prefill_attention._kernel's signature: the caches and out hold bfloat16 bits (uint16), q32 is q's bits read
    as uint32 (one pair of d values an element: q [T, heads, D] with its last axis contiguous)."""
    TQ = 16 // G              # positions per query tile
    NC = D // 32              # 32-wide d chunks of the score product
    NP = D // 16              # 16-wide d panels of the value product

    @njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract", "nsz", "arcp"})
    def _prefill(q32, kf, vf, kvh, slots, q_starts, q_lens, ctx_lens, block_tables, block_size, out, scale):  # noqa: ANN001
        max_ctx = 0
        for b in range(ctx_lens.shape[0]):
            max_ctx = max(max_ctx, ctx_lens[b])
        # V^T rows padded to whole key chunks plus one more chunk, so that the 16 rows of a tile (one row stride
        # apart) do not all fall in one L1 set
        cpad = (max_ctx + 31) // 32 * 32 + 32
        vt = np.zeros(D * cpad, dtype=np.uint16)
        qb = np.zeros(2 * NC * 256, dtype=np.uint32)     # Q^T pairs, a B tile per d chunk, per query tile
        s = np.empty(2 * KB * 16, dtype=np.float32)      # a block's S^T, per query tile
        pb = np.empty(2 * KB * 16, dtype=np.uint16)      # its P^T pairs, a B tile per 32 keys, per query tile
        ob = np.empty(2 * D * 16, dtype=np.float32)      # the block's O^T, per query tile
        oacc = np.empty(2 * D * 16, dtype=np.float32)
        m = np.empty(32, dtype=np.float32)
        lsum = np.empty(32, dtype=np.float32)
        alph = np.empty(32, dtype=np.float32)
        tmp = np.empty(16, dtype=np.float32)
        cfg = np.empty(64, dtype=np.uint8)
        kb = np.empty(32, dtype=np.int64)                # a V^T copy's source rows
        for i in range(16):
            tmp[i] = np.float32(scale / math.log(2.0))
        cv = _load16(tmp, 0)
        for i in range(16):
            tmp[i] = np.float32(-scale / math.log(2.0))
        ncv = _load16(tmp, 0)
        _configure(cfg)
        _tile_config(cfg)
        like = out[0, 0]
        for b in range(q_lens.shape[0]):
            n_q = q_lens[b]
            ctx = ctx_lens[b]
            first = ctx - n_q
            row0 = q_starts[b]
            cp = (ctx + 31) // 32 * 32
            for h in range(kvh):
                # V^T of keys 0 .. ctx - 1 (zeros up to the chunk boundary: their probabilities are 0, but a zero
                # weight times a stale NaN would not be), 32 keys at a time with d outer: the 32 source rows stay
                # in L1 while each d's 64 bytes are written
                for jc in range(0, ctx, 32):
                    nj = min(32, ctx - jc)
                    for jj in range(nj):
                        j = jc + jj
                        kb[jj] = (h * slots + block_tables[b, j // block_size] * block_size + j % block_size) * D
                    for d in range(D):
                        for jj in range(nj):
                            vt[d * cpad + jc + jj] = vf[kb[jj] + d]
                for d in range(D):
                    for j in range(ctx, cp):
                        vt[d * cpad + j] = 0
                # two query tiles a pass (u = 0, 1: positions i0 .. + TQ and the TQ after): each K tile and V^T
                # tile loaded from L2 serves 32 rows (the S^T / O^T products of a tile pair in C tiles 0-3)
                for i0 in range(0, n_q, 2 * TQ):
                    nq0 = min(TQ, n_q - i0)
                    nq1 = min(TQ, max(0, n_q - i0 - TQ))
                    for u in range(2):
                        nqu = nq0 if u == 0 else nq1
                        # Q^T pairs (32-bit views: one pair of d values an element): B tile c of query tile u, row
                        # k2 = the pair 32c + 2 k2 (+1) of d, column n = position n // G, head n % G (zero columns
                        # past the tile's rows)
                        for x in range(NC * 16):     # x = 16 c + k2: one B tile row, 16 stores in a row
                            for i in range(nqu):
                                for g in range(G):
                                    qb[u * NC * 256 + x * 16 + i * G + g] = q32[row0 + i0 + u * TQ + i, h * G + g, x]
                            for n in range(nqu * G, 16):
                                qb[u * NC * 256 + x * 16 + n] = 0
                        for r in range(16):
                            m[u * 16 + r] = NEG_INF
                            lsum[u * 16 + r] = 0.0
                        for x in range(D * 16):
                            oacc[u * D * 16 + x] = 0.0
                    p0 = first + i0                      # the pair's first query position
                    n_keys = p0 + nq0 + nq1              # keys 0 .. its last position
                    for j0 in range(0, n_keys, KB):
                        nk = min(KB, n_keys - j0)
                        nt = (nk + 15) // 16             # key tiles
                        nch = (nk + 31) // 32            # key chunks of the value product
                        # S^T: two key tiles x the two query tiles in C tiles 0-3
                        for t0 in range(0, nt, 2):
                            two = t0 + 1 < nt
                            j = j0 + 16 * t0
                            b0 = (h * slots + block_tables[b, j // block_size] * block_size + j % block_size) * D
                            b1 = b0
                            if two:
                                j += 16
                                b1 = (h * slots + block_tables[b, j // block_size] * block_size + j % block_size) * D
                            _zero0()
                            _zero1()
                            if two:
                                _zero2()
                                _zero3()
                            for c in range(NC):
                                _load_b(qb, c * 256, np.int64(TILE_BYTES))
                                _load_b1(qb, NC * 256 + c * 256, np.int64(TILE_BYTES))
                                _load_a(kf, b0 + 32 * c, np.int64(2 * D))
                                _dot0()
                                _dot_a4b7_1()
                                if two:
                                    _load_a1(kf, b1 + 32 * c, np.int64(2 * D))
                                    _dot_a5b6_2()
                                    _dot_a5b7_3()
                            _store0(s, t0 * 256, np.int64(TILE_BYTES))
                            _store1(s, KB * 16 + t0 * 256, np.int64(TILE_BYTES))
                            if two:
                                _store2(s, t0 * 256 + 256, np.int64(TILE_BYTES))
                                _store3(s, KB * 16 + t0 * 256 + 256, np.int64(TILE_BYTES))
                        for u in range(2):
                            so = u * KB * 16
                            pu = p0 + u * TQ             # query tile u's first position
                            # keys past the block's end and after a row's position score -inf (weigh exactly 0)
                            for jj in range(nk, nch * 32):
                                for r in range(16):
                                    s[so + jj * 16 + r] = NEG_INF
                            for jj in range(max(0, pu + 1 - j0), nk):
                                cut = min(max((j0 + jj - pu) * G, 0), 16)   # rows r < cut: before key j0 + jj
                                for r in range(cut):
                                    s[so + jj * 16 + r] = NEG_INF
                            # the running max (of raw scores: the scale is positive); key 0 is in the first block
                            # and visible to every row, so it is finite from the first block on
                            mo = _load16(m, u * 16)
                            mv = mo
                            m1 = mo
                            m2 = mo
                            m3 = mo
                            jj = 0
                            while jj + 4 <= nk:       # four chains: one max waits on the one before (latency 4)
                                mv = _max16(mv, _load16(s, so + jj * 16))
                                m1 = _max16(m1, _load16(s, so + jj * 16 + 16))
                                m2 = _max16(m2, _load16(s, so + jj * 16 + 32))
                                m3 = _max16(m3, _load16(s, so + jj * 16 + 48))
                                jj += 4
                            while jj < nk:
                                mv = _max16(mv, _load16(s, so + jj * 16))
                                jj += 1
                            mv = _max16(_max16(mv, m1), _max16(m2, m3))
                            _store16(m, u * 16, mv)
                            nmc = _mul16(mv, ncv)
                            _store16(tmp, 0, mo)
                            _store16(alph, u * 16, _exp2_scores(tmp, 0, cv, nmc))   # the rescale (0 at first)
                            # numerators as bf16 pairs for the value product, their float32 sum for the row sum
                            part = _zero16()
                            for k in range(nch):
                                for k2 in range(16):
                                    x = so + (32 * k + 2 * k2) * 16
                                    e0 = _exp2_scores(s, x, cv, nmc)
                                    e1 = _exp2_scores(s, x + 16, cv, nmc)
                                    part = _add16(part, _add16(e0, e1))
                                    _store16_bf16_pairs(pb, so + k * 512 + k2 * 32, e0, e1)
                            _store16(lsum, u * 16, _add16(_mul16(_load16(lsum, u * 16), _load16(alph, u * 16)), part))
                        # O^T: two d panels x the two query tiles in C tiles 0-3
                        for pg in range(0, NP, 2):
                            _zero0()
                            _zero1()
                            _zero2()
                            _zero3()
                            for k in range(nch):
                                vj = j0 + 32 * k
                                _load_b(pb, k * 512, np.int64(TILE_BYTES))
                                _load_b1(pb, KB * 16 + k * 512, np.int64(TILE_BYTES))
                                _load_a(vt, (16 * pg) * cpad + vj, np.int64(2 * cpad))
                                _dot0()
                                _dot_a4b7_1()
                                _load_a1(vt, (16 * pg + 16) * cpad + vj, np.int64(2 * cpad))
                                _dot_a5b6_2()
                                _dot_a5b7_3()
                            _store0(ob, (16 * pg) * 16, np.int64(TILE_BYTES))
                            _store1(ob, D * 16 + (16 * pg) * 16, np.int64(TILE_BYTES))
                            _store2(ob, (16 * pg + 16) * 16, np.int64(TILE_BYTES))
                            _store3(ob, D * 16 + (16 * pg + 16) * 16, np.int64(TILE_BYTES))
                        for u in range(2):
                            alpha = _load16(alph, u * 16)
                            for d in range(D):
                                x = u * D * 16 + d * 16
                                _store16(oacc, x, _add16(_mul16(_load16(oacc, x), alpha), _load16(ob, x)))
                    for u in range(2):
                        rv = (nq0 if u == 0 else nq1) * G
                        for n in range(rv):
                            inv = np.float32(1.0) / lsum[u * 16 + n]
                            col = (h * G + n % G) * D
                            orow = row0 + i0 + u * TQ + n // G
                            for d in range(D):
                                out[orow, col + d] = _store(oacc[u * D * 16 + d * 16 + n] * inv, like)
        _tile_release()
    return _prefill


__all__ = ["KB", "applies", "kernel"]
