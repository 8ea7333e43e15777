"""64 characters at a time as vector steps: the compare-and-movemask step of the bit-parallel pre-tokenizer
(startbits.py), and the 64-unit steps of the feature bytes, UTF-8 and scans over a str's own code units.

This module imports numba (an `@intrinsic` is made by numba's extension API), so kernel modules do not import it:
they name `bits64` through `lazyjit.numba_global`, which resolves it when the kernels materialize.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_BYTES = ir.VectorType(ir.IntType(8), 64)


@intrinsic
def bits64(typingctx, arr, index, flag):  # noqa: ANN001
    """uint64 whose bit i is (arr[index + i] & flag) != 0 for i < 64 (arr: a C-contiguous uint8 array with 64 bytes
    readable from index; no bounds check). One 64-byte load, an AND and a compare with zero lane-wise, and the 64
    lane results as one integer: LLVM lowers it to vpand / vpcmpeqb / vpmovmskb on AVX2 (two of each), one
    vptestmb on AVX-512BW."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        v = builder.load(builder.bitcast(ptr, _BYTES.as_pointer()), align=1)
        f = builder.trunc(args[2], ir.IntType(8))
        fv = builder.insert_element(ir.Constant(_BYTES, ir.Undefined), f, ir.Constant(ir.IntType(32), 0))
        fv = builder.shuffle_vector(fv, fv, ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64))
        hit = builder.icmp_unsigned("!=", builder.and_(v, fv), ir.Constant(_BYTES, [0] * 64))
        return builder.bitcast(hit, ir.IntType(64))
    return types.uint64(arr, index, flag), codegen


def _units64(context, builder, aryty, ary, index, width):  # noqa: ANN001, ANN202
    """The 64 code units of the array value `ary` from `index` as one <64 x iW> vector (no bounds check)."""
    arr = context.make_array(aryty)(context, builder, ary)
    ptr = cgutils.get_item_pointer(context, builder, aryty, arr, [index], wraparound=False)
    return builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(width), 64).as_pointer()), align=1)


def _store64(context, builder, aryty, ary, index, vec):  # noqa: ANN001, ANN202
    """The 64 bytes `vec` stored at ary[index] (a uint8 array value; no bounds check)."""
    arr = context.make_array(aryty)(context, builder, ary)
    ptr = cgutils.get_item_pointer(context, builder, aryty, arr, [index], wraparound=False)
    builder.store(vec, builder.bitcast(ptr, _BYTES.as_pointer()), align=1)


def _mask(builder, hit):  # noqa: ANN001, ANN202
    return builder.bitcast(hit, ir.IntType(64))


def _at_least(builder, v, width, value):  # noqa: ANN001, ANN202
    return builder.icmp_unsigned(">=", v, ir.Constant(ir.VectorType(ir.IntType(width), 64), [value] * 64))


@intrinsic
def narrow64(typingctx, src, index, dst, pos):  # noqa: ANN001
    """src[index:index + 64] (8-, 16- or 32-bit code units) written as bytes (each unit's low 8 bits) to
    dst[pos:pos + 64] (uint8), and a uint64 whose bit i is src[index + i] >= 0x80 (both arrays C-contiguous with those
    64 elements in them; no bounds check). One vector load, a lane-wise narrowing store and one compare: the ASCII
    runs of a str's own code units become their UTF-8 64 characters at a time (strbuf._utf8_ascii_runs)."""
    width = src.dtype.bitwidth

    def codegen(context, builder, signature, args):  # noqa: ANN001
        v = _units64(context, builder, signature.args[0], args[0], args[1], width)
        _store64(context, builder, signature.args[2], args[2], args[3], v if width == 8 else builder.trunc(v, _BYTES))
        return _mask(builder, _at_least(builder, v, width, 0x80))
    return types.uint64(src, index, dst, pos), codegen


def _host_has(feature: str) -> bool:
    from llvmlite import binding
    try:
        return bool(binding.get_host_cpu_features().get(feature, False))
    except Exception:  # noqa: BLE001 - a host whose features LLVM cannot read: the portable form
        return False


# vpermi2b: a 128-entry byte table looked up for 64 bytes in one instruction (AVX-512 VBMI: Ice Lake, Zen 4 and
# later). The kernels are compiled for the host CPU (numba's JIT; aotbuild.py's target_cpu), so the host decides.
VBMI = _host_has("avx512vbmi")


def _lookup128(builder, idx, table_data):  # noqa: ANN001, ANN202
    """table[idx[i]] for the 64 lanes of idx (< 128): one vpermi2b with VBMI, else 64 scalar loads."""
    tptr = builder.bitcast(table_data, _BYTES.as_pointer())
    if VBMI:
        lo = builder.load(tptr, align=1)
        hi = builder.load(builder.gep(tptr, [ir.Constant(ir.IntType(64), 1)]), align=1)
        fnty = ir.FunctionType(_BYTES, [_BYTES, _BYTES, _BYTES])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.vpermi2var.qi.512")
        return builder.call(fn, [lo, idx, hi])
    base = builder.bitcast(table_data, ir.IntType(8).as_pointer())
    out = ir.Constant(_BYTES, ir.Undefined)
    for lane in range(64):
        k = builder.extract_element(idx, ir.Constant(ir.IntType(32), lane))
        x = builder.load(builder.gep(base, [builder.zext(k, ir.IntType(64))]))
        out = builder.insert_element(out, x, ir.Constant(ir.IntType(32), lane))
    return out


