"""Pieces -> IDs through one open-addressing map per thread, walked straight from the pre-tokenizer's piece starts.

The staged full encode writes the whole text's UTF-8 and piece bounds, then looks every piece up in bpe.py's
three direct-mapped tiers. Measured on 1M characters of real text (one core, warm): ~26 ns a piece on a run where
every piece had been seen, and the CJK tiers thrashed (76K of 275K pieces missed on a second pass over the same
text: 2,048 direct-mapped long slots for ~24K distinct CJK runs); a miss re-runs BPE (~0.9-1.7 us a piece). Here:

* one table of 16-byte slots, linear probing, no conflict misses until it holds LOAD of its slots (then it is
  emptied and refilled; distinct pieces of 2M characters of real text: 13-47K);
* seeded with every whole token of <= SEED_MAX_BYTES bytes: the map starts as a copy of the slots (and arena
  entries) of the tokenizer's whole-token map (`whole_map`, keyed and laid out as this map), so a new piece that is
  one token is a hit, and a piece that short which the map lacks is known to be none (no whole-token lookup before
  its merges). ~55% of the new pieces of a warm english encode are one token, and each cost a failed probe, a lookup
  in a table the walk otherwise leaves cold, and an insertion;
* a piece found past its home slot swaps places with the home slot's entry: a seeded map is ~30% full before the
  text's own pieces arrive, so they often land past their home slot, out of the branch-free path below (seeded
  without the swap: all-hit encodes 0.87-0.91x on cl100k, CJK's long pieces the most);
* a piece of <= 8 bytes with <= 2 IDs is one slot: its bytes as one word (the exact key) and its IDs packed in the
  other word; any other piece (<= MAX_BYTES) keeps its IDs and its bytes in an append-only arena, and its slot holds
  a 64-bit hash of the bytes, the length, the ID count and the arena offset; a hit compares the bytes, so a hit is
  exact by construction (the BPE of a piece depends on its bytes alone);
* a piece found in its home slot, inline, costs no data-dependent branch (both ID words stored, the count moves the
  output): on 1M characters every piece of which was in the map, 2.2-2.6 ms against 2.8-3.3 before for english and
  code (1.25x, one core, alternated in one process); single-byte pieces are kept in the map like any other;
* a long piece's hash and its byte compare read whole words of the text's UTF-8 where it lies (no copy of the piece);
* a miss runs bpe.py's own merge kernels (whole-piece lookup, then the scan kernel up to HEAP_MIN_BYTES; above,
  backtrack.py's kernel where the tokenizer has its tables, else the heap) on the piece's bytes: the same IDs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import backtrack as bt_mod
from . import bpe as bpe_mod
from . import hugepages
from . import merge as merge_mod
from .lazyjit import njit, numba_global  # numba itself only when a JIT kernel runs (lazyjit.py)

_borrowed = numba_global("tokenplane.tokenize.cpu.borrow", "borrowed")
_load_u64 = numba_global("tokenplane.tokenize.cpu.unaligned", "load_u64")
_prefetch = numba_global("tokenplane.tokenize.cpu.prefetch", "prefetch")

# status of a fused call (fullencode.py); OVERRUN: o200k's rare-shape matcher overran a window (a bug: the staged
# chain then raises it)
OK, SURROGATE, DROPPED, CUT_REJECTED, OVERRUN = 0, 1, 2, 3, 4
SLOTS = 1 << 17              # 2 MB of slots per thread (an unseeded map; a seeded one has its seed's slots)
LOAD = 5 / 8                 # entries before the map is emptied (linear probing stays short below ~0.6)
ARENA_WORDS = 1 << 21        # 8 MB of IDs and bytes of pieces that do not fit a slot
MAX_BYTES = 1024             # longer pieces (long whitespace or symbol runs) are merged each time, not kept
SEED_MAX_BYTES = MAX_BYTES   # a seeded map holds every whole token up to this length (no lookup for such a miss)
SEED_LOAD = 0.4              # whole_map's slots, sized so the seed fills at most this part of a seeded map
WINDOW_SCRATCH = 2 << 20      # bytes of a thread's scratch for the append path's window arrays (window.py `_take`)
# Pieces longer than this merge through bpe.py's heap kernel (same IDs): on the multi-token pieces a warm 1M-character
# encode misses (one core, hot tables), the heap took 2,161 vs 2,450 ns for 17-32 bytes and 2,970 vs 3,864 ns for
# 33-48 bytes (qwen3 CJK runs); up to 16 bytes merge._merge_piece_scan is the fastest (its docstring; bpe.HEAP_MIN_BYTES
# is 48 in the staged path, which keeps the rounds kernel).
HEAP_MIN_BYTES = 16
# Longer pieces go to backtrack.py's kernel where the tokenizer has its tables (same IDs; 2.0-2.6x less time than
# the heap above 32 bytes, its docstring). Alone it also beats the scan kernel at 9-16 bytes (318 vs 382 ns), but in
# the walk a threshold of 8 made english and code encodes 0.77-0.88x (its trie and records are cold where few pieces
# need them) and CJK gained less (1.16x against 1.21x; warm 1M, alternated in one process).
BACKTRACK_MIN_BYTES = 16
_K = 0x9E3779B97F4A7C15
# whole_map's filter: cap >> 5 rows after its slots, 2 words a row (1/16 of the slots' words, as the pair filter)
WMAP_FILTER_SHIFT = 5


class PieceMap:
    """One thread's map (never shared: the kernels write it without locks; bpe.PieceCache.pmap holds it).

    `seed`, `seed_arena`: the tokenizer's `whole_map`; the map then starts as a copy of its slots and its arena as a
    copy of `seed_arena` (same keys, home slots and entries a miss would insert), and is refilled from them when
    emptied, so a piece of <= SEED_MAX_BYTES bytes that the map lacks is known to be no whole token. state[4]: the
    seeded entries (0: unseeded), state[5]: the arena words the seed's entries take (never overwritten)."""

    def __init__(self, slots: int = SLOTS, arena_words: int = ARENA_WORDS, max_load: int | None = None,
                 seed: np.ndarray | None = None, seed_arena: np.ndarray | None = None):
        self.seed = self.seed_arena = None
        nseed = nwords = 0
        self.arena = hugepages.zeros(arena_words, np.uint32)      # (hugepages.py: probed at random)
        if seed is not None:
            cap = 1 << (seed.shape[0].bit_length() - 1)     # (its slots; the rows after them are whole_map's filter)
            self.seed = seed[:cap]
            self.slots = hugepages.copy(self.seed)
            nseed = int(np.count_nonzero(self.slots[:, 1]))
            if seed_arena is None:
                raise ValueError("a seeded piece map needs the seed's arena (whole_map's warena)")
            self.seed_arena = seed_arena
            nwords = int(seed_arena.shape[0])
            self.arena[:nwords] = seed_arena
            slots = cap
        else:
            self.slots = hugepages.zeros((slots, 2), np.uint64)     # word 1 == 0: empty slot
        limit = max_load if max_load is not None else int(slots * LOAD)
        # entries, arena words used, the entry limit, times emptied, seeded entries, seeded arena words
        self.state = np.array([nseed, nwords, limit, 0, nseed, nwords], dtype=np.int64)
        self.bound: dict[str, Any] = {}     # fullencode kernels with these arrays bound, by family
        # backtrack._valid_memo's answers (pure functions of the tokenizer's tables: never stale, never cleared)
        self.valid = np.zeros(bt_mod.VALID_SLOTS, dtype=np.uint64)
        # the fused append kernel's window arrays (appendwin.py): a mapping of its own (independent of the heap's
        # state), 4 KB pages touched only where a window reaches (~0.3 MB for a 1.4K-character append's)
        self.window_scratch = hugepages.zeros(WINDOW_SCRATCH, np.uint8, huge=False)

    def clear(self) -> None:
        if self.seed is not None:
            np.copyto(self.slots, self.seed)
            self.arena[:self.state[5]] = self.seed_arena
        else:
            self.slots[:, 1] = 0
        self.state[0] = self.state[4]
        self.state[1] = self.state[5]


