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
    __slots__ = ("ra", "rb", "na", "nb", "texts")

    # a value (tuples, never edited: `replace` makes a new map): sessions share the empty one's tuples, and a
    # tuple of a few regions is half the size of an over-allocated list (issue 17: small sessions' bytes/token)
    def __init__(self, ra: Sequence[int] = (), rb: Sequence[int] = (), na: Sequence[int] = (),
                 nb: Sequence[int] = (), texts: Sequence[str] = ()):
        self.ra, self.rb = tuple(ra), tuple(rb)
        self.na, self.nb = tuple(na), tuple(nb)
        self.texts = tuple(texts)          # texts[k] == normalized[na[k]:nb[k]]

    def nbytes(self) -> int:
        return sum(sys.getsizeof(t) for t in self.texts) + 4 * 8 * len(self.ra)

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
        if not inner.ra and i == j and (j == len(self.ra) or dr == dn == 0):
            return self     # no region added, removed or moved (an ASCII append): the same value, no list copies
        ra, rb, na, nb = list(self.ra[:i]), list(self.rb[:i]), list(self.na[:i]), list(self.nb[:i])
        texts = self.texts[:i] + inner.texts + self.texts[j:]
        ra += [x + lo for x in inner.ra]
        rb += [x + lo for x in inner.rb]
        na += [x + n_lo for x in inner.na]
        nb += [x + n_lo for x in inner.nb]
        ra += [x + dr for x in self.ra[j:]]
        rb += [x + dr for x in self.rb[j:]]
        na += [x + dn for x in self.na[j:]]
        nb += [x + dn for x in self.nb[j:]]
        return NfcMap(ra, rb, na, nb, texts)


def build_map(raw: str, normalize: Callable[[str], str]) -> tuple[str, NfcMap]:
    """NFC of `raw` and its map, from the spans that can change (cpu/nfc.regions: each starts at 0 or at an inert
    code point and ends at the text end or before one, so NFC(raw) is the concatenation of the spans' NFCs)."""
    if raw.isascii():
        return raw, NfcMap()
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
        self.length = len(raw) + (nmap.nb[-1] - nmap.rb[-1] if len(nmap) else 0)

    def __len__(self) -> int:
        return self.length

    def slice(self, a: int, b: int) -> str:
        a, b = max(a, 0), min(b, self.length)
        m, out, pos = self.map, [], a
        k = bisect.bisect_right(m.nb, a)          # first region ending after a
        while pos < b:
            if k < len(m.na) and m.na[k] <= pos:  # inside region k
                e = min(b, m.nb[k])
                out.append(m.texts[k][pos - m.na[k]:e - m.na[k]])
                k += 1
            else:
                e = min(b, m.na[k]) if k < len(m.na) else b
                off = m.nb[k - 1] - m.rb[k - 1] if k > 0 else 0
                out.append(self.raw.slice(pos - off, e - off))
            pos = e
        return out[0] if len(out) == 1 else "".join(out)

    def char(self, pos: int) -> str:
        return self.slice(pos, pos + 1)

    def joined(self) -> str:
        return self.slice(0, self.length)
