"""A session's token records: the IDs, with each token's character end derived instead of stored.

A token's end in the normalized text is the previous end plus the characters its bytes start (UTF-8 lead bytes:
`char_len[id]`, a property of the vocabulary, specials included), so a per-token ends array (4 bytes/token) is
redundant. What is kept beside the IDs (uint32, 4 bytes/token, grown by a fraction) is:

- a checkpoint per block of 64 tokens: `ck[j]` = end of the tokens before index 64*j (0.125 bytes/token), so any
  end is a checkpoint plus at most 63 table lookups and a search by position is a binary search over the
  checkpoints then a scan of one block;
- the exceptions, (index, extra characters) for tokens whose end moves by more than their own characters: a
  vocabulary without a token for some byte (smollm2) drops that byte's character from the token stream, so the next
  token's end also covers it. Empty for every other family and for most text; O(such tokens) when present.

An edit that changes the token count moves the IDs right of it with one memmove and recomputes the checkpoints
after it (a table-lookup scan over the moved IDs); an edit that keeps the count shifts their checkpoints by the
length change. The kernels here are shared with splice.py (the splice-point search reads records through them).
"""

from __future__ import annotations

import ctypes

import numpy as np
from numba import njit

SHIFT = 6                   # 64 tokens per checkpoint
MIN_CAPACITY = 64           # records allocated for an empty session
GROWTH = 32                 # capacity grows to n + n / GROWTH + 16 (at most ~3% slack; a reallocation copies the
MAX_SLACK = 1 << 16         # IDs, amortized 32 x 4 bytes per appended token) and at most 64K records beyond n


@njit(cache=True)
def _first_at_or_after(ex_i, t):
    lo, hi = 0, ex_i.shape[0]
    while lo < hi:
        mid = (lo + hi) >> 1
        if ex_i[mid] < t:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True)
def end_at(ids, ck, tc, ex_i, ex_v, i):
    """Character end of record i (i >= 0): its block's checkpoint plus the characters of the tokens up to i."""
    t = (i >> SHIFT) << SHIFT
    s = np.int64(ck[i >> SHIFT])
    for k in range(t, i + 1):
        s += tc[ids[k]]
    if ex_i.shape[0]:
        k = _first_at_or_after(ex_i, t)
        while k < ex_i.shape[0] and ex_i[k] <= i:
            s += ex_v[k]
            k += 1
    return s


@njit(cache=True)
def locate(ids, ck, tc, ex_i, ex_v, n, x):
    """(how many records end at or before x, the end of the last of them or 0): numpy's searchsorted(side="right")
    over the ends, from the checkpoints (ends never decrease, so a checkpoint <= x clears its whole past)."""
    if n == 0 or x < 0:
        return 0, np.int64(0)
    lo, hi = 0, ((n - 1) >> SHIFT) + 1          # the last block whose checkpoint is <= x (ck[0] == 0 <= x)
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if ck[mid] <= x:
            lo = mid
        else:
            hi = mid
    t = lo << SHIFT
    s = np.int64(ck[lo])
    k = _first_at_or_after(ex_i, t) if ex_i.shape[0] else 0
    while t < n:
        e = s + tc[ids[t]]
        if k < ex_i.shape[0] and ex_i[k] == t:
            e += ex_v[k]
            k += 1
        if e > x:
            break
        s = e
        t += 1
    return t, s


@njit(cache=True)
def _fill_checkpoints(ids, ck, tc, ex_i, ex_v, j0, j1):
    """ck[j] for j in [j0, j1] from ck[j0 - 1] forward (j0 >= 1)."""
    t = (j0 - 1) << SHIFT
    s = np.int64(ck[j0 - 1])
    if ex_i.shape[0] == 0:
        for j in range(j0, j1 + 1):
            stop = j << SHIFT
            while t < stop:
                s += tc[ids[t]]
                t += 1
            ck[j] = s
        return
    k = _first_at_or_after(ex_i, t)
    for j in range(j0, j1 + 1):
        stop = j << SHIFT
        while t < stop:
            s += tc[ids[t]]
            if k < ex_i.shape[0] and ex_i[k] == t:
                s += ex_v[k]
                k += 1
            t += 1
        ck[j] = s


_EMPTY_I = np.zeros(0, np.int64)


