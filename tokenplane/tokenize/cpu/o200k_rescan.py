"""o200k's rare shapes: a scalar matcher between synchronizing positions (pretokenize.py's o200k loop hands them here).

The run rule of pretokenize.py does not cover two local shapes of o200k's splitter: a combining mark right after
punctuation (which the punctuation alternative can swallow) and `/` right after CR/LF (which `[\\r\\n/]*` can chain
into). The o200k loop writes those positions to `rare`; around each, the pieces are recomputed by `_o200k_scan` (the
regex emulated alternative by alternative) between two synchronizing positions, where a piece starts whatever the
left context is: after CR/LF before a non-whitespace non-'/' character, at digit-run edges, and at the text's ends.
`_o200k_rescan_local` finds those positions near each rare position (the staged path); `_o200k_rescan` computes
them over the whole text (the test oracle it is checked against). `_rescan_bits` is `_o200k_rescan_local` compiled,
on a start bitmap: the full encode's block kernel (fullencode._full_o200k) runs it without leaving numba, and a
session window's spans through `_rescan_mask` (window._window_o200k, the append kernel); the Python matcher is its
oracle (tests/test_pretokenize.py).
"""

from __future__ import annotations

import numpy as np

from ..spec import charclass
from .lazyjit import njit  # numba itself only when a JIT kernel runs (lazyjit.py)

_B = charclass.BIT
_L, _N, _S, _M = _B["L"], _B["N"], _B["s"], _B["M"]
_LU, _LT, _LL = _B["Lu"], _B["Lt"], _B["Ll"]
CR, LF, SPACE, APOS, SLASH = 13, 10, 32, 39, 47
_UPPERISH = _LU | _LT | _B["Lm"] | _B["Lo"] | _M        # [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]
_LOWERISH = _LL | _B["Lm"] | _B["Lo"] | _M              # [\p{Ll}\p{Lm}\p{Lo}\p{M}]


def _merge_windows(lo: np.ndarray, hi: np.ndarray):
    a, b = int(lo[0]), int(hi[0])
    for x, y in zip(lo[1:].tolist(), hi[1:].tolist()):
        if x < b:
            b = max(b, y)
        else:
            yield a, b
            a, b = x, y
    yield a, b


def _o200k_scan(cps: np.ndarray, cls: np.ndarray, a: int, b: int) -> list[int]:
    """Piece starts in [a, b) by emulating the o200k regex alternative by alternative from `a` (a known start)."""
    n = cps.shape[0]
    cp = cps.tolist() if n < 4096 else None
    get = (lambda i: cp[i]) if cp is not None else (lambda i: int(cps[i]))
    c = lambda i: int(cls[i])

    def is_u(i):
        return c(i) & (_LU | _LT | _B["Lm"] | _B["Lo"] | _M) != 0

    def is_lw(i):
        return c(i) & (_LL | _B["Lm"] | _B["Lo"] | _M) != 0

    def fold(x):
        return x + 32 if 65 <= x <= 90 else (115 if x == 0x17F else x)

    def contraction(e):
        if e + 1 < n and get(e) == APOS:
            f1 = fold(get(e + 1))
            if f1 in (115, 116, 109, 100):          # s t m d
                return e + 2
            if e + 2 < n:
                f2 = fold(get(e + 2))
                if (f1, f2) in ((114, 101), (118, 101), (108, 108)):   # re ve ll
                    return e + 3
        return e

    def word(alt, x):
        if x >= n:
            return -1
        y = x
        while y < n and is_u(y):
            y += 1
        if alt == 1:
            if y < n and is_lw(y):
                z = y
                while z < n and is_lw(z):
                    z += 1
                return z
            for j in range(y - 1, x - 1, -1):
                if is_lw(j):
                    return j + 1
            return -1
        if y == x:
            return -1
        while y < n and is_lw(y):
            y += 1
        return y

    def match(p):
        k = c(p)
        ch = get(p)
        prefix_ok = ch not in (CR, LF) and not (k & (_L | _N))
        for alt in (1, 2):
            for pre in ((1, 0) if prefix_ok else (0,)):
                e = word(alt, p + pre)
                if e > p + pre:
                    return contraction(e)
        if k & _N:
            e = p
            while e < n and e - p < 3 and c(e) & _N:
                e += 1
            return e
        for sp in ((1, 0) if ch == SPACE else (0,)):
            x = e = p + sp
            while e < n and not (c(e) & (_S | _L | _N)):
                e += 1
            if e > x:
                while e < n and get(e) in (CR, LF, SLASH):
                    e += 1
                return e
        y = p
        while y < n and c(y) & _S:
            y += 1
        last_nl = -1
        for j in range(y - 1, p - 1, -1):
            if get(j) in (CR, LF):
                last_nl = j
                break
        if last_nl >= 0:
            return last_nl + 1
        if y == n:
            return y
        if y - 1 > p:
            return y - 1
        return y

    out = []
    p = a
    while p < b:
        out.append(p)
        p = match(p)
    if p != b:
        raise RuntimeError(f"o200k scalar scan overran a synchronizing position ({p} != {b})")
    return out


