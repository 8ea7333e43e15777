"""BPE of one piece by backtracking over longest token matches, checked pair by pair: the merge kernels' IDs.

merge.py merges a new piece bottom-up: every adjacent pair probed in the pair table, then each merge re-probes its
two neighbours, ~2.5 probes a byte of dependent loads into a 2-4 MB table. A warm 1M-character CJK encode spends
most of its time there (qwen3 / DeepSeek V4 split CJK runs into pieces of 20 bytes on average, 65+ for some;
fastokens' whole BPE of the same 22K new pieces took 4.4 ms where ours took 20-22). This kernel builds the answer
left to right instead (the backtracking encoder of GitHub's `bpe` crate, in our own form; fastokens' binary carries
the double-array matcher that crate uses):

* the BPE of a text is its one *valid* tokenization: re-encoding its bytes gives it back. A sequence of tokens is
  valid iff each token is a self-encoding token and every adjacent pair is valid (the span argument of
  bpetables._own_pairs: the merges inside a final token's span are its own bytes' merges, and two valid sequences
  that share their boundary token glue into a valid one);
* so: take the longest token that is a prefix of the rest (`_longest`, a double-array trie of the self-encoding
  tokens), keep it if the pair it makes with the previous token is valid and its end is not known to be a dead end,
  else try the next shorter prefix token, and when none is left pop the previous token and mark that position dead
  (each position dies at most once: linear time);
* a pair (t1, t2) is valid iff BPE of their concatenated bytes merges nothing across the boundary. Where every
  token's own merge orders above its two parts' (the orders are monotone; `build` checks it), merges happen in
  increasing order and the boundary between the two tokens' merge trees moves only when a token on the left one's
  right spine or on the right one's left spine is made; walking both spines down from the top, the pair straddling
  the boundary in each state must not be in the pair table with an order below the event that ended that state
  (strictly below on the left, at most equal on the right: an equal order is the same pair, and the leftmost
  occurrence merges first). `_valid` is that walk (a few steps), `_valid_memo` keeps its answers per thread.

A family whose orders are not monotone (llama3: a token ordered before one of its own parts) gets empty tables and
keeps the merge kernels. Measured on the 18K multi-token pieces a warm 1M-character DeepSeek V4 CJK encode misses
(one core, each kernel over all of them, alternated, memo emptied before each pass; ns a piece): 9-16 bytes 318 vs
382 (scan kernel), 17-32 bytes 451 vs 907 (heap), 33-64 bytes 900 vs 1,857, 65+ bytes 1,375 vs 3,614.
"""

from __future__ import annotations

import numpy as np

from . import merge as merge_mod
from .lazyjit import njit  # numba itself only when a JIT kernel runs (lazyjit.py)

_INF = 0x7FFFFFFF
_F21 = (1 << 21) - 1
# one double-array entry (uint64): bits 0-20 the parent state + 1 (0: a free entry), 21-41 the state's base, 42-62
# its token + 1 (0: none)
_BASE_SHIFT, _TOKEN_SHIFT = 21, 42
VALID_SLOTS = 1 << 14     # a thread's memo of pair validity (128 KB, direct-mapped)


@njit(cache=True, nogil=True)
def _records(ptab, byte_ids, n):
    """(rec int64[n, 2], monotone): rec[t, 0] the order of self-encoding token t's own pair (its rank or the value
    that orders ranks, as merge._pair_rank answers it), -1 for a single byte's token, -2 for any other token (never a
    merge result: no match may end on it); rec[t, 1] its own pair's left and right tokens (a byte token: itself) in
    bits 0-20 and 21-41; bits 42-62 are left for the longest shorter prefix token + 1 (`build`)."""
    rec = np.zeros((n, 2), np.int64)
    for t in range(n):
        rec[t, 0] = -2
        rec[t, 1] = t | (t << 21)
    for b in range(256):
        if byte_ids[b] >= 0:
            rec[byte_ids[b], 0] = -1
    cap, _ = merge_mod._filter_split(ptab.shape[1], merge_mod.FILTER_SHIFT)
    one_row = ptab.shape[0] == 1
    for s in range(cap):
        v = ptab[0, s]
        if v == merge_mod.EMPTY:
            continue
        left = np.int64((v >> np.uint64(merge_mod.PAIR_BITS)) & np.uint64(_F21))
        right = np.int64(v & np.uint64(_F21))
        order = np.int64(v >> np.uint64(2 * merge_mod.PAIR_BITS))
        t = order if one_row else np.int64(ptab[1, s])
        rec[t, 0] = order
        rec[t, 1] = left | (right << 21)
    monotone = True
    for t in range(n):
        if rec[t, 0] >= 0:
            left, right = rec[t, 1] & _F21, (rec[t, 1] >> 21) & _F21
            if not (rec[t, 0] > rec[left, 0] and rec[t, 0] > rec[right, 0]):
                monotone = False
    return rec, monotone


