"""Device pre-tokenizer: UTF-8 decode, classification, run aggregates and the per-character piece-start predicate.

The reference splitters are leftmost-first regexes; the rules below reproduce their piece starts from character
classes (L, N, W = \\s, O = anything else), maximal same-class runs, a few per-run aggregates and at most two
characters of lookback. docs/gpu.md derives each rule from the regex alternatives. In short, for a character x in run
[a, b) of class K:

* absorbed: x is in S ({\\r, \\n}; o200k adds '/') and the last non-CR/LF character before it is O -> the `[\\r\\n]*`
  (o200k: `[\\r\\n/]*`) tail of the preceding punctuation piece; never a start. Absorbed characters form a prefix
  of their run; `reff` = first non-absorbed position of the run.
* N: (x - a) % 3 == 0 (qwen3's `\\p{N}`: every digit).
* O: x == reff, unless x == a and the character before is a space (` ?` of the punctuation alternative took it),
  or (o200k) x is an apostrophe whose contraction attaches to the preceding word.
* W: x == reff; otherwise with q = last newline of the run: at document end, cl100k has none (`\\s++$`), llama3 and
  o200k start again after q; inside the text, starts at q + 1 and at b - 1 (`\\s+(?!\\S)` leaves the last blank for
  the next piece).
* L: a is a start unless the character before is a blank (not a newline) or a punctuation character that starts a
  piece (the optional prefix of the letter alternative). cl100k/llama3 add a start after a contraction `'s` etc.;
  o200k adds the case boundaries of its two word alternatives and attached contractions.

o200k counts combining marks (\\p{M}) in both word sets, so they classify as caseless letters here; a mark that
starts a letter run right after a punctuation piece (which `[^\\s\\p{L}\\p{N}]+` extends through marks) and chained
contractions (`x's's`) set the FALLBACK flag of their document; the encoder answers those documents on the CPU.
"""

from __future__ import annotations

from functools import cache
from typing import Callable

from .layout import BIG, F_O200K, F_QWEN3, FALLBACK, INVALID, N_BYTES, N_CHARS, N_DOCS, N_PIECES, N_SMALL
from .tables import B_C, B_M, B_PL, B_PU, K_L, K_N, K_O, K_W


def aggregate_kernel(absorbed_at: Callable, run_aux: Callable) -> Callable:
    """The run-aggregate kernel for one family's absorption rule (`absorbed_at(cp, code, lastnons, fam, x)`: x is a
    CR/LF that the preceding punctuation piece takes) and per-run extra (`run_aux(code, raux, r, x)`): per run, the
    first non-absorbed position (reff), the last CR/LF and the end. Only a few characters per run issue atomics
    (long blank runs would otherwise serialize on one address). Call after make_pretokenize (it binds `cuda`)."""
    @cuda.jit
    def k_aggregate(cp, code, meta, fam, rstart, lastnons, reff, rlastnl, rend, raux, docstart, docfb):
        n = meta[N_CHARS]
        x = cuda.grid(1)
        while x < n:
            c = cp[x]
            r = rstart[x]
            if not absorbed_at(cp, code, lastnons, fam, x):
                if x == r:
                    reff[r] = x       # the smallest value the run can have: a racing atomic min cannot undercut it
                elif absorbed_at(cp, code, lastnons, fam, x - 1):
                    cuda.atomic.min(reff, r, x)   # o200k O runs: "!/-" has two such positions
                if c == 10 or c == 13:
                    cuda.atomic.max(rlastnl, r, x)
            if x + 1 >= n or rstart[x + 1] != r:
                rend[r] = x + 1
            run_aux(code, raux, r, x)
            x += cuda.gridsize(1)

    return k_aggregate