def _sorted_union(*arrays: np.ndarray) -> np.ndarray:
    # np.union1d/np.unique hash-sort here, which is slower than sort + adjacent-difference on these sizes
    x = np.sort(np.concatenate(arrays))
    return x[np.append(True, x[1:] != x[:-1])] if x.size else x


def _o200k_rescan(cps, cls, c, rare, starts) -> None:
    """Recompute starts with the scalar matcher between the synchronizing positions around each rare position:
    after CR/LF before a non-whitespace non-'/' character, at digit-run edges, and the text ends."""
    n = c.shape[0]
    is_n = (cls & _N) != 0
    is_ws = (cls & _S) != 0
    after_crlf = np.flatnonzero((c[:-1] == CR) | (c[:-1] == LF)) + 1
    after_crlf = after_crlf[~is_ws[after_crlf] & (c[after_crlf] != SLASH)]
    digit_edge = np.flatnonzero(is_n[1:] != is_n[:-1]) + 1
    sync_pos = _sorted_union(np.array([0, n]), after_crlf, digit_edge)
    lo = sync_pos[np.searchsorted(sync_pos, rare, side="right") - 1]
    hi = sync_pos[np.searchsorted(sync_pos, rare, side="right")]
    for a, b in _merge_windows(lo, hi):
        starts[a:b] = False
        starts[_o200k_scan(cps, cls, a, b)] = True


class _LazyClasses:
    """cls[i] = table[cps[i]] on demand: the scalar matcher reads a few hundred characters around each rare
    position, so the whole text's class array (a GIL-held gather) is never built."""

    def __init__(self, table: np.ndarray, cps: np.ndarray):
        self.table, self.cps = table, cps

    def __getitem__(self, i: int) -> int:
        return int(self.table[self.cps[i]])


def _sync_mask(cps, c, table, p0: int, p1: int) -> np.ndarray:
    """Which positions p0..p1-1 (p0 >= 1) are synchronizing positions of `_o200k_rescan` (after CR/LF before a
    non-whitespace non-'/' character, or a digit-run edge)."""
    cls = table[cps[p0 - 1:p1]]
    prev, cur = cls[:-1], cls[1:]
    prev_c, cur_c = c[p0 - 1:p1 - 1], c[p0:p1]
    after_crlf = ((prev_c == CR) | (prev_c == LF)) & ((cur & _S) == 0) & (cur_c != SLASH)
    return after_crlf | (((cur & _N) != 0) != ((prev & _N) != 0))


def _sync_before(cps, c, table, r: int) -> int:
    """The largest synchronizing position <= r (0 counts), searched in growing windows left of r."""
    w = 256
    while True:
        p0 = max(1, r + 1 - w)
        idx = np.flatnonzero(_sync_mask(cps, c, table, p0, r + 1)) if r >= 1 else np.zeros(0, dtype=np.int64)
        if idx.size:
            return p0 + int(idx[-1])
        if p0 <= 1:
            return 0
        w *= 4


def _sync_after(cps, c, table, r: int) -> int:
    """The smallest synchronizing position > r (the text's end counts), searched in growing windows."""
    n = c.shape[0]
    w = 256
    while True:
        p1 = min(n, r + 1 + w)
        if r + 1 >= n:
            return n
        idx = np.flatnonzero(_sync_mask(cps, c, table, r + 1, p1))
        if idx.size:
            return r + 1 + int(idx[0])
        if p1 >= n:
            return n
        w *= 4


def _o200k_rescan_local(cps, table, c, rare, starts) -> None:
    """`_o200k_rescan` (same windows, same matcher) with each window's synchronizing positions found near its rare
    position instead of over the whole text: the whole-text passes cost ~15 ms per 1M characters whenever a text
    held one rare position."""
    r_list = rare.tolist()
    lo = np.array([_sync_before(cps, c, table, r) for r in r_list], dtype=np.int64)
    hi = np.array([_sync_after(cps, c, table, r) for r in r_list], dtype=np.int64)
    cls = _LazyClasses(table, cps)
    for a, b in _merge_windows(lo, hi):
        starts[a:b] = False
        starts[_o200k_scan(cps, cls, a, b)] = True     # type: ignore[arg-type]  # indexable like the array


# -- compiled: the same windows and matcher on a start bitmap (fullencode._full_o200k) -----------------------------
def _fold(x):
    return x + 32 if 65 <= x <= 90 else (115 if x == 0x17F else x)


def _contraction(cps, n, e):
    """`_o200k_scan`'s contraction(e): the end of `(?i:'s|'t|'re|'ve|'m|'ll|'d)` at e, or e."""
    if e + 1 < n and cps[e] == APOS:
        f1 = _fold(np.int64(cps[e + 1]))
        if f1 == 115 or f1 == 116 or f1 == 109 or f1 == 100:
            return e + 2
        if e + 2 < n:
            f2 = _fold(np.int64(cps[e + 2]))
            if (f1 == 114 and f2 == 101) or (f1 == 118 and f2 == 101) or (f1 == 108 and f2 == 108):
                return e + 3
    return e


