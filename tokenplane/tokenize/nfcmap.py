"""Where a session's raw text and its NFC differ: sorted regions (raw [ra, rb) <-> normalized [na, nb)) whose ends
are NFC split points (text ends, or a code point that is inert under NFC: cpu/nfc.py). Outside the regions the two
texts are equal, shifted by the length changes of the regions before; inside, normalized[na:nb] is NFC(raw[ra:rb]).

This is what keeps a qwen3 edit local when some part of the text is not NFC: the edit's raw split points map to
normalized offsets (O(log regions)), only the edited stretch is renormalized, and the regions after it shift by the
edit's length change (O(regions), a list, not the text). A map is a value: `replace` returns a new one, so a
mutation plans it and the commit swaps it in. The map also holds each region's normalized text, so the normalized
text is never stored twice: `MappedText` reads it as the raw store with the regions substituted.
"""

from __future__ import annotations

import bisect
import sys
from typing import Callable, Sequence

from .cpu import nfc
from .textstore import TextStore


class NfcMap:
    __slots__ = ("pos", "texts")

    # a value, never edited (`replace` makes a new map), and flat: one tuple of every region's four offsets,
    # ra..., rb..., na..., nb... (a tuple per column, or a list, costs a small session ~150 bytes more: issue 17's
    # bytes/token of a 1.5K-token session); the columns are searched in place (bisect's lo/hi)
    def __init__(self, ra: Sequence[int] = (), rb: Sequence[int] = (), na: Sequence[int] = (),
                 nb: Sequence[int] = (), texts: Sequence[str] = ()):
        self.pos = (*ra, *rb, *na, *nb)
        self.texts = tuple(texts)          # texts[k] == normalized[na(k):nb(k)]

    def nbytes(self) -> int:
        return sum(sys.getsizeof(t) for t in self.texts) + 8 * len(self.pos)

    def __len__(self) -> int:
        return len(self.texts)

    def ra(self, k: int) -> int:
        return self.pos[k]

    def rb(self, k: int) -> int:
        return self.pos[len(self.texts) + k]

    def na(self, k: int) -> int:
        return self.pos[2 * len(self.texts) + k]

    def nb(self, k: int) -> int:
        return self.pos[3 * len(self.texts) + k]

    def column(self, c: int) -> tuple[int, ...]:
        """Column c (0 ra, 1 rb, 2 na, 3 nb) of every region, as a tuple."""
        n = len(self.texts)
        return self.pos[c * n:(c + 1) * n]

    def search(self, c: int, x: int, right: bool) -> int:
        """bisect_right (right) or bisect_left of x in column c."""
        n = len(self.texts)
        find = bisect.bisect_right if right else bisect.bisect_left
        return find(self.pos, x, c * n, (c + 1) * n) - c * n

    def widen(self, lo: int, hi: int) -> tuple[int, int]:
        """[lo, hi] grown so that neither end lies strictly inside a region."""
        k = self.search(0, lo, True) - 1
        if k >= 0 and lo < self.rb(k):
            lo = self.ra(k)
        k = self.search(1, hi, False)
        if k < len(self) and self.ra(k) < hi:
            hi = self.rb(k)
        return lo, hi

    def to_norm(self, q: int) -> int:
        """Normalized offset of raw offset q (q not strictly inside a region)."""
        k = self.search(1, q, True) - 1
        return q if k < 0 else q + self.nb(k) - self.rb(k)

    def replace(self, lo: int, hi: int, n_lo: int, n_hi: int, raw_len: int, norm_len: int, inner: NfcMap) -> NfcMap:
        """The map after raw[lo:hi] (split points, widened) became a text of raw_len characters whose NFC has
        norm_len characters and replaces normalized[n_lo:n_hi]; `inner`: the new text's own map (build_map)."""
        i = self.search(1, lo, True)          # regions ending at or before lo stay
        j = self.search(0, hi, False)         # regions starting at or after hi shift
        dr, dn = raw_len - (hi - lo), norm_len - (n_hi - n_lo)
        if not len(inner) and i == j and (j == len(self) or dr == dn == 0):
            return self     # no region added, removed or moved (an ASCII append): the same value, no copies
        cols = []
        for c, (at, shift) in enumerate(((lo, dr), (lo, dr), (n_lo, dn), (n_lo, dn))):
            mine = self.column(c)
            cols.append([*mine[:i], *(x + at for x in inner.column(c)), *(x + shift for x in mine[j:])])
        return NfcMap(*cols, self.texts[:i] + inner.texts + self.texts[j:])


EMPTY_MAP = NfcMap()      # a session whose text is its own NFC (a value: `replace` never edits it)


def build_map(raw: str, normalize: Callable[[str], str]) -> tuple[str, NfcMap]:
    """NFC of `raw` and its map, from the spans that can change (cpu/nfc.regions: each starts at 0 or at an inert
    code point and ends at the text end or before one, so NFC(raw) is the concatenation of the spans' NFCs)."""
    if raw.isascii():
        return raw, EMPTY_MAP
    spans = nfc.regions(raw).tolist()
    out, prev, shift = [], 0, 0
    ra: list[int] = []
    rb: list[int] = []
    na: list[int] = []
    nb: list[int] = []
    texts: list[str] = []
    for a, b in spans:
        seg = raw[a:b]
        done = normalize(seg)
        out += [raw[prev:a], done]
        if done != seg:
            ra.append(a)
            rb.append(b)
            na.append(a + shift)
            nb.append(a + shift + len(done))
            texts.append(done)
            shift += len(done) - len(seg)
        prev = b
    out.append(raw[prev:])
    return "".join(out), NfcMap(ra, rb, na, nb, texts)


class MappedText:
    """The normalized text of a session read through its map: raw text outside the regions, the regions' own
    normalized texts inside (the `TextStore` reading interface a repair uses: len, slice, char, joined)."""

    def __init__(self, raw: TextStore, nmap: NfcMap):
        self.raw, self.map = raw, nmap
        self.length = len(raw) + (nmap.nb(len(nmap) - 1) - nmap.rb(len(nmap) - 1) if len(nmap) else 0)

    def __len__(self) -> int:
        return self.length

    def slice(self, a: int, b: int) -> str:
        a, b = max(a, 0), min(b, self.length)
        m, out, pos = self.map, [], a
        k = m.search(3, a, True)                  # first region ending after a
        while pos < b:
            if k < len(m) and m.na(k) <= pos:     # inside region k
                e, na = min(b, m.nb(k)), m.na(k)
                out.append(m.texts[k][pos - na:e - na])
                k += 1
            else:
                e = min(b, m.na(k)) if k < len(m) else b
                off = m.nb(k - 1) - m.rb(k - 1) if k > 0 else 0
                out.append(self.raw.slice(pos - off, e - off))
            pos = e
        return out[0] if len(out) == 1 else "".join(out)

    def char(self, pos: int) -> str:
        return self.slice(pos, pos + 1)

    def joined(self) -> str:
        return self.slice(0, self.length)
