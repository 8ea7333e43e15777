"""Array elements of the CPU kernels across dtypes: float32, float64, and bfloat16 as its raw 16 bits.

numpy has no bfloat16, so a bf16 tensor reaches numba as uint16 (`as_array`). A kernel reads an element with `_load`
(bf16 bits -> float32, exact: they are float32's top half; floats as they are) and writes one with `_store` (float32
-> bf16 rounded to nearest even, NaN to torch's quiet NaN, as torch's own cast; floats as they are). `_round` is the
rounding alone (a value as the output dtype would hold it, kept in the compute type), which is how a kernel follows
PyTorch's bf16 ops: each op computes in float32 and rounds its result to bf16. `_cast` makes a constant of the compute
type and `_narrow` brings a wider intermediate down to float32 for bf16 only. For float32 and float64 `_load`,
`_store`, `_round` and `_narrow` are the identity, so one kernel body serves every dtype with unchanged float numerics.
"""
from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from tokenplane.engine.cpu_decode_paging import _f32_from_bits


@intrinsic
def _bits_from_f32(typingctx, value):  # noqa: ANN001
    """Reinterpret a float32 as the uint32 with its bits."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


def _load(x):  # noqa: ANN001, ANN202
    """An element as the value to compute with (bfloat16 bits -> float32; floats as they are)."""


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


def _round(value, like):  # noqa: ANN001, ANN202
    """`value` rounded as `_store` would store it into an array like `like`'s, kept in the compute type."""


@overload(_round, inline="always")
def _round_impl(value, like):  # noqa: ANN001, ANN202
    if like == types.uint16:
        return lambda value, like: _load(_store(value, like))
    return lambda value, like: value


def _cast(value, like):  # noqa: ANN001, ANN202
    """`value` in the compute type of elements like `like`: float32 for bf16 bits and float32, float64 for float64."""


@overload(_cast, inline="always")
def _cast_impl(value, like):  # noqa: ANN001, ANN202
    if like == types.uint16 or like == types.float32:
        return lambda value, like: types.float32(value)
    return lambda value, like: types.float64(value)


def _narrow(value, like):  # noqa: ANN001, ANN202
    """`value` as float32 for bf16 elements (the type PyTorch's bf16 ops compute in); floats: unchanged, whatever
    its type (the float kernels keep their wider intermediates)."""


@overload(_narrow, inline="always")
def _narrow_impl(value, like):  # noqa: ANN001, ANN202
    if like == types.uint16:
        return lambda value, like: types.float32(value)
    return lambda value, like: value


def as_array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's numpy view; bfloat16 as its raw bits (uint16)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


__all__ = ["as_array"]
