"""NFC that only hands the reference normalizer the parts of a text that can change.

A 4M-character text costs HF's NFC normalizer ~350 ms even when it is already NFC (it builds an alignment map),
and that pass is serial in front of every qwen3 encode. Almost all real text is NFC already, and the places where
normalization can act are rare and local.

A code point is *inert* when it is a starter (ccc = 0), NFC_Quick_Check = Yes (it survives NFC alone) and it is no
composition's second element (it never combines with what precedes it). Then, by UAX #15 (quick check and
normalization boundaries):
  * a string of inert code points is its own NFC;
  * NFC(x + y) = NFC(x) + NFC(y) whenever y starts with an inert code point (nothing reorders across a starter,
    and the starter neither composes backwards nor lets a later mark reach a starter before it).
So `normalize` finds the non-inert code points, widens each run of them by the one character on its left (the starter
they may compose with), and normalizes only those regions, all in one call to the reference normalizer.

The table is probed out of the reference normalizer itself, never from `unicodedata` (whose Unicode version differs):
  1. NFC of every code point alone: changed -> not inert (Quick_Check No).
  2. NFD of every code point: every character after the first of a decomposition is marked not inert (this covers
     all composition second elements, Quick_Check Maybe, including Hangul V/T jamo; it over-marks, which is safe).
  3. ccc: "一\\u0345" + c reorders iff 0 < ccc(c) < 240, and "一" + c + "\\u0315" reorders iff ccc(c) > 232; any
     change in either probe marks c not inert.
Every probe can only clear the inert bit, so an engine quirk costs speed, never exactness; tests compare against
the reference normalizer on adversarial and real text.
"""

from __future__ import annotations

import hashlib
from functools import cache
from typing import Callable

import numpy as np

from ..spec.artifacts import cached_array
from .strbuf import false_at  # GIL-free: a scan of the str's own buffer, no text-sized arrays

N_CODEPOINTS = 0x110000
SMALL_TEXT = 512        # below this the reference normalizer is cheaper than the scan
PRECHECK_TEXT = 1 << 14   # below this a text is first checked for being all inert (all_inert); longer ones take the
                          # scan, whose kernels a text that size pays for
MERGE_GAP = 64          # non-inert runs closer than this are normalized as one region (fewer slices, same result)
# sha256 of the packed table per tokenizers version, as probed when this module was written (a regression pin: a
# different table is still exact, it only means the engine's Unicode data moved).
PINNED = {"tokenizers-0.23.3": "e889c53e94b642d0b9350cc545d1878dfb8aeca77c54f5102b47c9281c1db8cf"}
_PROBE1 = ("\u4e00\u0345", "")      # CJK ideograph: composes with nothing; U+0345: ccc 240
_PROBE2 = ("\u4e00", "\u0315")      # U+0315: ccc 232, composes with nothing


def _universe() -> list[str]:
    return [chr(c) for c in range(N_CODEPOINTS) if not 0xD800 <= c < 0xE000]


def _per_char(normalize, items: list[str]) -> list[str]:
    # One call over "\n"-joined probes equals one call per probe when "\n" is inert, which is checked first; the
    # probe of "\n" itself (and any probe that contains it) is run on its own.
    sep = "\n"
    if any(normalize(p) != p for p in (sep, "\u4e00" + sep, sep + "\u0301", "\u0345" + sep + "\u0315")):
        return [normalize(p) for p in items]
    alone = [i for i, p in enumerate(items) if sep in p]
    joined = [p for p in items if sep not in p]
    out = normalize(sep.join(joined)).split(sep)
    if len(out) != len(joined):
        raise RuntimeError("normalizer probe: separator count changed; cannot probe this normalizer")
    for i in alone:
        out.insert(i, normalize(items[i]))
    return out


def probe(nfc: Callable[[str], str], nfd: Callable[[str], str]) -> np.ndarray:
    """bool[0x110000]: True where the code point is inert under `nfc` (functions str -> str of one engine)."""
    chars = _universe()
    inert = np.zeros(N_CODEPOINTS, dtype=bool)
    same = [a == b for a, b in zip(chars, _per_char(nfc, chars))]
    for c, ok in zip(chars, same):
        if ok:
            inert[ord(c)] = True
    for c, d in zip(chars, _per_char(nfd, chars)):
        if d != c:
            for later in d[1:]:
                inert[ord(later)] = False
    for left, right in (_PROBE1, _PROBE2):
        cand = [c for c in chars if inert[ord(c)]]
        probes = [left + c + right for c in cand]
        for c, p, q in zip(cand, probes, _per_char(nfc, probes)):
            if p != q:
                inert[ord(c)] = False
    inert[0xD800:0xE000] = False
    return inert


