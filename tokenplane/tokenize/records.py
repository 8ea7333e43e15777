"""A session's token records: the IDs, with each token's character end derived instead of stored.

A token's end in the normalized text is the previous end plus the characters its bytes start (UTF-8 lead bytes:
`char_len[id]`, a property of the vocabulary, specials included), so a per-token ends array (4 bytes/token) is
redundant. What is kept beside the IDs (uint32, 4 bytes/token, grown by a fraction) is:

- a checkpoint per block of 256 tokens: `ck[j]` = end of the tokens before index 256*j (0.03125 bytes/token), so
  any end is a checkpoint plus at most 255 table lookups (~0.2 us, a few per edit) and a search by position is a
  binary search over the checkpoints then a scan of one block;
- the exceptions, (index, extra characters) for tokens whose end moves by more than their own characters: a
  vocabulary without a token for some byte (smollm2) drops that byte's character from the token stream, so the next
  token's end also covers it. Empty for every other family and for most text; O(such tokens) when present.

The IDs handed out (`exported`) are read-only views that stay valid after later edits: every view of the buffer,
and every view derived from one, holds the buffer as its numpy base, so the buffer's reference count says whether
any is alive (ndarray.resize's refcheck uses the same fact), and a splice that would write into the buffer while
one of them is alive first copies the buffer (copy-on-write; a reference held for any other reason only costs
that copy). A caller that drops the IDs before the next edit (the server, the benchmarks) costs no copy; one that
keeps them pays the copy a returned tail would have cost anyway.

An edit moves the IDs right of it with one memmove; their checkpoints are the old ones shifted by the length
change when the token count is kept, else read from the old records at the moved offsets (a few table lookups per
block: `_moved_checkpoints`). The kernels here are shared with splice.py (the splice-point search reads records
through them).
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np

from .cpu import kernels
from .cpu.lazyjit import njit  # numba itself only when a JIT kernel runs (lazyjit.py); AOT: kernels.py

SHIFT = 8                   # 256 tokens per checkpoint: an edit's moved checkpoints (a cache miss each) cost 0.70x
                            # (cold) and 0.48x (warm) of 128's, a cold 4M-character edit 0.77x, a position search
                            # the same within noise (benchmarks/results/checkpoint_block_xeon.md)
MIN_CAPACITY = 64           # records allocated for an empty session
GROWTH = 64                 # capacity grows to n + n / GROWTH + 16 (at most ~1.6% slack; a reallocation copies the
MAX_SLACK = 1 << 16         # IDs, amortized 64 x 4 bytes per appended token) and at most 64K records beyond n;
                            # a first fill (no records yet) is sized exactly: nothing has been appended to it yet


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


@njit(cache=True)
def _moved_checkpoints(ids, ck, tc, ex_i, ex_v, n_old, shift, delta, j_first, out):
    """Checkpoints of the moved right part, from the old records before the move: new block j's checkpoint is the
    end of old record j*256 - 1 - shift, plus the length change. That record sits at the same offset in every old
    block, so each costs min(offset + 1, 255 - offset) table lookups from the nearer old checkpoint (1-2 for the
    typical edit that changes the count by a few tokens), not a scan of the moved records. Counting back from the
    next checkpoint needs no exception between the record and the block end (exceptions are sorted: one cursor)."""
    old_last = (n_old - 1) >> SHIFT
    n_ex = ex_i.shape[0]
    e = 0
    for k in range(out.shape[0]):
        x = ((j_first + k) << SHIFT) - 1 - shift
        b = x >> SHIFT
        r = x - (b << SHIFT)
        stop = (b + 1) << SHIFT
        back = r >= (1 << (SHIFT - 1)) and b + 1 <= old_last
        if back and n_ex:
            while e < n_ex and ex_i[e] <= x:
                e += 1
            back = e == n_ex or ex_i[e] >= stop
        if back:
            s = np.int64(ck[b + 1])
            for t in range(x + 1, stop):
                s -= tc[ids[t]]
        else:
            s = end_at(ids, ck, tc, ex_i, ex_v, x)
        out[k] = s + delta


@njit(cache=True)
def _mid_extras(mid_ids, mid_ends, prev_end, tc, out_i, out_v, base):
    """Records of the new middle whose end moves by more than their own characters: (base + index, extra) into
    out_i/out_v; returns how many."""
    m = 0
    prev = prev_end
    for k in range(mid_ids.shape[0]):
        e = np.int64(mid_ends[k])
        x = e - prev - tc[mid_ids[k]]
        if x != 0:
            out_i[m] = base + k
            out_v[m] = x
            m += 1
        prev = e
    return m


@njit(cache=True)
def _append_tail(buf, ck, tc, keep, n, mid_ids, mid_ends):
    """The common splice of an append, in one call: no record right of the window (right_from == n), no end
    exceptions before or inside it, capacity already reserved. Writes mid_ids at keep and the checkpoints of the
    blocks after keep's; returns False, before writing anything, when some mid record's end moves by more than its
    own characters (an exception: the general path records it)."""
    prev = np.int64(0)
    if keep:
        t = ((keep - 1) >> SHIFT) << SHIFT
        prev = np.int64(ck[(keep - 1) >> SHIFT])
        for k in range(t, keep):
            prev += tc[buf[k]]
    for k in range(mid_ids.shape[0]):
        e = np.int64(mid_ends[k])
        if e - prev != tc[mid_ids[k]]:
            return False
        prev = e
    for k in range(mid_ids.shape[0]):
        buf[keep + k] = mid_ids[k]
    new_n = keep + mid_ids.shape[0]
    if new_n == 0:
        return True
    j0 = min(keep >> SHIFT, ((n - 1) >> SHIFT) if n else 0) + 1
    j1 = (new_n - 1) >> SHIFT
    if j0 <= j1:
        _fill_checkpoints(buf, ck, tc, _EMPTY_I, _EMPTY_I, j0, j1)   # no exceptions: the precondition above
    return True


_EMPTY_I = np.zeros(0, np.int64)


class Records:
    """IDs (uint32, edited in place, grown by a fraction), block checkpoints and end exceptions of one session.
    `tc`: characters per token ID (the vocabulary's `token_chars`), shared by all sessions of a tokenizer."""

    # _ro: a read-only view of the whole of buf (None until an export needs it; dropped whenever buf is replaced or
    # resized), so that an export is one slice of it: setflags on each new view cost ~14 us more with the process's
    # caches cold (an agent's call after other work), as much as the slice itself
    __slots__ = ("tc", "buf", "ck", "ex_i", "ex_v", "n", "_ro")

    def __init__(self, tc: np.ndarray):
        self.tc = tc
        self.buf = np.zeros(MIN_CAPACITY, np.uint32)
        self.ck = np.zeros((MIN_CAPACITY >> SHIFT) + 2, np.int64)
        self.ex_i, self.ex_v = _EMPTY_I, _EMPTY_I
        self.n = 0
        self._ro: np.ndarray | None = None

    @property
    def ids(self) -> np.ndarray:
        """The IDs as a plain view, for reads inside one mutation (it is not protected from the next splice)."""
        return self.buf[:self.n]

    def exported(self, start: int = 0) -> np.ndarray:
        """ids[start:] as a read-only view that later splices never change (see the module docstring)."""
        ro = self._ro
        if ro is None:
            ro = self._ro = self.buf.view()
            ro.flags.writeable = False
        return ro[start:self.n]

    def detach(self) -> None:
        """Before an in-place write: give the buffer to the live views of it and keep writing into a copy. The
        references that are not a holder: this object's, getrefcount's argument and `_ro`'s (a view's base is
        the buffer itself, however it was derived); any more is a view (or a caller) holding it."""
        if sys.getrefcount(self.buf) > (2 if self._ro is None else 3):
            self.buf = self.buf.copy()
            self._ro = None

    def kernel_args(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """(ids, ck, tc, ex_i, ex_v, n): what the kernels of this module and splice.py read."""
        return self.buf, self.ck, self.tc, self.ex_i, self.ex_v, self.n

    def end(self, i: int) -> int:
        return int(kernels.get().rec_end_at(self.buf, self.ck, self.tc, self.ex_i, self.ex_v, i))

    def locate(self, x: int) -> tuple[int, int]:
        """(records ending at or before x, end of the last of them or 0)."""
        c, e = kernels.get().rec_locate(self.buf, self.ck, self.tc, self.ex_i, self.ex_v, self.n, x)
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
        n, tc, k = self.n, self.tc, kernels.get()
        n_mid, n_right = len(mid_ids), n - right_from
        if keep < n and keep + n_mid + n_right <= len(self.buf):
            self.detach()      # (a write only past n, or into a grown buffer, leaves the exported IDs as they are)
        if not n_right and not self.ex_i.size:
            # an append (nothing right of the window, no exceptions): one kernel, when no new exception arises
            if keep + n_mid > len(self.buf):
                self._move(keep, n_mid, right_from, 0, keep + n_mid)
            if k.rec_append_tail(self.buf, self.ck, tc, keep, n, mid_ids, mid_ends):
                self.n = keep + n_mid
                return
        buf, ck, ex_i, ex_v = self.buf, self.ck, self.ex_i, self.ex_v
        new_n = keep + n_mid + n_right
        shift = new_n - n
        # everything read from the old records happens before anything moves
        prev_end = int(k.rec_end_at(buf, ck, tc, ex_i, ex_v, keep - 1)) if keep else 0
        new_i, new_v = np.empty(n_mid + 1, np.int64), np.empty(n_mid + 1, np.int64)
        m = k.rec_mid_extras(mid_ids, mid_ends, prev_end, tc, new_i, new_v, keep) if n_mid else 0
        if n_right:
            # the first right record's predecessor changed: its extra is measured again
            first_end = int(k.rec_end_at(buf, ck, tc, ex_i, ex_v, right_from)) + delta
            x = first_end - (int(mid_ends[-1]) if n_mid else prev_end) - int(tc[buf[right_from]])
            if x:
                new_i[m], new_v[m] = keep + n_mid, x
                m += 1
        if ex_i.size or m:
            lo = int(np.searchsorted(ex_i, keep))
            hi = int(np.searchsorted(ex_i, right_from, side="right")) if n_right else ex_i.size
            self.ex_i = np.concatenate([ex_i[:lo], new_i[:m], ex_i[hi:] + shift])
            self.ex_v = np.concatenate([ex_v[:lo], new_v[:m], ex_v[hi:]])
        last_block = (new_n - 1) >> SHIFT if new_n else 0
        j_first = ((keep + n_mid) >> SHIFT) + 1     # first new checkpoint that ends inside the right part
        moved = None
        if n_right and shift and j_first <= last_block:
            moved = np.empty(last_block - j_first + 1, np.int64)
            k.rec_moved_checkpoints(buf, ck, tc, ex_i, ex_v, n, shift, delta, j_first, moved)
        self._move(keep, n_mid, right_from, n_right, new_n)
        self.buf[keep:keep + n_mid] = mid_ids
        self.n = new_n
        if new_n == 0:
            return
        # checkpoints at or before `keep` cover kept records only; those past the old last block were never set
        j0 = min(keep >> SHIFT, ((n - 1) >> SHIFT) if n else 0) + 1
        j1 = last_block
        if n_right and shift == 0:
            # same count: checkpoints inside the right part are the old ones moved by the length change
            j1 = min(last_block, j_first - 1)
            if j1 < last_block:
                self.ck[j1 + 1:last_block + 1] += delta
        elif moved is not None:
            j1 = j_first - 1
            self.ck[j_first:last_block + 1] = moved
        if j0 <= j1:
            k.rec_fill_checkpoints(self.buf, self.ck, tc, self.ex_i, self.ex_v, j0, j1)

    def reserve(self, need: int) -> None:
        """Capacity for `need` records (grown by the usual fraction beyond it), so that an append kernel can write
        them in place (appendwin.py's commit); the IDs stay where the exported views see them."""
        if need <= len(self.buf):
            return
        cap = self._capacity(need)
        if not self._grow_in_place(cap):        # an exported view holds the buffer: it keeps it, we copy
            grown = np.empty(cap, np.uint32)
            grown[:self.n] = self.buf[:self.n]
            ck = np.zeros((cap >> SHIFT) + 2, np.int64)
            ck[:len(self.ck)] = self.ck
            self.buf, self.ck, self._ro = grown, ck, None

    def _capacity(self, need: int) -> int:
        return need + min(need // GROWTH, MAX_SLACK) + 16 if self.n else need

    def _grow_in_place(self, cap: int) -> bool:
        """An append's growth as a realloc of both arrays (no new buffer, no Python-level copy: ~1 us instead of ~4
        for a 12K-record session): only while no exported view holds the buffer (numpy's refcheck refuses the
        resize then, and the caller copies into a new buffer instead, leaving the views as they are)."""
        self._ro = None         # (its reference would fail the refcheck)
        try:
            self.buf.resize(cap)
        except ValueError:
            return False
        self.ck.resize((cap >> SHIFT) + 2)     # new checkpoints are zero-filled, as a fresh array's would be
        return True

    def _move(self, keep: int, n_mid: int, right_from: int, n_right: int, new_n: int) -> None:
        """The right part to its new place: one memmove in place, or a copy into larger arrays."""
        cap = self._capacity(new_n)
        if new_n > len(self.buf) and not n_right and self._grow_in_place(cap):
            return          # (before any local name holds the buffer: the resize's refcheck counts them)
        buf = self.buf
        dst = keep + n_mid
        if new_n > len(buf):
            grown = np.empty(cap, np.uint32)
            grown[:keep] = buf[:keep]
            grown[dst:new_n] = buf[right_from:right_from + n_right]
            ck = np.zeros((cap >> SHIFT) + 2, np.int64)
            ck[:len(self.ck)] = self.ck
            self.buf, self.ck, self._ro = grown, ck, None
        elif n_right and dst != right_from:
            ctypes.memmove(buf.ctypes.data + 4 * dst, buf.ctypes.data + 4 * right_from, 4 * n_right)