@njit(cache=True, nogil=True)
def _trie(tok_flat, tok_off, rec, n):
    """The self-encoding and byte tokens (rec[t, 0] >= -1) as a trie: (first child, next sibling, label, token) per
    node, node 0 the root; and each token's longest shorter prefix token into rec[t, 1] bits 42-62 (+ 1)."""
    total = 1
    for t in range(n):
        if rec[t, 0] >= -1:
            total += tok_off[t + 1] - tok_off[t]
    first = np.full(total, -1, np.int64)
    sibling = np.full(total, -1, np.int64)
    label = np.zeros(total, np.int64)
    token = np.full(total, -1, np.int64)
    nodes = 1
    for t in range(n):
        if rec[t, 0] < -1:
            continue
        node = 0
        for i in range(tok_off[t], tok_off[t + 1]):
            c = tok_flat[i]
            ch = first[node]
            while ch >= 0 and label[ch] != c:
                ch = sibling[ch]
            if ch < 0:
                ch = nodes
                nodes += 1
                label[ch] = c
                sibling[ch] = first[node]
                first[node] = ch
            node = ch
        token[node] = t
    for t in range(n):
        if rec[t, 0] < -1:
            continue
        node = 0
        shorter = -1
        for i in range(tok_off[t], tok_off[t + 1] - 1):
            ch = first[node]
            while label[ch] != tok_flat[i]:
                ch = sibling[ch]
            node = ch
            if token[node] >= 0:
                shorter = token[node]
        rec[t, 1] |= (shorter + 1) << 42
    return first[:nodes], sibling[:nodes], label[:nodes], token[:nodes]


@njit(cache=True, nogil=True)
def _double_array(first, sibling, label, token):
    """The trie as one uint64 array: a node's children at base ^ byte (XOR double array), bases found breadth-first
    in 256-entry blocks, so a transition is one load of the child's entry (its check says whose child it is)."""
    nodes = first.shape[0]
    size = 1024
    while size < 2 * nodes + 1024:
        size <<= 1
    entry = np.zeros(size, np.uint64)
    used = np.zeros(size, np.bool_)
    state = np.zeros(nodes, np.int64)
    used[0] = True
    queue = np.empty(nodes, np.int64)
    queue[0] = 0
    head, tail, hint, top = 0, 1, 0, 0
    kids = np.empty(256, np.int64)
    while head < tail:
        node = queue[head]
        head += 1
        k = 0
        ch = first[node]
        while ch >= 0:
            kids[k] = ch
            k += 1
            ch = sibling[ch]
        if k == 0:
            continue
        base = -1
        block = hint
        while base < 0:
            if (block + 1) * 256 > size:
                grown = np.zeros(2 * size, np.uint64)
                grown[:size] = entry
                entry = grown
                more = np.zeros(2 * size, np.bool_)
                more[:size] = used
                used = more
                size *= 2
            for x in range(256):
                b = block * 256 + x
                free = True
                for j in range(k):
                    if used[b ^ label[kids[j]]]:
                        free = False
                        break
                if free:
                    base = b
                    break
            block += 1
        while hint * 256 + 256 <= size and used[hint * 256:hint * 256 + 256].all():
            hint += 1
        s = state[node]
        entry[s] |= np.uint64(base) << np.uint64(_BASE_SHIFT)
        for j in range(k):
            c = kids[j]
            t = base ^ label[c]
            used[t] = True
            state[c] = t
            top = max(top, t)
            entry[t] = np.uint64(s + 1) | (np.uint64(token[c] + 1) << np.uint64(_TOKEN_SHIFT))
            queue[tail] = c
            tail += 1
    return entry[:top + 256]     # (a base's block may reach 255 entries past the last used one)


def _no_tables() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(0, np.uint64), np.zeros((0, 2), np.int64)


