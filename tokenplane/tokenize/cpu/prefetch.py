"""A software prefetch of one array element inside a kernel (`llvm.prefetch`: read, kept in every cache level).

Used where a kernel knows a batch of independent table addresses before it needs them, and the tables are likely
out of the caches: a session's repair window after the process has done other work between an agent's calls
(piecemap._prefetch_homes). Issued together, their misses overlap; the walk that reads them meets them one at a
time, each behind the compare of the previous piece.

This module imports numba (an `@intrinsic` is made by numba's extension API), so kernel modules name `prefetch`
through `lazyjit.numba_global`, as borrow.py's views.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I32 = ir.IntType(32)


@intrinsic
def prefetch(typingctx, arr, index):  # noqa: ANN001
    """Prefetch the cache line of arr[index] (a 1-D array; no bounds check: a prefetch never faults)."""
    if not isinstance(arr, types.Array) or arr.ndim != 1 or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        p = cgutils.get_item_pointer(context, builder, signature.args[0], ary, [args[1]], wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(p, i8p), ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.void(arr, index), codegen
