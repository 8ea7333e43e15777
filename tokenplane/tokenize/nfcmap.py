"""Where a session's raw text and its NFC differ: sorted regions (raw [ra, rb) <-> normalized [na, nb)) whose ends
are NFC split points (text ends, or a code point that is inert under NFC: cpu/nfc.py). Outside the regions the two
texts are equal, shifted by the length changes of the regions before; inside, normalized[na:nb] is NFC(raw[ra:rb]).

This is what keeps a qwen3 edit local when some part of the text is not NFC: the edit's raw split points map to
normalized offsets (O(log regions)), only the edited stretch is renormalized, and the regions after it shift by the
edit's length change (O(regions), a list, not the text). A map is a value: `replace` returns a new one, so a
mutation plans it and the commit swaps it in.
"""

from __future__ import annotations

import bisect
from typing import Callable

from .cpu import nfc
from .cpu.strbuf import codepoints


class NfcMap:
    __slots__ = ("ra", "rb", "na", "nb")

    def __init__(self, ra: list[int] | None = None, rb: list[int] | None = None, na: list[int] | None = None,
                 nb: list[int] | None = None):
        self.ra, self.rb = ra or [], rb or []
        self.na, self.nb = na or [], nb or []

    def __len__(self) -> int:
        return len(self.ra)

    def widen(self, lo: int, hi: int) -> tuple[int, int]:
        """[lo, hi] grown so that neither end lies strictly inside a region."""
        k = bisect.bisect_right(self.ra, lo) - 1
        if k >= 0 and lo < self.rb[k]:
            lo = self.ra[k]
        k = bisect.bisect_left(self.rb, hi)
        if k < len(self.rb) and self.ra[k] < hi:
            hi = self.rb[k]
        return lo, hi

    def to_norm(self, q: int) -> int:
        """Normalized offset of raw offset q (q not strictly inside a region)."""
        k = bisect.bisect_right(self.rb, q) - 1
        return q if k < 0 else q + self.nb[k] - self.rb[k]

    def replace(self, lo: int, hi: int, n_lo: int, n_hi: int, raw_len: int, norm_len: int, inner: NfcMap) -> NfcMap:
        """The map after raw[lo:hi] (split points, widened) became a text of raw_len characters whose NFC has
        norm_len characters and replaces normalized[n_lo:n_hi]; `inner`: the new text's own map (build_map)."""
        i = bisect.bisect_right(self.rb, lo)          # regions ending at or before lo stay
        j = bisect.bisect_left(self.ra, hi)           # regions starting at or after hi shift
        dr, dn = raw_len - (hi - lo), norm_len - (n_hi - n_lo)
        ra, rb, na, nb = self.ra[:i], self.rb[:i], self.na[:i], self.nb[:i]
        ra += [x + lo for x in inner.ra]
        rb += [x + lo for x in inner.rb]
        na += [x + n_lo for x in inner.na]
        nb += [x + n_lo for x in inner.nb]
        ra += [x + dr for x in self.ra[j:]]
        rb += [x + dr for x in self.rb[j:]]
        na += [x + dn for x in self.na[j:]]
        nb += [x + dn for x in self.nb[j:]]
        return NfcMap(ra, rb, na, nb)


def build_map(raw: str, normalize: Callable[[str], str]) -> tuple[str, NfcMap]:
    """NFC of `raw` and its map, from the spans that can change (cpu/nfc.regions: each starts at 0 or at an inert
    code point and ends at the text end or before one, so NFC(raw) is the concatenation of the spans' NFCs)."""
    if raw.isascii():
        return raw, NfcMap()
    spans = nfc.regions(codepoints(raw), nfc.inert_table()).tolist()
    out, m, prev, shift = [], NfcMap(), 0, 0
    for a, b in spans:
        seg = raw[a:b]
        done = normalize(seg)
        out += [raw[prev:a], done]
        if done != seg:
            m.ra.append(a)
            m.rb.append(b)
            m.na.append(a + shift)
            m.nb.append(a + shift + len(done))
            shift += len(done) - len(seg)
        prev = b
    out.append(raw[prev:])
    return "".join(out), m