@cache
def make_pretokenize() -> dict[str, Callable]:
    # kernels must see `cuda` as a module global: the simulator swaps it in the function's globals
    global cuda, int32
    from numba import cuda, int32

    @cuda.jit(device=True)
    def in_s(c, fam):
        return c == 10 or c == 13 or (fam == F_O200K and c == 47)

    @cuda.jit(device=True)
    def kind(code, x):
        return code[x] & 3

    @cuda.jit(device=True)
    def contraction_len(cp, docflag, n, x):
        # (?i:'s|'t|'re|'ve|'m|'ll|'d) at apostrophe x; case folding maps 's' to U+017F too
        if x + 1 >= n or docflag[x + 1] != 0:
            return 0
        c1 = cp[x + 1]
        if c1 == 115 or c1 == 83 or c1 == 383 or c1 == 116 or c1 == 84 or c1 == 100 or c1 == 68 or c1 == 109 \
                or c1 == 77:
            return 2
        if x + 2 >= n or docflag[x + 2] != 0:
            return 0
        c2 = cp[x + 2]
        if (c1 == 108 or c1 == 76) and (c2 == 108 or c2 == 76):
            return 3
        if (c1 == 118 or c1 == 86 or c1 == 114 or c1 == 82) and (c2 == 101 or c2 == 69):
            return 3
        return 0

    @cuda.jit(device=True)
    def attached(cp, code, docflag, rstart, rend, n, e):
        # o200k: a lone apostrophe right after a word takes the contraction into that word's piece
        if cp[e] != 39 or rstart[e] != e or rend[e] != e + 1:
            return False
        if docflag[e] != 0 or kind(code, e - 1) != K_L:
            return False
        return contraction_len(cp, docflag, n, e) > 0

    @cuda.jit(device=True)
    def start_o(cp, code, docflag, rstart, rend, reff, n, fam, y):
        r = rstart[y]
        if y != reff[r]:
            return False
        if y == r and docflag[y] == 0 and cp[y - 1] == 32:
            return False
        if fam == F_O200K and attached(cp, code, docflag, rstart, rend, n, y):
            return False
        return True

    @cuda.jit(device=True)
    def prefix_taken(cp, code, docflag, rstart, rend, reff, n, fam, a):
        # the letter alternatives' optional [^\r\n\p{L}\p{N}] prefix: did the character before a start a piece?
        if docflag[a] != 0:
            return False
        p = a - 1
        k = kind(code, p)
        if k == K_W:
            return cp[p] != 10 and cp[p] != 13
        if k == K_O:
            return start_o(cp, code, docflag, rstart, rend, reff, n, fam, p)
        return False

    @cuda.jit
    def k_lead(data, meta, lead, tokflag):
        n = meta[N_BYTES]
        i = cuda.grid(1)
        while i < n:
            lead[i] = 1 if (data[i] & 0xC0) != 0x80 else 0
            tokflag[i] = 0
            i += cuda.gridsize(1)

    @cuda.jit
    def k_decode(data, meta, cidx, cp, cbyte, docflag):
        n = meta[N_BYTES]
        i = cuda.grid(1)
        while i < n:
            b0 = int32(data[i])
            if (b0 & 0xC0) != 0x80:
                c = int32(-1)
                need = 0
                lo = 0
                if b0 < 0x80:
                    c = b0
                elif b0 >= 0xC2 and b0 < 0xE0:
                    c, need, lo = b0 & 0x1F, 1, 0x80
                elif b0 >= 0xE0 and b0 < 0xF0:
                    c, need, lo = b0 & 0x0F, 2, 0x800
                elif b0 >= 0xF0 and b0 < 0xF5:
                    c, need, lo = b0 & 0x07, 3, 0x10000
                ok = c >= 0 and i + need < n
                j = 1
                while ok and j <= need:
                    bj = int32(data[i + j])
                    if (bj & 0xC0) != 0x80:
                        ok = False
                    else:
                        c = (c << 6) | (bj & 0x3F)
                    j += 1
                if ok and (c < lo or c > 0x10FFFF or (c >= 0xD800 and c < 0xE000)):
                    ok = False
                if not ok:
                    cuda.atomic.max(meta, INVALID, 1)
                    c = 0xFFFD
                ci = cidx[i]
                cp[ci] = c
                cbyte[ci] = i
                docflag[ci] = 0
            else:
                # a continuation byte must lie inside the sequence its lead byte announces
                j = i - 1
                while j >= 0 and j > i - 4 and (int32(data[j]) & 0xC0) == 0x80:
                    j -= 1
                lead_len = 0
                if j >= 0:
                    bl = int32(data[j])
                    if bl >= 0xC2 and bl < 0xE0:
                        lead_len = 2
                    elif bl >= 0xE0 and bl < 0xF0:
                        lead_len = 3
                    elif bl >= 0xF0 and bl < 0xF5:
                        lead_len = 4
                if j < 0 or i - j >= lead_len:
                    cuda.atomic.max(meta, INVALID, 1)
            i += cuda.gridsize(1)

    @cuda.jit
    def k_docs(doc_off, meta, cidx, docflag):
        d = cuda.grid(1)
        while d < meta[N_DOCS]:
            docflag[cidx[doc_off[d]]] = 1
            d += cuda.gridsize(1)

    @cuda.jit(device=True)
    def family_class(classes, c, fam):
        # o200k: a combining mark is in both word sets ([\p{Lu}..\p{M}] and [\p{Ll}..\p{M}]): a caseless letter
        k = classes[c]
        if fam == F_O200K and (k & B_M) != 0 and (k & 3) == K_O:
            k = (k & 0xFC) | K_L | B_C
        return k

    @cuda.jit
    def k_classify(cp, classes, docflag, meta, fam, code, v_run, v_doc, v_nons, v_nonc, reff, rlastnl, rend,
                   rlastnonpu, docfb):
        n = meta[N_CHARS]
        x = cuda.grid(1)
        while x < n:
            c = cp[x]
            k = family_class(classes, c, fam)
            code[x] = k
            first = x == 0 or docflag[x] != 0
            if x == 0:
                docflag[x] = 1
            boundary = first or (family_class(classes, cp[x - 1], fam) & 3) != (k & 3)
            v_run[x] = x if boundary else -1
            v_doc[x] = x if first else -1
            # 2x + first: the max-scan then gives both the last non-CR/LF position and whether it opens the document
            v_nons[x] = 2 * x + (1 if first else 0) if (first or not (c == 10 or c == 13)) else -1
            v_nonc[x] = x if (boundary or (k & B_C) == 0) else -1
            reff[x] = BIG
            rlastnl[x] = -1
            rend[x] = -1
            rlastnonpu[x] = -1
            docfb[x] = 0
            x += cuda.gridsize(1)

    @cuda.jit(device=True)
    def absorbed_at(cp, code, lastnons, fam, x):
        # y = the last non-CR/LF character before x in its document. An O there ends in a punctuation run that
        # `[\r\n]*` (o200k: `[\r\n/]*`) extends through x; an o200k '/' counts as that O too ("a/\n": '/' opens
        # a punctuation piece, the newline is its tail)
        if not in_s(cp[x], fam):
            return False
        v = lastnons[x]
        if v >> 1 == x:
            if v & 1:
                return False      # x opens its document
            v = lastnons[x - 1]   # an o200k '/': look before it
        return (code[v >> 1] & 3) == K_O

    @cuda.jit(device=True)
    def last_non_upper(code, rlastnonpu, r, x):
        if (code[x] & 3) == K_L and (code[x] & B_PU) == 0:
            cuda.atomic.max(rlastnonpu, r, x)

    k_aggregate = aggregate_kernel(absorbed_at, last_non_upper)

    @cuda.jit(device=True)
    def start_w(cp, docflag, rstart, rend, reff, rlastnl, n, fam, x):
        a = rstart[x]
        a2 = reff[a]
        if x < a2:
            return False
        if x == a2:
            return True
        b = rend[a]
        q = rlastnl[a]
        at_end = b >= n or docflag[b] != 0
        if at_end:
            if fam == 0:
                return False
            return q >= 0 and x == q + 1
        r = q + 1 if q >= 0 else a2
        if x == r:
            return True
        return x == b - 1 and x > r

    @cuda.jit(device=True)
    def start_l(cp, code, docflag, rstart, rend, reff, rlastnonpu, lastnonc, n, fam, x):
        a = rstart[x]
        p = a - 1
        if fam != F_O200K:
            if x == a:
                return not prefix_taken(cp, code, docflag, rstart, rend, reff, n, fam, a)
            if docflag[a] == 0 and cp[p] == 39 and start_o(cp, code, docflag, rstart, rend, reff, n, fam, p):
                m = contraction_len(cp, docflag, n, p)
                return m > 0 and x == p + m
            return False
        att = docflag[a] == 0 and attached(cp, code, docflag, rstart, rend, n, p)
        ws = a
        if att:
            m = contraction_len(cp, docflag, n, p)
            if x < p + m:
                return False
            if x == p + m:
                return True
            ws = p + m
        elif x == a:
            return not prefix_taken(cp, code, docflag, rstart, rend, reff, n, fam, a)
        if x <= ws or (code[x] & B_PU) == 0:
            return False
        y = lastnonc[x - 1]
        if y >= ws and (code[y] & B_PL) != 0:
            return True      # lower (or caseless after lower) then upper: a new word
        return (code[x - 1] & B_C) != 0 and rlastnonpu[a] < x   # trailing all-caps after a caseless letter

    @cuda.jit
    def k_predicate(cp, code, docflag, meta, fam, rstart, rend, reff, rlastnl, rlastnonpu, lastnonc, startflag,
                    docstart, docfb):
        n = meta[N_CHARS]
        x = cuda.grid(1)
        while x < n:
            k = code[x] & 3
            s = False
            if k == K_N:
                s = fam == F_QWEN3 or (x - rstart[x]) % 3 == 0
            elif k == K_O:
                s = start_o(cp, code, docflag, rstart, rend, reff, n, fam, x)
                if fam == F_O200K and attached(cp, code, docflag, rstart, rend, n, x):
                    # a chained contraction (x's's) needs the sequential rule: leave it to the CPU
                    a0 = rstart[x - 1]
                    if docflag[a0] == 0 and attached(cp, code, docflag, rstart, rend, n, a0 - 1) and \
                            x - a0 <= contraction_len(cp, docflag, n, a0 - 1) - 1:
                        cuda.atomic.max(meta, FALLBACK, 1)
                        docfb[docstart[x]] = 1
            elif k == K_W:
                s = start_w(cp, docflag, rstart, rend, reff, rlastnl, n, fam, x)
            else:
                s = start_l(cp, code, docflag, rstart, rend, reff, rlastnonpu, lastnonc, n, fam, x)
                if fam == F_O200K and (code[x] & B_M) != 0 and rstart[x] == x and docflag[x] == 0 and \
                        kind(code, x - 1) == K_O and \
                        not prefix_taken(cp, code, docflag, rstart, rend, reff, n, fam, x):
                    # a mark right after a punctuation piece: ` ?[^\s\p{L}\p{N}]+` swallows it (it is not \p{L}),
                    # possibly chaining on through more punctuation: leave the document to the CPU
                    cuda.atomic.max(meta, FALLBACK, 1)
                    docfb[docstart[x]] = 1
            if docflag[x] != 0:
                s = True
            startflag[x] = 1 if s else 0
            x += cuda.gridsize(1)

    @cuda.jit
    def k_pieces(startflag, pidx, cbyte, meta, pstart):
        n = meta[N_CHARS]
        x = cuda.grid(1)
        while x < n:
            if startflag[x] != 0:
                pstart[pidx[x]] = cbyte[x]
            x += cuda.gridsize(1)

    @cuda.jit
    def k_dispatch(pstart, meta, small_max, medium_max, small, medium, large):
        # warp-aggregated append: one atomic per warp and list instead of one per piece (the counters are hot)
        npieces = meta[N_PIECES]
        lane = cuda.threadIdx.x % 32
        base = (cuda.grid(1) // 32) * 32
        while base < npieces:
            k = base + lane
            tier = -1
            if k < npieces:
                end = pstart[k + 1] if k + 1 < npieces else meta[N_BYTES]
                length = end - pstart[k]
                tier = 0 if length <= small_max else (1 if length <= medium_max else 2)
            for t in range(3):
                mask = cuda.ballot_sync(0xFFFFFFFF, tier == t)
                if mask != 0:
                    leader = cuda.ffs(mask) - 1
                    first = 0
                    if lane == leader:
                        first = cuda.atomic.add(meta, N_SMALL + t, cuda.popc(mask))
                    first = cuda.shfl_sync(0xFFFFFFFF, first, leader)
                    if tier == t:
                        slot = first + cuda.popc(mask & ((1 << lane) - 1))
                        if t == 0:
                            small[slot] = k
                        elif t == 1:
                            medium[slot] = k
                        else:
                            large[slot] = k
            base += cuda.gridsize(1)

    return dict(k_lead=k_lead, k_decode=k_decode, k_docs=k_docs, k_classify=k_classify, k_aggregate=k_aggregate,
                k_predicate=k_predicate, k_pieces=k_pieces, k_dispatch=k_dispatch)
