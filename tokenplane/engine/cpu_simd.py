"""SIMD vectors for numba kernels: <8 x float> and <16 x float> LLVM values and the few operations the CPU kernels
use on them (unaligned load and store, broadcast, fused multiply-add, add, prefetch), emitted through llvmlite
because numba has no vector type. An 8-lane vector is a ymm register on AVX2; a 16-lane one is a zmm register where
the host has AVX-512 (`HOST_AVX512`), and two ymm registers elsewhere (so 16-lane kernels are picked only there).
Both widths come from one definition (`_vector_ops`), so the 8- and 16-lane names are the same operations.
"""
from __future__ import annotations

import os
from typing import Any

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model


def _host_has(feature: str) -> bool:
    """Whether the host CPU has `feature` (LLVM's name for it; numba compiles for the host CPU)."""
    try:
        return bool(llvm.get_host_cpu_features().get(feature, False))
    except RuntimeError:    # pragma: no cover - a host LLVM cannot describe
        return False


# AVX-512F: the 16-lane kernels (TOKENPLANE_SIMD_WIDTH=8 turns them off); AVX512-BF16 on such a host: the vdpbf16ps
# kernels (TOKENPLANE_DPBF16=0 turns them off)
HOST_AVX512 = os.environ.get("TOKENPLANE_SIMD_WIDTH") != "8" and _host_has("avx512f")
HOST_AVX512_BF16 = HOST_AVX512 and os.environ.get("TOKENPLANE_DPBF16") != "0" and _host_has("avx512bf16")

_I32 = ir.IntType(32)


class _VecType(types.Type):
    """`lanes` float32 lanes held as one LLVM vector value."""

    def __init__(self, lanes: int) -> None:
        self.lanes = lanes
        super().__init__(name=f"Vec{lanes}f32")


@register_model(_VecType)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:  # noqa: ANN001
        super().__init__(dmm, fe_type, ir.VectorType(ir.FloatType(), fe_type.lanes))


def _pointer(context, builder, aryty, ary, index):  # noqa: ANN001, ANN202
    a = context.make_array(aryty)(context, builder, ary)
    return cgutils.get_item_pointer(context, builder, aryty, a, [index], wraparound=False)


def _vector_ops(lanes: int) -> tuple[Any, ...]:
    """(type, load, store, splat, zero, fma, add, max) on `lanes`-float vectors:
    load(flat, i): flat[i : i + lanes] as a vector (unaligned, no bounds or wraparound code); store(flat, i, v);
    splat(flat, i): flat[i] broadcast to every lane (one vbroadcastss from memory); zero(); fma(a, b, c): a * b + c,
    one rounding per lane (llvm.fma: vfmadd on FMA hardware); add(a, b); max(a, b): lane-wise (vmaxps; for inputs
    that are never NaN)."""
    vt = ir.VectorType(ir.FloatType(), lanes)
    vec = _VecType(lanes)

    @intrinsic
    def load(typingctx, flat, index):  # noqa: ANN001
        def codegen(context, builder, signature, args):  # noqa: ANN001
            p = _pointer(context, builder, signature.args[0], args[0], args[1])
            return builder.load(builder.bitcast(p, vt.as_pointer()), align=4)
        return vec(flat, index), codegen

    @intrinsic
    def store(typingctx, flat, index, value):  # noqa: ANN001
        def codegen(context, builder, signature, args):  # noqa: ANN001
            p = _pointer(context, builder, signature.args[0], args[0], args[1])
            builder.store(args[2], builder.bitcast(p, vt.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.void(flat, index, vec), codegen

    @intrinsic
    def splat(typingctx, flat, index):  # noqa: ANN001
        def codegen(context, builder, signature, args):  # noqa: ANN001
            s = builder.load(_pointer(context, builder, signature.args[0], args[0], args[1]), align=4)
            v = builder.insert_element(ir.Constant(vt, ir.Undefined), s, ir.Constant(_I32, 0))
            return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, lanes), [0] * lanes))
        return vec(flat, index), codegen

    @intrinsic
    def zero(typingctx):  # noqa: ANN001
        def codegen(context, builder, signature, args):  # noqa: ANN001
            return ir.Constant(vt, [0.0] * lanes)
        return vec(), codegen

    @intrinsic
    def fma(typingctx, a, b, c):  # noqa: ANN001
        def codegen(context, builder, signature, args):  # noqa: ANN001
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt, vt, vt]),
                                                f"llvm.fma.v{lanes}f32")
            return builder.call(fn, args)
        return vec(vec, vec, vec), codegen

    @intrinsic
    def add(typingctx, a, b):  # noqa: ANN001
        def codegen(context, builder, signature, args):  # noqa: ANN001
            return builder.fadd(args[0], args[1])
        return vec(vec, vec), codegen

    @intrinsic
    def vmax(typingctx, a, b):  # noqa: ANN001
        def codegen(context, builder, signature, args):  # noqa: ANN001
            return builder.select(builder.fcmp_ordered(">", args[0], args[1]), args[0], args[1])
        return vec(vec, vec), codegen

    return vec, load, store, splat, zero, fma, add, vmax


