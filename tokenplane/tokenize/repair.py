"""The certified window repair of a session's records (the record side of a mutation; session.py plans the text side).

Given the new normalized text, equal to the old one on [0, d) and on [e_new, end) (shifted by the length change), a
window of fresh tokens around the change is encoded and spliced onto the cached records only at points splice.py
certifies (a clean boundary of both inside an agreeing run, or a hard boundary). Otherwise the window doubles, up to
`max_widenings` times, and finally the whole text is encoded. The result is a `RecordSplice`, a value the session
commits to its records (records.py). The first attempt of an append without allowed literals (the common call on
agent traffic) runs as one compiled call (appendwin.py: same steps, same answer); what it declines starts here.

`append_commit` is Session.sync's append: the same fused call with `commit`, which also writes the new records into
the session's buffer and checkpoints (records.py's `_append_tail` on the values Records.splice would hand it) when
that is the whole splice: no end exceptions, capacity reserved here beforehand from the session's characters per
token, no new exception in the window. It answers COMMITTED then, else OK with the records untouched and they are
spliced in Python. A sync's append thus runs as one compiled call plus a handful of Python steps, with no plan,
RecordSplice or Records.splice between (tests/test_sync_commit.py checks it against the general path).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal

import numpy as np

from . import appendwin
from .appendwin import append_encoder
from .cpu import boundary, nfc, pretokenize
from .cpu.segments import with_literals
from .records import Records
from .router import SEGMENTS_MAX_CHARS, encode_segments_on, segment_encoder
from .splice import Point
from .textstore import SplicedText, TextReader

if TYPE_CHECKING:   # type names only: tokenizer.py imports session.py, which imports this module
    from .reference import ReferenceEngine
    from .tokenizer import Tokenizer

Specials = Callable[[int, int], list[tuple[int, int, int]]]    # allowed literals inside [lo, hi): (a, b, id)


def no_specials(lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The Specials of a session without allowed literals (one function, not a closure per mutation)."""
    return []


# shared empty records (read-only): a RecordSplice's defaults, without two allocations per mutation
_NO_IDS = np.zeros(0, np.uint32)
_NO_ENDS = np.zeros(0, np.int64)
_NO_IDS.flags.writeable = False
_NO_ENDS.flags.writeable = False


@dataclass(slots=True)
class SessionStats:
    repairs: int = 0                # mutations of a non-empty session
    windows_tried: int = 0
    widenings: int = 0
    first_window_accepts: int = 0   # repairs certified on the first window
    full_fallbacks: int = 0         # repairs that exhausted the widenings and encoded everything
    full_encodes: int = 0           # all full encodes (fallbacks, bootstrap, unsupported family)
    renormalizations: int = 0       # full NFC recomputations (documented O(N) cases)
    last_repair_s: float = 0.0
    last_encode_s: float = 0.0      # part of last_repair_s spent inside the reference engine (the rest: bookkeeping)
    total_repair_s: float = 0.0
    last_path: str = ""

    def to_dict(self) -> dict[str, int | float | str]:
        """Plain JSON-able values (counters may be numpy scalars after array arithmetic)."""
        return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in
                ((f, getattr(self, f)) for f in self.__slots__)}


class Splice:
    """The change to a session's ID sequence: new_ids == old_ids[:keep] + ids (`ids`: a read-only view that later
    mutations of the session leave as it is; see Session.ids).

    Made by a session with `end`: `ids` is then its records buffer and the splice's IDs are ids[keep:end], viewed on
    first access. Holding the buffer protects those IDs as the view would (records.py copies a held buffer before
    writing into it), and a view made with the process's caches cold (an agent's call after other work) costs
    ~25 us that callers which read the session's IDs instead (a server) would pay for nothing."""

    __slots__ = ("keep", "revision", "path", "_ids", "_end")

    def __init__(self, keep: int, ids: np.ndarray, revision: int,
                 path: Literal["window", "full", "noop"] = "window", end: int = -1):
        self.keep, self.revision, self.path = keep, revision, path
        self._ids, self._end = ids, end

    @property
    def ids(self) -> np.ndarray:
        if self._end >= 0:
            v = self._ids[self.keep:self._end]
            v.flags.writeable = False
            self._ids, self._end = v, -1
        return self._ids

    @property
    def count(self) -> int:
        """len(ids), without viewing them."""
        return self._end - self.keep if self._end >= 0 else len(self._ids)

    def __repr__(self) -> str:
        return f"Splice(keep={self.keep}, ids=<{self.count} IDs>, revision={self.revision}, path={self.path!r})"


