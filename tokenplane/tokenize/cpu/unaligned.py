"""One unaligned little-endian 64-bit load from a byte array, for kernels that read a piece's bytes as a word.

This module imports numba (an `@intrinsic`), so kernel modules name `load_u64` through `lazyjit.numba_global`.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def load_u64(typingctx, arr, index):  # noqa: ANN001
    """uint64 of arr[index:index + 8] (arr: a C-contiguous uint8 array with 8 bytes readable from index; no bounds
    check): one unaligned load (x86-64 and AArch64 load unaligned words at the aligned cost unless a line is crossed),
    where reading the two aligned words around the bytes and shifting them together is two loads, a shift amount
    that depends on the index, and two shifts more."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        return builder.load(builder.bitcast(ptr, ir.IntType(64).as_pointer()), align=1)
    return types.uint64(arr, index), codegen
