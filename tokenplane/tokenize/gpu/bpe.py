"""Device BPE with tiktoken semantics, dispatched by piece length, and output compaction.

Per piece: probe the whole piece in the vocabulary hash first (tiktoken emits one ID when the piece is a token);
otherwise start from single bytes and repeatedly merge the leftmost adjacent pair of minimum rank, the rank being
looked up in the (left_id, right_id) -> merged_id hash (rank == id in tiktoken vocabularies). One merge per step, as
the reference does, so no property of the vocabulary is assumed.

* thread-per-piece (<= small_max bytes): parts, positions and pair ranks in local arrays (registers / local memory).
* warp-per-piece (<= medium_max bytes): lanes own positions p = start + lane + 32 k of a linked list kept in
  per-byte scratch; each step every lane finds its best (rank, position), `ballot_sync` ends the loop when no lane has
  a candidate, a shuffle butterfly takes the minimum, and lane 0 applies the merge and re-probes the two neighbours.
* block-per-piece (longer): the same with a shared-memory reduction.

Each surviving part writes `tokflag[byte] = 1` and its ID at its first byte; an exclusive scan of `tokflag` gives
every token its output slot, so the output is compacted without the host learning any count.
"""

from __future__ import annotations

from functools import cache
from typing import Callable

from .layout import N_BYTES, N_DOCS, N_LARGE, N_MEDIUM, N_PIECES, N_SMALL, N_TOKENS
from .tables import FNV_OFFSET, FNV_PRIME, MASK32, PAIR_SHIFT

FULL_MASK = 0xFFFFFFFF
NO_KEY = 0x7FFFFFFFFFFFFFFF


