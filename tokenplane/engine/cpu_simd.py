"""SIMD vectors for numba kernels: <8 x float> and <16 x float> LLVM values and the few operations the CPU kernels
use on them (unaligned load and store, broadcast, fused multiply-add, add, prefetch), emitted through llvmlite
because numba has no vector type. An 8-lane vector is a ymm register on AVX2; a 16-lane one is a zmm register where
the host has AVX-512 (`HOST_AVX512`), and two ymm registers elsewhere (so 16-lane kernels are picked only there).
"""
from __future__ import annotations

import os

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model


def _host_avx512() -> bool:
    """AVX-512F on the host (numba compiles for the host CPU); TOKENPLANE_SIMD_WIDTH=8 turns the 16-lane kernels off."""
    if os.environ.get("TOKENPLANE_SIMD_WIDTH") == "8":
        return False
    try:
        return bool(llvm.get_host_cpu_features().get("avx512f", False))
    except RuntimeError:    # pragma: no cover - a host LLVM cannot describe
        return False


HOST_AVX512 = _host_avx512()

_V8 = ir.VectorType(ir.FloatType(), 8)
_I32 = ir.IntType(32)


class _Vec8Type(types.Type):
    """Eight float32 lanes held as one LLVM vector value (a ymm register on AVX2)."""

    def __init__(self) -> None:
        super().__init__(name="Vec8f32")


_vec8 = _Vec8Type()


@register_model(_Vec8Type)
class _Vec8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:  # noqa: ANN001
        super().__init__(dmm, fe_type, _V8)


def _pointer(context, builder, aryty, ary, index):  # noqa: ANN001, ANN202
    a = context.make_array(aryty)(context, builder, ary)
    return cgutils.get_item_pointer(context, builder, aryty, a, [index], wraparound=False)


@intrinsic
def _load8(typingctx, flat, index):  # noqa: ANN001
    """flat[index : index + 8] as a vector (unaligned load, no bounds or wraparound code)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        p = _pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.load(builder.bitcast(p, _V8.as_pointer()), align=4)
    return _vec8(flat, index), codegen


@intrinsic
def _store8(typingctx, flat, index, value):  # noqa: ANN001
    def codegen(context, builder, signature, args):  # noqa: ANN001
        p = _pointer(context, builder, signature.args[0], args[0], args[1])
        builder.store(args[2], builder.bitcast(p, _V8.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.void(flat, index, _vec8), codegen


@intrinsic
def _splat8(typingctx, flat, index):  # noqa: ANN001
    """flat[index] broadcast to 8 lanes (one vbroadcastss from memory)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        s = builder.load(_pointer(context, builder, signature.args[0], args[0], args[1]), align=4)
        v = builder.insert_element(ir.Constant(_V8, ir.Undefined), s, ir.Constant(_I32, 0))
        return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 8), [0] * 8))
    return _vec8(flat, index), codegen


@intrinsic
def _zero8(typingctx):  # noqa: ANN001
    def codegen(context, builder, signature, args):  # noqa: ANN001
        return ir.Constant(_V8, [0.0] * 8)
    return _vec8(), codegen


@intrinsic
def _fma8(typingctx, a, b, c):  # noqa: ANN001
    """a * b + c, one rounding (llvm.fma: vfmadd on FMA hardware)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8, [_V8, _V8, _V8]), "llvm.fma.v8f32")
        return builder.call(fn, args)
    return _vec8(_vec8, _vec8, _vec8), codegen


@intrinsic
def _add8(typingctx, a, b):  # noqa: ANN001
    def codegen(context, builder, signature, args):  # noqa: ANN001
        return builder.fadd(args[0], args[1])
    return _vec8(_vec8, _vec8), codegen


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


_V16 = ir.VectorType(ir.FloatType(), 16)


class _Vec16Type(types.Type):
    """Sixteen float32 lanes held as one LLVM vector value (a zmm register on AVX-512)."""

    def __init__(self) -> None:
        super().__init__(name="Vec16f32")


_vec16 = _Vec16Type()


@register_model(_Vec16Type)
class _Vec16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:  # noqa: ANN001
        super().__init__(dmm, fe_type, _V16)


@intrinsic
def _load16(typingctx, flat, index):  # noqa: ANN001
    """flat[index : index + 16] as a vector (unaligned load, no bounds or wraparound code)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        p = _pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.load(builder.bitcast(p, _V16.as_pointer()), align=4)
    return _vec16(flat, index), codegen


@intrinsic
def _store16(typingctx, flat, index, value):  # noqa: ANN001
    def codegen(context, builder, signature, args):  # noqa: ANN001
        p = _pointer(context, builder, signature.args[0], args[0], args[1])
        builder.store(args[2], builder.bitcast(p, _V16.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.void(flat, index, _vec16), codegen


@intrinsic
def _splat16(typingctx, flat, index):  # noqa: ANN001
    """flat[index] broadcast to 16 lanes (one vbroadcastss from memory)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        s = builder.load(_pointer(context, builder, signature.args[0], args[0], args[1]), align=4)
        v = builder.insert_element(ir.Constant(_V16, ir.Undefined), s, ir.Constant(_I32, 0))
        return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 16), [0] * 16))
    return _vec16(flat, index), codegen


@intrinsic
def _zero16(typingctx):  # noqa: ANN001
    def codegen(context, builder, signature, args):  # noqa: ANN001
        return ir.Constant(_V16, [0.0] * 16)
    return _vec16(), codegen


@intrinsic
def _fma16(typingctx, a, b, c):  # noqa: ANN001
    """a * b + c, one rounding per lane (llvm.fma: vfmadd)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16, _V16, _V16]),
                                            "llvm.fma.v16f32")
        return builder.call(fn, args)
    return _vec16(_vec16, _vec16, _vec16), codegen


@intrinsic
def _add16(typingctx, a, b):  # noqa: ANN001
    def codegen(context, builder, signature, args):  # noqa: ANN001
        return builder.fadd(args[0], args[1])
    return _vec16(_vec16, _vec16), codegen