def table_hash(table: np.ndarray) -> str:
    return hashlib.sha256(np.packbits(table).tobytes()).hexdigest()


@cache
def inert_table() -> np.ndarray:
    """The inert table of this `tokenizers` version's NFC, probed once and cached on disk."""
    import tokenizers
    from tokenizers import normalizers

    return cached_array(f"nfc-inert-tokenizers-{tokenizers.__version__}.npy", (N_CODEPOINTS,), np.bool_,
                        lambda: probe(normalizers.NFC().normalize_str, normalizers.NFD().normalize_str))


def all_inert(text: str) -> bool:
    """Every code point of text is inert (then text is its own NFC): the scan `regions` runs (strbuf.false_at, the
    str's own buffer), 2.7 us for a turn's 1.4K characters where the reference normalizer takes ~0.17 us a character
    (a chat turn's segments are normalized twice: the session's plan, then the repair window's NFC self-check). A
    lone surrogate is not inert (the probed table says so), so the caller's full path decides."""
    return false_at(text, inert_table()).shape[0] == 0


def regions(text: str) -> np.ndarray:
    """int64[k, 2] character spans of text that may change under NFC; every span starts at 0 or at an inert code
    point and ends at the text end or before an inert one, so the text between spans is already NFC. The non-inert
    characters are found by one scan of the str's own buffer (strbuf.false_at): no text-sized code point and flag
    arrays, whose first touch cost ~1.5 ms of a 1M-character encode's NFC check (qwen3 english, no region)."""
    return _spans(false_at(text, inert_table()))


def _spans(bad: np.ndarray, lo: int = 0) -> np.ndarray:
    if bad.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    new = np.empty(bad.size, dtype=bool)
    new[0] = True
    np.greater(np.diff(bad), MERGE_GAP, out=new[1:])
    first = bad[new]
    last = bad[np.append(np.flatnonzero(new)[1:] - 1, bad.size - 1)]
    return np.stack([np.maximum(first - 1, lo), last + 1], axis=1)


def normalize_many(texts: list[str], joined: str, reference_nfc: Callable[[str], str],
                   check: Callable[[int], None] | None = None) -> list[str]:
    """`normalize` of each text (joined: their concatenation) in one scan of the joined text and at most one call of
    the reference normalizer: the regions that may change (as `regions`, but never across a text's edge: each is
    widened left only within its text) of every text, joined by an inert separator as `normalize` joins one text's
    regions. A batch of short texts otherwise pays per text a scan kernel's call (~2.5 us) and the reference
    normalizer on the whole text (~10 us for 160 characters). `check(i)`: called first for each text that holds a
    non-inert code point (a lone surrogate is one: the caller's validation of text i); the other texts are all
    inert, their own NFC. The same list is returned when no text changes."""
    bad = false_at(joined, inert_table())
    if bad.size == 0:
        return texts
    lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    ends = np.cumsum(lengths)
    begins = ends - lengths
    owner = np.searchsorted(ends, bad, side="right")
    if check is not None:
        for i in np.unique(owner).tolist():
            check(i)
    new = np.empty(bad.size, dtype=bool)            # a region starts at a wide gap or in a new text
    new[0] = True
    new[1:] = (np.diff(bad) > MERGE_GAP) | (np.diff(owner) != 0)
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, bad.size - 1)
    lo = np.maximum(bad[first] - 1, begins[owner[first]]).tolist()
    hi = (bad[last] + 1).tolist()
    dirty = [joined[x:y] for x, y in zip(lo, hi)]
    sep = next((c for c in "\x00\x01\x02\x03\x04\x05\x06\x07\x08" if not any(c in d for d in dirty)), None)
    done = reference_nfc(sep.join(dirty)).split(sep) if sep is not None else None
    if done is None or len(done) != len(dirty):     # (no free separator, or the normalizer produced one)
        done = [reference_nfc(d) for d in dirty]
    if done == dirty:
        return texts
    out = list(texts)
    starts = begins.tolist()
    by_text: dict[int, list[tuple[int, int, str]]] = {}
    for k, i in enumerate(owner[first].tolist()):
        if done[k] != dirty[k]:
            by_text.setdefault(i, []).append((lo[k] - starts[i], hi[k] - starts[i], done[k]))
    for i, parts in by_text.items():
        text, pieces, prev = texts[i], [], 0
        for x, y, d in parts:
            pieces += [text[prev:x], d]
            prev = y
        pieces.append(text[prev:])
        out[i] = "".join(pieces)
    return out