@njit(cache=True, nogil=True, inline="always")
def _home(key, m, mask):
    return np.int64((((key + np.uint64(m)) * np.uint64(_K)) >> np.uint64(40)) & np.uint64(mask))


@njit(cache=True, nogil=True, inline="always")
def _word8(b64, a, m):
    """Bytes a..a+m-1 (m <= 8) of the buffer whose whole words are `b64` as one little-endian word, zero above the
    piece: the two aligned words that hold them, shifted together and masked (the buffer has 16 bytes of padding),
    no loop whose exit depends on the piece's length (it mispredicts once a piece); two loads instead of eight
    byte loads measured -3..-7% of the walk's time on a run where every piece hit."""
    q = a >> 3
    r = np.uint64((a & 7) * 8)
    lo = b64[q] >> r
    hi = (b64[q + 1] << np.uint64(1)) << (np.uint64(63) - r)    # two shifts: a shift by 64 (r == 0) is undefined
    return (lo | hi) & (np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - 8 * m))


@njit(cache=True, nogil=True, inline="always")
def _bytes8(buf, a, m):
    """`_word8` of the same bytes read from the byte buffer itself (at least 8 bytes readable from a): one unaligned
    load, masked."""
    return _load_u64(buf, a) & (np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - 8 * m))


@njit(cache=True, nogil=True, inline="always")
def _long_hash(b64, a, m):
    """A 64-bit hash of the m bytes at a (m > 8), its length mixed in: read as whole words (zero past byte m) straight
    from the buffer, no copy of the piece."""
    h = np.uint64(m) * np.uint64(_K)
    for w in range((m + 7) >> 3):
        h = (h ^ _word8(b64, a + 8 * w, min(8, m - 8 * w))) * np.uint64(_K)
        h ^= h >> np.uint64(29)
    return h


