"""A run of session text that is mostly Latin-1 with a few wider characters, kept at about one byte a character.

A str stores every character at the width of its widest one, so a Czech sentence (U+010D, U+0159, ... among Latin
letters) or a code comment with a few symbols costs 2 bytes a character, and the text store's wide runs
(textstore.width_runs) cannot be cut finer where the wide characters are a few dozen characters apart. A sealed wide
run (one the store no longer appends to) is kept here instead as the low byte of every character plus the positions
and code points of the characters above U+00FF: 1 byte a character and 8 per wide character, against 2 (or 4).

The text store reads a run through `str` slices (`run[a:b]`, `str(run)`: rebuilt from the two arrays, O(length)),
which only edits and repair windows reaching into old text do. The hot read is sync's prefix check, `match_at`: one
compiled pass over the resent str's own buffer that compares each character's low byte and counts its characters above
U+00FF, then the exceptions one by one. Text equals the run exactly when all low bytes are equal, the counts are equal
and every exception position holds its code point (the positions then account for every wide character of the text,
so every other character is below U+0100 and equal to its low byte).
"""

from __future__ import annotations

import sys

import numpy as np

from .cpu import kernels
from .cpu.lazyjit import njit, numba_global

_deref_uint16 = numba_global("numba.cpython.unicode", "deref_uint16")
_deref_uint32 = numba_global("numba.cpython.unicode", "deref_uint32")

MIN_SAVING = 1024       # bytes a packed run must save over its str (the arrays' headers cost ~250 bytes)
_SAMPLE = 2048          # leading characters `pack` reads first to decline dense text cheaply


@njit(cache=True)
def _match_at(low, exc, text, off):
    """1 if text[off:] starts with the run (`low`: each character's low byte; exc: the k positions of the characters
    above U+00FF, then their k code points), else 0. A text of 1 byte a character holds no wide character and k >= 1."""
    n = low.shape[0]
    k = exc.shape[0] // 2
    tk = text._kind
    if off + n > len(text) or tk == 1:
        return 0
    td = text._data
    count = 0
    i = 0
    while i < n:
        m = min(n - i, 4096)
        lw = low[i:i + m]       # a slice indexed from 0: no negative-index fix-up in the loop, which vectorizes
        base = off + i
        acc = np.uint32(0)
        wide = np.uint32(0)
        if tk == 2:     # 16-bit lanes (a block's count fits): sixteen characters a vector on AVX2
            acc16 = np.uint16(0)
            wide16 = np.uint16(0)
            for j in range(m):
                c16 = _deref_uint16(td, base + j)
                acc16 = np.uint16(acc16 | np.uint16((c16 & np.uint16(255)) ^ np.uint16(lw[j])))
                wide16 = np.uint16(wide16 + np.uint16(c16 >> np.uint16(8) != 0))
            acc = np.uint32(acc16)
            wide = np.uint32(wide16)
        else:
            for j in range(m):
                c = _deref_uint32(td, base + j)
                acc = np.uint32(acc | np.uint32((c & np.uint32(255)) ^ np.uint32(lw[j])))
                wide = np.uint32(wide + np.uint32(c >> np.uint32(8) != 0))
        if acc:
            return 0
        count += wide
        i += m
    if count != k:
        return 0
    for x in range(k):
        p = off + np.int64(exc[x])
        c = np.uint32(_deref_uint16(td, p)) if tk == 2 else _deref_uint32(td, p)
        if c != exc[k + x]:
            return 0
    return 1


class PackedRun:
    """An immutable run of text: `low` (uint8, one byte a character) and `exc` (uint32: the positions of the
    characters above U+00FF, then their code points). Sliced and converted like the str it stands for."""

    __slots__ = ("low", "exc", "width")

    def __init__(self, low: np.ndarray, exc: np.ndarray, width: int):
        self.low, self.exc, self.width = low, exc, width    # 2 or 4: the str's width (how to rebuild it)

    def __len__(self) -> int:
        return int(self.low.shape[0])

    def __str__(self) -> str:
        return self._rebuild(0, len(self))

    def __getitem__(self, key: int | slice) -> str:
        if isinstance(key, slice):
            a, b, step = key.indices(len(self))
            if step != 1:
                return str(self)[key]
            return self._rebuild(a, b) if a < b else ""
        i = key + len(self) if key < 0 else key
        if not 0 <= i < len(self):
            raise IndexError("run index out of range")
        return self._rebuild(i, i + 1)

    def _rebuild(self, a: int, b: int) -> str:
        k = self.exc.shape[0] // 2
        pos = self.exc[:k]
        lo, hi = np.searchsorted(pos, a), np.searchsorted(pos, b)
        if lo == hi:
            return self.low[a:b].tobytes().decode("latin-1")
        units = self.low[a:b].astype(np.uint16 if self.width == 2 else np.uint32)
        units[pos[lo:hi].astype(np.int64) - a] = self.exc[k + lo:k + hi]
        return units.tobytes().decode("utf-16-le" if self.width == 2 else "utf-32-le")

    @property
    def nbytes(self) -> int:
        return sys.getsizeof(self) + sys.getsizeof(self.low) + sys.getsizeof(self.exc)

    def match_at(self, text: str, off: int) -> bool:
        """text.startswith(str(self), off) for off >= 0, on the str's own buffer."""
        return off >= 0 and bool(kernels.get().packed_match_at(self.low, self.exc, text, off))


def pack(s: str, width: int) -> PackedRun | None:
    """`s` (of `width` bytes a character, 2 or 4) as a PackedRun when that saves MIN_SAVING bytes or more."""
    if len(s) > 4 * _SAMPLE:    # dense text (CJK, Cyrillic) declines on a sample, not a pass over 64K characters
        head = np.frombuffer(s[:_SAMPLE].encode("utf-32-le", "surrogatepass"), np.uint32)
        if int(np.count_nonzero(head > 255)) * 8 >= _SAMPLE * (width - 1):   # a sample at no saving
            return None
    cps = np.frombuffer(s.encode("utf-32-le", "surrogatepass"), np.uint32)
    where = np.flatnonzero(cps > 255)
    k = len(where)
    if not k or len(s) * (width - 1) - 8 * k < MIN_SAVING:
        return None
    wide = cps[where]
    if bool(((wide >= 0xD800) & (wide < 0xE000)).any()):
        return None     # a lone surrogate (refused at the session's input) would not survive the UTF-16 rebuild
    # the width from the characters themselves (`width` is a size hint: a str caching its UTF-8 reads wider)
    return PackedRun(cps.astype(np.uint8), np.concatenate([where.astype(np.uint32), wide]),
                     4 if int(wide.max()) > 0xFFFF else 2)


__all__ = ["MIN_SAVING", "PackedRun", "pack"]
