"""A bound kernel's tail as one argument: the tables' addresses and shapes in one int64 array (the AOT module only).

A kernel the encoder calls with most of its arguments fixed (the family and BPE tables, the thread's piece map:
kernels.Kernels.bind) still pays, on every call of an AOT export, the unboxing of each array argument: pycc's wrapper
makes a meminfo for each (an allocation), and frees it on return, ~150 ns an array. The block kernel has ~27
arguments: a 1-character encode spent 5.5 us in the call, ~0.4 us of it encoding. Here the AOT module also exports,
for each kernel of kernels.PACKED, a wrapper that takes the head arguments and one int64 array `h` of
(address, shape 0, shape 1) per tail argument (a scalar: its value), and rebuilds each table inside as a borrowed
array (borrow.py's kind: no owner, no reference count) before calling the kernel. The binding keeps the tail's
arrays alive for as long as it is used (kernels.bind), and every array was checked against the signature when
bound, as before.

This module imports numba (intrinsics), so only the AOT build imports it (aotbuild.py).
"""

from __future__ import annotations

from functools import cache
from typing import Any, Callable

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array

from . import kernels
from .borrow import borrowed


@cache
def view_of(dtype: str, ndim: int) -> Any:
    """An intrinsic view(h, i): the C-contiguous `dtype` array of rank `ndim` whose address and shape are h[3i],
    h[3i + 1], h[3i + 2], without an owner."""
    arrty = types.Array(types.bool_ if dtype == "boolean" else getattr(types, dtype), ndim, "C")

    @intrinsic
    def view(typingctx, h, i):  # noqa: ANN001
        def codegen(context, builder, signature, args):  # noqa: ANN001
            handle = context.make_array(signature.args[0])(context, builder, value=args[0])
            base = builder.mul(args[1], context.get_constant(types.intp, 3))

            def word(k: int) -> Any:
                at = builder.add(base, context.get_constant(types.intp, k))
                return builder.load(cgutils.gep(builder, handle.data, at))

            ary = context.make_array(arrty)(context, builder)
            item = context.get_abi_sizeof(context.get_data_type(arrty.dtype))
            shape = [word(1)] if ndim == 1 else [word(1), word(2)]
            itemsize = context.get_constant(types.intp, item)
            strides = [itemsize] if ndim == 1 else [builder.mul(shape[1], itemsize), itemsize]
            data = builder.inttoptr(word(0), ary.data.type)
            populate_array(ary, data=data, shape=shape, strides=strides, itemsize=itemsize, meminfo=None)
            return ary._getvalue()
        return arrty(h, i), codegen
    return view


def wrapper(name: str) -> Callable[..., Any]:
    """The packed form of export `name`: (its first kernels.PACKED[name] arguments, h) -> the kernel's result."""
    n_head = kernels.PACKED[name]
    args = kernels.EXPORTS[name][3]
    env: dict[str, Any] = {"fn": kernels._jit_kernel(name), "borrowed": borrowed}
    head = [f"a{i}" for i in range(n_head)]
    # the head's arrays and strs borrowed too: no reference counts inside (every PACKED export returns arrays of
    # its own, never a view of an argument; tests/test_aot_kernels.py checks)
    passed = [f"borrowed({a})" if (t == kernels.S or isinstance(t, tuple)) else a for a, t in zip(head, args)]
    tail = []
    for k, t in enumerate(args[n_head:]):
        if isinstance(t, tuple):
            env[f"v{k}"] = view_of(t[0], t[1])
            tail.append(f"v{k}(h, {k})")
        elif t == kernels.B:
            tail.append(f"h[{3 * k}] != 0")
        else:
            tail.append(f"h[{3 * k}]")
    src = f"def packed({', '.join([*head, 'h'])}):\n    return fn({', '.join([*passed, *tail])})\n"
    exec(compile(src, f"<packed {name}>", "exec"), env)
    return env["packed"]  # type: ignore[no-any-return]