@njit(cache=True, nogil=True, inline="always")
def _long_hash2(w0, w1, m):
    """`_long_hash` of a piece of 9-16 bytes whose two words are w0, w1 (zero past byte m)."""
    h = np.uint64(m) * np.uint64(_K)
    h = (h ^ w0) * np.uint64(_K)
    h ^= h >> np.uint64(29)
    h = (h ^ w1) * np.uint64(_K)
    return h ^ (h >> np.uint64(29))


@njit(cache=True, nogil=True, inline="always")
def _word4(b64, a, m):
    """Bytes a..a+m-1 (m <= 4) as one uint32, zero above the piece: the arena's form of a long piece's bytes."""
    return np.uint32(_word8(b64, a, m))


@njit(cache=True, nogil=True, inline="always")
def _whole_small(wmap, key, m):
    """The token whose bytes are the small piece (key: its bytes as one word, m: its length), or -1: one probe
    sequence in `wmap` (whole_map), laid out as the piece map's inline slots, after its filter (most small pieces
    the walk misses and that are no token are answered by the filter without a probe to an empty slot)."""
    cap, rows = merge_mod._filter_split(wmap.shape[0], WMAP_FILTER_SHIFT)
    if not _wmap_filter_has(wmap, cap, rows, (key + np.uint64(m)) * np.uint64(_K)):
        return -1
    mask = cap - 1
    s = _home(key, m, mask)
    while True:
        meta = wmap[s, 1]
        if meta == 0:
            return -1
        if wmap[s, 0] == key and (meta & np.uint64(15)) == np.uint64(m):
            return np.int64(meta >> np.uint64(8))
        s = (s + 1) & mask


@njit(cache=True, nogil=True)
def _prefetch_homes(buf, bounds, nb, slots):
    """Prefetch the home slot of every piece of up to 16 bytes in buf[bounds[0]:bounds[nb - 1]], hashed as `_walk_into`
    hashes it. For a repair window (a few hundred pieces) arriving after the process did other work, its slots are in
    memory: issued here together, their misses overlap, where the walk meets each behind the previous piece's compare
    (~2 ns a piece when they are cached)."""
    mask = slots.shape[0] - 1
    flat = slots.reshape(2 * slots.shape[0])
    for j in range(nb - 1):
        a = bounds[j]
        m = bounds[j + 1] - a
        if m <= 8:
            key = _bytes8(buf, a, m)
        elif m <= 16:
            key = _long_hash2(_load_u64(buf, a), _bytes8(buf, a + 8, m - 8), m)
        else:
            continue
        _prefetch(flat, 2 * _home(key, m, mask))


@njit(cache=True, nogil=True)
def _walk(buf, bounds, nb, has_missing, missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat, tok_off,
          wmap, btda, btrec, slots, arena, state, valid):
    """(IDs of the pieces buf[bounds[j]:bounds[j+1]], j < nb - 1, status OK or DROPPED: a byte the vocabulary
    lacks). buf: the UTF-8, with at least 16 bytes after the last piece."""
    out = np.empty(bounds[nb - 1] + 16, np.int32)        # a piece yields at most one ID per byte
    o, status = _walk_into(buf, bounds, nb, out, 0, np.empty(5 * 64, np.int32), np.empty(3 * 64, np.int64),
                           has_missing, missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat, tok_off, wmap,
                           btda, btrec, slots, arena, state, valid)
    return (out[:o] if status == OK else out[:0]), status


