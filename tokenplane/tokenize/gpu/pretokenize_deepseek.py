"""Device pre-tokenizer rules for DeepSeek's three chained Split stages (classify, run aggregates, predicate).

The same run-level rules as the CPU loop (`pretokenize._deepseek_loop_impl`), evaluated once per character. Stages 1
and 2 (`\\p{N}{1,3}`, then runs of the CJK ranges) only cut the text into segments, and a segment end acts as the end
of text for stage 3. A segment head is therefore a local property of two neighbours: a digit-run edge, or a CJK-range
edge between two non-digits. docs/gpu.md derives the rules.

The kernels take the GPT-4 kernels' buffers, so the encoder's launch sequence and CUDA graphs are the same for every
family. The class code per character is `pretokenize._cp_feat_deepseek`: bits 0-2 the kind (0 letter or mark, 1
punctuation or symbol, 2 whitespace, 3 other, 4 digit), then 8 CJK range, 16 ASCII letter, 32 ASCII punctuation.
Per run, `raux` holds the first character that is not an ASCII letter (the end of `[!-/...][A-Za-z]+`), where the GPT-4
kernels keep o200k's last non-uppercase letter.
"""

from __future__ import annotations

from functools import cache
from typing import Callable

from .layout import BIG, N_CHARS

KIND_LM, KIND_PS, KIND_W, KIND_OTHER, KIND_N = 0, 1, 2, 3, 4
F_CJK, F_ASCII_LETTER, F_ASCII_PUNCT = 8, 16, 32


@cache
def make_pretokenize_deepseek() -> dict[str, Callable]:
    global cuda
    from numba import cuda

    from .pretokenize import aggregate_kernel, make_pretokenize
    make_pretokenize()      # binds the module global the shared aggregate kernel reads

    @cuda.jit(device=True)
    def seg_edge(prev_code, code):
        # a stage 1/2 piece boundary between two neighbours of one document
        k, pk = code & 7, prev_code & 7
        if k == KIND_N or pk == KIND_N:
            return k != pk
        return (code & F_CJK) != (prev_code & F_CJK)

    @cuda.jit(device=True)
    def seg_head(code, docflag, x):
        return docflag[x] != 0 or seg_edge(code[x - 1], code[x])

    @cuda.jit(device=True)
    def is_crlf(c):
        return c == 10 or c == 13

    @cuda.jit
    def k_classify(cp, classes, docflag, meta, fam, code, v_run, v_doc, v_nons, v_nonc, reff, rlastnl, rend, raux,
                   docfb):
        n = meta[N_CHARS]
        x = cuda.grid(1)
        while x < n:
            c = cp[x]
            k = classes[c]
            code[x] = k
            first = x == 0 or docflag[x] != 0
            if x == 0:
                docflag[x] = 1
            boundary = first
            if not first:
                pk = classes[cp[x - 1]]
                boundary = (pk & 7) != (k & 7) or seg_edge(pk, k)
            v_run[x] = x if boundary else -1
            v_doc[x] = x if first else -1
            v_nons[x] = x if (first or not is_crlf(c)) else -1
            v_nonc[x] = -1
            reff[x] = BIG
            rlastnl[x] = -1
            rend[x] = -1
            raux[x] = BIG
            docfb[x] = 0
            x += cuda.gridsize(1)

    @cuda.jit(device=True)
    def absorbed_at(cp, code, lastnons, fam, x):
        # ` ?[\p{P}\p{S}]+[\r\n]*` takes the CR/LF right after its punctuation, inside one segment (a CJK-range
        # punctuation character ends its segment before the CR/LF)
        if not is_crlf(cp[x]):
            return False
        y = lastnons[x]
        return y != x and (code[y] & 7) == KIND_PS and (code[y] & F_CJK) == 0

    @cuda.jit(device=True)
    def first_non_ascii_letter(code, raux, r, x):
        # only the first of each stretch of non-ASCII letters competes (a CJK run would serialize otherwise)
        k = code[x]
        if (k & 7) == KIND_LM and (k & F_ASCII_LETTER) == 0 and (x == r or (code[x - 1] & F_ASCII_LETTER) != 0):
            cuda.atomic.min(raux, r, x)

    k_aggregate = aggregate_kernel(absorbed_at, first_non_ascii_letter)

    @cuda.jit(device=True)
    def punct_glue(cp, code, docflag, rstart, a):
        # `[!-/:-@[-`{-~][A-Za-z]+`: a one-character ASCII punctuation run that opens a piece, then ASCII letters
        if seg_head(code, docflag, a) or (code[a] & F_ASCII_LETTER) == 0:
            return False
        p = a - 1
        if (code[p] & 7) != KIND_PS or (code[p] & F_ASCII_PUNCT) == 0 or rstart[p] != p:
            return False
        return seg_head(code, docflag, p) or cp[p - 1] != 32

    @cuda.jit
    def k_predicate(cp, code, docflag, meta, fam, rstart, rend, reff, rlastnl, raux, lastnonc, startflag,
                    docstart, docfb):
        n = meta[N_CHARS]
        x = cuda.grid(1)
        while x < n:
            k = code[x] & 7
            a = rstart[x]
            if x == 0 or seg_head(code, docflag, x):
                s = True
            elif k == KIND_N:
                s = (x - a) % 3 == 0
            elif k == KIND_PS:
                s = x == a and cp[x - 1] != 32
            elif k == KIND_LM:
                if x == a:
                    pk = code[a - 1] & 7
                    glued = (pk == KIND_W and not is_crlf(cp[a - 1])) or pk == KIND_OTHER
                    s = not glued and not punct_glue(cp, code, docflag, rstart, a)
                else:
                    s = x == raux[a] and punct_glue(cp, code, docflag, rstart, a)
            elif k == KIND_OTHER:
                # one unmatched span, except its last character when letters follow: their piece's prefix
                s = x == a or (x + 1 == rend[a] and x + 1 < n and (code[x + 1] & 7) == KIND_LM
                               and not seg_head(code, docflag, x + 1))
            else:
                s = False
                s0 = reff[a]
                if x == s0:
                    s = True
                elif x > s0:
                    b = rend[a]
                    q = rlastnl[a]
                    at_end = b >= n or seg_head(code, docflag, b)
                    s = (q >= 0 and x == q + 1) or (not at_end and x == b - 1 and not is_crlf(cp[x]))
            startflag[x] = 1 if s else 0
            x += cuda.gridsize(1)

    return dict(k_classify=k_classify, k_aggregate=k_aggregate, k_predicate=k_predicate)