def build(tok_flat: np.ndarray, tok_off: np.ndarray, byte_ids: np.ndarray, ptab: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray]:
    """(double array uint64[L], records int64[n_vocab, 2]) for `_merge_piece`, or two empty arrays (the walk then
    keeps merge.py's kernels) where the tokenizer's orders are not monotone, or its token IDs or the trie's states do
    not fit the 21-bit fields."""
    n = tok_off.shape[0] - 1
    if n >= 1 << 21:
        return _no_tables()
    rec, monotone = _records(ptab, byte_ids, n)
    if not monotone:
        return _no_tables()
    entry = _double_array(*_trie(tok_flat, tok_off, rec, n))
    if entry.shape[0] > _F21:
        return _no_tables()
    return entry, rec


@njit(cache=True, nogil=True, inline="always")
def _longest(buf, p, end, da):
    """The longest token in the double array that is a prefix of buf[p:end] (every byte's token is one)."""
    s = np.int64(0)
    e = da[0]
    last = np.int64(-1)
    while p < end:
        t = np.int64((e >> np.uint64(_BASE_SHIFT)) & np.uint64(_F21)) ^ np.int64(buf[p])
        e = da[t]
        if np.int64(e & np.uint64(_F21)) != s + 1:
            break
        tok = np.int64(e >> np.uint64(_TOKEN_SHIFT)) - 1
        if tok >= 0:
            last = tok
        s = t
        p += 1
    return last


@njit(cache=True, nogil=True, inline="always")
def _valid(ptab, rec, t1, t2):
    """Whether the BPE of t1's bytes then t2's is exactly (t1, t2) (the module docstring's walk)."""
    limit = np.int64(1) << 62
    while True:
        c, _ = merge_mod._pair_rank(ptab, t1, t2)
        if c != _INF and np.int64(c) < limit:
            return False
        o1 = rec[t1, 0]
        o2 = rec[t2, 0]
        if o1 > o2:     # t1 was made last: before it, its right part met t2
            limit = o1
            t1 = (rec[t1, 1] >> 21) & _F21
        elif o2 < 0:    # two single bytes
            return True
        else:
            limit = o2 + 1
            t2 = rec[t2, 1] & _F21


@njit(cache=True, nogil=True, inline="always")
def _valid_memo(ptab, rec, memo, t1, t2):
    """`_valid` through the thread's direct-mapped memo (an entry: (t1 << 21 | t2) + 1, then the answer bit)."""
    key = (np.uint64(t1) << np.uint64(21)) | np.uint64(t2)
    h = np.int64(((key * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)) & np.uint64(memo.shape[0] - 1))
    e = memo[h]
    if (e >> np.uint64(1)) == key + np.uint64(1):
        return (e & np.uint64(1)) != 0
    v = _valid(ptab, rec, t1, t2)
    memo[h] = ((key + np.uint64(1)) << np.uint64(1)) | (np.uint64(1) if v else np.uint64(0))
    return v


@njit(cache=True, nogil=True)
def _merge_piece(buf, a, b, ptab, tok_off, da, rec, memo, toks, dead, out, o):
    """BPE of buf[a:b] appended to out[o:] (the IDs of merge.py's kernels); returns the new o, or -1 (nothing
    written past o) if the search found no valid tokenization. toks: scratch of >= b - a entries, dead: >= b - a + 1
    (any int dtype)."""
    m = b - a
    for i in range(m + 1):
        dead[i] = 0
    k = 0
    pos = 0
    nxt = _longest(buf, a, b, da)
    while pos < m:
        token = nxt
        last = toks[k - 1] if k > 0 else -1
        while True:
            end = pos + tok_off[token + 1] - tok_off[token]
            if dead[end] == 0 and (last < 0 or _valid_memo(ptab, rec, memo, last, token)):
                toks[k] = token
                k += 1
                pos = end
                if pos < m:
                    nxt = _longest(buf, a + pos, b, da)
                break
            shorter = (rec[token, 1] >> 42) - 1
            if shorter >= 0:
                token = shorter
            else:       # nothing from here on pairs with the previous token: it goes, and its end is a dead end
                if k == 0:
                    return -1       # (no valid tokenization: unreachable for monotone orders; the caller merges)
                dead[pos] = 1
                k -= 1
                pos -= tok_off[last + 1] - tok_off[last]
                nxt = last
                break
    for i in range(k):
        out[o + i] = toks[i]
    return o + k


__all__ = ["VALID_SLOTS", "build"]