_vec8, _load8, _store8, _splat8, _zero8, _fma8, _add8, _max8 = _vector_ops(8)
_vec16, _load16, _store16, _splat16, _zero16, _fma16, _add16, _max16 = _vector_ops(16)


@intrinsic
def _fma1(typingctx, a, b, c):  # noqa: ANN001
    """a * b + c on float32 scalars with one rounding (llvm.fma.f32): one lane of the vector kernels' `fma`."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        f = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f, [f, f, f]), "llvm.fma.f32")
        return builder.call(fn, args)
    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _load16_bf16(typingctx, flat, index):  # noqa: ANN001
    """flat[index : index + 16] of a uint16 array holding bfloat16 bits, as 16 float32 lanes (exact: a bfloat16 is
    the top half of a float32): a 32-byte load, zero-extended to 32-bit lanes and shifted left by 16."""
    vi16 = ir.VectorType(ir.IntType(16), 16)
    vi32 = ir.VectorType(_I32, 16)

    def codegen(context, builder, signature, args):  # noqa: ANN001
        p = _pointer(context, builder, signature.args[0], args[0], args[1])
        raw = builder.load(builder.bitcast(p, vi16.as_pointer()), align=2)
        wide = builder.shl(builder.zext(raw, vi32), ir.Constant(vi32, [16] * 16))
        return builder.bitcast(wide, ir.VectorType(ir.FloatType(), 16))
    return _vec16(flat, index), codegen


class _BFloat(ir.types.Type):
    """LLVM's `bfloat` scalar, which llvmlite's IR builder lacks: the vdpbf16ps intrinsic's operand lanes (a bitcast
    of 16 x 32-bit lanes) and, in cpu_prefill_attention_amx, an `fptrunc` target (nearest even in one instruction
    where the host has AVX512-BF16: vcvtneps2bf16)."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


@intrinsic
def _dpbf16x16(typingctx, acc, a, b):  # noqa: ANN001
    """acc + pairwise bfloat16 dot products (vdpbf16ps, AVX512-BF16; `HOST_AVX512_BF16`): each 32-bit lane of a and
    b holds two bfloat16 (their bits, as a 16-float vector loaded from a view of bf16 pairs), and lane j of the
    result is acc[j] + a[2j] b[2j] + a[2j+1] b[2j+1]: the products are exact in float32 (8-bit significands), the
    sums rounded to float32; bfloat16 denormals (below 1.2e-38) are read as zero. Twice the multiply-adds of one
    16-lane FMA at the same issue rate."""
    vt = ir.VectorType(ir.FloatType(), 16)
    # LLVM 17 retyped the intrinsic's operands from <16 x i32> to <32 x bfloat> (numba >= 0.60 ships LLVM 14 up)
    bv = ir.VectorType(_BFloat(), 32) if llvm.llvm_version_info[0] >= 17 else ir.VectorType(_I32, 16)

    def codegen(context, builder, signature, args):  # noqa: ANN001
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt, bv, bv]),
                                            "llvm.x86.avx512bf16.dpbf16ps.512")
        return builder.call(fn, [args[0], builder.bitcast(args[1], bv), builder.bitcast(args[2], bv)])
    return _vec16(_vec16, _vec16, _vec16), codegen


