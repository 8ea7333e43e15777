"""What the decode attention kernels share (cpu_decode_attention.py's generic one, cpu_decode_attention_vec.py's
float32 vector form): software prefetch, float32 bit casts, the vectorizable softmax exponent, and the order in which a
row's KV blocks are read (falling block tables in reverse) with where the read goes next (what to prefetch).
"""
from __future__ import annotations

import math
from functools import cache

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from tokenplane.engine.cpu_simd import (
    _add16,
    _load8,
    _load16,
    _max8,
    _max16,
    _pointer,
    _splat8,
    _splat16,
    _store8,
    _store16,
    _vec8,
    _vec16,
    _zero16,
)
from tokenplane.engine.numbacache import njit

CACHE_LINE = 64


@intrinsic
def _prefetch_kv(typingctx, kf, vf, in_v, index):  # noqa: ANN001
    """llvm.prefetch (read, high locality) of vf[index] if in_v else kf[index] (1-D arrays; `_stream_block`'s answer):
    the cache is chosen by a select on the two addresses inside the intrinsic, because numba passing either array
    through a Python-level branch or helper costs reference counting on every call (see `_stream_block`)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        pk = builder.bitcast(_pointer(context, builder, signature.args[0], args[0], args[3]), i8p)
        pv = builder.bitcast(_pointer(context, builder, signature.args[1], args[1], args[3]), i8p)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.select(args[2], pv, pk), ir.Constant(i32, 0), ir.Constant(i32, 3),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(kf, vf, in_v, index), codegen


@intrinsic
def _f32_from_bits(typingctx, bits):  # noqa: ANN001
    """Reinterpret a uint32 as the float32 with those bits."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen



_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)       # ln 2 split in two (Cody-Waite): n * _LN2_HI is exact for |n| < 2^9
_LN2_LO = np.float32(-2.12194440e-4)
# e^r's degree-6 Taylor coefficients in Horner order (highest degree first)
_EXP_TAYLOR = (1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0)


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
            p = types.float32(_EXP_TAYLOR[0])
            p = p * r + types.float32(_EXP_TAYLOR[1])
            p = p * r + types.float32(_EXP_TAYLOR[2])
            p = p * r + types.float32(_EXP_TAYLOR[3])
            p = p * r + types.float32(_EXP_TAYLOR[4])
            p = p * r + types.float32(_EXP_TAYLOR[5])
            p = p * r + types.float32(_EXP_TAYLOR[6])
            return p * _f32_from_bits(types.uint32(types.int32(n) + types.int32(127)) << types.uint32(23))
        return exp_f32
    return lambda x: math.exp(x)


def exp_nonpos_ir(builder: ir.IRBuilder, x: ir.Value, lanes: int) -> ir.Value:
    """`_exp_nonpos` of a `lanes`-float vector x (every lane <= 0) as vector operations (the polynomial's steps as
    fused multiply-adds): the same bits as `_exp_nonpos` lane by lane, and at any width."""
    f, i32 = ir.FloatType(), ir.IntType(32)
    vt, vi = ir.VectorType(f, lanes), ir.VectorType(i32, lanes)

    def splat(c: float) -> ir.Constant:
        return ir.Constant(vt, [float(np.float32(c))] * lanes)
    lo = splat(-87.0)
    x = builder.select(builder.fcmp_ordered(">", x, lo), x, lo)
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt]), f"llvm.floor.v{lanes}f32")
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt, vt, vt]), f"llvm.fma.v{lanes}f32")
    n = builder.call(floor, [builder.fadd(builder.fmul(x, splat(_LOG2E)), splat(0.5))])
    r = builder.fsub(builder.fsub(x, builder.fmul(n, splat(_LN2_HI))), builder.fmul(n, splat(_LN2_LO)))
    poly = splat(_EXP_TAYLOR[0])
    for c in _EXP_TAYLOR[1:]:
        poly = builder.call(fma, [poly, r, splat(c)])
    bits = builder.shl(builder.add(builder.fptosi(n, vi), ir.Constant(vi, [127] * lanes)),
                       ir.Constant(vi, [23] * lanes))
    return builder.fmul(poly, builder.bitcast(bits, vt))