def _features_codegen(width: int, narrow: bool):  # noqa: ANN202
    def codegen(context, builder, signature, args):  # noqa: ANN001
        v = _units64(context, builder, signature.args[0], args[0], args[1], width)
        low = v if width == 8 else builder.trunc(v, _BYTES)
        table = context.make_array(signature.args[2])(context, builder, args[2])
        out = _lookup128(builder, builder.and_(low, ir.Constant(_BYTES, [0x7F] * 64)), table.data)
        _store64(context, builder, signature.args[3], args[3], args[1], out)
        if narrow:
            _store64(context, builder, signature.args[4], args[4], args[5], low)
        return _mask(builder, _at_least(builder, v, width, 0x80))
    return codegen


@intrinsic
def features64(typingctx, src, index, table, dst):  # noqa: ANN001
    """dst[index + i] = table[src[index + i] & 0x7F] for i < 64 (src: 8-, 16- or 32-bit code units; table: uint8 with
    at least 128 entries; dst: uint8; no bounds check), and a uint64 whose bit i is src[index + i] >= 0x80: the
    caller writes those lanes again from the whole table. With VBMI one vpermi2b does the 64 lookups; otherwise
    LLVM gets 64 scalar loads."""
    return types.uint64(src, index, table, dst), _features_codegen(src.dtype.bitwidth, False)


@intrinsic
def features_narrow64(typingctx, src, index, table, dst, buf, pos):  # noqa: ANN001
    """`features64`, and the same 64 units narrowed to bytes at buf[pos:pos + 64] as `narrow64` writes them (one load
    of the units for both)."""
    return types.uint64(src, index, table, dst, buf, pos), _features_codegen(src.dtype.bitwidth, True)


@intrinsic
def surrogates64(typingctx, src, index):  # noqa: ANN001
    """uint64 whose bit i is 0xD800 <= src[index + i] < 0xE000 (code units; 64 readable from index; 8-bit units
    hold none: 0)."""
    width = src.dtype.bitwidth

    def codegen(context, builder, signature, args):  # noqa: ANN001
        if width == 8:
            return ir.Constant(ir.IntType(64), 0)
        vty = ir.VectorType(ir.IntType(width), 64)
        v = _units64(context, builder, signature.args[0], args[0], args[1], width)
        off = builder.sub(v, ir.Constant(vty, [0xD800] * 64))
        return _mask(builder, builder.icmp_unsigned("<", off, ir.Constant(vty, [0x800] * 64)))
    return types.uint64(src, index), codegen


@intrinsic
def wide64(typingctx, src, index):  # noqa: ANN001
    """uint64 whose bit i is src[index + i] >= 0x80 (code units of any width; 64 readable from index)."""
    width = src.dtype.bitwidth

    def codegen(context, builder, signature, args):  # noqa: ANN001
        v = _units64(context, builder, signature.args[0], args[0], args[1], width)
        return _mask(builder, _at_least(builder, v, width, 0x80))
    return types.uint64(src, index), codegen


@intrinsic
def positions8(typingctx, out, k, table, byte, at):  # noqa: ANN001
    """out[k:k + 8] = at + table[8 * byte:8 * byte + 8] (out: int64 with 8 entries from k; table: int8, the positions
    of the set bits of each byte value, BYTE_POSITIONS): the set bits of one byte of a bitmap as offsets, in one load,
    one widening add and one 8-lane store, without a branch a bit (the caller advances k by the byte's bit count)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        i64x8 = ir.VectorType(ir.IntType(64), 8)
        oty, tty = signature.args[0], signature.args[2]
        oarr = context.make_array(oty)(context, builder, args[0])
        tarr = context.make_array(tty)(context, builder, args[2])
        optr = cgutils.get_item_pointer(context, builder, oty, oarr, [args[1]], wraparound=False)
        row = builder.mul(args[3], ir.Constant(ir.IntType(64), 8))
        tptr = cgutils.get_item_pointer(context, builder, tty, tarr, [row], wraparound=False)
        pos = builder.sext(builder.load(builder.bitcast(tptr, ir.VectorType(ir.IntType(8), 8).as_pointer()), align=1),
                           i64x8)
        at = builder.insert_element(ir.Constant(i64x8, ir.Undefined), args[4], ir.Constant(ir.IntType(32), 0))
        at = builder.shuffle_vector(at, at, ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8))
        builder.store(builder.add(pos, at), builder.bitcast(optr, i64x8.as_pointer()), align=1)
        return context.get_dummy_value()
    return types.void(out, k, table, byte, at), codegen