@njit(cache=True, nogil=True)
def _walk_into(buf, bounds, nb, out, o, ms, heap, has_missing, missing, byte_ids, ptab, batch, whole, wkeys, wids,
               tok_flat, tok_off, wmap, btda, btrec, slots, arena, state, valid):
    """`_walk` writing the IDs into out from o on (out: at least o + bounds[nb - 1] + 16 entries); ms (int32, 5 x
    k) and heap (int64, >= 3 x k): the merge kernels' scratch for pieces up to k bytes (a longer one gets its own).
    (o after the last ID, OK), or (o, DROPPED). Allocates nothing while every piece fits the scratch: a batch of
    short texts calls it once a text (fullbatch.py)."""
    # every array a miss passes to the merge kernels as a borrowed view (borrow.py): a call's refcounts on nine
    # arrays cost ~150 ns of atomics a miss otherwise (out and the scratch are the caller's, alive for the call)
    buf, bounds, missing, byte_ids, ptab = _borrowed(buf), _borrowed(bounds), _borrowed(missing), \
        _borrowed(byte_ids), _borrowed(ptab)
    wkeys, wids, tok_flat, tok_off, wmap = _borrowed(wkeys), _borrowed(wids), _borrowed(tok_flat), \
        _borrowed(tok_off), _borrowed(wmap)
    slots, arena, state, out = _borrowed(slots), _borrowed(arena), _borrowed(state), _borrowed(out)
    # backtrack.py's arrays stay owned: borrowed, they made the JIT-compiled all-hit walk 5% slower than before they
    # were added (cl100k code, qwen3 english, o200k code; alternated in one process), owned 1.08-1.21x faster (the
    # AOT build: within noise either way); the long misses that read them pay ~50 ns of reference counts against
    # ~0.5-1.4 us of BPE
    backtrack = btda.shape[0] > 0
    scratch = ms.shape[0] // 5
    sym, rk, nw, prk, pnw = _split5(_borrowed(ms), scratch)
    heap = _borrowed(heap)
    mask = slots.shape[0] - 1
    idmask = np.uint64((1 << bpe_mod.ID_BITS) - 1)
    b64 = buf[:(buf.shape[0] >> 3) << 3].view(np.uint64)
    inline_of = np.uint64((1 << 63) | 15)      # a slot's "kept in the arena" bit and length field
    flat = slots.reshape(2 * slots.shape[0])    # the fast paths index words (a shift, not a stride multiply)
    for j in range(nb - 1):
        a = bounds[j]
        b = bounds[j + 1]
        m = b - a
        small = m <= 8
        if small:
            key = _bytes8(buf, a, m)
            # -- the common case without a data-dependent branch: the piece sits in its home slot, inline (its key
            # is its bytes: equal key and length are the piece); both ID words are stored, the count decides how far
            # the output advances (out has 16 spare entries)
            s = _home(key, m, mask)
            meta = flat[2 * s + 1]
            if flat[2 * s] == key and (meta & inline_of) == np.uint64(m):
                out[o] = np.int32((meta >> np.uint64(8)) & idmask)
                out[o + 1] = np.int32(meta >> np.uint64(32))
                o += 1 + np.int64((meta >> np.uint64(4)) & np.uint64(1))
                continue
        elif m <= 16:
            # -- the same for a piece of 9-16 bytes with up to 4 IDs in the arena: its two words hashed, its 3-4
            # arena words compared and 4 ID words copied with no loop whose trip count depends on the piece
            w0 = _load_u64(buf, a)
            w1 = _bytes8(buf, a + 8, m - 8)
            key = _long_hash2(w0, w1, m)
            s = _home(key, m, mask)
            meta = flat[2 * s + 1]
            cnt = np.int64((meta >> np.uint64(16)) & np.uint64(0xFF))
            if flat[2 * s] == key and (meta >> np.uint64(63)) == 1 and np.int64(meta & np.uint64(0xFFFF)) == m \
                    and cnt <= 4:
                off = np.int64(meta >> np.uint64(24)) & np.int64(0x7FFFFFFFFF)
                x = off + cnt
                last = arena[min(x + 3, arena.shape[0] - 1)]       # the fourth word exists when m > 12
                if (arena[x] == np.uint32(w0) and arena[x + 1] == np.uint32(w0 >> np.uint64(32))
                        and arena[x + 2] == np.uint32(w1) and (m <= 12 or last == np.uint32(w1 >> np.uint64(32)))):
                    out[o] = arena[off]
                    out[o + 1] = arena[off + 1]      # within the entry: its IDs, then at least 3 words of bytes
                    out[o + 2] = arena[off + 2]
                    out[o + 3] = arena[off + 3]
                    o += cnt
                    continue
        else:
            key = _long_hash(b64, a, m)
        # -- lookup
        h0 = _home(key, m, mask)
        s = h0
        hit = False
        while True:
            meta = slots[s, 1]
            if meta == 0:
                break
            if slots[s, 0] == key:
                if (meta >> np.uint64(63)) == 0:
                    if small and (meta & np.uint64(15)) == np.uint64(m):
                        out[o] = np.int32((meta >> np.uint64(8)) & idmask)
                        if (meta & np.uint64(16)) != 0:
                            out[o + 1] = np.int32(meta >> np.uint64(32))
                            o += 2
                        else:
                            o += 1
                        hit = True
                        break
                elif np.int64(meta & np.uint64(0xFFFF)) == m:
                    cnt = np.int64((meta >> np.uint64(16)) & np.uint64(0xFF))
                    off = np.int64(meta >> np.uint64(24)) & np.int64(0x7FFFFFFFFF)
                    same = True
                    if not small:       # a small piece's key is its bytes: equal keys and lengths are enough
                        for w in range((m + 3) >> 2):
                            if arena[off + cnt + w] != _word4(b64, a + 4 * w, min(4, m - 4 * w)):
                                same = False
                                break
                    if same:
                        for t in range(cnt):
                            out[o + t] = arena[off + t]
                        o += cnt
                        hit = True
                        break
            s = (s + 1) & mask
        if hit:
            if s != h0:
                # a piece found past its home slot trades places with the home slot's entry, so its next occurrence
                # takes the branch-free path; the other entry stays reachable (every slot from its own home to s is
                # full: its chain ran to the home slot, the piece's from there to s)
                k0, m0 = slots[h0, 0], slots[h0, 1]
                slots[h0, 0] = slots[s, 0]
                slots[h0, 1] = slots[s, 1]
                slots[s, 0] = k0
                slots[s, 1] = m0
            continue
        # -- miss: bpe.py's kernels on the piece's bytes
        if has_missing:
            for k in range(a, b):
                if missing[buf[k]]:
                    return o, DROPPED
        if m >= scratch:    # (the grown scratch lives to the end of this call; backtracking reads m + 1)
            scratch = 2 * m
            sym, rk, nw, prk, pnw = _split5(np.empty(5 * scratch, np.int32), scratch)
            heap = np.empty(3 * scratch, np.int64)
        o0 = o
        t = -1
        if m == 1:
            t = byte_ids[buf[a]]
        elif whole and small:
            if state[4] == 0:       # (a seeded map holds every whole token this short: this piece is none)
                t = _whole_small(wmap, key, m)
        elif whole and (state[4] == 0 or m > SEED_MAX_BYTES):
            t = bpe_mod._whole_lookup(wkeys, wids, tok_flat, tok_off, buf, a, b, bpe_mod._fnv(buf, a, b))
        if t >= 0:
            out[o] = t
            o += 1
        elif not batch:     # the plain one-merge-a-round schedule (kept to measure against)
            o = merge_mod._merge_piece(buf, a, b, byte_ids, ptab, batch, _borrowed(sym), _borrowed(rk),
                                       _borrowed(nw), _borrowed(out), o)
        else:
            o1 = -1
            if backtrack and m > BACKTRACK_MIN_BYTES:
                o1 = bt_mod._merge_piece(buf, a, b, ptab, tok_off, btda, btrec, valid, _borrowed(sym), _borrowed(rk),
                                         _borrowed(out), o)
            if o1 >= 0:
                o = o1
            elif m > HEAP_MIN_BYTES:
                o = merge_mod._merge_piece_heap(buf, a, b, byte_ids, ptab, _borrowed(sym), _borrowed(rk),
                                                _borrowed(nw), _borrowed(prk), _borrowed(pnw), _borrowed(heap),
                                                _borrowed(out), o)
            else:
                o = merge_mod._merge_piece_scan(buf, a, b, byte_ids, ptab, _borrowed(sym), _borrowed(rk),
                                                _borrowed(nw), _borrowed(out), o)
        # -- insert (the slot found empty above, unless the map is emptied first)
        cnt = o - o0
        inline = small and cnt <= 2
        need = 0 if inline else cnt + ((m + 3) >> 2)
        if m > MAX_BYTES or cnt > 255:
            continue
        if state[0] >= state[2] or state[1] + need > arena.shape[0]:
            if state[4] > 0:
                for z in range(slots.shape[0]):
                    slots[z, 0] = wmap[z, 0]
                    slots[z, 1] = wmap[z, 1]
            else:
                for z in range(slots.shape[0]):
                    slots[z, 1] = 0
            state[0] = state[4]
            state[1] = state[5]
            state[3] += 1
            s = _home(key, m, mask)
            while slots[s, 1] != 0:     # (a refilled seed may hold the home slot; the piece itself is no seed)
                s = (s + 1) & mask
        if inline:
            meta = np.uint64(m) | (np.uint64(out[o0]) << np.uint64(8))
            if cnt == 2:
                meta |= np.uint64(16) | (np.uint64(out[o0 + 1]) << np.uint64(32))
        else:
            off = state[1]
            for t in range(cnt):
                arena[off + t] = out[o0 + t]
            if not small:
                for w in range((m + 3) >> 2):
                    arena[off + cnt + w] = _word4(b64, a + 4 * w, min(4, m - 4 * w))
            state[1] = off + need
            meta = (np.uint64(1) << np.uint64(63)) | np.uint64(m) | (np.uint64(cnt) << np.uint64(16)) | (
                np.uint64(off) << np.uint64(24))
        slots[s, 0] = key
        slots[s, 1] = meta
        state[0] += 1
    return o, OK


