"""Certified splice points: where fresh window tokens may replace cached ones (docs/boundaries.md).

A point p qualifies when it is a clean boundary (a character end no token straddles) of both the cached records and
the fresh ones, and either a hard boundary (window edge, special literal edge) or a stable position of the family's
rule that lies inside a run of agreeing records of >= 2 tokens covering more characters than the longest token.
The same search serves both sides of an edit: rightmost candidate on the left side, leftmost on the right side.

The search is one numba kernel over the window text's own buffer and the record arrays (binary searches, early-exit
compares; the cached records' ends are derived by records.py's kernels): a repair's fixed cost is a few microseconds
instead of ~30 numpy calls on session-sized views.
"""

from __future__ import annotations

import numpy as np

from .cpu import kernels
from .cpu.lazyjit import njit, numba_global  # numba itself only when a JIT kernel runs; AOT: kernels.py
from .records import Records, end_at, locate

_get_code_point = numba_global("numba.cpython.unicode", "_get_code_point")

MAX_CANDIDATES = 24        # stable positions tried per window side before widening
MAX_STABLE = 4 * MAX_CANDIDATES    # stable positions scanned per side (nearest the edit first)
Point = tuple[int, int, int]   # (text position, cached record index, fresh record index)
_NO_HARD = np.zeros(0, np.int64)


