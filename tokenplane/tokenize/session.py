"""Session: per-session token state with certified incremental repair (appends, mid-context edits, full resends).

Contract: after every call, `session.ids` equals `tokenizer.encode(session.text, allowed_special=...)`, or the call
raised and the session is unchanged. Repair never trusts a heuristic: a window of fresh reference tokens is spliced
onto the cached ones only at a position the family's stable-boundary predicate (boundary.py, docs/boundaries.md)
proves synchronizing, inside a run of agreeing (position, ID) records of >= 2 tokens covering more characters than the
longest vocabulary token. Otherwise the window doubles (up to `max_widenings` times) and finally the whole text is
encoded. A miss costs time, never correctness.

State (all in normalized-text coordinates): ids uint32 and ends uint32 (character end of each token) in arrays that
grow by an eighth (at most 12.5% slack: ~9 bytes/token) and are edited in place, so an append does O(delta + window)
work, not O(context). Text is kept in a chunked store (textstore.py); families with plain NFC (qwen3) keep the raw
text the user sent plus a map of the regions where its NFC differs (nfcmap.py: the normalized text is read through
it, and edits stay local); with allowed specials, the normalized text is kept beside the raw one instead. The
splice-point search is splice.py (numba kernels over the window text and the record arrays). A mutation is
planned first (`_Plan`: text, literal and record changes as values) and applied by `_commit`. A session is
single-writer: callers serialize mutations.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Collection, Literal

import numpy as np

from .cpu import boundary
from .cpu.segments import MAX_CHARS as SEGMENTS_MAX_CHARS
from .cpu.segments import encode_segments, with_literals
from .errors import SessionError, StaleRevisionError, TextTooLargeError, validate_text  # noqa: F401
from .nfcmap import MappedText, NfcMap, build_map
from .records import move_right_part
from .router import segment_encoder
from .splice import Point, SpliceSearch
from .textstore import (
    Append,
    Replace,
    SetText,
    SplicedText,
    TextChange,
    TextReader,
    TextStore,
    common_prefix_len,
    common_suffix_len,
)

if TYPE_CHECKING:   # type names only: tokenizer.py imports this module, never the other way round
    from .tokenizer import Tokenizer

DEFAULT_WINDOW = 512
MAX_WIDENINGS = 5
_NFC_REACH = 1 << 16        # how far an NFC split point (an ASCII character) is searched for before a full renormalize
_MIN_CAPACITY = 64          # records allocated for an empty session
_GROWTH = 8                 # arrays grow to n + n / _GROWTH records: at most 12.5% slack, ~9 bytes/token


@dataclass(frozen=True)
class Splice:
    """The change to the ID sequence: new_ids == old_ids[:keep] + ids."""
    keep: int
    ids: np.ndarray
    revision: int
    path: Literal["window", "full", "noop"] = "window"


@dataclass
class SessionStats:
    repairs: int = 0                # mutations of a non-empty session
    windows_tried: int = 0
    widenings: int = 0
    first_window_accepts: int = 0   # repairs certified on the first (w=512) window
    full_fallbacks: int = 0         # repairs that exhausted the widenings and encoded everything
    full_encodes: int = 0           # all full encodes (fallbacks, bootstrap, unsupported family)
    renormalizations: int = 0       # full NFC recomputations (documented O(N) cases)
    last_repair_s: float = 0.0
    last_encode_s: float = 0.0      # part of last_repair_s spent inside the reference engine (the rest: bookkeeping)
    total_repair_s: float = 0.0
    last_path: str = ""

    def to_dict(self) -> dict[str, int | float | str]:
        """Plain JSON-able values (counters may be numpy scalars after array arithmetic)."""
        return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in self.__dict__.items()}


# -- repair plan --------------------------------------------------------------------------------------------------
# A literal entry: (raw_start, raw_end, norm_start, norm_end, id), id = -1 for a literal that is not allowed.
LiteralEntry = tuple[int, int, int, int, int]


@dataclass(frozen=True)
class ReplaceLiteralsFrom:
    """Literal entries from index `keep` on are replaced by `added` (an append rescans only the tail)."""
    keep: int
    added: list[LiteralEntry]

    def apply(self, entries: list[LiteralEntry]) -> list[LiteralEntry]:
        del entries[self.keep:]
        entries.extend(self.added)
        return entries


@dataclass(frozen=True)
class SetLiterals:
    entries: list[LiteralEntry]

    def apply(self, entries: list[LiteralEntry]) -> list[LiteralEntry]:
        return self.entries


@dataclass
class _Plan:
    """Everything a mutation changes, computed before anything is mutated."""
    raw_change: TextChange
    norm_change: TextChange | None              # None: the normalized text equals the raw text
    lits: ReplaceLiteralsFrom | SetLiterals | None    # None: literal entries unchanged
    keep: int = 0
    mid_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    mid_ends: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    right_from: int = 0                         # old record index where the shifted right part starts
    delta: int = 0
    path: Literal["window", "full", "noop"] = "window"
    attempts: int = 0
    nmap: NfcMap | None = None                  # the NFC map after the change (None: unchanged)


class Session:
    """Token state of one growing (or edited) context. See the module docstring for the contract."""

    def __init__(self, tokenizer: Tokenizer, *, text: str | bytes = "",
                 allowed_special: Collection[str] | Literal["all"] = (), window: int = DEFAULT_WINDOW,
                 max_widenings: int = MAX_WIDENINGS, certify: bool = True, encode_path: str = "auto"):
        if not isinstance(window, int) or window < 1 or not isinstance(max_widenings, int) or max_widenings < 0:
            raise SessionError("window must be a positive int and max_widenings a non-negative int")
        self.tokenizer = tokenizer
        self.reference = tokenizer.reference
        self.window, self.max_widenings = window, max_widenings
        # Which encoder fills windows: the reference engine, or a registered exact path of the tokenizer ("auto",
        # "cpu", "gpu"; same contract: reference IDs). Ends are derived from token byte lengths either way. The
        # default "auto" is the CPU path, built on its first use (for qwen3, HF's encode of a 2K-char window costs
        # ~12 ms; the CPU path ~0.3 ms).
        self.encode_path = encode_path
        self.allowed_special = tokenizer.resolve_allowed(allowed_special)
        self._nfc = tokenizer.family.normalizer is not None
        # certify=False disables the fast path (baseline flag on the same code path: every call encodes fully).
        self.rule = boundary.rule_for(tokenizer.family) if certify else None
        if self._nfc and any(not s.isascii() for s in self.allowed_special):
            self.rule = None     # split points for NFC assume ASCII literals (docs/boundaries.md)
        self._literals = bool(self.allowed_special)    # track special-token literals (only when some are allowed)
        # Raw <-> normalized offsets (nfcmap.py) keep NFC edits local; sessions with allowed literals normalize
        # between literals and renormalize on edits instead (documented O(N) case).
        self._mapped = self._nfc and not self._literals and tokenizer.reference.plain_nfc
        self._maxlit = max((len(s) for s in tokenizer.specials), default=1)
        self._cont = self.reference.continuation_start
        self._is_special = tokenizer.special_mask(self.allowed_special)
        sig, pair = boundary.pair_table(self.rule) if self.rule is not None else (None, None)
        self._search = SpliceSearch(self._cont, tokenizer.max_token_chars, sig, pair)
        self._encode_s = 0.0
        self._clear()
        if text:
            self.append(text)

    def _clear(self) -> None:
        """The state of an empty session at revision 0."""
        self._raw = TextStore()
        self._norm: TextStore | None = None          # None while the normalized text equals the raw text
        self._nmap: NfcMap | None = NfcMap() if self._mapped else None
        # Literal (special-token string) matches of the allowed-special scan, raw coordinates, sorted.
        self._lits: list[LiteralEntry] = []
        self._ids = np.zeros(_MIN_CAPACITY, dtype=np.uint32)
        self._ends = np.zeros(_MIN_CAPACITY, dtype=np.uint32)
        self._n = 0
        self.revision = 0
        self.stats = SessionStats()

    # -- read side ------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._n

    @property
    def ids(self) -> np.ndarray:
        """Current IDs: a read-only zero-copy view, valid until the next mutation."""
        v = self._ids[:self._n]
        v.flags.writeable = False
        return v

    @property
    def ends(self) -> np.ndarray:
        """Character end of each token in the normalized text (read-only view)."""
        v = self._ends[:self._n]
        v.flags.writeable = False
        return v

    @property
    def text(self) -> str:
        """The raw text the user sent (joined lazily, then cached as one chunk)."""
        return self._raw.joined()

    @property
    def normalized_text(self) -> str:
        return self._normtext.joined()

    @property
    def _normtext(self) -> TextReader:
        if self._nmap is not None and len(self._nmap):
            return MappedText(self._raw, self._nmap)
        return self._raw if self._norm is None else self._norm

    @property
    def nbytes(self) -> int:
        """Resident bytes of the state: id/end arrays (allocated capacity), text chunks, literal index."""
        seen: set[int] = set()
        text = self._raw.nbytes(seen) + (self._norm.nbytes(seen) if self._norm is not None else 0)
        text += self._nmap.nbytes() if self._nmap is not None else 0
        return self._ids.nbytes + self._ends.nbytes + text + 72 * len(self._lits)

    @property
    def array_nbytes(self) -> int:
        return self._ids.nbytes + self._ends.nbytes

    # -- write side -----------------------------------------------------------------------------------------------
    def append(self, text: str | bytes, *, expect_revision: int | None = None) -> Splice:
        """Append raw text; returns the splice that turns the previous IDs into the new ones."""
        self._check_revision(expect_revision)
        text = validate_text(text, self.tokenizer.max_chars)
        if len(self._raw) + len(text) > self.tokenizer.max_chars:
            raise TextTooLargeError(f"session would hold {len(self._raw) + len(text):,} characters; "
                                    f"the limit is {self.tokenizer.max_chars:,}")
        if not text:
            return Splice(self._n, np.zeros(0, np.uint32), self.revision, "noop")
        t0 = time.perf_counter()
        self._encode_s = 0.0
        plan = self._plan_append(text)
        return self._commit(plan, t0)

    def edit(self, start: int, end: int, replacement: str | bytes = "", *,
             expect_revision: int | None = None) -> Splice:
        """Replace text[start:end] (character offsets into `text`) by `replacement`."""
        self._check_revision(expect_revision)
        length = len(self._raw)
        for v in (start, end):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise SessionError(f"edit offsets must be ints, got {type(v).__name__}")
        start, end = int(start), int(end)
        if not 0 <= start <= end <= length:
            raise SessionError(f"edit range [{start}, {end}) is outside the text [0, {length}]")
        replacement = validate_text(replacement, self.tokenizer.max_chars)
        if length - (end - start) + len(replacement) > self.tokenizer.max_chars:
            raise TextTooLargeError("edited text exceeds the tokenizer's size limit")
        if end == length and start == end:
            return self.append(replacement)
        old = self._raw.slice(start, end)
        if old == replacement:
            return Splice(self._n, np.zeros(0, np.uint32), self.revision, "noop")
        t0 = time.perf_counter()
        self._encode_s = 0.0
        plan = self._plan_edit(start, end, replacement)
        return self._commit(plan, t0)

    def sync(self, full_text: str | bytes, *, expect_revision: int | None = None) -> Splice:
        """Bring the session to `full_text` (clients that resend the whole context): an append when the stored text
        is a prefix, else an edit of the changed middle (common prefix and suffix kept)."""
        self._check_revision(expect_revision)
        if isinstance(full_text, str):
            # Validate only what is new: the kept prefix (and suffix) equal the stored, already validated text, and
            # the comparison runs on the str's own buffer (memcmp for chunks of the same kind). append/edit below
            # validate the new tail or middle (lone surrogates refused with the same error, session unchanged).
            if len(full_text) > self.tokenizer.max_chars:
                raise TextTooLargeError(f"input has {len(full_text):,} characters; "
                                        f"the limit is {self.tokenizer.max_chars:,}")
        else:
            full_text = validate_text(full_text, self.tokenizer.max_chars)    # bytes: decoding validates them
        length = len(self._raw)
        if self._raw.is_prefix_of(full_text):
            return self.append(full_text[length:])
        cp = self._raw.common_prefix(full_text)
        cs = self._raw.common_suffix(full_text, min(length, len(full_text)) - cp)
        return self.edit(cp, length - cs, full_text[cp:len(full_text) - cs])

    def reset(self, text: str | bytes = "", *, expect_revision: int | None = None) -> Splice:
        """Drop the state and start over from `text` (a session-state miss)."""
        self._check_revision(expect_revision)
        text = validate_text(text, self.tokenizer.max_chars)
        saved = (self._raw, self._norm, self._lits, self._ids, self._ends, self._n, self.revision, self.stats,
                 self._nmap)
        try:
            self._clear()
            self.append(text)
        except BaseException:
            (self._raw, self._norm, self._lits, self._ids, self._ends, self._n, self.revision, self.stats,
             self._nmap) = saved
            raise
        self.stats, self.revision = saved[7], saved[6] + 1     # counters and revision continue across a reset
        return Splice(0, self._ids[:self._n].copy(), self.revision, "full")

    def _check_revision(self, expect: int | None) -> None:
        if expect is not None and expect != self.revision:
            raise StaleRevisionError(f"expected revision {expect}, session is at {self.revision}")

    # -- literals (allowed special tokens) ------------------------------------------------------------------------
    def _scan(self, text: str, offset: int) -> list[tuple[int, int, int]]:
        """Literal matches of the special scan (same regex and order as Tokenizer.encode): (start, end, id|-1)."""
        specials, allowed = self.tokenizer.specials, self.allowed_special
        return [(offset + a, offset + b, specials[lit] if lit in allowed else -1)
                for a, b, lit in self.tokenizer.special_matches(text)]

    # -- planning -------------------------------------------------------------------------------------------------
    def _plan_append(self, text: str) -> _Plan:
        L0 = len(self._raw)
        norm = self._normtext
        N0 = len(norm)
        struct_raw = L0                         # first raw position whose segmentation may differ
        found: list[tuple[int, int, int]] = []
        keep_lits = len(self._lits)
        if self._literals:
            lo = max(0, L0 - self._maxlit + 1)
            keep_lits = bisect.bisect_left(self._lits, (lo,))
            restart = max(lo, self._lits[keep_lits - 1][1] if keep_lits else 0)
            found = self._scan(self._raw.slice(restart, L0) + text, restart)
            old_tail = [(a, b, sid) for a, b, _, _, sid in self._lits[keep_lits:]]
            new_head = [x for x in found if x[0] < L0]
            if old_tail != new_head:
                diff = [x[0] for x in old_tail if x not in new_head] + [x[0] for x in new_head if x not in old_tail]
                struct_raw = min(diff)
        if self._nfc and struct_raw < L0:
            return self._plan_rebuild(self._raw.joined() + text, Append(text))
        # The normalized middle `mid` replaces norm[d0:N0]; allowed literals get normalized coordinates.
        new_map = None
        if not self._nfc:
            d0, mid, struct = N0, text, struct_raw
            keep_from, added = keep_lits, [(a, b, a, b, sid) for a, b, sid in found]
        elif self._nmap is not None:
            # split in raw coordinates (outside any non-NFC region), mapped to normalized ones
            q = self._raw.nfc_split_before(L0, 0, _NFC_REACH)
            if q is None:
                return self._plan_rebuild(self._raw.joined() + text, Append(text))
            q = self._nmap.widen(q, L0)[0]
            d0 = self._nmap.to_norm(q)
            raw_mid = self._raw.slice(q, L0) + text
            mid, inner = build_map(raw_mid, self.tokenizer.normalize)
            struct, keep_from, added = N0, 0, []
            new_map = self._nmap.replace(q, L0, d0, N0, len(raw_mid), len(mid), inner)
        else:
            last = next((e for e in reversed(self._lits) if e[4] >= 0), None)
            store = self._raw if self._norm is None else self._norm     # unmapped: the normalized store
            split = store.nfc_split_before(N0, last[3] if last else 0, _NFC_REACH)
            if split is None:
                return self._plan_rebuild(self._raw.joined() + text, Append(text))
            d0 = split
            # struct_raw == L0 here: the old literal entries all stand; walk the new ones
            keep_from, added, pieces, cur, pos, raw_pos = len(self._lits), [], [], norm.slice(d0, N0), d0, L0
            for a, b, sid in (x for x in found if x[0] >= L0):
                if sid < 0:
                    added.append((a, b, -1, -1, -1))
                    continue
                seg = self.tokenizer.normalize(cur + text[raw_pos - L0:a - L0])
                lit = text[a - L0:b - L0]
                pieces += [seg, lit]
                added.append((a, b, pos + len(seg), pos + len(seg) + len(lit), sid))
                pos += len(seg) + len(lit)
                cur, raw_pos = "", b
            pieces.append(self.tokenizer.normalize(cur + text[raw_pos - L0:]))
            mid, struct = "".join(pieces), N0
        new = SplicedText(norm, d0, mid, N0)
        d = min(d0 + common_prefix_len(norm.slice(d0, N0), mid, 0), struct)
        if new_map is not None:
            raw_is_norm = not len(new_map)
        else:
            raw_is_norm = self._norm is None and (not self._nfc or mid == norm.slice(d0, N0) + text)
        plan = _Plan(raw_change=Append(text),
                     norm_change=None if raw_is_norm else Replace(d0, N0, mid),
                     lits=ReplaceLiteralsFrom(keep_from, added) if self._literals else None, nmap=new_map)
        added_sp = [(e[2], e[3], e[4]) for e in added if e[4] >= 0]

        def specials(lo: int, hi: int) -> list[tuple[int, int, int]]:
            """Allowed literals inside [lo, hi) in normalized coordinates: O(literals in range), not O(session)."""
            if not self._literals:
                return []
            out = []
            for e in reversed(self._lits[:keep_from]) if keep_from else ():
                if e[4] >= 0:
                    if e[3] <= lo:
                        break
                    out.append((e[2], e[3], e[4]))
            out.reverse()
            return [x for x in out + added_sp if x[1] > lo and x[0] < hi]

        self._repair(plan, new, d, new.length, specials)
        return plan

    def _plan_edit(self, start: int, end: int, replacement: str) -> _Plan:
        raw_len = len(self._raw)
        if self._literals or (self._nfc and self._nmap is None and self._norm is not None):
            new_raw = self._raw.slice(0, start) + replacement + self._raw.slice(end, raw_len)
            return self._plan_rebuild(new_raw, SetText(new_raw))
        raw, norm = self._raw, self._normtext
        new_map = None
        if not self._nfc:
            d0, e_old, mid = start, end, replacement
            raw_is_norm = True
        else:
            lo = raw.nfc_split_before(start, 0, _NFC_REACH)
            hi = raw.nfc_split_after(end, _NFC_REACH)
            if lo is None or hi is None:
                new_raw = raw.slice(0, start) + replacement + raw.slice(end, raw_len)
                return self._plan_rebuild(new_raw, SetText(new_raw))
            nmap = self._nmap if self._nmap is not None else NfcMap()
            lo, hi = nmap.widen(lo, hi)
            d0, e_old = nmap.to_norm(lo), nmap.to_norm(hi)
            raw_mid = raw.slice(lo, start) + replacement + raw.slice(end, hi)
            if self._nmap is not None:
                mid, inner = build_map(raw_mid, self.tokenizer.normalize)
                new_map = nmap.replace(lo, hi, d0, e_old, len(raw_mid), len(mid), inner)
                raw_is_norm = not len(new_map)
            else:
                mid = self.tokenizer.normalize(raw_mid)
                raw_is_norm = mid == raw_mid
        old_mid = norm.slice(d0, e_old)
        cp = common_prefix_len(old_mid, mid, 0)
        cs = common_suffix_len(old_mid[cp:], mid[cp:])
        new = SplicedText(norm, d0, mid, e_old)
        plan = _Plan(raw_change=Replace(start, end, replacement),
                     norm_change=None if raw_is_norm else Replace(d0, e_old, mid), lits=None, nmap=new_map)
        self._repair(plan, new, d0 + cp, d0 + len(mid) - cs, lambda lo, hi: [])
        return plan

    def _plan_rebuild(self, new_raw: str, raw_change: TextChange) -> _Plan:
        """Full renormalization / literal rescan of the new raw text, then the same certified repair on the diff.
        O(N) in the text (documented: edits with allowed specials, edits of NFC text whose raw form is not NFC)."""
        self.stats.renormalizations += 1
        lits = self._scan(new_raw, 0) if self._literals else []
        pieces, entries, pos, raw_pos = [], [], 0, 0
        for a, b, sid in lits:
            if sid < 0:
                entries.append((a, b, -1, -1, -1))
                continue
            seg = self.tokenizer.normalize(new_raw[raw_pos:a]) if self._nfc else new_raw[raw_pos:a]
            lit = new_raw[a:b]
            pieces += [seg, lit]
            entries.append((a, b, pos + len(seg), pos + len(seg) + len(lit), sid))
            pos += len(seg) + len(lit)
            raw_pos = b
        new_map = None
        if self._mapped:       # no literals: one span, normalized region by region with its map
            new_norm, new_map = build_map(new_raw, self.tokenizer.normalize)
        else:
            pieces.append(self.tokenizer.normalize(new_raw[raw_pos:]) if self._nfc else new_raw[raw_pos:])
            new_norm = "".join(pieces)
        old_norm = self._normtext.joined()
        old_sp = [(e[2], e[3], e[4]) for e in self._lits if e[4] >= 0]
        new_sp = [(e[2], e[3], e[4]) for e in entries if e[4] >= 0]
        delta = len(new_norm) - len(old_norm)
        d = common_prefix_len(old_norm, new_norm, 0)
        cs = common_suffix_len(old_norm[d:], new_norm[d:])
        e_new = len(new_norm) - cs
        # segmentation must agree on the kept prefix and the kept (shifted) suffix
        k = 0
        while k < min(len(old_sp), len(new_sp)) and old_sp[k] == new_sp[k]:
            k += 1
        if k < len(old_sp) or k < len(new_sp):
            firsts = [old_sp[k][0]] if k < len(old_sp) else []
            firsts += [new_sp[k][0]] if k < len(new_sp) else []
            d = min(d, *firsts)
        j = 0
        while (j < min(len(old_sp), len(new_sp)) - k
               and (old_sp[-1 - j][0] + delta, old_sp[-1 - j][1] + delta, old_sp[-1 - j][2]) == new_sp[-1 - j]):
            j += 1
        if len(new_sp) - j > k or len(old_sp) - j > k:
            lasts = [new_sp[len(new_sp) - j - 1][1]] if len(new_sp) - j - 1 >= 0 else []
            lasts += [old_sp[len(old_sp) - j - 1][1] + delta] if len(old_sp) - j - 1 >= 0 else []
            e_new = max(e_new, *lasts)
        d = min(d, e_new)
        e_old = e_new - delta
        raw_is_norm = new_norm == new_raw
        plan = _Plan(raw_change=raw_change, norm_change=None if raw_is_norm else SetText(new_norm),
                     lits=SetLiterals(entries) if self._literals else None, nmap=new_map)
        new = SplicedText(TextStore([old_norm]), d, new_norm[d:e_new], e_old)
        self._repair(plan, new, d, e_new, lambda lo, hi: [x for x in new_sp if x[1] > lo and x[0] < hi])
        return plan

    # -- the certified repair -------------------------------------------------------------------------------------
    def _repair(self, plan: _Plan, new: SplicedText, d: int, e_new: int, specials: Callable[[int, int], list]) -> None:
        """Fill plan's record splice for new text that equals the old text on [0, d) and on [e_new, end) (shifted by
        new.delta), with the same literal segmentation there."""
        n = self._n
        plan.delta = new.delta
        new_len = new.length
        rule = self.rule
        if n and rule is not None:
            self.stats.repairs += 1
            for attempt in range(self.max_widenings + 1):
                w = self.window << attempt
                s = self._window_start(d - w, d)
                if self._literals:
                    s = self._after_literal(s, d, specials)
                r = new_len
                if e_new + w < new_len:
                    r = self._window_end(e_new + w, specials(e_new + w - 1, e_new + w + 1))
                plan.attempts = attempt + 1
                sp = specials(s, r)
                text = new.slice(s, r)
                fresh = self._encode_window(text, s, r, sp)
                if fresh is None:
                    continue
                f_ids, f_ends = fresh
                left = self._find_left(text, s, d, f_ids, f_ends, sp)
                if left is None:
                    continue
                right = self._find_right(text, s, e_new, r, new_len, f_ids, f_ends, sp, new.delta)
                if right is None:
                    continue
                self._fill_window(plan, s, left, right, f_ids, f_ends)
                plan.path = "window"
                if attempt == 0:
                    self.stats.first_window_accepts += 1
                return
            self.stats.full_fallbacks += 1
        elif n:
            self.stats.repairs += 1
        self.stats.full_encodes += 1
        full = self._encode_window(new.slice(0, new_len), 0, new_len, specials(0, new_len), check=False)
        assert full is not None     # check=False never refuses
        f_ids, f_ends = full
        m = min(n, len(f_ids))
        neq = np.flatnonzero(self._ids[:m] != f_ids[:m])
        keep = int(neq[0]) if len(neq) else m
        plan.keep, plan.mid_ids, plan.mid_ends = keep, f_ids[keep:], f_ends[keep:]
        plan.right_from, plan.path = n, "full"

    def _window_start(self, target: int, d: int) -> int:
        """A clean cached token boundary <= target (a character boundary no token straddles); ASCII for NFC."""
        if target <= 0:
            return 0
        ends, ids = self._ends[:self._n], self._ids[:self._n]
        norm = self._normtext
        i = self._search.clean_before(ends, ids, target)
        if i < 0:
            return 0
        pos = int(ends[i])
        if not self._nfc or norm.char(pos) < "\x80":
            return pos
        fallback = pos
        for _ in range(255):         # NFC: the window must start at an ASCII character (a split point)
            i = self._search.clean_before(ends, ids, target, i - 1)
            if i < 0:
                return 0
            pos = int(ends[i])
            if norm.char(pos) < "\x80":
                return pos
        return fallback

    def _after_literal(self, s: int, d: int, specials) -> int:
        """The window may start right after the last allowed literal in [s, d]: a literal is always split out of the
        encode, so its end is a certified splice point and the text before it needs no re-encoding (a chat prompt
        ends in its template's control tokens, so an appended turn re-encodes little more than itself)."""
        edge = max((b for _, b, _ in specials(s, d + 1) if b <= d), default=s)
        if edge <= s:
            return s
        if self._nfc and (edge >= len(self._normtext) or self._normtext.char(edge) >= "\x80"):
            return s     # NFC windows start at an ASCII character (a normalization split point)
        return edge

    @staticmethod
    def _window_end(target: int, specials) -> int:
        for a, b, _ in specials:          # never cut a literal
            if a < target < b:
                return a
        return target

    def _encode_window(self, text: str, s: int, r: int, specials, check: bool = True):
        """Reference records of text = new[s:r] (literals split out), ends absolute. None if an NFC self-check
        fails."""
        inside = [(a - s, b - s, sid) for a, b, sid in specials if s <= a and b <= r]
        spans, pos = [], 0
        for a, b, _ in inside:
            spans.append((pos, a))
            pos = b
        spans.append((pos, r - s))
        spans = [(a, b) for a, b in spans if a < b]
        if self._nfc and check:
            for a, b in spans:
                t = text[a:b]
                if not t.isascii() and self.tokenizer.normalize(t) != t:
                    return None
        t0 = time.perf_counter()
        ids, ends, counts = self._ordinary_records(text, spans)
        self._encode_s += time.perf_counter() - t0
        ids, ends = with_literals(ids, ends, counts, spans, inside)
        return ids, ends + s

    def _ordinary_records(self, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, list]:
        """(ids uint32, ends int64 in characters of text, token count per span) of each span encoded on its own:
        one batched call on the CPU path (cpu/segments.py), else one encode per span."""
        if not spans:
            return np.zeros(0, np.uint32), np.zeros(0, np.int64), []
        if self.encode_path != "reference" and spans[-1][1] - spans[0][0] < SEGMENTS_MAX_CHARS:
            cpu = segment_encoder(self.tokenizer.path(self.encode_path), max(b - a for a, b in spans))
            if cpu is not None:
                out = encode_segments(cpu.bpe, self.tokenizer.family.name, text, spans)
                if out is not None:
                    return out[0], out[1], out[2].tolist()
        id_parts, end_parts, counts = [], [], []
        for a, b in spans:
            t = text[a:b]
            if self.encode_path == "reference":
                ids = self.reference.encode_ordinary_normalized(t)
            else:
                ids = self.tokenizer.encode_ordinary(t, path=self.encode_path)
            id_parts.append(np.asarray(ids, dtype=np.uint32))
            end_parts.append(self.reference.char_ends(t, ids) + a)
            counts.append(len(ids))
        return np.concatenate(id_parts), np.concatenate(end_parts).astype(np.int64, copy=False), counts

    def _find_left(self, text: str, s: int, d: int, f_ids: np.ndarray, f_ends: np.ndarray,
                   specials: list[tuple[int, int, int]]) -> Point | None:
        """Rightmost certified splice point p in [s, d]: (p, cached index, fresh index); text = new[s:r]."""
        hard = [s] if s == 0 or self._is_special_edge(s) else []
        for a, b, _ in specials:
            if s <= b <= d:
                hard += [x for x in (a, b) if x >= s]
        return self._search.point(text, s, s, d, hard, *self._records(), f_ids, f_ends, rightmost=True, shift=0,
                                  fresh_origin=s)

    def _find_right(self, text: str, s: int, e_new: int, r: int, new_len: int, f_ids: np.ndarray,
                    f_ends: np.ndarray, specials: list[tuple[int, int, int]], delta: int) -> Point | None:
        """Leftmost certified splice point q in [e_new, r]: (q, cached index of q - delta, fresh index)."""
        if r >= new_len and e_new >= new_len:
            return new_len, self._n - 1, len(f_ids) - 1
        hard = [new_len] if r >= new_len else []
        for a, b, _ in specials:
            if a >= e_new and b <= r:
                hard += [a, b]
        # fresh_origin -1: the fresh window starts left of e_new, so a fresh index must be a real record (>= 0)
        return self._search.point(text, s, e_new, r, hard, *self._records(), f_ids, f_ends, rightmost=False,
                                  shift=delta, fresh_origin=-1)

    def _records(self) -> tuple[np.ndarray, np.ndarray]:
        """The cached (ids, ends) records as views."""
        return self._ids[:self._n], self._ends[:self._n]

    def _is_special_edge(self, pos: int) -> bool:
        if not self._literals:
            return False
        i = int(np.searchsorted(self._ends[:self._n], np.uint32(pos), side="right")) - 1
        if i >= 0 and self._ends[i] == pos and self._is_special[self._ids[i]]:
            return True
        return i + 1 < self._n and self._is_special[self._ids[i + 1]] and (i < 0 or self._ends[i] == pos)

    def _fill_window(self, plan: _Plan, s: int, left, right, f_ids, f_ends) -> None:
        p, ci_p, fj_p = left
        q, ci_q, fj_q = right
        mid_ids = f_ids[fj_p + 1:fj_q + 1]
        mid_ends = f_ends[fj_p + 1:fj_q + 1]
        # keep cached tokens that equal the fresh ones after p (same start, same IDs -> same records)
        cap = min(len(mid_ids), max(0, ci_q - ci_p))
        neq = np.flatnonzero(self._ids[ci_p + 1:ci_p + 1 + cap] != mid_ids[:cap])
        k = int(neq[0]) if len(neq) else cap
        plan.keep = ci_p + 1 + k
        plan.mid_ids, plan.mid_ends = mid_ids[k:], mid_ends[k:]
        plan.right_from = ci_q + 1

    # -- commit ---------------------------------------------------------------------------------------------------
    def _commit(self, plan: _Plan, t0: float) -> Splice:
        n, keep, right_from = self._n, plan.keep, plan.right_from
        n_mid, n_right = len(plan.mid_ids), n - right_from
        new_n = keep + n_mid + n_right
        ids, ends = self._ids, self._ends
        if new_n > len(ids):
            cap = new_n + new_n // _GROWTH + 16
            ids2, ends2 = np.empty(cap, np.uint32), np.empty(cap, np.uint32)
            ids2[:keep], ends2[:keep] = ids[:keep], ends[:keep]
            ids2[keep + n_mid:new_n] = ids[right_from:n]
            ends2[keep + n_mid:new_n] = ends[right_from:n]
            ids, ends = ids2, ends2
            move_right_part(ids, ends, keep + n_mid, keep + n_mid, n_right, plan.delta)
        else:
            move_right_part(ids, ends, right_from, keep + n_mid, n_right, plan.delta)
        ids[keep:keep + n_mid] = plan.mid_ids
        ends[keep:keep + n_mid] = plan.mid_ends
        self._ids, self._ends, self._n = ids, ends, new_n
        # text: the normalized store splits off the raw one (sharing its chunks) the first time they differ
        norm = None
        if plan.norm_change is not None and not self._mapped:   # mapped: the map holds the normalized regions
            norm = self._norm if self._norm is not None else self._raw.copy()
        self._raw = self._raw.apply(plan.raw_change)
        self._norm = norm.apply(plan.norm_change) if norm is not None and plan.norm_change is not None else None
        if plan.lits is not None:
            self._lits = plan.lits.apply(self._lits)
        if plan.nmap is not None:
            self._nmap = plan.nmap
        self.revision += 1
        dt = time.perf_counter() - t0
        self.stats.last_repair_s = dt
        self.stats.last_encode_s = self._encode_s
        self.stats.total_repair_s += dt
        self.stats.windows_tried += plan.attempts
        self.stats.widenings += max(0, plan.attempts - 1)
        self.stats.last_path = plan.path
        return Splice(keep, self._ids[keep:new_n].copy(), self.revision, plan.path)