def changes(text: str, reference_nfc: Callable[[str], str]) -> list[tuple[int, int, str]]:
    """The regions of text that NFC changes, in order, as (start, end, NFC of text[start:end]): NFC(text), as
    `reference_nfc` computes it on the whole text, is text with each region replaced. The reference normalizer is
    called only on the regions that can change (see the module docstring)."""
    if text.isascii():
        return []
    if len(text) < PRECHECK_TEXT and all_inert(text):
        return []
    if len(text) < SMALL_TEXT:
        done = reference_nfc(text)
        return [] if done == text else [(0, len(text), done)]
    return _changed(text, regions(text), reference_nfc)


def changes_in(text: str, a: int, b: int, reference_nfc: Callable[[str], str]) -> list[tuple[int, int, str]]:
    """`changes` of text[a:b], as positions in text, without slicing it: the scan reads text[a:b] in place
    (GIL-free: a chunk thread of the parallel encoder scans its own chunk) and the reference normalizer sees only
    the regions. a and b must be positions NFC cannot act across (the text's ends, or cuts with inert characters
    around them: parallel.py); then `splice(text, a, b, changes_in(text, a, b, nfc))` is NFC(text[a:b])."""
    return _changed(text, _spans(false_at(text, inert_table(), a, b), a), reference_nfc)


def _changed(text: str, spans: np.ndarray, reference_nfc: Callable[[str], str]) -> list[tuple[int, int, str]]:
    """The regions among `spans` (int64[k, 2], as `regions` gives them) that NFC changes, with their NFC."""
    if spans.shape[0] == 0:
        return []
    bounds = spans.tolist()
    dirty = [text[a:b] for a, b in bounds]
    # only the regions are joined: a separator that none of them holds will do (no scan of the whole text)
    sep = next((s for s in "\x00\x01\x02\x03\x04\x05\x06\x07\x08" if not any(s in d for d in dirty)), None)
    if sep is None:
        done_list = [reference_nfc(d) for d in dirty]
    else:
        # sep is inert and every region starts at an inert code point (or at the scan's start, only the first), so
        # one call over the joined regions equals one call per region; NFC never produces a control character.
        done_list = reference_nfc(sep.join(dirty)).split(sep)
        if len(done_list) != len(dirty):   # pragma: no cover - would mean the normalizer produced sep
            done_list = [reference_nfc(d) for d in dirty]
    return [(a, b, d) for (a, b), d, old in zip(bounds, done_list, dirty) if d != old]


def normalize(text: str, reference_nfc: Callable[[str], str]) -> str:
    """NFC(text) computed as `reference_nfc` would on the whole text, calling it only on the regions that can
    change (see the module docstring); the same str when nothing changes (real text's usual case: no copy)."""
    found = changes(text, reference_nfc)
    if not found:
        return text
    out = splice(text, 0, len(text), found)
    assert out is not None      # (no region crosses the text's own ends)
    return out


def splice(text: str, a: int, b: int, found: list[tuple[int, int, str]], k: int = 0) -> str | None:
    """NFC of text[a:b] from `changes(text)` (`found`; found[k] the first region that ends after a): the text between
    the regions and their normalized forms, with no second scan. a and b must be positions NFC cannot act across
    (the text's ends, or cuts with inert characters around them: parallel.py); None when a region crosses a or b
    (one merged across inert characters with such a cut among them): the caller normalizes text[a:b] anew."""
    out: list[str] = []
    prev = a
    while k < len(found) and found[k][0] < b:
        x, y, d = found[k]
        if x < a or y > b:
            return None
        out.append(text[prev:x])
        out.append(d)
        prev = y
        k += 1
    out.append(text[prev:b])
    return "".join(out)