def _kv_typed(flat, index, splat: bool):  # noqa: ANN001, ANN202
    """Typing and codegen of `_splat16_kv` (splat) and `_load16_kv`: a float32 array's elements as they are, a uint16
    array's bfloat16 bits widened exactly (zero-extended and shifted left by 16); other arrays do not type."""
    if flat.dtype not in (types.float32, types.uint16):
        return None
    bf16 = flat.dtype == types.uint16
    vt = ir.VectorType(ir.FloatType(), 16)

    def codegen(context, builder, signature, args):  # noqa: ANN001
        p = _pointer(context, builder, signature.args[0], args[0], args[1])
        if splat:
            s = builder.load(p, align=2)
            if bf16:
                s = builder.bitcast(builder.shl(builder.zext(s, _I32), ir.Constant(_I32, 16)), ir.FloatType())
            v = builder.insert_element(ir.Constant(vt, ir.Undefined), s, ir.Constant(_I32, 0))
            return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 16), [0] * 16))
        if not bf16:
            return builder.load(builder.bitcast(p, vt.as_pointer()), align=4)
        vi32 = ir.VectorType(_I32, 16)
        raw = builder.load(builder.bitcast(p, ir.VectorType(ir.IntType(16), 16).as_pointer()), align=2)
        return builder.bitcast(builder.shl(builder.zext(raw, vi32), ir.Constant(vi32, [16] * 16)), vt)
    return _vec16(flat, index), codegen


@intrinsic
def _splat16_kv(typingctx, flat, index):  # noqa: ANN001
    """`_splat16` of a K/V cache element: float32, or bfloat16 bits in a uint16 array (widened exactly)."""
    return _kv_typed(flat, index, True)


@intrinsic
def _load16_kv(typingctx, flat, index):  # noqa: ANN001
    """`_load16` of K/V cache elements: float32, or bfloat16 bits in a uint16 array (as `_load16_bf16`)."""
    return _kv_typed(flat, index, False)


def _bf16_pair_codegen(odd: bool):  # noqa: ANN202
    def codegen(context, builder, signature, args):  # noqa: ANN001
        vi32 = ir.VectorType(_I32, 16)
        p = _pointer(context, builder, signature.args[0], args[0], args[1])
        raw = builder.load(builder.bitcast(p, vi32.as_pointer()), align=2)
        if odd:   # the high halves of the 32-bit lanes already sit where float32 wants them
            wide = builder.and_(raw, ir.Constant(vi32, [-65536] * 16))
        else:
            wide = builder.shl(raw, ir.Constant(vi32, [16] * 16))
        return builder.bitcast(wide, ir.VectorType(ir.FloatType(), 16))
    return codegen


@intrinsic
def _load16_bf16_even(typingctx, flat, index):  # noqa: ANN001
    """flat[index], flat[index + 2], ..., flat[index + 30] of a uint16 array of bfloat16 bits, as 16 float32 lanes:
    one 64-byte load read as 16 32-bit lanes (little-endian: each lane's low half is the even element), shifted
    left by 16. With `_load16_bf16_odd` at the same index (LLVM keeps one load) 32 elements widen in two lane-wise
    operations and no shuffle, against `_load16_bf16`'s shuffle per 16; the caller works in that even/odd order."""
    return _vec16(flat, index), _bf16_pair_codegen(False)


@intrinsic
def _load16_bf16_odd(typingctx, flat, index):  # noqa: ANN001
    """flat[index + 1], flat[index + 3], ..., flat[index + 31] as 16 float32 lanes (the high halves, masked)."""
    return _vec16(flat, index), _bf16_pair_codegen(True)


