"""A borrowed view of an array or a str inside a kernel: the same data, shape and strides, no reference count.

numba counts references to every array variable. A kernel that passes its arrays to another kernel (or to an
inlined helper) once per element (the pre-tokenizer's scalar fix-ups, the BPE merge of each new piece) pays an
atomic increment and decrement per array per call where its reference-count pruning pass cannot pair them up
(branchy bodies): on 1M characters of English text, 300K atomics per encode (gdb on NRT_incref / NRT_decref), ~11%
of a one-core encode's samples. A borrowed view has no owner (its meminfo is null, which NRT_incref and NRT_decref
skip after one test), so those calls cost nothing. It must not outlive the array it views: kernels borrow their own
arguments, which live for the whole call, and never return or store the view.

`str_units8` / `str_units16` view a str's own PEP 393 buffer (one or two bytes a code point) as an array the same
way: the kernels read a text's code points in place instead of copying them out (fullencode.py).

This module imports numba (an `@intrinsic` is made by numba's extension API), so kernel modules do not import it:
they name `borrowed` through `lazyjit.numba_global`, which resolves it when the kernels materialize.
"""

from __future__ import annotations

from typing import Any

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array


@intrinsic
def borrowed(typingctx, arr):  # noqa: ANN001
    """arr (an array, or a str) as a view without an owner (see the module docstring: never return or keep it)."""
    if isinstance(arr, types.Array):
        def codegen(context, builder, signature, args):  # noqa: ANN001
            view = context.make_array(signature.args[0])(context, builder, value=args[0])
            view.meminfo = cgutils.get_null_value(view.meminfo.type)
            view.parent = cgutils.get_null_value(view.parent.type)
            return view._getvalue()
        return arr(arr), codegen
    if arr == types.unicode_type:
        # a str's meminfo holds the Python object it was unboxed from: the same atomics per call it is passed in
        def codegen_str(context, builder, signature, args):  # noqa: ANN001
            view = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=args[0])
            view.meminfo = cgutils.get_null_value(view.meminfo.type)
            return view._getvalue()
        return arr(arr), codegen_str
    return None


def _units(dtype: Any) -> Any:
    arrty = types.Array(dtype, 1, "C")

    def typer(typingctx, s):  # noqa: ANN001
        if s != types.unicode_type:
            return None

        def codegen(context, builder, signature, args):  # noqa: ANN001
            text = cgutils.create_struct_proxy(types.unicode_type)(context, builder, value=args[0])
            ary = context.make_array(arrty)(context, builder)
            itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(dtype)))
            populate_array(ary, data=builder.bitcast(text.data, ary.data.type), shape=[text.length],
                           strides=[itemsize], itemsize=itemsize, meminfo=None)
            return ary._getvalue()
        return arrty(s), codegen
    return intrinsic(typer)


# s's code units as an array without an owner (valid while s lives; never return or keep it): only for a str of the
# matching PEP 393 kind (s._kind == 1, 2 or 4), which the caller checks
str_units8 = _units(types.uint8)
str_units16 = _units(types.uint16)
str_units32 = _units(types.uint32)