class Records:
    """IDs (uint32, edited in place, grown by a fraction), block checkpoints and end exceptions of one session.
    `tc`: characters per token ID (the vocabulary's `token_chars`), shared by all sessions of a tokenizer."""

    __slots__ = ("tc", "buf", "ck", "ex_i", "ex_v", "n")

    def __init__(self, tc: np.ndarray):
        self.tc = tc
        self.buf = np.zeros(MIN_CAPACITY, np.uint32)
        self.ck = np.zeros((MIN_CAPACITY >> SHIFT) + 2, np.int64)
        self.ex_i, self.ex_v = _EMPTY_I, _EMPTY_I
        self.n = 0

    @property
    def ids(self) -> np.ndarray:
        return self.buf[:self.n]

    def kernel_args(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """(ids, ck, tc, ex_i, ex_v, n): what the kernels of this module and splice.py read."""
        return self.buf, self.ck, self.tc, self.ex_i, self.ex_v, self.n

    def end(self, i: int) -> int:
        return int(end_at(self.buf, self.ck, self.tc, self.ex_i, self.ex_v, i))

    def locate(self, x: int) -> tuple[int, int]:
        """(records ending at or before x, end of the last of them or 0)."""
        c, e = locate(self.buf, self.ck, self.tc, self.ex_i, self.ex_v, self.n, x)
        return int(c), int(e)

    def ends(self) -> np.ndarray:
        """Every record's character end (int64, computed: O(n))."""
        d = self.tc[self.buf[:self.n]].astype(np.int64)
        d[self.ex_i] += self.ex_v
        return np.cumsum(d)

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes + self.ck.nbytes + self.ex_i.nbytes + self.ex_v.nbytes

    def splice(self, keep: int, mid_ids: np.ndarray, mid_ends: np.ndarray, right_from: int, delta: int) -> None:
        """Records become old[:keep] + mid + old[right_from:], the last part's ends moved by `delta`; `mid_ends`:
        the absolute ends of the mid records (from the fresh encode)."""
        n, tc = self.n, self.tc
        n_mid, n_right = len(mid_ids), n - right_from
        new_n = keep + n_mid + n_right
        shift = new_n - n
        # ends the new exceptions are measured against, read before anything moves
        prev_end = self.end(keep - 1) if keep else 0
        ex_i, ex_v = self.ex_i, self.ex_v
        parts_i, parts_v = [ex_i[:np.searchsorted(ex_i, keep)]], [ex_v[:np.searchsorted(ex_i, keep)]]
        if n_mid:
            d = np.diff(mid_ends.astype(np.int64), prepend=np.int64(prev_end)) - tc[mid_ids]
            nz = np.flatnonzero(d)
            parts_i.append(nz + keep)
            parts_v.append(d[nz])
        if n_right:
            # the first right record's predecessor changed: its extra is measured again
            first_end = self.end(right_from) + delta
            before = int(mid_ends[-1]) if n_mid else prev_end
            x = first_end - before - int(tc[self.buf[right_from]])
            if x:
                parts_i.append(np.array([keep + n_mid], np.int64))
                parts_v.append(np.array([x], np.int64))
            r = np.searchsorted(ex_i, right_from, side="right")
            parts_i.append(ex_i[r:] + shift)
            parts_v.append(ex_v[r:])
        if ex_i.size or any(p.size for p in parts_i):
            self.ex_i = np.concatenate(parts_i).astype(np.int64, copy=False)
            self.ex_v = np.concatenate(parts_v).astype(np.int64, copy=False)
        self._move(keep, n_mid, right_from, n_right, new_n)
        self.buf[keep:keep + n_mid] = mid_ids
        self.n = new_n
        if new_n == 0:
            return
        last_block = (new_n - 1) >> SHIFT
        # checkpoints at or before `keep` cover kept records only; those past the old last block were never set
        j0 = min(keep >> SHIFT, ((n - 1) >> SHIFT) if n else 0) + 1
        if shift == 0 and n_right:
            # same count: checkpoints inside the right part are the old ones moved by the length change
            j1 = min(last_block, (keep + n_mid) >> SHIFT)
            if j1 < last_block:
                self.ck[j1 + 1:last_block + 1] += delta
        else:
            j1 = last_block
        if j0 <= j1:
            _fill_checkpoints(self.buf, self.ck, tc, self.ex_i, self.ex_v, j0, j1)

    def _move(self, keep: int, n_mid: int, right_from: int, n_right: int, new_n: int) -> None:
        """The right part to its new place: one memmove in place, or a copy into larger arrays."""
        buf = self.buf
        dst = keep + n_mid
        if new_n > len(buf):
            cap = new_n + min(new_n // GROWTH, MAX_SLACK) + 16
            grown = np.empty(cap, np.uint32)
            grown[:keep] = buf[:keep]
            grown[dst:new_n] = buf[right_from:right_from + n_right]
            ck = np.zeros((cap >> SHIFT) + 2, np.int64)
            ck[:len(self.ck)] = self.ck
            self.buf, self.ck = grown, ck
        elif n_right and dst != right_from:
            ctypes.memmove(buf.ctypes.data + 4 * dst, buf.ctypes.data + 4 * right_from, 4 * n_right)