@njit(cache=True)
def _count_le(ends, n, x):
    """How many of the sorted ends[:n] are <= x (numpy's searchsorted(side="right"), callable from kernels)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if ends[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True)
def _clean_fresh(ends, ids, n, pos, origin, cont):
    """Index of the last fresh record ending at pos if pos is a clean boundary of these records, -1 for origin, -2
    when not a clean boundary (searchsorted(side="right") - 1, then the next record must not start inside a
    character)."""
    if pos == origin:
        return -1
    idx = _count_le(ends, n, pos) - 1
    if idx < 0 or ends[idx] != pos:
        return -2
    if idx + 1 < n and cont[ids[idx + 1]]:
        return -2
    return idx


@njit(cache=True)
def _clean_cached(c_ids, ck, tc, ex_i, ex_v, c_n, pos, cont):
    """_clean_fresh over the cached records (ends derived: records.py), origin 0."""
    if pos == 0:
        return -1
    count, end = locate(c_ids, ck, tc, ex_i, ex_v, c_n, pos)
    idx = count - 1
    if idx < 0 or end != pos:
        return -2
    if idx + 1 < c_n and cont[c_ids[idx + 1]]:
        return -2
    return idx


@njit(cache=True)
def _run_ok(c_ids, ck, tc, ex_i, ex_v, c_n, ci, f_ids, f_n, fj, max_chars):
    """The agreeing run through the splice point: >= 2 tokens, > max_chars characters, and it includes the token
    left of the point (so the point lies inside the run)."""
    back = 0
    while back <= ci and back <= fj and c_ids[ci - back] == f_ids[fj - back]:
        back += 1
    if back == 0:
        return False
    fwd = 0
    while ci + 1 + fwd < c_n and fj + 1 + fwd < f_n and c_ids[ci + 1 + fwd] == f_ids[fj + 1 + fwd]:
        fwd += 1
    if back + fwd < 2:
        return False
    first = ci - back + 1
    start = end_at(c_ids, ck, tc, ex_i, ex_v, first - 1) if first > 0 else np.int64(0)
    stop = end_at(c_ids, ck, tc, ex_i, ex_v, ci + fwd)
    return stop - start > max_chars


@njit(cache=True)
def _search(text, t0, lo, hi, hard, sig, pair, use_stable, c_ids, ck, tc, ex_i, ex_v, c_n, f_ids, f_ends, f_n, cont,
            max_chars, rightmost, shift, fresh_origin, max_stable, max_cand):
    """Candidates: the sorted `hard` positions and the stable positions p in [lo+1, hi-1] (pair[sig[text[p-1]],
    sig[text[p]]], text holding absolute positions [t0, t0 + len(text))), at most max_stable of them, nearest the
    edit first. Returns (p, cached index, fresh index) of the first qualifying one, or p = -1."""
    nh = hard.shape[0]
    step = -1 if rightmost else 1
    p = hi if rightmost else lo
    end = lo - 1 if rightmost else hi + 1
    h = nh - 1 if rightmost else 0
    seen = 0
    tried = 0
    while p != end:
        while 0 <= h < nh and (hard[h] > p if rightmost else hard[h] < p):
            h += step
        is_hard = 0 <= h < nh and hard[h] == p
        is_stable = False
        if not is_hard:
            if not use_stable or seen >= max_stable:
                if not (0 <= h < nh):
                    break
                p = hard[h]          # only hard positions remain: jump
                continue
            if lo < p < hi:
                x = _get_code_point(text, p - 1 - t0)
                y = _get_code_point(text, p - t0)
                is_stable = pair[sig[x], sig[y]] != 0
                if is_stable:
                    seen += 1
        if is_hard or is_stable:
            ci = _clean_cached(c_ids, ck, tc, ex_i, ex_v, c_n, p - shift, cont)
            if ci >= -1:
                fj = _clean_fresh(f_ends, f_ids, f_n, p, fresh_origin, cont)
                if fj >= -1:
                    if is_hard:
                        return p, ci, fj
                    if tried >= max_cand:
                        return -1, 0, 0
                    tried += 1
                    if _run_ok(c_ids, ck, tc, ex_i, ex_v, c_n, ci, f_ids, f_n, fj, max_chars):
                        return p, ci, fj
        p += step
    return -1, 0, 0


@njit(cache=True)
def _clean_before(ids, ck, tc, ex_i, ex_v, n, cont, target, start):
    """See SpliceSearch.clean_before: (index, its end) or (-1, 0)."""
    last = locate(ids, ck, tc, ex_i, ex_v, n, target)[0] - 1
    i = min(last, start) if start >= 0 else last
    while i >= 0:
        if i + 1 >= n or not cont[ids[i + 1]]:
            return i, end_at(ids, ck, tc, ex_i, ex_v, i)
        i -= 1
    return -1, np.int64(0)


class SpliceSearch:
    """The boundary search over token records of one tokenizer: `cont` marks tokens that start inside a character,
    `max_token_chars` is the longest vocabulary token in characters; `sig`/`pair`: the rule's pair table
    (boundary.pair_table), None for a family without a rule."""

    def __init__(self, cont: np.ndarray, max_token_chars: int, sig: np.ndarray | None = None,
                 pair: np.ndarray | None = None):
        self.cont = cont
        self.max_token_chars = max_token_chars
        self.sig = sig if sig is not None else np.zeros(1, np.uint8)
        self.pair = pair if pair is not None else np.zeros((1, 1), np.uint8)
        self.use_stable = sig is not None

    def point(self, text: str, t0: int, lo: int, hi: int, hard: list[int], cached: Records,
              f_ids: np.ndarray, f_ends: np.ndarray, *, rightmost: bool, shift: int, fresh_origin: int
              ) -> Point | None:
        """The boundary search of both window sides: the candidate in [lo, hi] nearest the edit (hard boundaries:
        window and literal edges; stable positions of the rule, read from `text`, which holds absolute positions
        [t0, t0 + len(text)) covering [lo, hi)) that is a clean boundary of the cached records (at position
        - shift) and of the fresh ones, and, unless hard, lies inside an agreeing run."""
        h = _NO_HARD if not hard else np.array(sorted({x for x in hard if lo <= x <= hi}), dtype=np.int64)
        p, ci, fj = kernels.get().splice_search(
            text, t0, lo, hi, h, self.sig, self.pair, self.use_stable, *cached.kernel_args(), f_ids, f_ends,
            len(f_ids), self.cont, self.max_token_chars, rightmost, shift, fresh_origin, MAX_STABLE, MAX_CANDIDATES)
        return None if p < 0 else (int(p), int(ci), int(fj))

    def clean_before(self, cached: Records, target: int, start: int = -1) -> tuple[int, int]:
        """(index, end) of the last record (at most `start` when >= 0) ending at or before `target` at a clean
        boundary (the next record does not start inside a character); (-1, 0) when none."""
        i, e = kernels.get().splice_clean_before(*cached.kernel_args()[:5], cached.n, self.cont, target, start)
        return int(i), int(e)
