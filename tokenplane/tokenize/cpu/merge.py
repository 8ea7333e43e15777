"""The byte-pair merge kernels: one piece's bytes -> its IDs through the pair table (`pair_records`).

Schedule: each round finds the piece's minimum rank, merges the leftmost non-overlapping occurrences of it, and
re-probes only the pairs next to a merge. A later occurrence joins the round only while every pair created so far
ranks strictly above the minimum, which is exactly when iterated single leftmost-minimum merges (tiktoken's
`byte_pair_merge`, HF's merge heap) would take it next; so the result is the same on any vocabulary (cl100k has
tokens ranked below one of their own parts, so a global monotonicity assumption would not hold). Three forms of it:
`_merge_piece` (rounds; `batch` False: one merge a round, kept to measure against), `_merge_piece_scan` (short
pieces: a rescan per merge, no bookkeeping) and `_merge_piece_heap` (long pieces: O(m log m)). bpe.py (the piece
caches) and piecemap.py (the full encode's walk) call them on a miss.

The kernels are numba-compiled with nogil=True, so chunks encode in parallel threads (parallel.py); docs/pretokenizer.md
("BPE kernel") compares them with a numpy batched-rounds form of the same schedule.
"""

from __future__ import annotations

import numpy as np

from .lazyjit import njit  # numba itself only when a JIT kernel runs (lazyjit.py)

EMPTY = np.uint64(0xFFFFFFFFFFFFFFFF)