@dataclass
class RecordSplice:
    """The records after a mutation: old[:keep] + mid + old[right_from:], the last part's ends moved by delta."""
    keep: int = 0
    mid_ids: np.ndarray = field(default_factory=lambda: _NO_IDS)
    mid_ends: np.ndarray = field(default_factory=lambda: _NO_ENDS)
    right_from: int = 0                         # old record index where the shifted right part starts
    delta: int = 0
    path: Literal["window", "full", "noop"] = "window"
    attempts: int = 0


class WindowRepair:
    """The repair policy of a tokenizer's sessions (allowed literals, boundary rule, window): read-only, so one
    instance serves every session with the same policy (Tokenizer.window_repair). What varies per session (its
    records, text, encoder path, counters) comes with each call."""

    __slots__ = ("tokenizer", "allowed_special", "rule", "window", "max_widenings", "nfc", "literals", "mapped",
                 "maxlit", "is_special", "search", "token_chars", "fused", "family", "_inert")

    def __init__(self, tokenizer: Tokenizer, allowed_special: frozenset[str], rule: boundary.BoundaryRule | None, *,
                 window: int, max_widenings: int):
        self.tokenizer = tokenizer
        self.rule = rule
        self.window, self.max_widenings = window, max_widenings
        self.nfc = tokenizer.family.normalizer is not None
        self.allowed_special = allowed_special
        self.literals = bool(allowed_special)     # sessions track special-token literals only when some are allowed
        # Raw <-> normalized offsets (nfcmap.py) keep NFC edits local; sessions with allowed literals normalize
        # between literals and renormalize on edits instead (documented O(N) case).
        self.mapped = self.nfc and not self.literals and tokenizer.plain_nfc
        self.maxlit = max((len(s) for s in tokenizer.specials), default=1)
        self.is_special = tokenizer.special_mask(allowed_special)
        self.search = tokenizer.splice_search(rule)
        self.token_chars = tokenizer.vocab_facts.token_chars
        # the fused first window of an append (appendwin.py): families with a CPU window kernel, without allowed
        # literals, and no normalizer or exactly NFC (its inert table proves a window is its own NFC)
        self.fused = (rule is not None and not self.literals and (not self.nfc or tokenizer.plain_nfc)
                      and pretokenize.supported(tokenizer.family))
        self.family = tokenizer.family.name
        self._inert: np.ndarray | None = None       # the NFC inert table, loaded on the first fused NFC repair

    @property
    def reference(self) -> ReferenceEngine:
        return self.tokenizer.reference      # built on first use: only the "reference" window path needs it

    def inert(self) -> np.ndarray | None:
        """The NFC inert table the fused append window reads (loaded on first use), None without a normalizer."""
        if self.nfc and self._inert is None:
            self._inert = nfc.inert_table()
        return self._inert

    def repair(self, rec: Records, old_norm: TextReader, new: SplicedText, d: int, e_new: int, specials: Specials,
               stats: SessionStats, path: str) -> RecordSplice:
        """The record splice for new text that equals the old text on [0, d) and on [e_new, end) (shifted by
        new.delta), with the same literal segmentation there; windows encoded on `path` (its time is added to
        stats.last_encode_s)."""
        n = rec.n
        new_len = new.length
        if n and self.fused and e_new >= new_len and path != "reference":
            fast = self._fused_append(rec, new, d, path, stats)
            if fast is not None:
                return RecordSplice(fast[1], fast[2], fast[3], n, new.delta, "window", 1)
        out = RecordSplice(delta=new.delta)
        if n and self.rule is not None:
            stats.repairs += 1
            for attempt in range(self.max_widenings + 1):
                w = self.window << attempt
                s = self._literal_edge(old_norm, d, w, specials) if self.literals else -1
                if s < 0:
                    s = self._window_start(rec, old_norm, d - w)
                    if self.literals:
                        s = self._after_literal(old_norm, s, d, specials)
                r = new_len
                if e_new + w < new_len:
                    r = self._window_end(e_new + w, specials(e_new + w - 1, e_new + w + 1))
                out.attempts = attempt + 1
                sp = specials(s, r)
                text = new.slice(s, r)
                fresh = self.encode_window(text, s, r, sp, path, stats)
                if fresh is None:
                    continue
                f_ids, f_ends = fresh
                left = self._find_left(rec, text, s, d, f_ids, f_ends, sp)
                if left is None:
                    continue
                right = self._find_right(rec, text, s, e_new, r, new_len, f_ids, f_ends, sp, new.delta)
                if right is None:
                    continue
                self._fill_window(out, rec, left, right, f_ids, f_ends)
                out.path = "window"
                if attempt == 0:
                    stats.first_window_accepts += 1
                return out
            stats.full_fallbacks += 1
        elif n:
            stats.repairs += 1
        stats.full_encodes += 1
        full = self.encode_window(new.slice(0, new_len), 0, new_len, specials(0, new_len), path, stats, check=False)
        assert full is not None     # check=False never refuses
        f_ids, f_ends = full
        m = min(n, len(f_ids))
        neq = np.flatnonzero(rec.ids[:m] != f_ids[:m])
        keep = int(neq[0]) if len(neq) else m
        out.keep, out.mid_ids, out.mid_ends = keep, f_ids[keep:], f_ends[keep:]
        out.right_from, out.path = n, "full"
        return out

    def append_commit(self, rec: Records, new: str, base: int, d: int, path: str, stats: SessionStats
                      ) -> int | None:
        """The repair of an append whose new normalized text from `base` to its end is `new` (equal to the old text
        on [0, d)), committed to `rec`: one compiled call that also writes the new records when they are the plain
        tail write (appendwin.COMMITTED), else `rec.splice` of what it found. Returns the kept record count, or
        None, with `rec` unchanged, where the fused call declines (the caller then takes the general repair)."""
        n = rec.n
        if not (n and self.fused and path != "reference" and d):
            return None
        # room for the new records, estimated from the session's own characters per token (a few % over): the
        # kernel writes them in place when they fit, else the records take them by the general splice
        added = base + len(new) - d
        rec.reserve(n + (added * n) // d + (added >> 4) + 32)
        fast = self._fused_append(rec, new, d, path, stats, True, base)
        if fast is None:
            return None
        status, keep, mid_ids, mid_ends = fast
        if status == appendwin.COMMITTED:
            rec.n = keep + len(mid_ids)     # the kernel wrote the IDs and checkpoints past keep
        else:
            rec.splice(keep, mid_ids, mid_ends, rec.n, added)
        return keep

    def _fused_append(self, rec: Records, new: SplicedText | str, d: int, path: str, stats: SessionStats,
                      commit: bool = False, str_base: int = 0) -> tuple[int, int, np.ndarray, np.ndarray] | None:
        """The first attempt of `repair` for an append (the change reaches the text end, no literals) in one compiled
        call (appendwin.py): the same window start, encode, splice search and kept-token compare; None when that
        call declines (the general loop then decides from its first attempt) or no CPU window kernel applies.
        `new`: the new normalized text, or the part of it from `str_base` to its end as one str. Answers (status,
        keep, mid_ids, mid_ends); `commit`: the records may already hold the result (status COMMITTED; see
        appendwin._Bound)."""
        if isinstance(new, str):
            whole, new_len = new, str_base + len(new)
        else:
            whole, new_len, str_base = new.whole, new.length, 0
        # the window starts at a clean boundary at or before d - window: text from d - 2 * window covers it unless
        # the tokens there are long (or, for NFC, not ASCII for long); then the call declines, unless it reads the
        # whole new text (sync's resent str: no slice, no copy)
        base = max(0, d - 2 * self.window)
        if new_len - base >= SEGMENTS_MAX_CHARS:
            return None
        cpu = segment_encoder(self.tokenizer.path(path), new_len - base)
        if cpu is None:
            return None
        fn = append_encoder(cpu.bpe, self.family, self.token_chars, self.search, self.inert())
        if whole is not None:
            if str_base > base:
                return None     # the str starts right of where the window may start: the general repair reads it
            text, base = whole, str_base
        else:
            assert not isinstance(new, str)
            text = new.slice(base, new_len)
        if commit:
            rec.detach()        # the kernel may write over records that an exported view shows
        t0 = time.perf_counter()
        out = fn(text, base, d, self.window, rec.buf, rec.ck, rec.ex_i, rec.ex_v, rec.n, commit)
        # the fused call's time counts as the window encode (the splice search and compare inside it are a few us);
        # mid_ids / mid_ends are views of the thread's scratch, copied into the records at this mutation's commit
        stats.last_encode_s += time.perf_counter() - t0
        if out[0] != appendwin.OK and out[0] != appendwin.COMMITTED:
            return None
        stats.repairs += 1
        stats.first_window_accepts += 1
        return out

    def _window_start(self, rec: Records, norm: TextReader, target: int) -> int:
        """A clean cached token boundary <= target (a character boundary no token straddles); ASCII for NFC."""
        if target <= 0:
            return 0
        i, pos = self.search.clean_before(rec, target)
        if i < 0:
            return 0
        if not self.nfc or norm.char(pos) < "\x80":
            return pos
        fallback = pos
        for _ in range(255):         # NFC: the window must start at an ASCII character (a split point)
            i, pos = self.search.clean_before(rec, target, i - 1)
            if i < 0:
                return 0
            if norm.char(pos) < "\x80":
                return pos
        return fallback

    def _literal_edge(self, norm: TextReader, d: int, w: int, specials: Specials) -> int:
        """What `_window_start` then `_after_literal` give when an allowed literal ends in (d - w, d]: that end (the
        last one), found without the clean-boundary search; -1 otherwise. Same answer: the window start is at or
        before d - w, so every literal ending past d - w lies in the range _after_literal looks at, and the last end
        at or before d among them is the one it returns. A chat turn's append always has one (its template's
        control tokens end the previous prompt)."""
        lo = max(0, d - w)
        edge = max((b for _, b, _ in specials(lo, d + 1) if b <= d), default=-1)
        if edge <= lo:
            return -1
        if self.nfc and (edge >= len(norm) or norm.char(edge) >= "\x80"):
            return -1    # _after_literal keeps the window start there: the full path computes it
        return edge

    def _after_literal(self, norm: TextReader, s: int, d: int, specials: Specials) -> int:
        """The window may start right after the last allowed literal in [s, d]: a literal is always split out of the
        encode, so its end is a certified splice point and the text before it needs no re-encoding (a chat prompt
        ends in its template's control tokens, so an appended turn re-encodes little more than itself)."""
        edge = max((b for _, b, _ in specials(s, d + 1) if b <= d), default=s)
        if edge <= s:
            return s
        if self.nfc and (edge >= len(norm) or norm.char(edge) >= "\x80"):
            return s     # NFC windows start at an ASCII character (a normalization split point)
        return edge

    @staticmethod
    def _window_end(target: int, specials: list[tuple[int, int, int]]) -> int:
        for a, b, _ in specials:          # never cut a literal
            if a < target < b:
                return a
        return target

    def encode_window(self, text: str, s: int, r: int, specials: list[tuple[int, int, int]], path: str,
                      stats: SessionStats, check: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
        """Reference records of text = new[s:r] (literals split out), ends absolute. None if an NFC self-check
        fails."""
        if not specials and r > s:
            # the common window: no literal in it, one span (ends made absolute by the encoder itself)
            if self.nfc and check and not text.isascii() and self.tokenizer.normalize(text) != text:
                return None
            t0 = time.perf_counter()
            ids, ends, _ = self._ordinary_records(text, [(0, r - s)], path, s)
            stats.last_encode_s += time.perf_counter() - t0
            return ids, ends
        inside = [(a - s, b - s, sid) for a, b, sid in specials if s <= a and b <= r]
        spans, pos = [], 0
        for a, b, _ in inside:
            spans.append((pos, a))
            pos = b
        spans.append((pos, r - s))
        spans = [(a, b) for a, b in spans if a < b]
        if self.nfc and check:
            for a, b in spans:
                t = text[a:b]
                if not t.isascii() and self.tokenizer.normalize(t) != t:
                    return None
        t0 = time.perf_counter()
        ids, ends, counts = self._ordinary_records(text, spans, path, s)
        stats.last_encode_s += time.perf_counter() - t0
        return with_literals(ids, ends, counts, spans, inside, s)

    def _ordinary_records(self, text: str, spans: list[tuple[int, int]], path: str, shift: int = 0
                          ) -> tuple[np.ndarray, np.ndarray, list[int] | np.ndarray]:
        """(ids uint32, ends int64 in characters of text + shift, token count per span) of each span encoded on its
        own: one batched call on the CPU path (cpu/segments.py: one fused kernel call), else one encode per span."""
        if not spans:
            return np.zeros(0, np.uint32), np.zeros(0, np.int64), []
        if path != "reference":
            out = encode_segments_on(self.tokenizer.path(path), self.tokenizer.family.name, text, spans,
                                     tc=self.token_chars, shift=shift)
            if out is not None:
                return out
        id_parts, end_parts, counts = [], [], []
        for a, b in spans:
            t = text[a:b]
            if path == "reference":
                ids = self.reference.encode_ordinary_normalized(t)
            else:
                ids = self.tokenizer.encode_ordinary(t, path=path)
            ids = np.asarray(ids, dtype=np.uint32)
            id_parts.append(ids)
            end_parts.append(self._char_ends(t, ids, path) + (a + shift))
            counts.append(len(ids))
        return np.concatenate(id_parts), np.concatenate(end_parts).astype(np.int64, copy=False), counts

    def _char_ends(self, t: str, ids: np.ndarray, path: str) -> np.ndarray:
        """Each token's end in characters of t: the running sum of the characters each token starts (the
        vocabulary's token_chars), exact unless the vocabulary dropped some character's lead byte (smollm2's missing
        control bytes), which shows as a total short of len(t); then the reference's byte walk decides."""
        if path != "reference":
            ends = np.cumsum(self.tokenizer.vocab_facts.token_chars[ids], dtype=np.int64)
            if not ends.size or int(ends[-1]) == len(t):
                return ends
        return self.reference.char_ends(t, ids)

    def _find_left(self, rec: Records, text: str, s: int, d: int, f_ids: np.ndarray, f_ends: np.ndarray,
                   specials: list[tuple[int, int, int]]) -> Point | None:
        """Rightmost certified splice point p in [s, d]: (p, cached index, fresh index); text = new[s:r]."""
        hard = [s] if s == 0 or (self.literals and self._is_special_edge(rec, s)) else []
        for a, b, _ in specials:
            if s <= b <= d:
                hard += [x for x in (a, b) if x >= s]
        return self.search.point(text, s, s, d, hard, rec, f_ids, f_ends, rightmost=True, shift=0, fresh_origin=s)

    def _find_right(self, rec: Records, text: str, s: int, e_new: int, r: int, new_len: int, f_ids: np.ndarray,
                    f_ends: np.ndarray, specials: list[tuple[int, int, int]], delta: int) -> Point | None:
        """Leftmost certified splice point q in [e_new, r]: (q, cached index of q - delta, fresh index)."""
        if r >= new_len and e_new >= new_len:
            return new_len, rec.n - 1, len(f_ids) - 1
        hard = [new_len] if r >= new_len else []
        for a, b, _ in specials:
            if a >= e_new and b <= r:
                hard += [a, b]
        # fresh_origin -1: the fresh window starts left of e_new, so a fresh index must be a real record (>= 0)
        return self.search.point(text, s, e_new, r, hard, rec, f_ids, f_ends, rightmost=False, shift=delta,
                                 fresh_origin=-1)

    def _is_special_edge(self, rec: Records, pos: int) -> bool:
        if not self.literals:
            return False
        count, end = rec.locate(pos)
        i, ids = count - 1, rec.ids
        if i >= 0 and end == pos and self.is_special[ids[i]]:
            return True
        return i + 1 < rec.n and bool(self.is_special[ids[i + 1]]) and (i < 0 or end == pos)

    @staticmethod
    def _fill_window(out: RecordSplice, rec: Records, left: Point, right: Point, f_ids: np.ndarray,
                     f_ends: np.ndarray) -> None:
        p, ci_p, fj_p = left
        q, ci_q, fj_q = right
        mid_ids = f_ids[fj_p + 1:fj_q + 1]
        mid_ends = f_ends[fj_p + 1:fj_q + 1]
        # keep cached tokens that equal the fresh ones after p (same start, same IDs -> same records)
        cap = min(len(mid_ids), max(0, ci_q - ci_p))
        k = cap
        if cap:
            old, new = rec.buf[ci_p + 1:ci_p + 1 + cap], mid_ids[:cap]
            if old.tobytes() != new.tobytes():      # a few tokens: two copies and a memcmp beat ufunc dispatch
                k = int((old != new).argmax())      # the first differing token (one exists)
        out.keep = ci_p + 1 + k
        out.mid_ids, out.mid_ends = mid_ids[k:], mid_ends[k:]
        out.right_from = ci_q + 1