def _exp_shifted(lanes: int, vec: types.Type):  # noqa: ANN202
    """exp(flat[index : index + lanes] - m) on `lanes`-float vectors (m a vector, every value <= m), by
    `exp_nonpos_ir`: ~lanes x fewer instructions per score than the scalar form."""
    @intrinsic
    def exp_shifted(typingctx, flat, index, m):  # noqa: ANN001
        def codegen(context, builder, signature, args):  # noqa: ANN001
            vt = ir.VectorType(ir.FloatType(), lanes)
            ptr = _pointer(context, builder, signature.args[0], args[0], args[1])
            x = builder.fsub(builder.load(builder.bitcast(ptr, vt.as_pointer()), align=4), args[2])
            return exp_nonpos_ir(builder, x, lanes)
        return vec(flat, index, vec), codegen
    return exp_shifted


_exp8_shifted = _exp_shifted(8, _vec8)
_exp16_shifted = _exp_shifted(16, _vec16)


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
def _stream_block(block_tables, context_lens, b, h, kvh, slots, block_size, d, pos, rev):  # noqa: ANN001, ANN202
    """Where the kernel reads `pos` blocks after the start of row b's head h (read order `rev`): its K blocks, then its
    V blocks, then the next head's (or the next row's first head's) K blocks. Returns (in V, flat offset): what to
    prefetch, for `_prefetch_kv`. A flag, not the array: an array value crossing an inlined helper costs a reference
    count round trip (NRT calls that spill every vector register) per block; the bf16 kernel's value pass, SmolLM2's
    shape with the caches in L2, ran 20.5 -> 10.9 ms for 16 rows x 2080 tokens x 30 layers without it (an njit
    helper taking the two arrays measured 10x slower still: reference counts on every call)."""
    nblk = (context_lens[b] + block_size - 1) // block_size
    if pos < nblk:
        return False, (h * slots + block_tables[b, _table_index(pos, nblk, rev)] * block_size) * d
    if pos < 2 * nblk:
        return True, (h * slots + block_tables[b, _table_index(pos - nblk, nblk, rev)] * block_size) * d
    pos -= 2 * nblk
    if h + 1 < kvh:
        h += 1
    elif b + 1 < context_lens.shape[0]:
        b += 1
        h = 0
        nblk = (context_lens[b] + block_size - 1) // block_size
        rev = _descending(block_tables, b, nblk)
    pos = min(pos, nblk - 1)
    return False, (h * slots + block_tables[b, _table_index(pos, nblk, rev)] * block_size) * d


@cache
def softmax_numerators(W: int):  # noqa: ANN201
    """The vector kernels' softmax for one query head (W = 8 or 16 lanes): `fn(scores, r0, ctx, tmp)` turns
    scores[r0 : r0 + ctx] into their exponents minus the maximum and returns their sum as a float64 (tmp: W floats
    of scratch). The maximum is taken W lanes at a time: a scalar max is a chain of dependent compares (~5 ns a key).
    At 16 lanes the exponents too (`_exp16_shifted`), summed in float32 lanes per 1,024 scores and those sums in
    float64: LLVM's own vectorization of the scalar loop with one float64 sum ran ~0.9 ns a score here (SmolLM2's
    shape, 16 rows x 2048 tokens: ~8 of 79 ms of attention in the softmax; 81-86 -> 71-72 ms with this form)."""
    load, vmax, splat, store = (_load16, _max16, _splat16, _store16) if W == 16 else (_load8, _max8, _splat8, _store8)

    @njit(inline="always")
    def softmax(scores, r0, ctx, tmp):  # noqa: ANN001, ANN202
        mv = splat(scores, r0)
        i = 0
        while i + W <= ctx:
            mv = vmax(mv, load(scores, r0 + i))
            i += W
        store(tmp, 0, mv)
        m = tmp[0]
        for j in range(1, W):
            m = max(m, tmp[j])
        while i < ctx:
            m = max(m, scores[r0 + i])
            i += 1
        tot = 0.0
        i = 0
        if W == 16:
            # 16 lanes at a time; float32 lane sums over at most 1,024 scores each, then added in float64
            tmp[0] = m
            ms = _splat16(tmp, 0)
            while i + 16 <= ctx:
                end = min(ctx, i + 1024)
                acc = _zero16()
                while i + 16 <= end:
                    e = _exp16_shifted(scores, r0 + i, ms)
                    _store16(scores, r0 + i, e)
                    acc = _add16(acc, e)
                    i += 16
                _store16(tmp, 0, acc)
                for j in range(16):
                    tot += tmp[j]
        while i < ctx:
            e = _exp_nonpos(scores[r0 + i] - m)
            scores[r0 + i] = e
            tot += e
            i += 1
        return tot
    return softmax
