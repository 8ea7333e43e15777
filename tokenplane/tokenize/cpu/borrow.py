"""A borrowed view of an array or a str inside a kernel: the same data, shape and strides, no reference count.

numba counts references to every array variable. A kernel that passes its arrays to another kernel (or to an
inlined helper) once per element (the pre-tokenizer's scalar fix-ups, the BPE merge of each new piece) pays an
atomic increment and decrement per array per call where its reference-count pruning pass cannot pair them up
(branchy bodies): on 1M characters of English text, 300K atomics per encode (gdb on NRT_incref / NRT_decref), ~11%
of a one-core encode's samples. A borrowed view has no owner (its meminfo is null, which NRT_incref and NRT_decref
skip after one test), so those calls cost nothing. It must not outlive the array it views: kernels borrow their own
arguments, which live for the whole call, and never return or store the view.

This module imports numba (an `@intrinsic` is made by numba's extension API), so kernel modules do not import it:
they name `borrowed` through `lazyjit.numba_global`, which resolves it when the kernels materialize.
"""

from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


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