@intrinsic
def _sum16x16(typingctx, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):  # noqa: ANN001
    """[sum(a0), sum(a1), ..., sum(a15)] as one 16-lane vector: a transposing tree of 15 adds and 30 two-source
    shuffles (vpermt2ps), each level halving the lanes every input keeps. ~2 shuffles per sum, against ~4.7 for
    pairs of `_fold16` + `_sum8x8`; each lane only ever adds partial sums of its own input."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        vi = ir.VectorType(_I32, 16)

        def level(vs, width):  # noqa: ANN001, ANN202
            # each input holds 16 / width inputs' partial sums in runs of `width` lanes; halve every run
            half = width // 2
            lo = [j for r in range(0, 32, width) for j in range(r, r + half)]
            hi = [j + half for j in lo]
            return [builder.fadd(builder.shuffle_vector(x, y, ir.Constant(vi, lo)),
                                 builder.shuffle_vector(x, y, ir.Constant(vi, hi)))
                    for x, y in zip(vs[0::2], vs[1::2])]
        vs = list(args)
        for width in (16, 8, 4, 2):
            vs = level(vs, width)
        return vs[0]
    return _vec16(*([_vec16] * 16)), codegen


@intrinsic
def _mul16(typingctx, a, b):  # noqa: ANN001
    """a * b lane-wise on 16-float vectors, one rounding per lane (no contraction with a later add)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        return builder.fmul(args[0], args[1])
    return _vec16(_vec16, _vec16), codegen


def _bf16_bits(builder, v):  # noqa: ANN001, ANN202
    """The float32 bits of v rounded to bfloat16 (nearest even), NaN as torch's quiet NaN 0x7FC0: cpu_elements'
    scalar `_store` on 16 lanes, kept in the top halves of 32-bit lanes."""
    vi32 = ir.VectorType(_I32, 16)
    u = builder.bitcast(v, vi32)
    lsb = builder.and_(builder.lshr(u, ir.Constant(vi32, [16] * 16)), ir.Constant(vi32, [1] * 16))
    r = builder.add(builder.add(u, ir.Constant(vi32, [0x7FFF] * 16)), lsb)
    r = builder.and_(r, ir.Constant(vi32, [0xFFFF0000 - (1 << 32)] * 16))
    nan = builder.fcmp_unordered("uno", v, v)
    return builder.select(nan, ir.Constant(vi32, [0x7FC00000] * 16), r)


@intrinsic
def _round16_bf16(typingctx, v):  # noqa: ANN001
    """v rounded to bfloat16 lane-wise, kept as float32 (cpu_elements' `_round` for bf16 elements on 16 lanes)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        return builder.bitcast(_bf16_bits(builder, args[0]), ir.VectorType(ir.FloatType(), 16))
    return _vec16(_vec16), codegen


@intrinsic
def _store16_bf16(typingctx, flat, index, value):  # noqa: ANN001
    """flat[index : index + 16] = value rounded to bfloat16 bits (a uint16 array; cpu_elements' `_store`)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        vi32 = ir.VectorType(_I32, 16)
        top = builder.lshr(_bf16_bits(builder, args[2]), ir.Constant(vi32, [16] * 16))
        half = builder.trunc(top, ir.VectorType(ir.IntType(16), 16))
        p = _pointer(context, builder, signature.args[0], args[0], args[1])
        builder.store(half, builder.bitcast(p, ir.VectorType(ir.IntType(16), 16).as_pointer()), align=2)
        return context.get_dummy_value()
    return types.void(flat, index, _vec16), codegen


@intrinsic
def _prefetch(typingctx, flat, index):  # noqa: ANN001
    """llvm.prefetch (read, high locality) of flat[index]."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        p = _pointer(context, builder, signature.args[0], args[0], args[1])
        i8p = ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(p, i8p), ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.void(flat, index), codegen