@njit(cache=True, nogil=True, inline="always")
def _split5(ms, k):
    """Five int32 scratch arrays of k entries, views of one array of 5 x k."""
    return ms[:k], ms[k:2 * k], ms[2 * k:3 * k], ms[3 * k:4 * k], ms[4 * k:5 * k]


@njit(cache=True, nogil=True, inline="always")
def _wmap_filter_has(wmap, cap, rows, h):
    """Whether the filter in rows [cap, cap + rows) of wmap (2 * rows words, as merge._filter_probe indexes them) may
    hold the piece whose key hashes to h."""
    at, bits = merge_mod._filter_probe(h, 2 * rows)
    return (wmap[cap + (at >> 1), at & 1] & bits) == bits


@njit(cache=True, nogil=True)
def _build_whole_map(tok_flat, tok_off, whole_ids, wkeys, wids, cap, width):
    wmap = np.zeros((width, 2), np.uint64)
    mask = cap - 1
    rows = width - cap
    words = longest = 0
    for t in whole_ids:
        m = tok_off[t + 1] - tok_off[t]
        longest = max(longest, m)
        if 8 < m <= SEED_MAX_BYTES:
            words += 1 + ((m + 3) >> 2)
    warena = np.zeros(words, np.uint32)
    used = 0
    buf = np.zeros(((longest + 7) & ~7) + 16, np.uint8)     # one token and the 16 bytes _word8 may read past it
    b64 = buf.view(np.uint64)
    for t in whole_ids:
        s0 = tok_off[t]
        m = tok_off[t + 1] - s0
        if m > SEED_MAX_BYTES:
            continue
        buf[:] = 0
        for j in range(m):
            buf[j] = tok_flat[s0 + j]
        # the answer of the lookup it replaces, so a piece equal to two tokens' bytes gets the same one
        got = bpe_mod._whole_lookup(wkeys, wids, tok_flat, tok_off, buf, 0, m, bpe_mod._fnv(buf, 0, m))
        if m <= 8:
            key = _word8(b64, 0, m)
            s = _home(key, m, mask)
            while wmap[s, 1] != 0 and not (wmap[s, 0] == key and (wmap[s, 1] & np.uint64(15)) == np.uint64(m)):
                s = (s + 1) & mask
            wmap[s, 0] = key
            wmap[s, 1] = np.uint64(m) | (np.uint64(got) << np.uint64(8))
            at, bits = merge_mod._filter_probe((key + np.uint64(m)) * np.uint64(_K), 2 * rows)
            wmap[cap + (at >> 1), at & 1] |= bits
        elif got == t:      # (one entry for tokens with equal bytes: the one the lookup answers)
            # a piece map's arena entry, as the walk inserts a longer piece of one ID: the ID, then its bytes
            key = _long_hash2(_word8(b64, 0, 8), _word8(b64, 8, m - 8), m) if m <= 16 else _long_hash(b64, 0, m)
            s = _home(key, m, mask)
            while wmap[s, 1] != 0:
                s = (s + 1) & mask
            warena[used] = np.uint32(got)
            for w in range((m + 3) >> 2):
                warena[used + 1 + w] = _word4(b64, 4 * w, min(4, m - 4 * w))
            wmap[s, 0] = key
            wmap[s, 1] = (np.uint64(1) << np.uint64(63)) | np.uint64(m) | (np.uint64(1) << np.uint64(16)) | (
                np.uint64(used) << np.uint64(24))
            used += 1 + ((m + 3) >> 2)
    return wmap, warena[:used]


