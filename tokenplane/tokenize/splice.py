"""Certified splice points: where fresh window tokens may replace cached ones (docs/boundaries.md).

A point p qualifies when it is a clean boundary (a character end no token straddles) of both the cached records and
the fresh ones, and either a hard boundary (window edge, special literal edge) or a stable position of the family's
rule that lies inside a run of agreeing records of >= 2 tokens covering more characters than the longest token.
The same search serves both sides of an edit: rightmost candidate on the left side, leftmost on the right side.
"""

from __future__ import annotations

import numpy as np

MAX_CANDIDATES = 24        # stable positions tried per window side before widening
Point = tuple[int, int, int]   # (text position, cached record index, fresh record index)


class SpliceSearch:
    """The boundary search over token records of one tokenizer: `cont` marks tokens that start inside a character,
    `max_token_chars` is the longest vocabulary token in characters."""

    def __init__(self, cont: np.ndarray, max_token_chars: int):
        self.cont = cont
        self.max_token_chars = max_token_chars

    def clean_index(self, ends: np.ndarray, ids: np.ndarray, pos: np.ndarray, origin: int) -> np.ndarray:
        """For each position: index of the last record ending there if it is a clean boundary, -1 for origin,
        -2 when not a clean boundary of these records."""
        if not len(ends):
            return np.where(pos == origin, -1, -2)
        # query in the array's dtype: a mixed-dtype searchsorted converts the whole (session-sized) array
        idx = np.searchsorted(ends, pos.astype(ends.dtype), side="right") - 1
        ok = idx >= 0
        safe = np.where(ok, idx, 0)
        hit = ok & (ends[safe] == pos)
        nxt = np.minimum(safe + 1, len(ids) - 1)
        clean = hit & ((safe + 1 >= len(ids)) | ~self.cont[ids[nxt]])
        out = np.where(clean, idx, -2)
        return np.where(pos == origin, -1, out)

    def run_ok(self, c_ids: np.ndarray, ci: int, f_ids: np.ndarray, fj: int, c_ends: np.ndarray,
               c_origin: int) -> bool:
        """The agreeing run through the splice point: >= 2 tokens, > max_token_chars characters, and it includes
        the token left of the point (so the point lies inside the run)."""
        m = min(ci + 1, fj + 1)
        if m <= 0:
            return False
        a = c_ids[ci - m + 1:ci + 1][::-1]
        b = f_ids[fj - m + 1:fj + 1][::-1]
        neq = np.flatnonzero(a != b)
        back = int(neq[0]) if len(neq) else m
        if back == 0:
            return False
        m2 = min(len(c_ids) - ci - 1, len(f_ids) - fj - 1)
        neq = np.flatnonzero(c_ids[ci + 1:ci + 1 + m2] != f_ids[fj + 1:fj + 1 + m2])
        fwd = int(neq[0]) if len(neq) else m2
        first = ci - back + 1
        start = int(c_ends[first - 1]) if first > 0 else c_origin
        stop = int(c_ends[ci + fwd])
        return back + fwd >= 2 and stop - start > self.max_token_chars

    def point(self, hard: set[int], stable: np.ndarray, c_ids: np.ndarray, c_ends: np.ndarray, f_ids: np.ndarray,
              f_ends: np.ndarray, *, rightmost: bool, shift: int, fresh_origin: int) -> Point | None:
        """The boundary search of both window sides: the candidate nearest the edit (hard boundaries: window and
        literal edges; stable positions of the rule) that is a clean boundary of the cached records (at position
        - shift) and of the fresh ones, and, unless hard, lies inside an agreeing run (`run_ok`)."""
        cand = np.union1d(np.fromiter(hard, dtype=np.int64, count=len(hard)), stable)
        if rightmost:
            cand = cand[::-1]
        if not len(cand):
            return None
        ci = self.clean_index(c_ends, c_ids, cand - shift, 0)
        fj = self.clean_index(f_ends, f_ids, cand, fresh_origin)
        tried = 0
        for k in np.flatnonzero((ci >= -1) & (fj >= -1)):
            p = int(cand[k])
            if p in hard:
                return p, int(ci[k]), int(fj[k])
            if tried >= MAX_CANDIDATES:
                break
            tried += 1
            if self.run_ok(c_ids, int(ci[k]), f_ids, int(fj[k]), c_ends, 0):
                return p, int(ci[k]), int(fj[k])
        return None
