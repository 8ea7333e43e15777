"""Byte-pair encoding of pre-tokenized pieces, with merge ranks in an open-addressing hash table.

One table serves both flavours: a key is the pair of symbol IDs (left, right), the value is (rank, merged ID).
* tiktoken families: a split of a vocabulary token into two vocabulary tokens is a pair; its rank is the rank
  (= ID) of the concatenation, as tiktoken's `byte_pair_merge` ranks a pair of parts. A piece that is itself a
  vocabulary entry is one ID (tiktoken checks the whole piece first: `ignore_merges`).
* HF families (qwen3, deepseek_v4): `model.merges` in order, rank = merge index; `ignore_merges` as configured.
* Of those, the table keeps one pair per self-encoding token, the one that can ever merge into it
  (bpetables._own_pairs: the same IDs, a table a half to a quarter the size).

This module builds the tables, keeps the per-thread piece caches of the staged path and the session windows
(`_encode_pieces`) and holds `BPE`, one tokenizer's encoder; merge.py holds the merge kernels a cache miss runs.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from . import kernels
from .lazyjit import njit, numba_global  # numba itself only when a JIT kernel runs (lazyjit.py)
from .merge import FILTER_SHIFT, _filter_has, _filter_probe, _filter_split, _merge_piece, _merge_piece_heap, _pair_home

_borrowed = numba_global("tokenplane.tokenize.cpu.borrow", "borrowed")

if TYPE_CHECKING:   # type name only: bpetables builds its tables with this module's kernels
    from .bpetables import BpeTables

CACHE_WAYS = 1 << 15       # per-thread piece cache slots
CACHE_BYTES = SHORT_BYTES = 24     # pieces up to this many bytes go to the short tier (6 words of a record)
SHORT_IDS = 9                       # IDs a short record holds (9 words)
# Long tier: a piece of up to 256 bytes (85 CJK characters) with up to 128 IDs. 2048 ways: 1.5 MB per thread.
LONG_WAYS = 1 << 11
LONG_BYTES = 256
LONG_IDS = 128
HEAP_MIN_BYTES = 48        # longer pieces merge through a heap (O(m log m)) instead of rescanning rounds
# Tiny tier: pieces of up to 8 bytes (most pieces of prose and code) that encode to 1 or 2 IDs, one 16-byte record
# per slot (the piece's bytes as one word + length, count and IDs packed in another): a hit is one word compare on
# one cache line, and 64K slots are 1 MB per thread (fits beside the pair table far better than 64-byte records).
TINY_WAYS = 1 << 16
TINY_BYTES = 8
ID_BITS = 24               # a tiny record packs two IDs of 24 bits: every vocabulary here is below 2**24 tokens


# -- hash tables ----------------------------------------------------------------------------------------------------
def table_cap(n: int) -> int:
    """Slots of an open-addressing table of n entries (the pair table, the whole-piece tables): a power of two, filled
    to at most 0.5. Most lookups a merge or a whole-piece check makes find nothing (pairs that are no token, pieces
    that are none), and a linear probe runs to an empty slot: ~2.5 slots at 0.5, ~13 at 0.8. Tables filled to 0.8
    (half the bytes) measured 2-9% slower on CJK text (one process, both tables alternated), no faster on english."""
    return 1 << max(4, int(2 * n - 1).bit_length())


@njit(cache=True, nogil=True)
def _pair_slot(keys, key):
    mask = keys.shape[0] - 1
    i = _pair_home(key, mask)
    while True:
        k = keys[i]
        if k == key or k == np.uint64(0xFFFFFFFFFFFFFFFF):
            return i
        i = (i + 1) & mask


@njit(cache=True, nogil=True)
def _build_pairs(left, right, rank, new, cap):
    keys = np.full(cap, np.uint64(0xFFFFFFFFFFFFFFFF), dtype=np.uint64)
    ranks = np.full(cap, -1, dtype=np.int32)
    news = np.full(cap, -1, dtype=np.int32)
    for j in range(left.shape[0]):
        key = (np.uint64(left[j]) << np.uint64(32)) | np.uint64(right[j])
        i = _pair_slot(keys, key)
        if keys[i] == key and ranks[i] <= rank[j]:
            continue      # keep the best (lowest) rank for a repeated pair
        keys[i] = key
        ranks[i] = rank[j]
        news[i] = new[j]
    return keys, ranks, news


@njit(cache=True, nogil=True)
def _pair_entries(keys, ranks, news, left, right):
    """(rank, merged ID) of each pair (left[j], right[j]) in a `_build_pairs` table (-1, -1 where absent)."""
    r = np.full(left.shape[0], -1, dtype=np.int32)
    n = np.full(left.shape[0], -1, dtype=np.int32)
    for j in range(left.shape[0]):
        key = (np.uint64(left[j]) << np.uint64(32)) | np.uint64(right[j])
        i = _pair_slot(keys, key)
        if keys[i] == key:
            r[j] = ranks[i]
            n[j] = news[i]
    return r, n


@njit(cache=True, nogil=True)
def _fnv(buf, a, b):
    h = np.uint64(0xCBF29CE484222325)
    for i in range(a, b):
        h = (h ^ np.uint64(buf[i])) * np.uint64(0x100000001B3)
    return h


@njit(cache=True, nogil=True)
def _whole_lookup(wkeys, wids, tok_flat, tok_off, buf, a, b, h):
    """ID of the vocabulary token equal to buf[a:b], or -1 (h: _fnv(buf, a, b), which the caller has). wkeys: the
    hash slots, then a filter of them (merge.FILTER_SHIFT, as the pair table's): most pieces that reach this lookup
    are no token, and the filter answers them without a probe of the table to an empty slot."""
    cap, words = _filter_split(wkeys.shape[0], FILTER_SHIFT)
    mask = cap - 1
    if h == np.uint64(0xFFFFFFFFFFFFFFFF):
        h = np.uint64(0)
    if not _filter_has(wkeys, cap, words, h * np.uint64(0x9E3779B97F4A7C15)):
        return -1
    i = np.int64((h * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(29)) & mask
    while True:
        k = wkeys[i]
        if k == np.uint64(0xFFFFFFFFFFFFFFFF):
            return -1
        if k == h:
            t = wids[i]
            s, e = tok_off[t], tok_off[t + 1]
            if e - s == b - a:
                same = True
                for j in range(b - a):
                    if tok_flat[s + j] != buf[a + j]:
                        same = False
                        break
                if same:
                    return t
        i = (i + 1) & mask


@njit(cache=True, nogil=True)
def _build_whole(tok_flat, tok_off, ids, cap, width):
    """The whole-token hash table of `ids`: (wkeys, wids), wkeys = `cap` slots of FNV hashes followed by their filter
    (width = merge.table_width(cap))."""
    wkeys = np.full(width, np.uint64(0xFFFFFFFFFFFFFFFF), dtype=np.uint64)
    wkeys[cap:] = 0
    wids = np.full(cap, -1, dtype=np.int32)
    mask = cap - 1
    for t in ids:
        h = _fnv(tok_flat, tok_off[t], tok_off[t + 1])
        if h == np.uint64(0xFFFFFFFFFFFFFFFF):
            h = np.uint64(0)
        i = np.int64((h * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(29)) & mask
        while wkeys[i] != np.uint64(0xFFFFFFFFFFFFFFFF):
            i = (i + 1) & mask
        wkeys[i] = h
        wids[i] = t
        at, bits = _filter_probe(h * np.uint64(0x9E3779B97F4A7C15), width - cap)
        wkeys[cap + at] |= bits
    return wkeys, wids



# The cache helpers are inlined at numba IR level: as calls, passing the tier's arrays per piece cost ~10% of a
# mixed-text encode (measured against the inline form in alternating processes).
@njit(cache=True, nogil=True, inline="always")
def _short_word(buf, a, m, w):
    """Bytes 4w..4w+3 of buf[a:a+m] as a little-endian word, zero past the piece's end."""
    v = np.uint32(0)
    for k in range(4):
        i = 4 * w + k
        if i < m:
            v |= np.uint32(buf[a + i]) << np.uint32(8 * k)
    return v


@njit(cache=True, nogil=True, inline="always")
def _short_get(tab, slot, buf, a, m, out, o):
    """Short tier, one 64-byte record per slot (a hit reads one cache line): word 0 = length | count << 8,
    words 1-6 = the piece's bytes, words 7-15 = its IDs. Returns the new o, or -1 on a miss."""
    hdr = tab[slot, 0]
    if (hdr & np.uint32(0xFF)) != m:
        return -1
    for w in range((m + 3) >> 2):
        if tab[slot, 1 + w] != _short_word(buf, a, m, w):
            return -1
    c = np.int64(hdr >> np.uint32(8))
    for i in range(c):
        out[o + i] = tab[slot, 7 + i]
    return o + c


@njit(cache=True, nogil=True, inline="always")
def _short_put(tab, slot, buf, a, m, out, o0, o):
    if o - o0 > SHORT_IDS:
        return
    tab[slot, 0] = np.uint32(m) | (np.uint32(o - o0) << np.uint32(8))
    for w in range(6):
        tab[slot, 1 + w] = _short_word(buf, a, m, w)
    for i in range(o - o0):
        tab[slot, 7 + i] = out[o0 + i]


@njit(cache=True, nogil=True, inline="always")
def _cache_get(keys, length, ids, count, slot, buf, a, m, out, o):
    """Long tier: copy the cached IDs of buf[a:a+m] from `slot` to out[o:] and return the new o, or -1."""
    if length[slot] != m:
        return -1
    for i in range(m):
        if keys[slot, i] != buf[a + i]:
            return -1
    for i in range(count[slot]):
        out[o + i] = ids[slot, i]
    return o + count[slot]


@njit(cache=True, nogil=True, inline="always")
def _cache_put(keys, length, ids, count, slot, buf, a, m, out, o0, o):
    if o - o0 > ids.shape[1]:
        return
    length[slot] = m
    for i in range(m):
        keys[slot, i] = buf[a + i]
    count[slot] = o - o0
    for i in range(o - o0):
        ids[slot, i] = out[o0 + i]


@njit(cache=True, nogil=True, inline="always")
def _pack8(buf, a, m):
    """buf[a:a+m] (m <= 8) as one little-endian word, zero above the piece's bytes."""
    v = np.uint64(0)
    for i in range(m):
        v |= np.uint64(buf[a + i]) << np.uint64(8 * i)
    return v


@njit(cache=True, nogil=True)
def _encode_pieces(buf, bounds, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat, tok_off,
                   tiny, short, long_keys, long_len, long_ids, long_n):
    """IDs of every piece buf[bounds[j]:bounds[j+1]], concatenated (int32). Caches pieces per caller in three
    direct-mapped tiers: tiny pieces (<= 8 bytes, <= 2 IDs: most of them), short ones (<= 24 bytes) and long ones up to
    long_keys.shape[1] bytes (CJK runs and long identifiers, which cost the most to merge and recur in agent context).
    A cached entry is the piece's exact bytes and its IDs, and the BPE of a piece depends on nothing but its bytes, so
    a hit is exact by construction."""
    # every array the loop hands to a helper or a merge kernel is a borrowed view (borrow.py: no refcount atomics a
    # piece); the IDs' own array is what returns
    buf, bounds, byte_ids, ptab, wkeys, wids = _borrowed(buf), _borrowed(bounds), _borrowed(byte_ids), \
        _borrowed(ptab), _borrowed(wkeys), _borrowed(wids)
    tok_flat, tok_off, tiny, short = _borrowed(tok_flat), _borrowed(tok_off), _borrowed(tiny), _borrowed(short)
    long_keys, long_len, long_ids, long_n = _borrowed(long_keys), _borrowed(long_len), _borrowed(long_ids), \
        _borrowed(long_n)
    n_pieces = bounds.shape[0] - 1
    ids = np.empty(buf.shape[0], dtype=np.int32)
    out = _borrowed(ids)
    longest = 1
    for j in range(n_pieces):
        if bounds[j + 1] - bounds[j] > longest:
            longest = bounds[j + 1] - bounds[j]
    sym = np.empty(longest, dtype=np.int32)
    rk = np.empty(longest, dtype=np.int32)
    nw = np.empty(longest, dtype=np.int32)
    heap = np.empty(3 * longest, dtype=np.int64)
    prk = np.empty(longest, dtype=np.int32)
    pnw = np.empty(longest, dtype=np.int32)
    tmask = np.uint64(tiny.shape[0] - 1)
    cmask = short.shape[0] - 1
    lmask = long_len.shape[0] - 1
    idmask = np.uint64((1 << ID_BITS) - 1)
    o = 0
    for j in range(n_pieces):
        a = bounds[j]
        b = bounds[j + 1]
        m = b - a
        if m == 1:
            out[o] = byte_ids[buf[a]]
            o += 1
            continue
        tslot = -1
        v = np.uint64(0)
        if m <= TINY_BYTES:
            v = _pack8(buf, a, m)
            tslot = np.int64((((v + np.uint64(m)) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)) & tmask)
            rec = tiny[tslot, 1]
            if tiny[tslot, 0] == v and (rec & np.uint64(15)) == np.uint64(m):
                out[o] = np.int32((rec >> np.uint64(8)) & idmask)
                if (rec & np.uint64(16)) != 0:
                    out[o + 1] = np.int32(rec >> np.uint64(8 + ID_BITS))
                    o += 2
                else:
                    o += 1
                continue
        tier = 0 if m <= SHORT_BYTES else (1 if m <= long_keys.shape[1] else -1)
        slot = -1
        h = _fnv(buf, a, b)
        if tier >= 0:
            slot = np.int64((h * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40))
            if tier == 0:
                slot &= cmask
                got = _short_get(short, slot, buf, a, m, out, o)
            else:
                slot &= lmask
                got = _cache_get(long_keys, long_len, long_ids, long_n, slot, buf, a, m, out, o)
            if got >= 0:
                o = got
                continue
        o0 = o
        t = -1
        if whole:
            t = _whole_lookup(wkeys, wids, tok_flat, tok_off, buf, a, b, h)
        if t >= 0:
            out[o] = t
            o += 1
        elif m > HEAP_MIN_BYTES and batch:
            o = _merge_piece_heap(buf, a, b, byte_ids, ptab, _borrowed(sym), _borrowed(rk), _borrowed(nw),
                                  _borrowed(prk), _borrowed(pnw), _borrowed(heap), out, o)
        else:
            o = _merge_piece(buf, a, b, byte_ids, ptab, batch, _borrowed(sym), _borrowed(rk), _borrowed(nw), out, o)
        if tslot >= 0 and o - o0 <= 2:
            rec = np.uint64(m) | (np.uint64(out[o0]) << np.uint64(8))
            if o - o0 == 2:
                rec |= np.uint64(16) | (np.uint64(out[o0 + 1]) << np.uint64(8 + ID_BITS))
            tiny[tslot, 0] = v
            tiny[tslot, 1] = rec
        elif tier == 0:
            _short_put(short, slot, buf, a, m, out, o0, o)
        elif tier == 1:
            _cache_put(long_keys, long_len, long_ids, long_n, slot, buf, a, m, out, o0, o)
    return ids[:o]


class PieceCache:
    """Per-thread cache of pieces -> IDs (the kernel writes it; one per thread, never shared): a short tier and a
    long tier (pieces of CACHE_BYTES+1 .. LONG_BYTES bytes)."""

    def __init__(self, ways: int = CACHE_WAYS, long_ways: int = LONG_WAYS, tiny_ways: int = TINY_WAYS):
        self.tiny = np.zeros((tiny_ways, 2), dtype=np.uint64)   # word 1 == 0: empty (a record's length is >= 2)
        self.short = np.zeros((ways, 16), dtype=np.uint32)     # 64-byte records, see _short_get
        self.long_keys = np.zeros((long_ways, LONG_BYTES), dtype=np.uint8)
        self.long_length = np.zeros(long_ways, dtype=np.int32)
        self.long_ids = np.zeros((long_ways, LONG_IDS), dtype=np.int32)
        self.long_n = np.zeros(long_ways, dtype=np.int32)
        self.bound: dict[str, Any] = {}     # kernels with these arrays bound (window.py), by family
        self.pmap: Any = None               # the full encode's piece map (piecemap.py), made on first use

    def clear(self) -> None:
        if self.pmap is not None:
            self.pmap.clear()
        self.tiny[:, 1] = 0
        self.short[:, 0] = 0
        self.long_length[:] = 0


class DroppedBytes(ValueError):
    """The text holds a byte with no token, which the reference drops (HF BPE without an unknown token or byte
    fallback) while merging across it; the kernels do not implement that, so the caller encodes with the reference."""


@njit(cache=True, nogil=True)
def _any_of(buf, lut):
    for i in range(buf.shape[0]):
        if lut[buf[i]]:
            return True
    return False


class BPE:
    """The byte-pair encoder of one tokenizer (immutable after construction; encode() is thread-safe)."""

    def __init__(self, tables: BpeTables):
        """`tables`: the compact arrays of one tokenizer (bpetables.load: memory-mapped from the on-disk cache,
        built from the reference engine only when absent)."""
        self.family_name = tables.family_name
        self.n_vocab = tables.n_vocab
        if self.n_vocab >= 1 << ID_BITS:    # the tiny cache tier packs IDs in 24 bits
            raise ValueError(f"{self.family_name}: {self.n_vocab} tokens do not fit the piece cache's ID field")
        self.tok_flat, self.tok_off = tables.tok_flat, tables.tok_off
        self.n_pairs = tables.n_pairs
        self.batch = True        # False: one merge per round (the plain schedule; kept to measure against)
        self.pkeys, self.pranks, self.pnews = tables.pkeys, tables.pranks, tables.pnews   # the GPU tables read these
        self.ptab = tables.ptab                 # the kernels' form of the same table (_pair_rank)
        self.byte_ids = tables.byte_ids
        self.missing = tables.missing           # bytes the reference drops: such texts raise DroppedBytes
        self.whole = True     # whole-piece lookup first: every token (tiktoken, ignore_merges) or self-encoding ones
        self.whole_ids = tables.whole_ids       # the device tables' whole-piece lookup holds the same set
        self.n_whole = int(tables.whole_ids.shape[0])
        self.wkeys, self.wids = tables.wkeys, tables.wids
        self.wmap = tables.wmap                 # the same lookup for small pieces, keyed as the piece map (piecemap.py)
        self.warena = tables.warena             # with wmap, a piece map's seed
        self.btda, self.btrec = tables.btda, tables.btrec   # backtrack.py's tables (empty: merge kernels only)
        self._local = threading.local()
        self._caches: list[PieceCache] = []     # every thread's cache, so clear_caches can reach them

    def thread_cache(self) -> PieceCache:
        """The calling thread's piece cache."""
        return self._cache()

    def _cache(self) -> PieceCache:
        cache = getattr(self._local, "cache", None)
        if cache is None:
            cache = self._local.cache = PieceCache()
            self._caches.append(cache)
        return cache

    def clear_caches(self) -> None:
        """Forget every cached piece in every thread (a cold start for benchmarks: warm repeats of one text hit
        the cache far more often than a fresh request does)."""
        for cache in list(self._caches):
            cache.clear()

    def encode_bytes(self, buf: np.ndarray, bounds: np.ndarray, cache: PieceCache | None = None) -> np.ndarray:
        """IDs (int32) of the pieces buf[bounds[j]:bounds[j+1]] (buf: uint8 UTF-8, bounds: int64 byte offsets).
        DroppedBytes when buf holds a byte without a token (never for a vocabulary that has all 256)."""
        k = kernels.get()
        if self.missing is not None and k.any_of(buf, self.missing):
            raise DroppedBytes("the text holds a byte without a token")
        c = cache if cache is not None else self._cache()
        return k.encode_pieces(buf, bounds, self.byte_ids, self.ptab, self.batch,
                              self.whole, self.wkeys, self.wids, self.tok_flat, self.tok_off, c.tiny, c.short,
                              c.long_keys, c.long_length, c.long_ids, c.long_n)

    def encode_piece(self, piece: bytes) -> list[int]:
        buf = np.frombuffer(piece, dtype=np.uint8)
        return self.encode_bytes(buf, np.array([0, len(piece)], dtype=np.int64)).tolist()


@njit(cache=True, nogil=True)
def _piece_byte_bounds(cps, starts, out):
    # branch-free: piece starts are dense and irregular, so a data-dependent branch mispredicts often
    k = 0
    pos = 0
    last = out.shape[0] - 1
    for i in range(cps.shape[0]):
        out[min(k, last)] = pos
        k += 1 if starts[i] else 0
        c = cps[i]
        pos += 1 + (c >= 0x80) + (c >= 0x800) + (c >= 0x10000)
    out[k] = pos
    return k + 1


def piece_byte_bounds(cps: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """UTF-8 byte offsets of the piece starts plus the end (int64[pieces+1]); equals
    `np.append(offsets[starts], offsets[-1])` with `offsets` the UTF-8 offset of every code point, in one pass
    without that per-character array, so chunk threads spend it outside the GIL."""
    out = np.empty(int(np.count_nonzero(starts)) + 1, dtype=np.int64)
    n = _piece_byte_bounds(np.ascontiguousarray(cps, dtype=np.uint32), starts.view(np.bool_), out)
    return out[:n]