def whole_map(tok_flat: np.ndarray, tok_off: np.ndarray, whole_ids: np.ndarray, wkeys: np.ndarray,
              wids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(wmap, warena). wmap: uint64[merge.table_width(cap, WMAP_FILTER_SHIFT), 2]: the whole-piece lookup of bpe.py
    (`_whole_lookup` over `wkeys`) for tokens of 2-8 bytes, keyed as the piece map keys a small piece (its bytes as
    one word, its length), then its filter: a piece the map misses finds its token in one probe sequence of one table,
    where `_whole_lookup` reads four arrays one after another (hash slot, ID, offsets, bytes). On a warm 1M-character
    encode's misses (cl100k english, qwen3 code; one core, alternated in one process) the walk took 1.13-1.15x less
    time. Its slots also hold the longer tokens (up to SEED_MAX_BYTES) as a piece map holds such a piece (hash key,
    an arena entry in `warena`: the ID, then the bytes); `_whole_small` never matches them (their length field is
    above 8), and a seeded piece map (`PieceMap`) starts as a copy of both, so its slots are as many as keep the
    seed under SEED_LOAD of them (room for the text's own pieces, and short probe sequences)."""
    lengths = tok_off[whole_ids + 1] - tok_off[whole_ids]
    cap = 1 << max(4, int(np.ceil(np.count_nonzero(lengths <= SEED_MAX_BYTES) / SEED_LOAD)) - 1).bit_length()
    return _build_whole_map(tok_flat, tok_off, np.ascontiguousarray(whole_ids, dtype=np.int64), wkeys, wids, cap,
                            merge_mod.table_width(cap, WMAP_FILTER_SHIFT))


_NO_MISSING = np.zeros(256, np.bool_)


def thread_map(bpe: bpe_mod.BPE) -> PieceMap:
    """The calling thread's piece map for `bpe` (made on first use, kept on its thread cache): the one cache of
    pieces every compiled encode of that thread walks (full encodes, batches, session windows and appends), so a
    session's windows find the pieces its full encode saw."""
    c = bpe.thread_cache()
    if c.pmap is None:
        c.pmap = PieceMap(seed=bpe.wmap, seed_arena=bpe.warena) if bpe.whole else PieceMap()
    return c.pmap


def walk_tail(bpe: bpe_mod.BPE) -> tuple[Any, ...]:
    """What a kernel that walks the calling thread's map takes after its own arguments (kernels.FULL_TAIL): the
    missing bytes, `bpe`'s tables, the small whole-token map and the map's arrays."""
    pm = thread_map(bpe)
    missing = bpe.missing if bpe.missing is not None else _NO_MISSING
    return (bpe.missing is not None, missing, bpe.byte_ids, bpe.ptab, bpe.batch, bpe.whole, bpe.wkeys, bpe.wids,
            bpe.tok_flat, bpe.tok_off, bpe.wmap, bpe.btda, bpe.btrec, pm.slots, pm.arena, pm.state, pm.valid)


__all__ = ["CUT_REJECTED", "DROPPED", "OK", "PieceMap", "SURROGATE", "thread_map", "walk_tail", "whole_map"]