@njit(cache=True, nogil=True, inline="always")
def _pair_home(key, mask):
    """First probe slot of a pair key: the one formula the table builder and the kernels' lookup share."""
    return np.int64(((key * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(29)) & np.uint64(mask))


PAIR_BITS = 21       # a pair record holds two IDs and a rank of this many bits each (vocabularies < 2**21 - 1)
_PAIR_IDS = (1 << (2 * PAIR_BITS)) - 1
# The pair filter: row 0 of the table is followed by cap >> FILTER_SHIFT words, a blocked Bloom filter of the table's
# pairs (two bits of one word per pair). Most lookups of a merge find no pair (every pair left at the end of a piece,
# and most re-probes next to a merge), and a probe of the table (2-4 MB, beyond L2) to its empty slot is a cache miss;
# the filter (128-256 KB, 1/16 of the table) answers most of them (2-5% of absent pairs pass it). Warm 1M-character
# encodes, benchmarks/revision_ab.py --mode warm (revision_ab_xeon_stop64_filter_warm.md): CJK 1.14-1.23x, mixed
# text 1.02-1.09x. bpe.py's and piecemap.py's whole-token tables carry the same kind of filter.
FILTER_SHIFT = 4


def table_width(cap: int, shift: int = FILTER_SHIFT) -> int:
    """Length of a table of `cap` slots followed by its filter of cap >> shift entries (the pair table's row 0 and
    bpe.py's whole-token hash table: words; piecemap.whole_map: rows of two words)."""
    return cap + (cap >> shift)


@njit(cache=True, nogil=True, inline="always")
def _filter_split(width, shift):
    """(cap, filter entries) of a table of length `width` = `table_width(cap, shift)`: the filter has
    width // (2**shift + 1) entries; both are powers of two."""
    extra = width // ((1 << shift) + 1)
    return width - extra, extra


@njit(cache=True, nogil=True, inline="always")
def _filter_probe(h, words):
    """(word index, bits) of the key that hashes to h (the key times the multiplier of `_pair_home`) in a filter of
    `words` words. For a pair, bits 32-63 of h mix both IDs (the lower 32 depend on the right ID alone): the word
    comes from bits 40 and up, the two bits from bits 34-39 and 58-63."""
    at = np.int64((h >> np.uint64(40)) & np.uint64(words - 1))
    bits = (np.uint64(1) << ((h >> np.uint64(34)) & np.uint64(63))) | (np.uint64(1) << (h >> np.uint64(58)))
    return at, bits


@njit(cache=True, nogil=True)
def _fill_filter(row, cap, keys):
    """Set every pair key's two bits in the filter that follows row[:cap]."""
    words = row.shape[0] - cap
    for key in keys:
        at, bits = _filter_probe(key * np.uint64(0x9E3779B97F4A7C15), words)
        row[cap + at] |= bits


@njit(cache=True, nogil=True, inline="always")
def _filter_has(row, cap, words, h):
    """Whether the filter of `words` words after row[:cap] may hold the key that hashes to h (False: it does not)."""
    at, bits = _filter_probe(h, words)
    return (row[cap + at] & bits) == bits


def pair_records(pkeys: np.ndarray, pranks: np.ndarray, pnews: np.ndarray, one_row: bool | None = None) -> np.ndarray:
    """The kernels' pair table from the (key, rank, merged ID) table `_build_pairs` makes, slot for slot: row 0 holds
    each pair as one word, left << 21 | right | order << 42 (all ones: empty), so a probe reads 8 bytes a slot
    instead of 16 (the pair lookups of the BPE of new pieces are cache misses: half the table, fewer of them).

    order: the merged ID itself where that orders the pairs as their ranks do, i.e. where a rank is its merged ID
    (tiktoken) or merged IDs strictly increase with the rank (HF vocabularies numbered in merge order: qwen3,
    deepseek_v4, smollm2); the table is then that one row, uint64[1, width], and a merge reads nothing more.
    Otherwise the order is the rank and row 1 of uint64[2, width] holds the merged ID, read when a pair merges
    (`one_row` False: this form whatever the IDs, for tests). width = `table_width(cap)`: row 0's slots are followed
    by the pair filter (FILTER_SHIFT)."""
    used = pkeys != EMPTY
    left = pkeys >> np.uint64(32)
    right = pkeys & np.uint64(0xFFFFFFFF)
    ranks = pranks[used].astype(np.int64)
    news = pnews[used].astype(np.int64)
    follows = bool(np.array_equal(ranks, news))
    if not follows:
        by_rank = np.argsort(ranks, kind="stable")
        follows = bool(np.all(np.diff(ranks[by_rank]) > 0) and np.all(np.diff(news[by_rank]) > 0))
    if one_row and not follows:
        raise ValueError("merged IDs do not order the pairs as their ranks: the table needs its second row")
    one_row = follows if one_row is None else one_row
    order = pnews if one_row else pranks
    limit = (1 << PAIR_BITS) - 1
    if used.any() and (int(left[used].max()) >= limit or int(right[used].max()) >= limit
                       or int(order[used].max()) >= limit):
        raise ValueError(f"pair records hold IDs and ranks below {limit}")
    rec = (left << np.uint64(PAIR_BITS)) | right | (order.astype(np.uint64) << np.uint64(2 * PAIR_BITS))
    cap = pkeys.shape[0]
    out = np.zeros((1 if one_row else 2, table_width(cap)), np.uint64)
    out[0, :cap] = np.where(used, rec, EMPTY)
    _fill_filter(out[0], cap, np.ascontiguousarray(pkeys[used]))
    if not one_row:
        out[1, :cap] = np.where(used, pnews.astype(np.int64), -1).astype(np.uint64)
    return out


@njit(cache=True, nogil=True, inline="always")
def _merged(ptab, order, slot):
    """The merged ID of the pair found at `slot` with `order` (`pair_records`)."""
    if ptab.shape[0] == 1:
        return np.int32(order)
    return np.int32(ptab[1, slot])


@njit(cache=True, nogil=True)
def _pair_rank(ptab, a, b):
    """(order, slot) of the pair (a, b), or (INF, -1): its rank or what orders pairs as their ranks do, and where
    `_merged` finds its merged ID (`pair_records`). The filter first (FILTER_SHIFT: a pair it lacks is in no slot),
    then the probe sequence of `_build_pairs` (the home of left << 32 | right), each probe one 8-byte word of row 0."""
    cap, words = _filter_split(ptab.shape[1], FILTER_SHIFT)
    mask = cap - 1
    key = (np.uint64(a) << np.uint64(32)) | np.uint64(b)
    if not _filter_has(ptab[0], cap, words, key * np.uint64(0x9E3779B97F4A7C15)):
        return np.int32(0x7FFFFFFF), np.int32(-1)
    want = (np.uint64(a) << np.uint64(PAIR_BITS)) | np.uint64(b)
    i = _pair_home(key, mask)
    while True:
        v = ptab[0, i]
        if (v & np.uint64(_PAIR_IDS)) == want:
            return np.int32(v >> np.uint64(2 * PAIR_BITS)), np.int32(i)
        if v == np.uint64(0xFFFFFFFFFFFFFFFF):
            return np.int32(0x7FFFFFFF), np.int32(-1)
        i = (i + 1) & mask


@njit(cache=True, nogil=True, inline="always")
def _init_pairs(buf, a, m, byte_ids, ptab, sym, rk, nw):
    """The piece's bytes as tokens into sym[:m], each adjacent pair's order and pair-table slot into rk / nw."""
    for i in range(m):
        sym[i] = byte_ids[buf[a + i]]
    for i in range(m - 1):
        r, t = _pair_rank(ptab, sym[i], sym[i + 1])
        rk[i] = r
        nw[i] = t


@njit(cache=True, nogil=True)
def _merge_piece(buf, a, b, byte_ids, ptab, batch, sym, rk, nw, out, o):
    """BPE of buf[a:b] appended to out[o:]; returns the new o. sym/rk/nw: scratch of length >= b - a.

    rk[i]/nw[i]: order and pair-table slot of the pair (sym[i], sym[i+1]) (`_pair_rank`). A round merges the
    leftmost occurrence of the minimum rank, then keeps merging later occurrences left to right for as long as the
    pairs the merges create rank strictly above the minimum: exactly then the next single leftmost merge would be
    that occurrence too.
    """
    INF = np.int32(0x7FFFFFFF)
    m = b - a
    _init_pairs(buf, a, m, byte_ids, ptab, sym, rk, nw)
    k = m
    while k > 1:
        best = INF
        for i in range(k - 1):
            if rk[i] < best:
                best = rk[i]
        if best == INF:
            break
        w = 0
        i = 0
        done = False
        while i < k:
            if not done and i < k - 1 and rk[i] == best:
                t = _merged(ptab, best, nw[i])
                sym[w] = t
                low = INF
                if w > 0:       # the pair on the left now ends in the merged token: re-probe it
                    r, u = _pair_rank(ptab, sym[w - 1], t)
                    rk[w - 1] = r
                    nw[w - 1] = u
                    low = r
                if i + 2 < k:   # and the pair on the right starts with it
                    r, u = _pair_rank(ptab, t, sym[i + 2])
                    rk[w] = r
                    nw[w] = u
                    if r < low:
                        low = r
                else:
                    rk[w] = INF
                if low <= best or not batch:
                    done = True
                w += 1
                i += 2
            else:
                sym[w] = sym[i]
                if i < k - 1:
                    rk[w] = rk[i]
                    nw[w] = nw[i]
                w += 1
                i += 1
        k = w
    for i in range(k):
        out[o] = sym[i]
        o += 1
    return o


@njit(cache=True, nogil=True)
def _merge_piece_scan(buf, a, b, byte_ids, ptab, sym, rk, nw, out, o):
    """The same BPE as `_merge_piece` (the leftmost occurrence of the lowest-ranked pair merged, one merge a step),
    for short pieces: each step takes the first minimum in one pass of conditional moves (no branch on the ranks'
    order), merges there, shifts the pairs right of it down one and re-probes its two neighbours. Measured on the
    pieces a warm 1M-character encode misses (one core, hot tables, ns a piece, against the rounds kernel): cl100k
    english 2-8 bytes 179 vs 226, 9-16 bytes 394 vs 455; CJK 197 vs 211 and 478 vs 549; qwen3 alike; the heap
    kernel stays faster above 16 bytes (1,184 vs 1,338 at 17-32)."""
    inf = np.int32(0x7FFFFFFF)
    m = b - a
    _init_pairs(buf, a, m, byte_ids, ptab, sym, rk, nw)
    k = m
    while k > 1:
        best = inf
        at = 0
        for i in range(k - 1):
            r = rk[i]
            lower = r < best
            at = i if lower else at
            best = r if lower else best
        if best == inf:
            break
        t = _merged(ptab, best, nw[at])
        sym[at] = t
        for i in range(at + 1, k - 1):
            sym[i] = sym[i + 1]
            rk[i] = rk[i + 1]
            nw[i] = nw[i + 1]
        k -= 1
        if at > 0:
            r, u = _pair_rank(ptab, sym[at - 1], t)
            rk[at - 1] = r
            nw[at - 1] = u
        if at < k - 1:
            r, u = _pair_rank(ptab, t, sym[at + 1])
            rk[at] = r
            nw[at] = u
    for i in range(k):
        out[o + i] = sym[i]
    return o + k


@njit(cache=True, nogil=True)
def _heap_push(heap, n, key):
    i = n
    heap[i] = key
    while i > 0:
        parent = (i - 1) >> 1
        if heap[parent] <= heap[i]:
            break
        heap[parent], heap[i] = heap[i], heap[parent]
        i = parent
    return n + 1


@njit(cache=True, nogil=True)
def _heap_pop(heap, n):
    n -= 1
    heap[0] = heap[n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and heap[c + 1] < heap[c]:
            c += 1
        if heap[i] <= heap[c]:
            break
        heap[i], heap[c] = heap[c], heap[i]
        i = c
    return n


@njit(cache=True, nogil=True)
def _merge_piece_heap(buf, a, b, byte_ids, ptab, sym, nxt, prv, prk, pnw, heap, out, o):
    """The same BPE as `_merge_piece` in O(m log m) for long pieces (CJK runs, long identifiers), where the
    rounds' rescans are quadratic. A min-heap of (rank, position) yields the leftmost minimum-rank pair; prk[p]/pnw[p]
    hold the order and pair-table slot of the pair now starting at p (INF when none), and an entry is live iff its
    position still holds a symbol and prk of it equals the entry's rank (every current pair was pushed with its
    current rank, so the smallest live entry is the leftmost minimum; the check reads prk instead of probing the
    pair table again). Merges absorb the right symbol into the left one."""
    INF = np.int64(0x7FFFFFFF)
    m = b - a
    for i in range(m):
        sym[i] = byte_ids[buf[a + i]]
        nxt[i] = i + 1
        prv[i] = i - 1
    nxt[m - 1] = -1
    prk[m - 1] = INF
    n = 0
    for i in range(m - 1):
        r, t = _pair_rank(ptab, sym[i], sym[i + 1])
        prk[i] = r
        pnw[i] = t
        if r != INF:
            n = _heap_push(heap, n, (np.int64(r) << 32) | i)
    while n > 0:
        key = heap[0]
        n = _heap_pop(heap, n)
        r = key >> 32
        p = key & 0xFFFFFFFF
        if sym[p] < 0 or prk[p] != r:
            continue
        q = nxt[p]
        t = _merged(ptab, r, pnw[p])
        sym[p] = t
        sym[q] = -1
        nq = nxt[q]
        nxt[p] = nq
        if nq >= 0:
            prv[nq] = p
        lp = prv[p]
        if lp >= 0:
            r2, t2 = _pair_rank(ptab, sym[lp], t)
            prk[lp] = r2
            pnw[lp] = t2
            if r2 != INF:
                n = _heap_push(heap, n, (np.int64(r2) << 32) | lp)
        if nq >= 0:
            r3, t3 = _pair_rank(ptab, t, sym[nq])
            prk[p] = r3
            pnw[p] = t3
            if r3 != INF:
                n = _heap_push(heap, n, (np.int64(r3) << 32) | p)
        else:
            prk[p] = INF
    i = 0
    while i >= 0:
        out[o] = sym[i]
        o += 1
        i = nxt[i]
    return o


@njit(cache=True, nogil=True)
def _last_merges(tok_flat, tok_off, ids, byte_ids, ptab):
    """(left, right): the two tokens the BPE of token ids[j]'s own bytes merges last, where that BPE yields exactly
    ids[j] (a self-encoding token); -1, -1 where it does not. Token bytes as the piece, the scan kernel's schedule,
    with its merge step written out again: the step as one inline function shared with `_merge_piece_scan` made the
    warm walk 2-8% slower (benchmarks/revision_ab.py --mode warm, cl100k mixed and CJK, qwen3 mixed, 3 rounds), and
    this builder runs once per tokenizer."""
    longest = 2
    for t in ids:
        longest = max(longest, tok_off[t + 1] - tok_off[t])
    sym = np.empty(longest, dtype=np.int32)
    rk = np.empty(longest, dtype=np.int32)
    nw = np.empty(longest, dtype=np.int32)
    left = np.full(ids.shape[0], -1, dtype=np.int32)
    right = np.full(ids.shape[0], -1, dtype=np.int32)
    inf = np.int32(0x7FFFFFFF)
    for j in range(ids.shape[0]):
        a = tok_off[ids[j]]
        k = tok_off[ids[j] + 1] - a
        _init_pairs(tok_flat, a, k, byte_ids, ptab, sym, rk, nw)
        while k > 1:
            at = 0
            for i in range(1, k - 1):
                if rk[i] < rk[at]:
                    at = i
            if rk[at] == inf:
                break
            if k == 2:
                left[j] = sym[0]
                right[j] = sym[1]
            t = _merged(ptab, rk[at], nw[at])
            sym[at] = t
            for i in range(at + 1, k - 1):
                sym[i] = sym[i + 1]
                rk[i] = rk[i + 1]
                nw[i] = nw[i + 1]
            k -= 1
            if at > 0:
                rk[at - 1], nw[at - 1] = _pair_rank(ptab, sym[at - 1], t)
            if at < k - 1:
                rk[at], nw[at] = _pair_rank(ptab, t, sym[at + 1])
        if k != 1 or sym[0] != ids[j]:
            left[j] = right[j] = -1
    return left, right