@cache
def make_bpe(small_max: int, block_tpb: int) -> dict[str, Callable]:
    # kernels must see `cuda` as a module global: the simulator swaps it in the function's globals
    global cuda, int32, int64
    from numba import cuda, int32, int64

    @cuda.jit(device=True)
    def pair_lookup(left, right, pkeys, pvals):
        mask = pkeys.shape[0] - 1
        l64 = int64(left)
        r64 = int64(right)
        h = (l64 * 0x9E3779B1 + r64 * 0x85EBCA77) & MASK32
        h ^= h >> 15
        h = (h * 0x2C1B3C6D) & MASK32
        h ^= h >> 13
        key = (l64 << PAIR_SHIFT) | r64
        slot = h & mask
        while True:
            k = pkeys[slot]
            if k == key:
                return int32(pvals[slot])
            if k < 0:
                return int32(-1)
            slot = (slot + 1) & mask

    @cuda.jit(device=True)
    def vocab_lookup(data, s, n, vslots, tok_off, blob):
        mask = vslots.shape[0] - 1
        h = int64(FNV_OFFSET)
        for i in range(n):
            h = ((h ^ int64(data[s + i])) * FNV_PRIME) & MASK32
        slot = h & mask
        while True:
            tid = vslots[slot]
            if tid < 0:
                return int32(-1)
            o = tok_off[tid]
            if tok_off[tid + 1] - o == n:
                same = True
                for i in range(n):
                    if blob[o + i] != data[s + i]:
                        same = False
                        break
                if same:
                    return int32(tid)
            slot = (slot + 1) & mask

    @cuda.jit(device=True)
    def piece_end(pstart, meta, k):
        return pstart[k + 1] if k + 1 < meta[N_PIECES] else meta[N_BYTES]

    @cuda.jit
    def k_bpe_thread(data, meta, pstart, small, byte_id, vslots, tok_off, blob, pkeys, pvals, max_tok,
                     tokflag, tokid):
        ids = cuda.local.array(small_max, dtype=int32)
        pos = cuda.local.array(small_max, dtype=int32)
        rk = cuda.local.array(small_max, dtype=int32)
        j = cuda.grid(1)
        while j < meta[N_SMALL]:
            k = small[j]
            s = pstart[k]
            n = piece_end(pstart, meta, k) - s
            whole = vocab_lookup(data, s, n, vslots, tok_off, blob) if n <= max_tok else int32(-1)
            if whole >= 0:
                tokflag[s] = 1
                tokid[s] = whole
            else:
                for i in range(n):
                    ids[i] = byte_id[data[s + i]]
                    pos[i] = i
                for i in range(n - 1):
                    rk[i] = pair_lookup(ids[i], ids[i + 1], pkeys, pvals)
                m = n
                while m > 1:
                    best = -1
                    bi = 0
                    for i in range(m - 1):
                        r = rk[i]
                        if r >= 0 and (best < 0 or r < best):
                            best = r
                            bi = i
                    if best < 0:
                        break
                    ids[bi] = best
                    for i in range(bi + 1, m - 1):
                        ids[i] = ids[i + 1]
                        pos[i] = pos[i + 1]
                        rk[i] = rk[i + 1]
                    m -= 1
                    if bi + 1 < m:
                        rk[bi] = pair_lookup(ids[bi], ids[bi + 1], pkeys, pvals)
                    else:
                        rk[bi] = -1
                    if bi > 0:
                        rk[bi - 1] = pair_lookup(ids[bi - 1], ids[bi], pkeys, pvals)
                for i in range(m):
                    tokflag[s + pos[i]] = 1
                    tokid[s + pos[i]] = ids[i]
            j += cuda.gridsize(1)

    @cuda.jit(device=True)
    def merge_at(i, e, wid, wnx, wpv, wrk, pkeys, pvals):
        # merge the part at i with its successor; re-probe the pairs that changed
        jn = wnx[i]
        wid[i] = wrk[i]
        wid[jn] = -1
        nx = wnx[jn]
        wnx[i] = nx
        if nx < e:
            wpv[nx] = i
            wrk[i] = pair_lookup(wid[i], wid[nx], pkeys, pvals)
        else:
            wrk[i] = -1
        pv = wpv[i]
        if pv >= 0:
            wrk[pv] = pair_lookup(wid[pv], wid[i], pkeys, pvals)

    @cuda.jit
    def k_bpe_warp(data, meta, pstart, medium, byte_id, vslots, tok_off, blob, pkeys, pvals, max_tok,
                   tokflag, tokid, wid, wnx, wpv, wrk):
        lane = cuda.threadIdx.x % 32
        gw = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) // 32
        nw = (cuda.gridDim.x * cuda.blockDim.x) // 32
        j = gw
        while j < meta[N_MEDIUM]:
            k = medium[j]
            s = pstart[k]
            e = piece_end(pstart, meta, k)
            n = e - s
            whole = int32(-1)
            if lane == 0 and n <= max_tok:
                whole = vocab_lookup(data, s, n, vslots, tok_off, blob)
            whole = cuda.shfl_sync(FULL_MASK, whole, 0)
            if whole >= 0:
                if lane == 0:
                    tokflag[s] = 1
                    tokid[s] = whole
            else:
                p = s + lane
                while p < e:
                    wid[p] = byte_id[data[p]]
                    wnx[p] = p + 1
                    wpv[p] = p - 1 if p > s else -1
                    p += 32
                cuda.syncwarp(FULL_MASK)
                p = s + lane
                while p < e:
                    wrk[p] = pair_lookup(wid[p], wid[p + 1], pkeys, pvals) if p + 1 < e else int32(-1)
                    p += 32
                cuda.syncwarp(FULL_MASK)
                while True:
                    best = int64(NO_KEY)
                    p = s + lane
                    while p < e:
                        r = wrk[p]
                        if wid[p] >= 0 and r >= 0:
                            key = (int64(r) << 32) | int64(p - s)
                            if key < best:
                                best = key
                        p += 32
                    if cuda.ballot_sync(FULL_MASK, best != NO_KEY) == 0:
                        break
                    off = 16
                    while off > 0:
                        other = cuda.shfl_xor_sync(FULL_MASK, best, off)
                        if other < best:
                            best = other
                        off //= 2
                    if lane == 0:
                        merge_at(s + int32(best & 0xFFFFFFFF), e, wid, wnx, wpv, wrk, pkeys, pvals)
                    cuda.syncwarp(FULL_MASK)
                p = s + lane
                while p < e:
                    if wid[p] >= 0:
                        tokflag[p] = 1
                        tokid[p] = wid[p]
                    p += 32
            cuda.syncwarp(FULL_MASK)
            j += nw

    @cuda.jit
    def k_bpe_block(data, meta, pstart, large, byte_id, vslots, tok_off, blob, pkeys, pvals, max_tok,
                    tokflag, tokid, wid, wnx, wpv, wrk):
        sh = cuda.shared.array(block_tpb, dtype=int64)
        hit = cuda.shared.array(1, dtype=int32)
        t = cuda.threadIdx.x
        j = cuda.blockIdx.x
        while j < meta[N_LARGE]:
            k = large[j]
            s = pstart[k]
            e = piece_end(pstart, meta, k)
            n = e - s
            if t == 0:
                hit[0] = vocab_lookup(data, s, n, vslots, tok_off, blob) if n <= max_tok else int32(-1)
            cuda.syncthreads()
            whole = hit[0]
            if whole >= 0:
                if t == 0:
                    tokflag[s] = 1
                    tokid[s] = whole
            else:
                p = s + t
                while p < e:
                    wid[p] = byte_id[data[p]]
                    wnx[p] = p + 1
                    wpv[p] = p - 1 if p > s else -1
                    p += block_tpb
                cuda.syncthreads()
                p = s + t
                while p < e:
                    wrk[p] = pair_lookup(wid[p], wid[p + 1], pkeys, pvals) if p + 1 < e else int32(-1)
                    p += block_tpb
                cuda.syncthreads()
                while True:
                    best = int64(NO_KEY)
                    p = s + t
                    while p < e:
                        r = wrk[p]
                        if wid[p] >= 0 and r >= 0:
                            key = (int64(r) << 32) | int64(p - s)
                            if key < best:
                                best = key
                        p += block_tpb
                    sh[t] = best
                    cuda.syncthreads()
                    d = block_tpb // 2
                    while d > 0:
                        if t < d and sh[t + d] < sh[t]:
                            sh[t] = sh[t + d]
                        cuda.syncthreads()
                        d //= 2
                    best = sh[0]
                    cuda.syncthreads()
                    if best == NO_KEY:
                        break
                    if t == 0:
                        merge_at(s + int32(best & 0xFFFFFFFF), e, wid, wnx, wpv, wrk, pkeys, pvals)
                    cuda.syncthreads()
                p = s + t
                while p < e:
                    if wid[p] >= 0:
                        tokflag[p] = 1
                        tokid[p] = wid[p]
                    p += block_tpb
            cuda.syncthreads()
            j += cuda.gridDim.x

    @cuda.jit
    def k_emit(tokflag, tokidx, tokid, meta, doc_off, cidx, docfb, out, doc_tok, doc_fb):
        n = meta[N_BYTES]
        i = cuda.grid(1)
        while i < n:
            if tokflag[i] != 0:
                out[tokidx[i]] = tokid[i]
            i += cuda.gridsize(1)
        d = cuda.grid(1)
        while d < meta[N_DOCS]:
            doc_tok[d] = tokidx[doc_off[d]]
            doc_fb[d] = docfb[cidx[doc_off[d]]]
            d += cuda.gridsize(1)

    return dict(k_bpe_thread=k_bpe_thread, k_bpe_warp=k_bpe_warp, k_bpe_block=k_bpe_block, k_emit=k_emit)


__all__ = ["make_bpe", "N_TOKENS"]
