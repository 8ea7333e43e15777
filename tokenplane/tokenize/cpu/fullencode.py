"""A full encode's block in one compiled call: str -> IDs (code points, pre-tokenizer, piece map walk).

The staged block encode (parallel.CpuEncoder._encode_range before this module) made four kernel calls and three
text-sized arrays between them: code points, the class gather + pre-tokenizer loop, the whole block's UTF-8 and
piece bounds, then BPE over bpe.py's direct-mapped piece tiers. Here one call per pre-tokenizer family runs the same
code point reader and the family's pre-tokenizer (startbits.py's bit-parallel forms of the run loops, with the
starts as a bitmap), the block's UTF-8 and piece bounds (strbuf), then piecemap._walk: each piece looked up in the
thread's open-addressing piece map (a miss runs bpe.py's merge kernels). Same pieces, same BPE of each piece: the
same IDs (tests/test_fullencode.py checks fused == staged == reference on real and adversarial text).

What the common case does not cover answers a nonzero status and the caller runs the staged path: a lone surrogate
(the staged path raises), a byte the vocabulary lacks (DroppedBytes -> the reference), and a chunk cut that is not a
piece start (CUT_REJECTED: the caller re-encodes serially). o200k's block kernel also rescans the windows around its
rare shapes in numba (o200k_rescan._rescan_bits, checked against the Python matcher). `walk_encoder` is the second
half alone, for starts the caller computed (the encoder's `full_kernel` flag off: the staged pre-tokenizer).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import bpe as bpe_mod
from . import deepseekbits, kernels, o200k_rescan, o200kbits, startbits, strbuf
from . import pretokenize as pt
from .lazyjit import njit, numba_global  # numba itself only when a JIT kernel runs (lazyjit.py)
from .piecemap import CUT_REJECTED, DROPPED, OK, OVERRUN, SURROGATE, _walk, thread_map, walk_tail

FullFn = Callable[..., tuple[np.ndarray, int]]
_get_code_point = numba_global("numba.cpython.unicode", "_get_code_point")
_str_units8 = numba_global("tokenplane.tokenize.cpu.borrow", "str_units8")
_str_units16 = numba_global("tokenplane.tokenize.cpu.borrow", "str_units16")
_str_units32 = numba_global("tokenplane.tokenize.cpu.borrow", "str_units32")
_features64 = numba_global("tokenplane.tokenize.cpu.simdbits", "features64")
_surrogates64 = numba_global("tokenplane.tokenize.cpu.simdbits", "surrogates64")
_features_narrow64 = numba_global("tokenplane.tokenize.cpu.simdbits", "features_narrow64")
_trailing_zeros = numba_global("numba.cpython.unsafe.numbers", "trailing_zeros")


@njit(cache=True, nogil=True, inline="always")
def _feature_scratch(total, feat, starts):
    """The feature bytes' scratch for `total` units + startbits.PAD, and the start bitmap's (total >> 6) + 2 words (a
    view of the bool scratch `starts`), each replaced when too short."""
    words = (total >> 6) + 2
    feat = feat[:total + startbits.PAD] if feat.shape[0] >= total + startbits.PAD else np.empty(total + startbits.PAD,
                                                                                               np.uint8)
    sb = starts[:8 * words].view(np.uint64) if starts.shape[0] >= 8 * words else np.empty(words, np.uint64)
    return feat, sb


@njit(cache=True, nogil=True)
def _unit_features(c, feat, starts, table):
    """The feature bytes of code units c (8, 16 or 32 bits) followed by startbits.PAD zeros, the start bitmap's
    (len(c) >> 6) + 2 words (a view of the bool scratch `starts`), each scratch array replaced when too short, and the
    index of the first lone surrogate in c or -1 (the features right of it are then not all written). 64 units a
    step: simdbits.features64 looks up the ASCII ones, and a step that holds a wider unit is checked for surrogates
    (simdbits.surrogates64) and written again a unit at a time from the whole table. One table load a unit ran
    ~0.3 ms on 1M characters of any width, and 16- and 32-bit text took a surrogate scan of its own before it."""
    total = c.shape[0]
    feat, sb = _feature_scratch(total, feat, starts)
    full = total & ~63
    for i in range(0, full, 64):
        if _features64(c, i, table, feat) != 0:
            if _surrogates64(c, i) != 0:
                return feat, sb, i + np.int64(_trailing_zeros(_surrogates64(c, i)))
            for j in range(i, i + 64):
                feat[j] = table[c[j]]
    for j in range(full, total):
        x = c[j]
        feat[j] = table[x]
        if (np.uint32(x) - np.uint32(0xD800)) < np.uint32(0x800):
            return feat, sb, j
    for i in range(total, total + startbits.PAD):
        feat[i] = 0
    return feat, sb, -1


@njit(cache=True, nogil=True)
def _features_utf8(c, n, feat, starts, table, buf, bounds):
    """`_unit_features` of c and, in the same pass, the UTF-8 of c[:n] into `buf` as strbuf._utf8_ascii_runs writes
    it: (feat, starts bitmap, surrogate index or -1, buf, bounds (both `_sized` for n), UTF-8 size, wide positions,
    bytes added, count). Text that is mostly wide characters (strbuf._mostly_wide: CJK) gets its features alone and
    size -1: strbuf's one-pass writer places its UTF-8 and piece bounds together after the pre-tokenizer. One read of
    the text where there were two: a 1M-character block of a 4-byte str is 4 MB."""
    buf, bounds = _sized(buf, bounds, n)
    wide_pos = np.empty(64, np.int64)
    wide_add = np.empty(64, np.int64)
    if n < 64 or strbuf._mostly_wide(c, n):
        feat, sb, bad = _unit_features(c, feat, starts, table)
        return feat, sb, bad, buf, bounds, -1, wide_pos, wide_add, 0
    total = c.shape[0]
    feat, sb = _feature_scratch(total, feat, starts)
    nw = 0
    pos = 0
    full = n & ~63
    for i in range(0, full, 64):
        if _features_narrow64(c, i, table, feat, buf, pos) == 0:
            pos += 64
            continue
        m = _surrogates64(c, i)
        if m != 0:
            return feat, sb, i + np.int64(_trailing_zeros(m)), buf, bounds, -1, wide_pos, wide_add, 0
        for j in range(i, i + 64):     # (the ASCII branch written out: see strbuf._utf8_ascii_runs' tail)
            x = c[j]
            feat[j] = table[x]
            if x < 0x80:
                buf[pos] = np.uint8(x)
                pos += 1
            else:
                pos, wide_pos, wide_add, nw = strbuf._put_wide(buf, pos, x, j, wide_pos, wide_add, nw)
    for j in range(full, total):    # (the last partial 64 and the lookahead: its features only)
        x = c[j]
        feat[j] = table[x]
        if (np.uint32(x) - np.uint32(0xD800)) < np.uint32(0x800):
            return feat, sb, j, buf, bounds, -1, wide_pos, wide_add, 0
        if j < n:
            if x < 0x80:
                buf[pos] = np.uint8(x)
                pos += 1
            else:
                pos, wide_pos, wide_add, nw = strbuf._put_wide(buf, pos, x, j, wide_pos, wide_add, nw)
    for j in range(total, total + startbits.PAD):
        feat[j] = 0
    return feat, sb, -1, buf, bounds, pos, wide_pos, wide_add, nw


@njit(cache=True, nogil=True)
def _pieces_utf8(c, n, sb, buf, bounds, size, wide_pos, wide_add, nw):
    """`_finish`'s first half after `_features_utf8`, with the piece starts as a bitmap: (UTF-8, piece bounds, their
    count, status), a count of 0 for an empty block or a rejected cut. The bounds come in bytes from the bitmap and the
    wide characters noted (strbuf._bit_byte_positions), or, where the UTF-8 was left to it (size -1), from strbuf's
    one-pass writer."""
    if c.shape[0] > n and ((sb[n >> 6] >> np.uint64(n & 63)) & np.uint64(1)) == 0:    # (a stable cut)
        return buf, bounds, 0, CUT_REJECTED
    if n == 0:
        return buf, bounds, 0, OK
    if size < 0:
        nb, size = strbuf._utf8_one_pass_bits(c, n, sb, buf, bounds)
    else:
        nb = strbuf._bit_byte_positions(sb, n, bounds, wide_pos, wide_add, nw)
        bounds[nb] = size
        nb += 1
    _pad(buf, size)
    return buf, bounds, nb, OK


@njit(cache=True, nogil=True)
def _block_start_bits(s, a, b, extra, cps, feat, starts, table, buf, bounds):
    """Code points of s[a:b] + extra into `cps` (replaced by a new array when too short) and `_features_utf8` of them:
    (code points, then that call's nine results); the surrogate index is that of the code points (the features and
    UTF-8 are then not all written)."""
    n = b - a
    total = n + len(extra)
    if s._kind == 4 and n > 0 and _tail_is(s, b, extra):
        # a 4-byte str's code units are its code points: read in place, not copied (4 bytes a character written and
        # read again; one astral character in a text makes the whole str 4 bytes a character)
        c = _str_units32(s)[a:b + len(extra)]
        feat, sb, bad, buf, bounds, size, wide_pos, wide_add, nw = _features_utf8(c, n, feat, starts, table, buf,
                                                                                  bounds)
        return c, feat, sb, bad, buf, bounds, size, wide_pos, wide_add, nw
    cps = cps[:total] if cps.shape[0] >= total else np.empty(total, np.uint32)
    bad = strbuf._codepoints(s, a, b, cps) if n > 0 else -1
    if len(extra) > 0 and bad < 0:
        got = strbuf._codepoints(extra, 0, len(extra), cps[n:])
        if got >= 0:
            bad = n + got
    if bad >= 0:    # (after a surrogate the lookahead's code points were not read: nothing more, the caller declines)
        feat, sb, _, buf, bounds, size, wide_pos, wide_add, nw = _features_utf8(cps[:0], 0, feat, starts, table, buf,
                                                                                bounds)
        return cps, feat, sb, bad, buf, bounds, size, wide_pos, wide_add, nw
    feat, sb, bad, buf, bounds, size, wide_pos, wide_add, nw = _features_utf8(cps, n, feat, starts, table, buf, bounds)
    return cps, feat, sb, bad, buf, bounds, size, wide_pos, wide_add, nw


@njit(cache=True, nogil=True)
def _declined(status):
    return np.empty(0, np.int32), status


@njit(cache=True, nogil=True, inline="always")
def _sized(buf, bounds, n):
    """The scratch UTF-8 and bounds arrays, each replaced by a new one when too short for n characters (+ 16 bytes
    of padding: the walk reads a small piece's two words)."""
    if buf.shape[0] < 4 * n + 16:
        buf = np.empty(4 * n + 16, np.uint8)
    if bounds.shape[0] < n + 1:
        bounds = np.empty(n + 1, np.int64)
    return buf, bounds


@njit(cache=True, nogil=True, inline="always")
def _pad(buf, size):
    for k in range(size, size + 16):
        buf[k] = 0


@njit(cache=True, nogil=True)
def _finish(cps, n, starts, buf, bounds, has_missing, missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat,
            tok_off, wmap, btda, btrec, slots, arena, state, valid):
    """UTF-8 + piece bounds (strbuf's one pass, into the scratch `buf` and `bounds` when long enough), then the piece
    map walk."""
    if cps.shape[0] > n and not starts[n]:    # the lookahead character must start a piece (a stable cut)
        return _declined(CUT_REJECTED)
    if n == 0:
        return _declined(OK)
    buf, bounds = _sized(buf, bounds, n)
    nb, size = strbuf._utf8_and_bounds(cps, n, starts, buf, bounds)
    _pad(buf, size)
    return _walk(buf, bounds, nb, has_missing, missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat, tok_off,
                 wmap, btda, btrec, slots, arena, state, valid)


@njit(cache=True, nogil=True, inline="always")
def _walked(buf, bounds, nb, status, has_missing, missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat,
            tok_off, wmap, btda, btrec, slots, arena, state, valid):
    """The piece map walk of `_pieces_utf8`'s pieces (one call site per family kernel: the walk is compiled once, not
    once per code unit width)."""
    if nb == 0:
        return _declined(status)
    return _walk(buf, bounds, nb, has_missing, missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat, tok_off,
                 wmap, btda, btrec, slots, arena, state, valid)


@njit(cache=True, nogil=True)
def _in_place(s, a, b, extra):
    """s's PEP 393 kind (1 or 2) when the block s[a:b] + extra is s[a:b + len(extra)] itself (the lookahead of a cut
    is the same str's next character; the text's end has none) and not empty: its code points are then read from s's
    own buffer, 8 or 16 bits a character, instead of copied out as 32-bit ones (on 1M characters that copy is 4 MB
    written and read twice, which also pushes the piece map out of the cache). 0 otherwise (the copying path)."""
    kind = s._kind
    if kind == 4 or b <= a or not _tail_is(s, b, extra):
        return 0
    return kind


@njit(cache=True, nogil=True)
def _tail_is(s, b, extra):
    """Whether s continues at b with the characters of extra (a cut's lookahead read from the same str)."""
    if b + len(extra) > len(s):
        return False
    for j in range(len(extra)):
        if _get_code_point(s, b + j) != _get_code_point(extra, j):
            return False
    return True


# Arguments: the text, the block [a, b), its lookahead | scratch: code points, classes, starts, UTF-8, piece bounds |
# the family's tables | missing bytes, the BPE tables, the thread's piece map. Each family's pre-tokenizer runs on the
# str's own code units where `_in_place` allows (`_X_front`, specialized for 8 and 16 bits), else on a 32-bit copy;
# either way the pieces then go through one walk. The four kernels repeat that dispatch: one generic kernel taking
# the family's starts as a function argument computes the same, but numba cannot cache a kernel that takes another
# kernel as an argument (a "dynamic global"), which the JIT fallback's cache and the AOT build rely on.
def _gpt4_front(c, n, feat, starts, buf, bounds, feat_table, digits, whole_at_end):
    feat, sb, bad, buf, bounds, size, wide_pos, wide_add, nw = _features_utf8(c, n, feat, starts, feat_table, buf,
                                                                              bounds)
    if bad >= 0:
        return buf, bounds, 0, SURROGATE
    startbits._gpt4_bits(c, feat, digits, whole_at_end, sb)
    return _pieces_utf8(c, n, sb, buf, bounds, size, wide_pos, wide_add, nw)


def _full_gpt4_impl(s, a, b, extra, cps, feat, starts, buf, bounds, feat_table, digits, whole_at_end, has_missing,
                    missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots,
                    arena, state, valid):
    # the bit-parallel pre-tokenizer (startbits.py: the same starts as pretokenize._gpt4_loop)
    kind = _in_place(s, a, b, extra)
    if kind == 1:
        buf, bounds, nb, status = _gpt4_front(_str_units8(s)[a:b + len(extra)], b - a, feat, starts, buf, bounds,
                                              feat_table, digits, whole_at_end)
    elif kind == 2:
        c = _str_units16(s)[a:b + len(extra)]
        buf, bounds, nb, status = _gpt4_front(c, b - a, feat, starts, buf, bounds, feat_table, digits, whole_at_end)
    else:
        cps, feat, sb, bad, buf, bounds, size, wide_pos, wide_add, nw = _block_start_bits(
            s, a, b, extra, cps, feat, starts, feat_table, buf, bounds)
        if bad >= 0:
            return _declined(SURROGATE)
        startbits._gpt4_bits(cps.view(np.int32), feat, digits, whole_at_end, sb)
        buf, bounds, nb, status = _pieces_utf8(cps, b - a, sb, buf, bounds, size, wide_pos, wide_add, nw)
    return _walked(buf, bounds, nb, status, has_missing, missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat,
                   tok_off, wmap, btda, btrec, slots, arena, state, valid)


def _deepseek_front(c, n, feat, starts, buf, bounds, feat_table):
    feat, sb, bad, buf, bounds, size, wide_pos, wide_add, nw = _features_utf8(c, n, feat, starts, feat_table, buf,
                                                                              bounds)
    if bad >= 0:
        return buf, bounds, 0, SURROGATE
    deepseekbits._deepseek_bits(c, feat, sb)
    return _pieces_utf8(c, n, sb, buf, bounds, size, wide_pos, wide_add, nw)


def _full_deepseek_impl(s, a, b, extra, cps, feat, starts, buf, bounds, feat_table, has_missing, missing, byte_ids,
                        ptab, batch, whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena, state,
                        valid):
    # the bit-parallel pre-tokenizer (deepseekbits.py: the same starts as pretokenize._deepseek_loop)
    kind = _in_place(s, a, b, extra)
    if kind == 1:
        buf, bounds, nb, status = _deepseek_front(_str_units8(s)[a:b + len(extra)], b - a, feat, starts, buf, bounds,
                                                  feat_table)
    elif kind == 2:
        c = _str_units16(s)[a:b + len(extra)]
        buf, bounds, nb, status = _deepseek_front(c, b - a, feat, starts, buf, bounds, feat_table)
    else:
        cps, feat, sb, bad, buf, bounds, size, wide_pos, wide_add, nw = _block_start_bits(
            s, a, b, extra, cps, feat, starts, feat_table, buf, bounds)
        if bad >= 0:
            return _declined(SURROGATE)
        deepseekbits._deepseek_bits(cps.view(np.int32), feat, sb)
        buf, bounds, nb, status = _pieces_utf8(cps, b - a, sb, buf, bounds, size, wide_pos, wide_add, nw)
    return _walked(buf, bounds, nb, status, has_missing, missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat,
                   tok_off, wmap, btda, btrec, slots, arena, state, valid)


def _smollm2_front(c, n, feat, starts, buf, bounds, feat_table):
    feat, sb, bad, buf, bounds, size, wide_pos, wide_add, nw = _features_utf8(c, n, feat, starts, feat_table, buf,
                                                                              bounds)
    if bad >= 0:
        return buf, bounds, 0, SURROGATE
    startbits._smollm2_bits(c, feat, sb)
    return _pieces_utf8(c, n, sb, buf, bounds, size, wide_pos, wide_add, nw)


def _full_smollm2_impl(s, a, b, extra, cps, feat, starts, buf, bounds, feat_table, has_missing, missing, byte_ids,
                       ptab, batch, whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena, state,
                       valid):
    # the bit-parallel pre-tokenizer (startbits.py: the same starts as pretokenize._smollm2_loop)
    kind = _in_place(s, a, b, extra)
    if kind == 1:
        buf, bounds, nb, status = _smollm2_front(_str_units8(s)[a:b + len(extra)], b - a, feat, starts, buf, bounds,
                                                 feat_table)
    elif kind == 2:
        c = _str_units16(s)[a:b + len(extra)]
        buf, bounds, nb, status = _smollm2_front(c, b - a, feat, starts, buf, bounds, feat_table)
    else:
        cps, feat, sb, bad, buf, bounds, size, wide_pos, wide_add, nw = _block_start_bits(
            s, a, b, extra, cps, feat, starts, feat_table, buf, bounds)
        if bad >= 0:
            return _declined(SURROGATE)
        startbits._smollm2_bits(cps.view(np.int32), feat, sb)
        buf, bounds, nb, status = _pieces_utf8(cps, b - a, sb, buf, bounds, size, wide_pos, wide_add, nw)
    return _walked(buf, bounds, nb, status, has_missing, missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat,
                   tok_off, wmap, btda, btrec, slots, arena, state, valid)


def _o200k_front(c, n, feat, starts, buf, bounds, feat_table, cls_table):
    feat, sb, bad, buf, bounds, size, wide_pos, wide_add, nw = _features_utf8(c, n, feat, starts, feat_table, buf,
                                                                              bounds)
    if bad >= 0:
        return buf, bounds, 0, SURROGATE
    rare = np.empty(c.shape[0] + 64, np.int64)
    nr = o200kbits._o200k_bits(c, feat, sb, rare)
    if nr > 0 and o200k_rescan._rescan_bits(c, cls_table, np.sort(rare[:nr]), sb) < 0:
        return buf, bounds, 0, OVERRUN
    return _pieces_utf8(c, n, sb, buf, bounds, size, wide_pos, wide_add, nw)


def _full_o200k_impl(s, a, b, extra, cps, feat, starts, buf, bounds, feat_table, cls_table, has_missing, missing,
                     byte_ids, ptab, batch, whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena,
                     state, valid):
    # the bit-parallel pre-tokenizer (o200kbits.py: the same starts and rare positions as pretokenize._o200k_loop),
    # then the rescan of the windows around the rare positions (o200k_rescan._rescan_bits; cls_table: the class
    # table its matcher reads)
    kind = _in_place(s, a, b, extra)
    if kind == 1:
        buf, bounds, nb, status = _o200k_front(_str_units8(s)[a:b + len(extra)], b - a, feat, starts, buf, bounds,
                                               feat_table, cls_table)
    elif kind == 2:
        c = _str_units16(s)[a:b + len(extra)]
        buf, bounds, nb, status = _o200k_front(c, b - a, feat, starts, buf, bounds, feat_table, cls_table)
    else:
        cps, feat, sb, bad, buf, bounds, size, wide_pos, wide_add, nw = _block_start_bits(
            s, a, b, extra, cps, feat, starts, feat_table, buf, bounds)
        if bad >= 0:
            return _declined(SURROGATE)
        rare = np.empty(cps.shape[0] + 64, np.int64)
        nr = o200kbits._o200k_bits(cps.view(np.int32), feat, sb, rare)
        if nr > 0 and o200k_rescan._rescan_bits(cps, cls_table, np.sort(rare[:nr]), sb) < 0:
            return _declined(OVERRUN)
        buf, bounds, nb, status = _pieces_utf8(cps, b - a, sb, buf, bounds, size, wide_pos, wide_add, nw)
    return _walked(buf, bounds, nb, status, has_missing, missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat,
                   tok_off, wmap, btda, btrec, slots, arena, state, valid)


_gpt4_front = njit(cache=True, nogil=True)(_gpt4_front)
_deepseek_front = njit(cache=True, nogil=True)(_deepseek_front)
_smollm2_front = njit(cache=True, nogil=True)(_smollm2_front)
_o200k_front = njit(cache=True, nogil=True)(_o200k_front)
_full_gpt4 = njit(cache=True, nogil=True)(_full_gpt4_impl)
_full_deepseek = njit(cache=True, nogil=True)(_full_deepseek_impl)
_full_smollm2 = njit(cache=True, nogil=True)(_full_smollm2_impl)
_full_o200k = njit(cache=True, nogil=True)(_full_o200k_impl)


def block_tables(family: str) -> tuple[str, tuple[Any, ...]]:
    """pretokenize.loop_tables for the fused block kernels: each loop's kind table replaced by the feature table of
    its bitmap form (startbits.bitmap_form; every fused kernel runs that form)."""
    loop, fam_args = pt.loop_tables(family)
    return loop, (startbits.bitmap_form(family)[0], *fam_args[1:])     # (o200k: its class table follows)


def binding(bpe: bpe_mod.BPE, fn: Any) -> tuple[Any, bool, bool, Any]:
    """A kept binding: the kernel set and `bpe`'s schedule flags it was made under, then the bound kernel."""
    return kernels.get(), bpe.batch, bpe.whole, fn


def still_bound(entry: tuple[Any, bool, bool, Any] | None, bpe: bpe_mod.BPE) -> bool:
    """Whether a kept `binding` is still the one to call (same kernel set, same schedule flags: tests switch them)."""
    return entry is not None and entry[0] is kernels.get() and entry[1] == bpe.batch and entry[2] == bpe.whole


def bound_kernel(bpe: bpe_mod.BPE, key: str | None, n_head: int,
                 export: Callable[[], tuple[str, tuple[Any, ...]]]) -> Any:
    """The export `export()` names (made only when the binding is, with the family arguments it returns) with
    everything after its first `n_head` arguments bound: those family arguments, then the missing bytes, `bpe`'s
    tables and the calling thread's piece map. The binding is kept on that map under `key` (None: not kept, the
    caller keeps it), and made again when the kernel set or the encoder's schedule flags change (tests switch them)."""
    pm = thread_map(bpe)
    entry = pm.bound.get(key) if key is not None else None
    if still_bound(entry, bpe):
        return entry[3]
    name, family_args = export()
    fn = kernels.get().bind(name, n_head, *family_args, *walk_tail(bpe))
    if key is not None:
        pm.bound[key] = binding(bpe, fn)
    return fn


def full_encoder(bpe: bpe_mod.BPE, family: str) -> FullFn:
    """The fused block kernel of `family` with `bpe`'s tables and the calling thread's piece map bound
    (`bound_kernel`): fn(text, a, b, extra, cps, kind, starts, buf, bounds) -> (IDs int32 of text[a:b], status);
    `extra`: characters right of the block (a cut's lookahead, "" at the text's end) that the pre-tokenizer reads and
    that must start a piece; then scratch arrays (uint32, the family table's dtype, bool, uint8, int64;
    `scratch_args` makes them), each replaced inside by a new one when too short. The map lives on the thread's
    bpe.PieceCache (bpe.clear_caches empties it too)."""
    def export() -> tuple[str, tuple[Any, ...]]:
        loop, fam_args = block_tables(family)
        return f"full_{loop}", fam_args
    return bound_kernel(bpe, family, 9, export)


def scratch_bound_encoder(bpe: bpe_mod.BPE, family: str, scratch: tuple[np.ndarray, ...]) -> Any:
    """`full_encoder` with the calling thread's scratch arrays bound too (cps, kind, starts, buf, bounds, as
    `scratch_args` makes them): fn(text, a, b, extra) -> (IDs, status). The caller keeps the binding and makes a new
    one when it replaces an array (the kernel still replaces a too-short one inside, for that call). Every argument
    an array is then bound: the packed export (packed.py) unboxes none per call."""
    def export() -> tuple[str, tuple[Any, ...]]:
        loop, fam_args = block_tables(family)
        return f"full_{loop}", (*scratch, *fam_args)
    return bound_kernel(bpe, None, 4, export)


def walk_encoder(bpe: bpe_mod.BPE) -> FullFn:
    """The second half of the block kernel alone, with the same bindings as `full_encoder`: fn(cps, n, starts, buf,
    bounds) -> (IDs int32, status) for code points whose piece starts the caller computed (o200k's rare shapes:
    pretokenize.piece_starts runs its rescan), then UTF-8 + bounds and the walk through the thread's piece map."""
    return bound_kernel(bpe, "walk", 5, lambda: ("full_walk", ()))


def scratch_args(family: str, chars: int = 0) -> tuple[np.ndarray, ...]:
    """Scratch arrays for `full_encoder`'s kernel that hold a block of `chars` characters plus a lookahead
    (none given: empty ones, which the kernel replaces by arrays of the block's size)."""
    n = chars + 2 if chars else 0
    dtype = block_tables(family)[1][0].dtype
    return (np.empty(n, np.uint32), np.empty(n + startbits.PAD if n else 0, dtype), np.empty(n, np.bool_),
            np.empty(4 * n + 16, np.uint8), np.empty(n + 1, np.int64))


__all__ = ["CUT_REJECTED", "DROPPED", "OK", "OVERRUN", "SURROGATE", "bound_kernel", "full_encoder", "scratch_args",
           "scratch_bound_encoder", "walk_encoder"]
