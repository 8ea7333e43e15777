"""Session: per-session token state with certified incremental repair (appends, mid-context edits, full resends).

Contract: after every call, `session.ids` equals `tokenizer.encode(session.text, allowed_special=...)`, or the call
raised and the session is unchanged. Repair never trusts a heuristic: a window of fresh reference tokens is spliced
onto the cached ones only at a position the family's stable-boundary predicate (boundary.py, docs/boundaries.md)
proves synchronizing, inside a run of agreeing (position, ID) records of >= 2 tokens covering more characters than the
longest vocabulary token. Otherwise the window doubles (up to `max_widenings` times) and finally the whole text is
encoded. A miss costs time, never correctness.

State (all in normalized-text coordinates): token records (records.py: uint32 IDs edited in place and grown by a
fraction, each token's character end derived from its ID, ~4.3 bytes/token), so an append does O(delta + window)
work, not O(context). Text is kept once, in a chunked store (textstore.py); families with plain NFC (qwen3) keep the
raw text the user sent plus a map of the regions where its NFC differs (nfcmap.py: the normalized text is read
through it, and edits stay local); with allowed specials, the normalized text is kept beside the raw one instead. A
mutation is planned first (plan.py: text and literal changes as values, and the record splice that repair.py
certifies) and applied by `_commit`. A session is single-writer: callers serialize mutations.
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING, Collection, Literal

import numpy as np

from .asciiappend import append_ascii
from .cpu import boundary, nfc
from .errors import SessionError, StaleRevisionError, TextTooLargeError, validate_text  # noqa: F401
from .nfcmap import EMPTY_MAP, MappedText, NfcMap, build_map
from .plan import NO_LITERALS, Literals, Plan, ReplaceLiteralsFrom, SetLiterals
from .records import Records
from .repair import SessionStats, Specials, Splice, no_specials
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
    from .cpu.boundary import BoundaryRule
    from .reference import ReferenceEngine
    from .tokenizer import Tokenizer

# Characters left (and right) of a change that the first window re-encodes. A splice needs an agreeing run longer than
# the longest vocabulary token inside it, so the default is twice that token (128 characters in every family here),
# at least 256: on real agent traces that certifies every first window (benchmarks/session_repair.py reports the
# acceptance), and a real-trace append's window (~1.3K new characters P50) encodes ~15% less than at 512.
DEFAULT_WINDOW = 256
MAX_WIDENINGS = 5
_INERT_SCAN = 1 << 14      # appended non-ASCII text up to this long is checked for NFC-inert code points
_NFC_REACH = 1 << 16        # how far an NFC split point (an ASCII character) is searched for before a full renormalize


class Session:
    """Token state of one growing (or edited) context. See the module docstring for the contract."""

    # slots: thousands of small sessions live in one server, and an instance dict costs ~0.6 KB each (issue 17:
    # a 1.5K-token session's fixed overhead is what keeps it above 8 bytes/token)
    __slots__ = ("_repairer", "_path", "_raw", "_norm", "_nmap", "_lits", "_rec", "revision", "stats", "__weakref__")

    def __init__(self, tokenizer: Tokenizer, *, text: str | bytes = "",
                 allowed_special: Collection[str] | Literal["all"] = (), window: int | None = None,
                 max_widenings: int = MAX_WIDENINGS, certify: bool = True, encode_path: str = "auto"):
        if window is None:
            window = max(DEFAULT_WINDOW, 2 * tokenizer.max_token_chars)
        if not isinstance(window, int) or window < 1 or not isinstance(max_widenings, int) or max_widenings < 0:
            raise SessionError("window must be a positive int and max_widenings a non-negative int")
        allowed = tokenizer.resolve_allowed(allowed_special)
        # certify=False disables the fast path (baseline flag on the same code path: every call encodes fully).
        rule = boundary.rule_for(tokenizer.family) if certify else None
        if tokenizer.family.normalizer is not None and any(not s.isascii() for s in allowed):
            rule = None     # split points for NFC assume ASCII literals (docs/boundaries.md)
        # Which encoder fills windows: the reference engine, or a registered exact path of the tokenizer ("auto",
        # "cpu", "gpu"; same contract: reference IDs). Ends are derived from token byte lengths either way. The
        # default "auto" answers from the reference until the CPU path is built, then from the CPU path (for qwen3,
        # HF's encode of a 2K-char window costs ~12 ms; the CPU path ~0.3 ms). The repairer also holds what these
        # options imply (the tokenizer, the literal and NFC modes), shared by every session with the same options.
        self._repairer = tokenizer.window_repair(allowed, rule, window, max_widenings)
        self._path = encode_path
        self._clear()
        if text:
            self.append(text)

    def _clear(self) -> None:
        """The state of an empty session at revision 0."""
        self._raw = TextStore()
        self._norm: TextStore | None = None          # None while the normalized text equals the raw text
        self._nmap: NfcMap | None = EMPTY_MAP if self._repairer.mapped else None
        # Literal (special-token string) matches of the allowed-special scan, raw coordinates, sorted.
        self._lits: Literals = NO_LITERALS
        self._rec = Records(self.tokenizer.vocab_facts.token_chars)
        self.revision = 0
        self.stats = SessionStats()

    @property
    def tokenizer(self) -> Tokenizer:
        return self._repairer.tokenizer

    @property
    def allowed_special(self) -> frozenset[str]:
        return self._repairer.allowed_special

    @property
    def rule(self) -> BoundaryRule | None:
        """The stable-boundary rule that certifies windows (None: certify=False, or NFC with non-ASCII literals)."""
        return self._repairer.rule

    @property
    def reference(self) -> ReferenceEngine:
        """The tokenizer's reference engine (built on first use: a session itself never needs it)."""
        return self.tokenizer.reference

    # -- read side ------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._rec.n

    @property
    def encode_path(self) -> str:
        return self._path

    @encode_path.setter
    def encode_path(self, path: str) -> None:
        self._path = path

    @property
    def ids(self) -> np.ndarray:
        """Current IDs: a read-only zero-copy view. Later mutations never change it (records.py: a mutation copies
        the records first while such a view is alive), so holding it costs a copy at the next mutation."""
        return self._rec.exported()

    @property
    def ends(self) -> np.ndarray:
        """Character end of each token in the normalized text (int64, computed from the IDs: O(tokens))."""
        return self._rec.ends()

    @property
    def text(self) -> str:
        """The raw text the user sent (joined from its chunks: O(characters); `n_chars` is its length in O(1))."""
        return self._raw.joined()

    @property
    def n_chars(self) -> int:
        return len(self._raw)

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
        """Resident bytes of the state: record arrays (allocated capacity), text chunks, literal index."""
        seen: set[int] = set()
        text = self._raw.nbytes(seen) + (self._norm.nbytes(seen) if self._norm is not None else 0)
        text += self._nmap.nbytes() if self._nmap is not None else 0
        return self._rec.nbytes + text + 72 * len(self._lits)

    @property
    def array_nbytes(self) -> int:
        return self._rec.nbytes

    # -- write side -----------------------------------------------------------------------------------------------
    def append(self, text: str | bytes, *, expect_revision: int | None = None) -> Splice:
        """Append raw text; returns the splice that turns the previous IDs into the new ones."""
        if expect_revision is not None:
            self._check_revision(expect_revision)
        if type(text) is str and text.isascii():     # (asciiappend.py: the common case)
            done = self._ascii_append(text, None)
            if done is not None:
                return done
        return self._append(text, None)

    def _ascii_append(self, text: str, whole: str | None) -> Splice | None:
        """asciiappend.append_ascii on this session: the splice, or None with nothing changed where it declines (or
        where the normalized text is not the raw text)."""
        if self._norm is not None:
            return None
        keep = append_ascii(self._repairer, self._raw, self._rec, self._nmap, self._path, text, self.stats, whole)
        if keep is None:
            return None
        self.revision += 1
        return Splice(keep, self._rec.buf, self.revision, "window", self._rec.n)

    def _append(self, text: str | bytes, whole: str | None) -> Splice:
        """`append` after the revision check; `whole`: the whole new raw text as one str when the caller holds it
        (sync's resent text), so the repair window is read from it in place."""
        text = validate_text(text, self.tokenizer.max_chars)
        if len(self._raw) + len(text) > self.tokenizer.max_chars:
            raise TextTooLargeError(f"session would hold {len(self._raw) + len(text):,} characters; "
                                    f"the limit is {self.tokenizer.max_chars:,}")
        if not text:
            return Splice(self._rec.n, np.zeros(0, np.uint32), self.revision, "noop")
        if whole is None and self._rec.n and self._repairer.fused:
            done = self._append_committed(text)
            if done is not None:
                return done
        t0 = time.perf_counter()
        self.stats.last_encode_s = 0.0
        plan = self._plan_append(text, whole)
        return self._commit(plan, t0)

    def edit(self, start: int, end: int, replacement: str | bytes = "", *,
             expect_revision: int | None = None) -> Splice:
        """Replace text[start:end] (character offsets into `text`) by `replacement`."""
        self._check_revision(expect_revision)
        return self._edit(start, end, replacement, None)

    def _edit(self, start: int, end: int, replacement: str | bytes, whole: str | None) -> Splice:
        """`edit` after the revision check; `whole`: the whole new text as one ASCII str when the caller holds it
        (sync's resent text), which the text store then keeps as it is instead of cutting its chunks around the
        replacement."""
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
            return Splice(self._rec.n, np.zeros(0, np.uint32), self.revision, "noop")
        t0 = time.perf_counter()
        self.stats.last_encode_s = 0.0
        plan = self._plan_edit(start, end, replacement, whole)
        return self._commit(plan, t0)

    def sync(self, full_text: str | bytes, *, expect_revision: int | None = None) -> Splice:
        """Bring the session to `full_text` (clients that resend the whole context): an append when the stored text
        is a prefix, else an edit of the changed middle (common prefix and suffix kept)."""
        if expect_revision is not None:
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
            if length < len(full_text) and self._rec.n and type(full_text) is str:
                done = self._sync_append(full_text, length)
                if done is not None:
                    return done
            return self._append(full_text[length:], full_text)
        cp = self._raw.common_prefix(full_text)
        cs = self._raw.common_suffix(full_text, min(length, len(full_text)) - cp)
        return self._edit(cp, length - cs, full_text[cp:len(full_text) - cs],
                          full_text if type(full_text) is str and full_text.isascii() else None)

    def _sync_append(self, full_text: str, length: int) -> Splice | None:
        """A resend that appends to the stored text, the common sync of agent traffic: `_fast_append` reading the
        resent str in place (no slice of it unless its tail is not ASCII), which then becomes the stored text."""
        nmap = self._nmap
        if nmap is not None and len(nmap):   # NFC regions: the resent str is raw, the fused call reads normalized text
            tail = validate_text(full_text[length:], self.tokenizer.max_chars)
            done = self._ascii_append(tail, None) if tail.isascii() else None
            return done if done is not None else self._append_committed(tail)
        if full_text.isascii():
            done = self._ascii_append(full_text[length:], full_text)
            return done if done is not None else self._fast_append(None, full_text, 0, full_text)
        tail = validate_text(full_text[length:], self.tokenizer.max_chars)     # lone surrogates refused here
        # (a wide stored text, an ASCII tail: read from the store)
        done = self._ascii_append(tail, None) if tail.isascii() else None
        return done if done is not None else self._fast_append(tail, full_text, 0, None)

    def _append_committed(self, text: str) -> Splice | None:
        """`append` of validated text as `_fast_append`: the fused call reads the stored text from 2 windows left
        of the end (it declines, changing nothing, where its window would start further left) plus `text`.
        NFC text with regions that differ from their NFC (a map): an NFC-inert `text` leaves the map as it is
        (NFC(raw + text) == NFC(raw) + text, as in _plan_append), so the fused call reads the normalized text,
        in normalized offsets."""
        nmap = self._nmap
        mapped = nmap is not None and len(nmap) > 0
        store = self._normtext if mapped else self._raw
        end = len(store)
        base = max(0, end - 2 * self._repairer.window)
        return self._fast_append(text, store.slice(base, end) + text, base, None, end if mapped else None)

    def _fast_append(self, tail: str | None, new: str, base: int, adopt: str | None,
                     mapped_end: int | None = None) -> Splice | None:
        """An append in a few steps: one compiled call that repairs and writes the records
        (WindowRepair.append_commit), the text stored. The same result as `_append`'s plan and commit, whose general
        steps (plan values, a SplicedText, a RecordSplice, the text change as a value) it skips. `new`: the new text
        from `base` to its end; `tail`: the validated appended text, or None when `adopt`, the whole new ASCII
        text, replaces the stored one. `mapped_end`: the normalized text's length where it differs from the raw
        one (an NFC map; `new` and `base` are then normalized, `tail` inert). None, before anything changed, where
        it does not apply: allowed literals, NFC text whose normalized form differs from the raw one (unless
        `mapped_end`), an appended tail that is not NFC-inert, or the fused call declining; the general path then
        answers."""
        nmap = self._nmap
        mapped = nmap is not None and len(nmap) > 0
        if self._norm is not None or mapped != (mapped_end is not None) or self._repairer.literals:
            return None
        if tail is not None and self._repairer.nfc and not self._inert_text(tail):
            return None
        t0 = time.perf_counter()
        stats = self.stats
        stats.last_encode_s = 0.0
        # with no NFC region (or no normalizer) the normalized text is the raw one, so `new` is read as it is
        keep = self._repairer.append_commit(self._rec, new, base,
                                            len(self._raw) if mapped_end is None else mapped_end, self._path, stats)
        if keep is None:
            return None
        if adopt is not None:
            self._raw.adopt(adopt)
        else:
            assert tail is not None
            self._raw.append(tail)
        self.revision += 1
        dt = time.perf_counter() - t0
        stats.last_repair_s = dt
        stats.total_repair_s += dt
        stats.windows_tried += 1
        stats.last_path = "window"
        return Splice(keep, self._rec.buf, self.revision, "window", self._rec.n)

    def reset(self, text: str | bytes = "", *, expect_revision: int | None = None) -> Splice:
        """Drop the state and start over from `text` (a session-state miss)."""
        self._check_revision(expect_revision)
        text = validate_text(text, self.tokenizer.max_chars)
        saved = (self._raw, self._norm, self._lits, self._rec, self.revision, self.stats, self._nmap)
        try:
            self._clear()
            self.append(text)
        except BaseException:
            self._raw, self._norm, self._lits, self._rec, self.revision, self.stats, self._nmap = saved
            raise
        self.stats, self.revision = saved[5], saved[4] + 1     # counters and revision continue across a reset
        return Splice(0, self._rec.exported(), self.revision, "full")

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
    def _plan_append(self, text: str, whole: str | None = None) -> Plan:
        L0 = len(self._raw)
        if not self._repairer.nfc and not self._repairer.literals and self._norm is None:
            # the common append (no normalizer, no allowed literals: normalized text == raw text): the general plan
            # below with every literal and NFC step empty, without building them
            plan = Plan(raw_change=Append(text), norm_change=None, lits=None)
            new = SplicedText(self._raw, L0, text, L0, whole)
            self._repair(plan, new, L0, new.length, no_specials)
            return plan
        if self._nmap is not None and self._inert_text(text):
            # NFC with a map (no literals), appending text of inert code points only: NFC(raw + text) ==
            # NFC(raw) + text (cpu/nfc.py), so the map stands and the normalized text grows by `text` alone
            norm = self._normtext
            N0 = len(norm)
            plan = Plan(raw_change=Append(text), norm_change=None, lits=None)
            new = SplicedText(norm, N0, text, N0, None if len(self._nmap) else whole)   # no region: raw == NFC
            self._repair(plan, new, N0, new.length, no_specials)
            return plan
        norm = self._normtext
        N0 = len(norm)
        struct_raw = L0                         # first raw position whose segmentation may differ
        found: list[tuple[int, int, int]] = []
        keep_lits = len(self._lits)
        if self._repairer.literals:
            lo = max(0, L0 - self._repairer.maxlit + 1)
            keep_lits = bisect.bisect_left(self._lits, (lo,))
            restart = max(lo, self._lits[keep_lits - 1][1] if keep_lits else 0)
            found = self._scan(self._raw.slice(restart, L0) + text, restart)
            old_tail = [(a, b, sid) for a, b, _, _, sid in self._lits[keep_lits:]]
            new_head = [x for x in found if x[0] < L0]
            if old_tail != new_head:
                diff = [x[0] for x in old_tail if x not in new_head] + [x[0] for x in new_head if x not in old_tail]
                struct_raw = min(diff)
        if self._repairer.nfc and struct_raw < L0:
            return self._plan_rebuild(self._raw.joined() + text, Append(text))
        # The normalized middle `mid` replaces norm[d0:N0]; allowed literals get normalized coordinates.
        new_map = None
        if not self._repairer.nfc:
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
            raw_is_norm = self._norm is None and (not self._repairer.nfc or mid == norm.slice(d0, N0) + text)
        plan = Plan(raw_change=Append(text),
                     norm_change=None if raw_is_norm else Replace(d0, N0, mid),
                     lits=ReplaceLiteralsFrom(keep_from, added) if self._repairer.literals else None, nmap=new_map)
        added_sp = [(e[2], e[3], e[4]) for e in added if e[4] >= 0]

        def specials(lo: int, hi: int) -> list[tuple[int, int, int]]:
            """Allowed literals inside [lo, hi) in normalized coordinates: O(literals in range), not O(session)."""
            if not self._repairer.literals:
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

    @staticmethod
    def _inert_text(text: str) -> bool:
        """Every code point of `text` is inert under NFC (ASCII always is; a longer non-ASCII text takes the general
        plan, whose NFC split is cheaper than a table gather over all of it)."""
        return text.isascii() or (len(text) <= _INERT_SCAN and nfc.all_inert(text))

    def _plan_edit(self, start: int, end: int, replacement: str, whole: str | None = None) -> Plan:
        raw_len = len(self._raw)
        if self._repairer.literals or (self._repairer.nfc and self._nmap is None and self._norm is not None):
            new_raw = self._raw.slice(0, start) + replacement + self._raw.slice(end, raw_len)
            return self._plan_rebuild(new_raw, SetText(new_raw))
        raw, norm = self._raw, self._normtext
        new_map = None
        if not self._repairer.nfc:
            d0, e_old, mid = start, end, replacement
            raw_is_norm = True
        else:
            lo = raw.nfc_split_before(start, 0, _NFC_REACH)
            hi = raw.nfc_split_after(end, _NFC_REACH)
            if lo is None or hi is None:
                new_raw = raw.slice(0, start) + replacement + raw.slice(end, raw_len)
                return self._plan_rebuild(new_raw, SetText(new_raw))
            nmap = self._nmap if self._nmap is not None else EMPTY_MAP
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
        assert whole is None or len(whole) == raw_len - (end - start) + len(replacement)
        plan = Plan(raw_change=Replace(start, end, replacement) if whole is None else SetText(whole),
                     norm_change=None if raw_is_norm else Replace(d0, e_old, mid), lits=None, nmap=new_map)
        self._repair(plan, new, d0 + cp, d0 + len(mid) - cs, lambda lo, hi: [])
        return plan

    def _plan_rebuild(self, new_raw: str, raw_change: TextChange) -> Plan:
        """Full renormalization / literal rescan of the new raw text, then the same certified repair on the diff.
        O(N) in the text (documented: edits with allowed specials, edits of NFC text whose raw form is not NFC)."""
        self.stats.renormalizations += 1
        lits = self._scan(new_raw, 0) if self._repairer.literals else []
        pieces, entries, pos, raw_pos = [], [], 0, 0
        for a, b, sid in lits:
            if sid < 0:
                entries.append((a, b, -1, -1, -1))
                continue
            seg = self.tokenizer.normalize(new_raw[raw_pos:a]) if self._repairer.nfc else new_raw[raw_pos:a]
            lit = new_raw[a:b]
            pieces += [seg, lit]
            entries.append((a, b, pos + len(seg), pos + len(seg) + len(lit), sid))
            pos += len(seg) + len(lit)
            raw_pos = b
        new_map = None
        if self._repairer.mapped:       # no literals: one span, normalized region by region with its map
            new_norm, new_map = build_map(new_raw, self.tokenizer.normalize)
        else:
            pieces.append(self.tokenizer.normalize(new_raw[raw_pos:]) if self._repairer.nfc else new_raw[raw_pos:])
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
        plan = Plan(raw_change=raw_change, norm_change=None if raw_is_norm else SetText(new_norm),
                     lits=SetLiterals(entries) if self._repairer.literals else None, nmap=new_map)
        new = SplicedText(TextStore([old_norm]), d, new_norm[d:e_new], e_old)
        self._repair(plan, new, d, e_new, lambda lo, hi: [x for x in new_sp if x[1] > lo and x[0] < hi])
        return plan

    # -- commit ---------------------------------------------------------------------------------------------------
    def _repair(self, plan: Plan, new: SplicedText, d: int, e_new: int, specials: Specials) -> None:
        """The certified record splice of the planned text change (repair.py), read against the old state."""
        plan.records = self._repairer.repair(self._rec, self._normtext, new, d, e_new, specials, self.stats,
                                             self._path)

    def _commit(self, plan: Plan, t0: float) -> Splice:
        rs = plan.records
        assert rs is not None       # every plan is repaired before its commit
        self._rec.splice(rs.keep, rs.mid_ids, rs.mid_ends, rs.right_from, rs.delta)
        # text: the normalized store splits off the raw one (sharing its chunks) the first time they differ
        norm = None
        if plan.norm_change is not None and not self._repairer.mapped:   # mapped: the map holds the normalized regions
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
        self.stats.total_repair_s += dt
        self.stats.windows_tried += rs.attempts
        self.stats.widenings += max(0, rs.attempts - 1)
        self.stats.last_path = rs.path
        return Splice(rs.keep, self._rec.buf, self.revision, rs.path, self._rec.n)