def _word(cps, table, n, alt, x):
    """`_o200k_scan`'s word(alt, x): the end of word alternative 1 (`U* L+`) or 2 (`U+ L*`) at x, or -1."""
    if x >= n:
        return -1
    y = x
    while y < n and (table[cps[y]] & _UPPERISH) != 0:
        y += 1
    if alt == 1:
        if y < n and (table[cps[y]] & _LOWERISH) != 0:
            z = y
            while z < n and (table[cps[z]] & _LOWERISH) != 0:
                z += 1
            return z
        for j in range(y - 1, x - 1, -1):
            if (table[cps[j]] & _LOWERISH) != 0:
                return j + 1
        return -1
    if y == x:
        return -1
    while y < n and (table[cps[y]] & _LOWERISH) != 0:
        y += 1
    return y


def _match(cps, table, n, p):
    """`_o200k_scan`'s match(p): the end of the piece that starts at p."""
    k = table[cps[p]]
    ch = cps[p]
    prefix_ok = ch != CR and ch != LF and (k & (_L | _N)) == 0
    for alt in range(1, 3):
        pre = 1 if prefix_ok else 0
        while pre >= 0:
            e = _word(cps, table, n, alt, p + pre)
            if e > p + pre:
                return _contraction(cps, n, e)
            pre -= 1
    if (k & _N) != 0:
        e = p
        while e < n and e - p < 3 and (table[cps[e]] & _N) != 0:
            e += 1
        return e
    sp = 1 if ch == SPACE else 0
    while sp >= 0:
        x = p + sp
        e = x
        while e < n and (table[cps[e]] & (_S | _L | _N)) == 0:
            e += 1
        if e > x:
            while e < n and (cps[e] == CR or cps[e] == LF or cps[e] == SLASH):
                e += 1
            return e
        sp -= 1
    y = p
    while y < n and (table[cps[y]] & _S) != 0:
        y += 1
    for j in range(y - 1, p - 1, -1):
        if cps[j] == CR or cps[j] == LF:
            return j + 1
    if y == n:
        return y
    if y - 1 > p:
        return y - 1
    return y


def _is_sync(cps, table, n, p):
    """Whether p is a synchronizing position (`_sync_mask`; the text's ends count)."""
    if p <= 0 or p >= n:
        return True
    q = cps[p - 1]
    if (q == CR or q == LF) and (table[cps[p]] & _S) == 0 and cps[p] != SLASH:
        return True
    return ((table[cps[p]] & _N) != 0) != ((table[cps[p - 1]] & _N) != 0)


def _rescan_bits_impl(cps, table, rare, sb):
    """`_o200k_rescan_local` on the start bitmap sb: for each rare position r (sorted), the window from the last
    synchronizing position <= r to the first > r, overlapping windows merged, its bits replaced by the matcher's
    starts. Returns 0, or -1 where the matcher overran a window's end (`_o200k_scan` raises there)."""
    n = cps.shape[0]
    one = np.uint64(1)
    i = 0
    while i < rare.shape[0]:
        a = rare[i]
        while not _is_sync(cps, table, n, a):
            a -= 1
        b = rare[i] + 1
        while not _is_sync(cps, table, n, b):
            b += 1
        i += 1
        while i < rare.shape[0] and rare[i] < b:      # the next window starts inside this one (its lo < b)
            b = max(b, rare[i] + 1)
            while not _is_sync(cps, table, n, b):
                b += 1
            i += 1
        for j in range(a, b):
            sb[j >> 6] &= ~(one << np.uint64(j & 63))
        p = a
        while p < b:
            sb[p >> 6] |= one << np.uint64(p & 63)
            p = _match(cps, table, n, p)
        if p != b:
            return -1
    return 0


def _rescan_mask_impl(cps, table, rare, starts):
    """`_rescan_bits` on a bool start mask (a session window's span): the mask as a bitmap, the rescan, the bits back
    into the mask. Returns what `_rescan_bits` returns."""
    n = cps.shape[0]
    sb = np.zeros((n >> 6) + 2, np.uint64)
    one = np.uint64(1)
    for j in range(n):
        if starts[j]:
            sb[j >> 6] |= one << np.uint64(j & 63)
    if _rescan_bits(cps, table, rare, sb) < 0:
        return -1
    for j in range(n):
        starts[j] = ((sb[j >> 6] >> np.uint64(j & 63)) & one) != 0
    return 0


_fold = njit(cache=True, nogil=True, inline="always")(_fold)
_contraction = njit(cache=True, nogil=True, inline="always")(_contraction)
_word = njit(cache=True, nogil=True, inline="always")(_word)
_match = njit(cache=True, nogil=True)(_match)
_is_sync = njit(cache=True, nogil=True, inline="always")(_is_sync)
_rescan_bits = njit(cache=True, nogil=True)(_rescan_bits_impl)
_rescan_mask = njit(cache=True, nogil=True)(_rescan_mask_impl)
