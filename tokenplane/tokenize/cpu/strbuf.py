"""A Python str's code points and UTF-8 bytes produced without holding the GIL.

Chunk threads of the parallel encoder (parallel.py) each need their chunk as code points (for the pre-tokenizer)
and as UTF-8 bytes (for BPE). Made the obvious way, `text[a:b]`, `s.encode("utf-32-le")` and `s.encode("utf-8")` all
hold the GIL: on 4M characters they cost ~10-16 ms in total, and two threads queue for them while the rest of the
chain runs GIL-free. Here numba reads the string's own PEP 393 buffer (a str argument is unboxed without a copy:
pointer, kind, length) and writes the arrays inside nogil kernels, so a chunk thread never slices or encodes a str.

The UTF-8 writer is fused with the piece-bound pass (both walk the code points once and need each one's width).
The public encode rejects lone surrogates first (errors.validate_text); the code point reader checks again, in
the same pass, so a direct caller gets the same clear error instead of CESU-8 bytes.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidTextError
from . import kernels
from .lazyjit import njit, numba_global  # numba itself only when a JIT kernel runs (lazyjit.py)

_get_code_point = numba_global("numba.cpython.unicode", "_get_code_point")
_deref_uint8 = numba_global("numba.cpython.unicode", "deref_uint8")
_deref_uint16 = numba_global("numba.cpython.unicode", "deref_uint16")
_deref_uint32 = numba_global("numba.cpython.unicode", "deref_uint32")
_trailing_zeros = numba_global("numba.cpython.unsafe.numbers", "trailing_zeros")
_borrowed = numba_global("tokenplane.tokenize.cpu.borrow", "borrowed")
_narrow64 = numba_global("tokenplane.tokenize.cpu.simdbits", "narrow64")
_positions8 = numba_global("tokenplane.tokenize.cpu.simdbits", "positions8")
_wide64 = numba_global("tokenplane.tokenize.cpu.simdbits", "wide64")
_str_units8 = numba_global("tokenplane.tokenize.cpu.borrow", "str_units8")
_str_units16 = numba_global("tokenplane.tokenize.cpu.borrow", "str_units16")
_str_units32 = numba_global("tokenplane.tokenize.cpu.borrow", "str_units32")

# the positions of the set bits of each byte value (8 a row, padded with 0) and their counts: _bit_byte_positions'
# tables (numba compiles them in as constants)
BYTE_POSITIONS = np.zeros(256 * 8, np.int8)
BYTE_COUNTS = np.zeros(256, np.int64)
for _b in range(256):
    _set = [_i for _i in range(8) if (_b >> _i) & 1]
    BYTE_POSITIONS[8 * _b:8 * _b + len(_set)] = _set
    BYTE_COUNTS[_b] = len(_set)
del _b, _set


def _codepoints_impl(s, a, b, out):
    # One loop per PEP 393 kind: `_get_code_point` switches on the kind per character (~2.5 ns a character on
    # 1M characters here; these loops vectorize: ~0.1 ns for 1-byte strs). A 1-byte str holds no surrogate; the
    # wider kinds OR a branch-free surrogate flag and look for the first one only when it is set.
    kind = s._kind
    if kind == 1:
        for i in range(a, b):
            out[i - a] = _deref_uint8(s._data, i)
        return -1
    bad = False
    if kind == 2:
        for i in range(a, b):
            c = np.uint32(_deref_uint16(s._data, i))
            out[i - a] = c
            bad |= (c - np.uint32(0xD800)) < np.uint32(0x800)
    else:
        for i in range(a, b):
            c = np.uint32(_deref_uint32(s._data, i))
            out[i - a] = c
            bad |= (c - np.uint32(0xD800)) < np.uint32(0x800)
    if bad:
        for i in range(a, b):
            if 0xD800 <= out[i - a] < 0xE000:
                return i
    return -1


def _ascii_blocks(cps, i, last, buf, pos):
    """cps[i:] narrowed into buf[pos:] 64 characters at a time while i <= last and they are ASCII: (i, pos, the wide
    mask of cps[i:i + 64]) at the first 64 that holds a wide character (written as bytes, pos not moved past them),
    or (i, pos, 0) past `last`. Its own function: the loop stays a load, a narrowing store and a test."""
    while i <= last:
        m = _narrow64(cps, i, buf, pos)
        if m != np.uint64(0):
            return i, pos, m
        i += 64
        pos += 64
    return i, pos, np.uint64(0)


def _utf8_and_bounds_impl(cps, n, starts, buf, bounds):
    if _mostly_wide(cps, n):
        return _utf8_one_pass(cps, n, starts, buf, bounds)
    return _utf8_by_runs(cps, n, starts, buf, bounds)


def _mostly_wide(cps, n):
    """More than one character in 16 at or above U+0080, judged on a sample of up to 2K characters."""
    wide = 0
    if n < 2048:
        # every character, in a loop of unit stride that vectorizes: the strided form below ran ~1.7 ns a
        # character, 15% of a batch of 160-character texts (fullbatch.py)
        for i in range(n):
            wide += np.int64(cps[i] >= 0x80)
        return wide * 16 > n
    step = n >> 11
    for i in range(0, n, step):
        wide += cps[i] >= 0x80
    return wide * 16 > (n + step - 1) // step


def _utf8_by_runs(cps, n, starts, buf, bounds):
    # UTF-8 of cps[:n] into buf and the byte offset of every piece start (plus the end) into bounds. Mostly-ASCII
    # text (english, code) goes in three passes that each run without a data-dependent branch a character:
    # (1) UTF-8 by runs of ASCII characters, each a narrowing copy, noting where each wider character lies and how
    # many bytes it and those before it add; (2) the character offset of every piece start, one branch-free store a
    # character; (3) those offsets moved to bytes by the bytes the wider characters before them add. The one-pass
    # form below did both at ~1.5 ns a character (1M characters of english or code: 1.45-1.55 ms, three passes
    # 0.8-0.95 ms, alternated in one process).
    # Text with more than one wide character in 16 (CJK; decided on a sample) goes through the one-pass form.
    pos, wide_pos, wide_add, nw = _utf8_ascii_runs(cps, n, buf)
    s8 = starts[:n].view(np.uint8)
    k = 0
    for i in range(n):
        bounds[k] = i
        k += np.int64(s8[i])
    _chars_to_bytes(bounds, k, wide_pos, wide_add, nw)
    bounds[k] = pos
    return k + 1, pos


def _utf8_ascii_runs(cps, n, buf):
    """Pass (1) of _utf8_by_runs: (bytes written, positions of the wide characters, bytes added up to each, count).
    64 characters at a time, each 64 narrowed and tested by one vector step (simdbits.narrow64) and written again a
    character at a time where they hold a wide one. (Finding the end of each ASCII run first, four
    words a step, then copying it read 16- and 32-bit text twice: 1M characters of python source with one wide
    character took 0.17 / 0.60 ms as 16- / 32-bit units against 0.09 as 8-bit.)"""
    cps, buf = _borrowed(cps), _borrowed(buf)     # borrow.py: no refcounts per call
    wide_pos = np.empty(64, np.int64)
    wide_add = np.empty(64, np.int64)       # bytes added by the wide characters up to and including this one
    nw = 0
    pos = 0
    i = 0
    while True:
        i, pos, m = _ascii_blocks(cps, i, n - 128, buf, pos)
        if m == np.uint64(0):
            break
        # wide characters in cps[i:i + 64]: the ASCII run before the first is written; each later run is narrowed
        # again at its place (64 at a time, the excess overwritten next), each wide character written as UTF-8
        j = i
        while m != np.uint64(0):
            w = i + np.int64(_trailing_zeros(m))
            m &= m - np.uint64(1)
            if j != i:
                _narrow64(cps, j, buf, pos)
            pos += w - j
            pos, wide_pos, wide_add, nw = _put_wide(buf, pos, cps[w], w, wide_pos, wide_add, nw)
            j = w + 1
        if j < i + 64:
            _narrow64(cps, j, buf, pos)
            pos += i + 64 - j
        i += 64
    # the text's last 64 to 127 characters, or all of a short text, one at a time. The ASCII branch stays written out
    # here and in fullencode._features_utf8: a helper that returns the wide arrays in both branches (inlined) costs
    # their reference counts at every character (that loop on 1M characters of english: 0.083 -> 0.158 ms)
    for j in range(i, n):
        x = cps[j]
        if x < 0x80:
            buf[pos] = np.uint8(x)
            pos += 1
            continue
        pos, wide_pos, wide_add, nw = _put_wide(buf, pos, x, j, wide_pos, wide_add, nw)
    return pos, wide_pos, wide_add, nw


def _put_wide(buf, pos, x, j, wide_pos, wide_add, nw):
    """The UTF-8 of the wide character x (at character j) at buf[pos], noted as the nw-th wide character with the
    bytes added up to it (wide_add: the running total; both arrays doubled when full): (pos after it, the arrays,
    nw + 1)."""
    if nw == wide_pos.shape[0]:
        wide_pos = np.concatenate((wide_pos, np.empty(nw, np.int64)))
        wide_add = np.concatenate((wide_add, np.empty(nw, np.int64)))
    end = _put_utf8(buf, pos, x)
    wide_pos[nw] = j
    wide_add[nw] = end - pos - 1 + (wide_add[nw - 1] if nw > 0 else 0)
    return end, wide_pos, wide_add, nw + 1


def _chars_to_bytes(bounds, k, wide_pos, wide_add, nw):
    """Pass (3): bounds[:k] (character offsets, increasing) moved to byte offsets."""
    q = 0
    shift = 0
    for t in range(k):
        x = bounds[t]
        while q < nw and wide_pos[q] < x:
            shift = wide_add[q]
            q += 1
        bounds[t] = x + shift


def _bit_byte_positions(sb, n, bounds, wide_pos, wide_add, nw):
    """Passes (2) and (3) from a bitmap: the positions < n of its set bits moved to bytes (each plus the bytes that the
    wide characters left of it add: wide_add[q] past wide_pos[q]) into bounds, in order; their count. A word whose
    positions all lie at or before the next wide character (every word, for ASCII text) is written a byte at a time:
    simdbits.positions8 stores the byte's positions from BYTE_POSITIONS and k moves by its bit count, no branch a bit
    (the loop that exits after each bit ran 0.21-0.22 ms on 1M characters of english or code, this 0.12)."""
    k = 0
    q = 0
    shift = 0
    nxt = wide_pos[0] if nw > 0 else n      # positions up to here take `shift`
    room = bounds.shape[0] - 64             # a word's eight 8-entry stores fit from here down
    for g in range((n + 63) >> 6):
        w = sb[g]
        rest = n - (g << 6)
        if rest < 64:
            w &= (np.uint64(1) << np.uint64(rest)) - np.uint64(1)
        base = g << 6
        if base + 63 <= nxt:
            at = base + shift
            if k <= room:
                for r in range(8):      # (a byte at a time from tables: ~14 starts a word in english or code)
                    byte = np.int64((w >> np.uint64(8 * r)) & np.uint64(0xFF))
                    _positions8(bounds, k, BYTE_POSITIONS, byte, at + 8 * r)
                    k += BYTE_COUNTS[byte]
                continue
            while w != np.uint64(0):
                bounds[k] = at + np.int64(_trailing_zeros(w))
                k += 1
                w &= w - np.uint64(1)
            continue
        while w != np.uint64(0):
            x = base + np.int64(_trailing_zeros(w))
            while q < nw and wide_pos[q] < x:
                shift = wide_add[q]
                q += 1
            bounds[k] = x + shift
            k += 1
            w &= w - np.uint64(1)
        nxt = wide_pos[q] if q < nw else n
    return k


def _utf8_one_pass(cps, n, starts, buf, bounds):
    # UTF-8 and bounds in one pass over the characters; branch-free bound writes for the same reason as
    # bpe._piece_byte_bounds (dense, irregular piece starts).
    k = 0
    pos = 0
    last = bounds.shape[0] - 1
    for i in range(n):
        bounds[min(k, last)] = pos
        k += 1 if starts[i] else 0
        pos = _put_utf8(buf, pos, cps[i])
    bounds[k] = pos
    return k + 1, pos


def _utf8_one_pass_bits(cps, n, sb, buf, bounds):
    k = 0
    pos = 0
    last = bounds.shape[0] - 1
    for i in range(n):
        bounds[min(k, last)] = pos
        k += np.int64((sb[i >> 6] >> np.uint64(i & 63)) & np.uint64(1))
        pos = _put_utf8(buf, pos, cps[i])
    bounds[k] = pos
    return k + 1, pos


def _put_utf8(buf, pos, c):
    """The UTF-8 of code point c at buf[pos]; the offset after it."""
    if c < 0x80:
        buf[pos] = c
        return pos + 1
    if c < 0x800:
        buf[pos] = 0xC0 | (c >> 6)
        buf[pos + 1] = 0x80 | (c & 0x3F)
        return pos + 2
    if c < 0x10000:
        buf[pos] = 0xE0 | (c >> 12)
        buf[pos + 1] = 0x80 | ((c >> 6) & 0x3F)
        buf[pos + 2] = 0x80 | (c & 0x3F)
        return pos + 3
    buf[pos] = 0xF0 | (c >> 18)
    buf[pos + 1] = 0x80 | ((c >> 12) & 0x3F)
    buf[pos + 2] = 0x80 | ((c >> 6) & 0x3F)
    buf[pos + 3] = 0x80 | (c & 0x3F)
    return pos + 4


def _false_at_impl(s, a, b, table):
    # Positions i in [a, b) where table[ord(s[i])] is False, read from the str's own buffer (no code point copy).
    # They are rare where this is used (NFC's non-inert characters of real text): one scan into a small array, and a
    # second into one of the exact size only when the first overflowed (an array grown inside the loop kept it from
    # compiling tight: ~5 ns a character against ~0.3).
    out = np.empty(64, np.int64)
    count = _false_scan(s, a, b, table, out)
    if count > out.shape[0]:
        out = np.empty(count, np.int64)
        _false_scan(s, a, b, table, out)
    for k in range(count):
        out[k] += a
    return out[:count]


def _false_scan(s, a, b, table, out):
    # The count of such positions; the first out.shape[0] of them (from a) into out, from the str's own code units.
    kind = s._kind
    if kind == 1:
        return _false_units(_str_units8(s)[a:b], table, out)
    if kind == 2:
        return _false_units(_str_units16(s)[a:b], table, out)
    return _false_units(_str_units32(s)[a:b], table, out)


def _false_units(c, table, out):
    # 64 units a step where the table holds every ASCII code point (NFC's inert table does): a step without a unit
    # >= 0x80 (simdbits.wide64) has no position to note; 4M characters of a 4-byte str (python source with one astral
    # character) scanned one unit at a time took ~1 ms.
    n = c.shape[0]
    ascii_true = True
    for x in range(128):
        ascii_true &= table[x]
    k = 0
    i = 0
    if ascii_true:
        while i + 64 <= n:
            if _wide64(c, i) != 0:
                k = _note_false(c, i, i + 64, table, out, k)
            i += 64
    return _note_false(c, i, n, table, out, k)


def _note_false(c, a, b, table, out, k):
    # the positions j in [a, b) where table[c[j]] is False, from the k-th on: the first out.shape[0] into out; the new k
    cap = out.shape[0]
    for j in range(a, b):
        if not table[c[j]]:
            if k < cap:
                out[k] = j
            k += 1
    return k


def _sampled_sizes_impl(s, step, out):
    total = 0
    for j in range(out.shape[0]):
        c = _get_code_point(s, j * step)
        total += 1 + (c >= 0x80) + (c >= 0x800) + (c >= 0x10000)
        out[j] = total


_codepoints = njit(cache=True, nogil=True)(_codepoints_impl)
_sampled_sizes = njit(cache=True, nogil=True)(_sampled_sizes_impl)
_false_scan = njit(cache=True, nogil=True)(_false_scan)
_false_units = njit(cache=True, nogil=True)(_false_units)
_note_false = njit(cache=True, nogil=True, inline="always")(_note_false)
_false_at = njit(cache=True, nogil=True)(_false_at_impl)
_put_utf8 = njit(cache=True, nogil=True, inline="always")(_put_utf8)
_put_wide = njit(cache=True, nogil=True, inline="always")(_put_wide)
_ascii_blocks = njit(cache=True, nogil=True)(_ascii_blocks)
_mostly_wide = njit(cache=True, nogil=True)(_mostly_wide)
_utf8_ascii_runs = njit(cache=True, nogil=True)(_utf8_ascii_runs)
_chars_to_bytes = njit(cache=True, nogil=True)(_chars_to_bytes)
_bit_byte_positions = njit(cache=True, nogil=True)(_bit_byte_positions)
_utf8_one_pass = njit(cache=True, nogil=True)(_utf8_one_pass)
_utf8_one_pass_bits = njit(cache=True, nogil=True)(_utf8_one_pass_bits)
_utf8_by_runs = njit(cache=True, nogil=True)(_utf8_by_runs)
_utf8_and_bounds = njit(cache=True, nogil=True)(_utf8_and_bounds_impl)


def codepoints(s: str, a: int = 0, b: int | None = None, extra: str = "",
               out: np.ndarray | None = None) -> np.ndarray:
    """uint32 code points of s[a:b] followed by those of `extra` (a few characters, e.g. the one right of a chunk
    cut), equal to `np.frombuffer((s[a:b] + extra).encode("utf-32-le"), "<u4")`. `out`: a uint32 scratch array to
    write into when it is long enough (the result is then a view of it)."""
    b = len(s) if b is None else b
    if not 0 <= a <= b <= len(s):
        raise IndexError(f"code point range [{a}, {b}) outside a string of length {len(s)}")
    n = b - a
    size = n + len(extra)
    out = out[:size] if out is not None and out.shape[0] >= size else np.empty(size, dtype=np.uint32)
    if n:
        bad = kernels.get().codepoints(s, a, b, out)
        if bad >= 0:    # str.encode would have refused it; the UTF-8 writer must never see one
            raise InvalidTextError(f"input contains a lone surrogate U+{ord(s[bad]):04X} at character {bad}")
    for i, ch in enumerate(extra):
        out[n + i] = ord(ch)
    return out


def false_at(s: str, table: np.ndarray, a: int = 0, b: int | None = None) -> np.ndarray:
    """int64 positions i of s[a:b] (as positions in s) where table[ord(s[i])] is False (table: bool[0x110000]), read
    from the str's buffer; equal to `a + np.flatnonzero(~table[codepoints(s[a:b])])` without its text-sized arrays
    or the slice. GIL-free (chunk threads of the parallel encoder scan their own chunks)."""
    n = len(s)
    b = n if b is None else max(a, min(b, n))
    if not 0 <= a <= n:
        raise IndexError("false_at: a is out of range")
    return kernels.get().false_at(s, a, b, table)


def sampled_utf8_sizes(s: str, step: int) -> np.ndarray:
    """int64 running UTF-8 size of s[0], s[step], s[2*step], ... (a byte profile of the text from one character in
    `step`); equals `np.cumsum` of the UTF-8 widths of `s[::step]`."""
    count = -(-len(s) // step)
    out = np.empty(count, dtype=np.int64)
    if count:
        kernels.get().sampled_sizes(s, step, out)
    return out


def utf8_and_bounds(cps: np.ndarray, n: int, starts: np.ndarray, buf: np.ndarray | None = None,
                    bounds: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(UTF-8 bytes of cps[:n] as uint8, int64 byte offsets of the piece starts in starts[:n] plus the end).
    `buf` (uint8, >= 4n) and `bounds` (int64, >= n + 1): scratch arrays to write into (the results are views)."""
    cps = np.ascontiguousarray(cps, dtype=np.uint32)
    if buf is None or buf.shape[0] < 4 * n:
        buf = np.empty(4 * n, dtype=np.uint8)
    if bounds is None or bounds.shape[0] < n + 1:
        bounds = np.empty(n + 1, dtype=np.int64)     # untouched tail pages are never faulted in; no GIL-held count
    k, size = kernels.get().utf8_and_bounds(cps, n, starts.view(np.bool_), buf, bounds)
    return buf[:size], bounds[:k]
