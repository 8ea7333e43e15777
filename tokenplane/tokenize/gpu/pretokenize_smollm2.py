"""Device pre-tokenizer rules for smollm2 (HF Digits, then the GPT-2 pattern on each piece).

The same rules as the CPU loop (`pretokenize._smollm2_loop_impl`, derived in docs/pretokenizer.md), written per
character: they need no run aggregate, only the kinds of at most three characters to the left and one to the right.
The class code per character is `pretokenize._cp_kind_smollm2` (0 letter, 1 Digits-numeric, 2 whitespace, 3 other)
| 8 when the character's UTF-8 holds a byte the vocabulary lacks: the reference drops such bytes and merges across
them, which the device BPE does not, so the document is flagged and answered by the encoder's fallback.

The kernels take the GPT-4 kernels' buffers, so the encoder's launch sequence and CUDA graphs are the same.
"""

from __future__ import annotations

from functools import cache
from typing import Callable

from .layout import BIG, FALLBACK, N_CHARS

KIND_L, KIND_D, KIND_W, KIND_O = 0, 1, 2, 3
F_DROP = 8


@cache
def make_pretokenize_smollm2() -> dict[str, Callable]:
    global cuda
    from numba import cuda

    @cuda.jit
    def k_classify(cp, classes, docflag, meta, fam, code, v_run, v_doc, v_nons, v_nonc, reff, rlastnl, rend, raux,
                   docfb):
        n = meta[N_CHARS]
        x = cuda.grid(1)
        while x < n:
            k = classes[cp[x]]
            code[x] = k
            first = x == 0 or docflag[x] != 0
            if x == 0:
                docflag[x] = 1
            boundary = first or (classes[cp[x - 1]] & 3) != (k & 3)
            v_run[x] = x if boundary else -1
            v_doc[x] = x if first else -1
            v_nons[x] = x
            v_nonc[x] = x
            reff[x] = BIG
            rlastnl[x] = -1
            rend[x] = -1
            raux[x] = BIG
            docfb[x] = 0
            x += cuda.gridsize(1)

    @cuda.jit
    def k_aggregate(cp, code, meta, fam, rstart, lastnons, reff, rlastnl, rend, raux, docstart, docfb):
        pass    # the rules are local: no run aggregate

    @cuda.jit(device=True)
    def contraction(cp, code, docflag, n, p):
        # letters a lone "'" at p takes: it must start a match (a text start, or after neither an "other" character
        # of its own run nor a space prefix), then s t m d (1) or re ve ll (2), lowercase, inside the document
        if cp[p] != 39:
            return 0
        if docflag[p] == 0:
            pk = code[p - 1] & 3
            if pk == KIND_O or (pk == KIND_W and cp[p - 1] == 32):
                return 0
        if p + 1 >= n or docflag[p + 1] != 0:
            return 0
        c1 = cp[p + 1]
        if c1 == 115 or c1 == 116 or c1 == 109 or c1 == 100:
            return 1
        if p + 2 >= n or docflag[p + 2] != 0:
            return 0
        c2 = cp[p + 2]
        if (c1 == 114 and c2 == 101) or (c1 == 118 and c2 == 101) or (c1 == 108 and c2 == 108):
            return 2
        return 0

    @cuda.jit
    def k_predicate(cp, code, docflag, meta, fam, rstart, rend, reff, rlastnl, raux, lastnonc, startflag,
                    docstart, docfb):
        n = meta[N_CHARS]
        x = cuda.grid(1)
        while x < n:
            k = code[x] & 3
            if (code[x] & F_DROP) != 0:
                cuda.atomic.max(meta, FALLBACK, 1)
                docfb[docstart[x]] = 1
            if docflag[x] != 0:
                s = True
            else:
                pk = code[x - 1] & 3
                if k == KIND_D or pk == KIND_D:
                    s = True                      # Digits: every numeric character alone
                elif k == KIND_W:
                    # a run head; or the last character of a run of >= 2 that a letter or other character follows
                    # in the same document (`\s+(?!\S)` gives it back); a run that ends its segment is one piece
                    s = pk != KIND_W or (x + 1 < n and docflag[x + 1] == 0 and (code[x + 1] & 3) != KIND_W
                                         and (code[x + 1] & 3) != KIND_D)
                elif pk == k:
                    s = False
                    if k == KIND_L and docflag[x - 1] == 0:    # the letters after a contraction: a new piece
                        if (code[x - 2] & 3) == KIND_O and contraction(cp, code, docflag, n, x - 2) == 1:
                            s = True
                        elif docflag[x - 2] == 0 and x >= 3 and (code[x - 3] & 3) == KIND_O \
                                and contraction(cp, code, docflag, n, x - 3) == 2:
                            s = True
                elif pk == KIND_W and cp[x - 1] == 32:
                    s = False                     # ` ?`: the space before a letter or other run opens its piece
                elif k == KIND_L and pk == KIND_O:
                    s = contraction(cp, code, docflag, n, x - 1) == 0
                else:
                    s = True
            startflag[x] = 1 if s else 0
            x += cuda.gridsize(1)

    return dict(k_classify=k_classify, k_aggregate=k_aggregate, k_predicate=k_predicate)
