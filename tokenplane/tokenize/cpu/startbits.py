"""Pre-tokenizers 64 characters at a time, as bit masks: the cl100k lineage (cl100k_base, llama3, qwen3), smollm2,
DeepSeek V4 and o200k_base.

pretokenize._gpt4_loop walks the text run by run (a run: a maximal stretch of one kind, letter L, digit N,
whitespace W, other O) and decides each run's piece starts from the run's kind, the one or two characters left of it
and, for whitespace, the run's own characters. Its cost is one data-dependent branch per run (~12 ns a piece on
English). Here the same decisions are made for 64 characters at once from seven flag words (one bit per character:
L, N, W, O, space, CR/LF, apostrophe; `simdbits.bits64` reads each from the per-code-point feature bytes), and
only the runs whose decision needs more than two characters of context go through the loop's own scalar code.

With p(X) the flags of the character left of each position, p2(X) two left, q(X) the one right, and a run start
rs(X) = X & ~p(X), the loop's rules are (docs/pretokenizer.md derives them from the regex, alternative by alternative):

* other run: starts unless a space is left of it (` ?[^\\s\\p{L}\\p{N}]+` glues the space to it):
  rs(O) & ~p(SP);
* letter run: starts unless glued to the character left of it: a whitespace other than CR/LF
  (`[^\\r\\n\\p{L}\\p{N}]?\\p{L}+`, the whitespace run leaves that character to it), or a lone other character that
  has no space left of it (`opre` = p(O) & ~p2(O) & ~p2(SP)): rs(L) & ~(p(W) & ~p(NL)) & ~opre;
* digits: cl100k and llama3 start a piece every three digits from the run's start, qwen3 at every digit: N for
  qwen3, rs(N) plus the scalar groups of runs longer than one character otherwise;
* a whitespace run of one character starts a piece, except a CR/LF right after an other character (`[\\r\\n]*`
  absorbs it into that piece): rs(W) & ~q(W) & ~(p(O) & NL);
* scalar, with the loop's code: whitespace runs of two or more characters (CR/LF absorption, the last line break,
  `\\s+(?!\\S)` leaving the last space to the next piece, cl100k's `\\s++$` at the end of the text), and a letter run
  right after a lone apostrophe (the contractions `'s 't 're 've 'm 'll 'd`, case-insensitive, `ſ` as `s`).

The masks carry across words through the previous word's flags (for p, p2) and the next word's W (for q); the text's
first character has nothing left of it (as the loop's prev_kind = -1). Equality with the loop is tested on random
strings over the characters every rule distinguishes and on real text (tests/test_startbits.py); the loop itself is
checked against the reference tokenizers.

smollm2, DeepSeek V4 and o200k get the same treatment from their own loops (`_smollm2_bits_impl`,
`_deepseek_bits_impl`, `_o200k_bits_impl` say which of their rules are masks and which stay scalar); every full
encode runs its family's bitmap form (o200k's followed, in the same call, by the rescan of its rare shapes).

Measured on 1M-character documents of the benchmark corpus, one core, this stage alone against the loop (with its
start mask cleared), alternated in one process (benchmarks/pretokenizer_bits.py): cl100k english 0.82 vs 2.37 ms
(2.9x), code 2.5x, CJK 7.2x; qwen3 2.8-9.0x; smollm2 9.6-13.0x (english 0.17 vs 1.63 ms); DeepSeek 1.9-3.7x; o200k
3.4-5.4x (pretokenizer_bits_zen3_o200k.md).
"""

from __future__ import annotations

from functools import cache
from typing import Callable

import numpy as np

from ..spec import charclass
from .lazyjit import njit, numba_global  # numba itself only when a JIT kernel runs (lazyjit.py)
from .pretokenize import (
    _cp_feat_deepseek,
    _cp_kind_gpt4,
    _cp_kind_o200k,
    _cp_kind_smollm2,
    _family,
    _o200k_runs,
    _whitespace_run_cuts,
    loop_tables,
)

_bits64 = numba_global("tokenplane.tokenize.cpu.simdbits", "bits64")
_borrowed = numba_global("tokenplane.tokenize.cpu.borrow", "borrowed")
_trailing_zeros = numba_global("numba.cpython.unsafe.numbers", "trailing_zeros")

# feature bits of a code point: its run kind (one of the first four), then the three characters the rules name
FL, FN, FW, FO, FSP, FNL, FAP = 1, 2, 4, 8, 16, 32, 64
PAD = 64        # zero feature bytes the kernel may read past the text (one 64-character load)


@cache
def gpt4_feature_table(engine: str) -> np.ndarray:
    """uint8 per code point: 1 << run kind (pretokenize's gpt4 kind table: L, N, W, O) | FSP for U+0020 | FNL for
    CR and LF | FAP for the apostrophe. Cached on disk like the kind table it is made from."""
    def build() -> np.ndarray:
        feat = np.left_shift(1, _cp_kind_gpt4(engine).astype(np.int64)).astype(np.uint8)
        feat[0x20] |= FSP
        feat[[0x0A, 0x0D]] |= FNL
        feat[0x27] |= FAP
        return feat
    return charclass.derived_table("feat-gpt4", engine, (charclass.N_CODEPOINTS,), np.uint8, build, __file__)


@cache
def smollm2_feature_table(engine: str) -> np.ndarray:
    """uint8 per code point for smollm2: 1 << its run kind (pretokenize's smollm2 kinds: L, Digits-numeric, W,
    other) | FSP for U+0020 | FAP for the apostrophe."""
    def build() -> np.ndarray:
        feat = np.left_shift(1, _cp_kind_smollm2(engine).astype(np.int64)).astype(np.uint8)
        feat[0x20] |= FSP
        feat[0x27] |= FAP
        return feat
    return charclass.derived_table("feat-smollm2", engine, (charclass.N_CODEPOINTS,), np.uint8, build, __file__,
                                   numeric=True)


# DeepSeek's feature bits: its five run kinds one-hot, the CJK ranges of its stage 2, and two flags whose meaning
# depends on the kind (a letter / punctuation flag is only set on ASCII letters / punctuation, so on whitespace the
# same bits mark CR/LF and the space)
DL, DPS, DW, DO, DN, DCJK, DAL, DAP = 1, 2, 4, 8, 16, 32, 64, 128


@cache
def deepseek_feature_table(engine: str) -> np.ndarray:
    """uint8 per code point for DeepSeek V4: one-hot kind (pretokenize's feat-deepseek kinds: letter/mark, punctuation
    or symbol, whitespace, other, digit) | DCJK | DAL on ASCII letters and on CR/LF | DAP on ASCII punctuation and on
    the space."""
    def build() -> np.ndarray:
        f = _cp_feat_deepseek(engine).astype(np.int64)
        out = np.left_shift(1, f & 7).astype(np.int64)
        out |= np.where(f & 8, DCJK, 0) | np.where(f & 16, DAL, 0) | np.where(f & 32, DAP, 0)
        out[[0x0A, 0x0D]] |= DAL
        out[0x20] |= DAP
        return out.astype(np.uint8)
    return charclass.derived_table("feat-deepseek-bits", engine, (charclass.N_CODEPOINTS,), np.uint8, build, __file__)


# o200k's feature bytes: pretokenize's o200k kind table as its run loop reads it (bits 0-1 the run kind: word 0, digit
# 1, whitespace 2, other 3; then upper, lower, mark) and the three characters the masks name
OU, OLOW, OM, OSP, ONL, OAP = 4, 8, 16, 32, 64, 128


@cache
def o200k_feature_table(engine: str) -> np.ndarray:
    """uint8 per code point for o200k_base: pretokenize's kind-o200k byte (its run loop reads this table as it is)
    | OSP for U+0020 | ONL for CR and LF | OAP for the apostrophe."""
    def build() -> np.ndarray:
        feat = _cp_kind_o200k(engine).copy()
        feat[0x20] |= OSP
        feat[[0x0A, 0x0D]] |= ONL
        feat[0x27] |= OAP
        return feat
    return charclass.derived_table("feat-o200k", engine, (charclass.N_CODEPOINTS,), np.uint8, build, __file__)


def _set_bit(sb, p):
    sb[p >> 6] |= np.uint64(1) << np.uint64(p & 63)


def _set_cuts(sb, first, mid, last):
    """pretokenize._whitespace_run_cuts' positions (-1: none) into the bitmap."""
    if first >= 0:
        _set_bit(sb, first)
    if mid >= 0:
        _set_bit(sb, mid)
    if last >= 0:
        _set_bit(sb, last)


def _prev(x, xp):
    """The flags of the character left of each position: x shifted up one, the previous word's top bit carried in."""
    return (x << np.uint64(1)) | (xp >> np.uint64(63))


def _prev2(x, xp):
    """The flags two characters left."""
    return (x << np.uint64(2)) | (xp >> np.uint64(62))


def _next(x, xn):
    """The flags of the character right of each position: x shifted down one, the next word's bottom bit carried in."""
    return (x >> np.uint64(1)) | (xn << np.uint64(63))


def _clear(sb):
    for g in range(sb.shape[0]):
        sb[g] = 0


def _run_end(feat, n, a, flag):
    """The end of the run of `flag` characters that starts at a."""
    b = a + 1
    while b < n and (feat[b] & flag):
        b += 1
    return b


def _digit_groups(sb, a, b, size):
    """Starts every `size` digits from the digit run's start (`\\p{N}{1,3}`)."""
    for j in range(a + size, b, size):
        _set_bit(sb, j)


def _fold(x):
    """The contraction letters' case-insensitive form (ASCII upper to lower, U+017F LONG S to s)."""
    return x + 32 if 65 <= x <= 90 else (115 if x == 0x17F else x)


def _contraction_end(c, a, b, fold):
    """Where a contraction that starts with the apostrophe left of a ends inside the letter run [a, b): a + 1 after s
    t m d, a + 2 after re ve ll (`fold`: case-insensitively, `ſ` as s), a when there is none."""
    f0 = _fold(c[a]) if fold else c[a]
    f1 = -1
    if a + 1 < b:
        f1 = _fold(c[a + 1]) if fold else c[a + 1]
    if f0 == 115 or f0 == 116 or f0 == 109 or f0 == 100:
        return a + 1
    if (f0 == 114 and f1 == 101) or (f0 == 118 and f1 == 101) or (f0 == 108 and f1 == 108):
        return a + 2
    return a


def _cl100k_starts(lw, ww, ow, sp, nl, q_w, lp, wp, op, spp, nlp):
    """The cl100k masks of the module docstring for other runs, letter runs and one-character whitespace runs, from
    this word's flags (letter, whitespace, other, space, CR/LF), the next character's whitespace flag and the
    previous word's flags; shared by the gpt4 and o200k kernels (o200k's word runs start as cl100k's letter runs).
    Returns (starts, rs(L), rs(W), rs(O), opre)."""
    p_w = _prev(ww, wp)
    p_o = _prev(ow, op)
    rs_l = lw & ~_prev(lw, lp)
    rs_w = ww & ~p_w
    rs_o = ow & ~p_o
    opre = p_o & ~_prev2(ow, op) & ~_prev2(sp, spp)
    st = (rs_o & ~_prev(sp, spp)) | (rs_l & ~(p_w & ~_prev(nl, nlp)) & ~opre) | (rs_w & ~q_w & ~(p_o & nl))
    return st, rs_l, rs_w, rs_o, opre


def _gpt4_scalar(c, feat, n, a, digits, whole_at_end, sb):
    """The starts of the run at a that the masks leave to the loop's code (a whitespace run of 2+ characters, a
    digit run in groups of three, a letter run after a lone apostrophe)."""
    f = feat[a]
    if f & FW:
        b = _run_end(feat, n, a, FW)
        absorbed = a > 0 and (feat[a - 1] & FO) != 0     # the other run before absorbs the leading CR/LF
        first, mid, last = _whitespace_run_cuts(c, a, b, absorbed, b == n, whole_at_end and b == n)
        _set_cuts(sb, first, mid, last)
    elif f & FN:
        _digit_groups(sb, a, _run_end(feat, n, a, FN), digits)
    else:           # a letter run after a lone apostrophe: a contraction ends inside it
        b = _run_end(feat, n, a, FL)
        cut = _contraction_end(c, a, b, True)
        if a < cut < b:
            _set_bit(sb, cut)


def _gpt4_bits_impl(c, feat, digits, whole_at_end, sb):
    """Piece starts of the n = len(c) code points c into the bitmap sb (bit i of word i >> 6; at least (n >> 6) + 1
    words, cleared here), the same starts as pretokenize._gpt4_loop. feat: the feature bytes of c (gpt4_feature_table)
    followed by at least PAD zero bytes."""
    c, feat, sb = _borrowed(c), _borrowed(feat), _borrowed(sb)     # (borrow.py: no refcounts per scalar call)
    n = c.shape[0]
    words = (n + 63) >> 6
    _clear(sb)
    one = np.uint64(1)
    zero = np.uint64(0)
    lp = np_ = wp = op = spp = nlp = app = zero     # the previous word's flags
    wnext = _bits64(feat, 0, FW)
    for g in range(words):
        base = g << 6
        lw = _bits64(feat, base, FL)
        nw = _bits64(feat, base, FN)
        ww = wnext
        ow = _bits64(feat, base, FO)
        sp = _bits64(feat, base, FSP)
        nl = _bits64(feat, base, FNL)
        ap = _bits64(feat, base, FAP)
        wnext = _bits64(feat, base + 64, FW) if g + 1 < words else zero
        q_w = _next(ww, wnext)
        st, rs_l, rs_w, _, opre = _cl100k_starts(lw, ww, ow, sp, nl, q_w, lp, wp, op, spp, nlp)
        rs_n = nw & ~_prev(nw, np_)
        fix = (rs_w & q_w) | (rs_l & opre & _prev(ap, app))
        if digits == 1:
            st |= nw
        else:
            st |= rs_n
            fix |= rs_n & ~(~nw >> one)     # runs of two or more digits (or running into the next word)
        sb[g] |= st
        while fix != zero:
            _gpt4_scalar(c, feat, n, base + np.int64(_trailing_zeros(fix)), digits, whole_at_end, sb)
            fix &= fix - one
        lp, np_, wp, op, spp, nlp, app = lw, nw, ww, ow, sp, nl, ap


def _smollm2_bits_impl(c, feat, sb):
    """pretokenize._smollm2_loop's starts as a bitmap (same contract as _gpt4_bits_impl). Its rules in masks: every
    numeric character starts a piece (N); a whitespace run starts one (rs(W)), and when two or more long and followed
    by a letter or other character its last character starts the next (W & p(W) & q(L | O)); a letter or other run
    starts one unless a space is left of it (the space glues to it: p(SP)); a letter run right after a lone
    apostrophe that no space glues (p(AP) & ~p2(O) & ~p2(SP)) takes the loop's scalar contraction code (lowercase
    s t m d / re ve ll)."""
    c, feat, sb = _borrowed(c), _borrowed(feat), _borrowed(sb)     # (borrow.py: no refcounts per scalar call)
    n = c.shape[0]
    words = (n + 63) >> 6
    _clear(sb)
    one = np.uint64(1)
    zero = np.uint64(0)
    lp = wp = op = spp = app = zero     # the previous word's flags
    lonext = _bits64(feat, 0, FL | FO)
    for g in range(words):
        base = g << 6
        lw = _bits64(feat, base, FL)
        nw = _bits64(feat, base, FN)
        ww = _bits64(feat, base, FW)
        ow = _bits64(feat, base, FO)
        sp = _bits64(feat, base, FSP)
        ap = _bits64(feat, base, FAP)
        lo = lonext
        lonext = _bits64(feat, base + 64, FL | FO) if g + 1 < words else zero
        p_w = _prev(ww, wp)
        rs_l = lw & ~_prev(lw, lp)
        rs_o = ow & ~_prev(ow, op)
        apos = rs_l & _prev(ap, app) & ~_prev2(ow, op) & ~_prev2(sp, spp)
        st = nw | (ww & ~p_w) | (ww & p_w & _next(lo, lonext)) | ((rs_l | rs_o) & ~_prev(sp, spp) & ~apos)
        sb[g] |= st
        while apos != zero:
            a = base + np.int64(_trailing_zeros(apos))
            apos &= apos - one
            b = _run_end(feat, n, a, FL)
            x = _contraction_end(c, a, b, False)
            if x == a or x < b:
                _set_bit(sb, x)
        lp, wp, op, spp, app = lw, ww, ow, sp, ap


def _deepseek_scalar(c, feat, n, a, sb):
    """The starts of the run at a the masks leave to pretokenize._deepseek_loop's code: a whitespace run of 2+
    characters, a digit run longer than three, a letter run glued to a lone ASCII punctuation mark (its ASCII letters
    go with the mark; the rest starts a piece)."""
    f = feat[a]
    if f & DW:
        b = _run_end(feat, n, a, DW)
        head = a == 0 or (feat[a - 1] & (DN | DCJK)) != 0        # (whitespace is neither digit nor CJK)
        absorbed = not head and (feat[a - 1] & DPS) != 0        # the punctuation piece before absorbs CR/LF
        at_end = b == n or (feat[b] & (DN | DCJK)) != 0          # the segment ends with the run
        first, mid, last = _whitespace_run_cuts(c, a, b, absorbed, at_end, False)
        _set_cuts(sb, first, mid, last)
    elif f & DN:
        _digit_groups(sb, a, _run_end(feat, n, a, DN), 3)
    else:
        b = a + 1
        while b < n and (feat[b] & DL) and ((feat[b] & DCJK) == (feat[a] & DCJK)):
            b += 1
        j = a
        while j < b and (feat[j] & DAL):
            j += 1
        if j < b:
            _set_bit(sb, j)


def _deepseek_bits_impl(c, feat, sb):
    """pretokenize._deepseek_loop's starts as a bitmap (same contract as _gpt4_bits_impl). A segment head (h: the
    first character, a digit-run edge, or a CJK-range edge between non-digits) starts a piece; inside a segment, with
    p/p2/q as in the module docstring: punctuation starts unless a space is left of it; a letter run starts unless a
    whitespace other than CR/LF or an other character is left of it, or one ASCII punctuation mark with no space
    before it precedes it and it starts with an ASCII letter (then the scalar code finds where its ASCII letters end);
    an other run starts, and its last character starts the letter run after it; a one-character whitespace run
    starts, except a CR/LF right after punctuation; longer whitespace runs and digit runs take the scalar code."""
    c, feat, sb = _borrowed(c), _borrowed(feat), _borrowed(sb)     # (borrow.py: no refcounts per scalar call)
    n = c.shape[0]
    words = (n + 63) >> 6
    _clear(sb)
    one = np.uint64(1)
    zero = np.uint64(0)
    lp = psp = wp = op = np_ = cjkp = alp = app = hp = zero     # the previous word's flags
    wn = _bits64(feat, 0, DW)
    ln = _bits64(feat, 0, DL)
    nn = _bits64(feat, 0, DN)
    cjkn = _bits64(feat, 0, DCJK)
    for g in range(words):
        base = g << 6
        lw, ww, nw, cjk = ln, wn, nn, cjkn
        ps = _bits64(feat, base, DPS)
        ow = _bits64(feat, base, DO)
        al = _bits64(feat, base, DAL)
        ap = _bits64(feat, base, DAP)
        if g + 1 < words:
            wn = _bits64(feat, base + 64, DW)
            ln = _bits64(feat, base + 64, DL)
            nn = _bits64(feat, base + 64, DN)
            cjkn = _bits64(feat, base + 64, DCJK)
        else:
            wn = ln = nn = cjkn = zero
        p_ps = _prev(ps, psp)
        p_w = _prev(ww, wp)
        p_o = _prev(ow, op)
        p_n = _prev(nw, np_)
        p_ap = _prev(ap, app)
        # segment heads: the text's first character; a digit edge; a CJK edge between non-digits
        h = (nw ^ p_n) | (~nw & ~p_n & (cjk ^ _prev(cjk, cjkp)))
        if g == 0:
            h |= one
        p_h = _prev(h, hp)
        nw63 = nw >> np.uint64(63)
        h_next = ((nn ^ nw63) | (~nn & ~nw63 & (cjkn ^ (cjk >> np.uint64(63))))) & one   # the next word's bit 0
        q_h = _next(h, h_next)
        nl = ww & al            # (on whitespace the ASCII-letter bit marks CR/LF, the punctuation bit the space)
        p_sp = p_w & p_ap
        p_nl = p_w & _prev(al, alp)
        p2_sp = _prev2(ww, wp) & _prev2(ap, app)
        same = ~h
        rs_l = lw & ~_prev(lw, lp)
        rs_w = ww & ~p_w
        glued = same & ((p_w & ~p_nl) | p_o)
        single_ps = p_ps & (~_prev2(ps, psp) | p_h)
        punct_glue = rs_l & same & single_ps & ~(p2_sp & ~p_h) & p_ap & al
        st = h | (ps & ~p_ps & ~(p_sp & same)) | (rs_l & ~glued & ~punct_glue) | (ow & ~p_o)
        st |= (ow & _next(lw, ln) & ~q_h) | (rs_w & ~_next(ww, wn) & ~(same & p_ps & nl))
        if n - base < 64:       # a digit or CJK edge right after the text's last character is no start
            st &= (one << np.uint64(n - base)) - one
        sb[g] |= st
        fix = (rs_w & _next(ww, wn)) | (nw & ~p_n & ~(~nw >> one)) | punct_glue
        while fix != zero:
            _deepseek_scalar(c, feat, n, base + np.int64(_trailing_zeros(fix)), sb)
            fix &= fix - one
        lp, psp, wp, op, np_, cjkp, alp, app, hp = lw, ps, ww, ow, nw, cjk, al, ap, h


def _kind_end(feat, n, a, kind):
    """The end of the run of o200k kind `kind` that starts at a."""
    b = a + 1
    while b < n and (feat[b] & 3) == kind:
        b += 1
    return b


def _o200k_region(c, feat, n, h, sb, tmp, rare, nrare):
    """Re-decide, with pretokenize's o200k run loop, the starts of the word run holding h and of the word runs and
    lone apostrophes chained left of it (`don't's`: whether a contraction glues to the word before depends on the
    chain): from the chain's first word run r, whose state the two characters left of it give, to the end e of h's
    run. The bits of [r, e) are overwritten with the loop's; returns e. The loop's rare positions are dropped (the
    masks record the same ones: a word run starting with a mark right after an other run)."""
    a = h
    while a > 0 and (feat[a - 1] & 3) == 0:
        a -= 1
    e = _kind_end(feat, n, h, 0)
    r = a
    while r >= 2 and c[r - 1] == 39 and (feat[r - 2] & 3) == 0:
        r -= 2
        while r > 0 and (feat[r - 1] & 3) == 0:
            r -= 1
    pk = -1
    pl = 0
    ppk = -1
    if r > 0:
        pk = np.int64(feat[r - 1] & 3)
        pl = 1 if r < 2 or (feat[r - 2] & 3) != pk else 2
        if pl == 1 and r >= 2:      # (the kind two runs back matters only after a one-character run)
            ppk = np.int64(feat[r - 2] & 3)
    for j in range(r, e):
        tmp[j] = False
    sink = rare[nrare:] if rare.shape[0] - nrare >= e - r else np.empty(e - r, np.int64)
    _o200k_runs(c, feat, tmp, sink, 0, r, e, pk, pl, ppk, False)
    one = np.uint64(1)
    for j in range(r, e):
        bit = one << np.uint64(j & 63)
        if tmp[j]:
            sb[j >> 6] |= bit
        else:
            sb[j >> 6] &= ~bit
    return e


def _o200k_bits_impl(c, feat, sb, rare):
    """pretokenize._o200k_loop's starts as a bitmap (sb: as _gpt4_bits_impl's; feat: o200k_feature_table bytes and
    PAD zeros) and its rare positions into rare (capacity >= len(c) + 64), in no particular order; returns their
    count. With kinds from bits 0-1 (L word, N, W, O), p/p2/q as in the module docstring, U upper, LOW lower, B a
    word character that is neither (a mark, a letter without case): the cl100k masks for other runs, digit runs,
    one-character whitespace runs and word-run starts (o200k's word prefix is cl100k's letter prefix), plus a start
    at U & p(LOW) (`camelCase`: the case rule where the letter left of an upper-case one is lower-case). The loop's
    own code (`_o200k_region`) takes word runs after a lone apostrophe that follows a word (o200k's contractions
    glue to the word before, and a contraction's run may hold further starts) and upper-case letters after a B
    character (the case rule then looks past it); whitespace runs of 2+ and digit runs go through the scalar cuts as
    in cl100k; rare positions: a word run starting with a mark right after an other run (a mask), and '/' starting
    an other run after CR/LF that follows an other character or a mark (checked at each other run after CR/LF)."""
    c, feat, sb, rare = _borrowed(c), _borrowed(feat), _borrowed(sb), _borrowed(rare)     # (borrow.py)
    n = c.shape[0]
    words = (n + 63) >> 6
    _clear(sb)
    one = np.uint64(1)
    zero = np.uint64(0)
    nrare = 0
    owned = 0       # positions below are the loop's (_o200k_region)
    tmp = np.empty(0, np.bool_)
    lp = np_ = wp = op = spp = nlp = app = lowp = bp = zero     # the previous word's flags
    k0n = _bits64(feat, 0, 1)
    k1n = _bits64(feat, 0, 2)
    for g in range(words):
        base = g << 6
        k0, k1 = k0n, k1n
        if g + 1 < words:
            k0n = _bits64(feat, base + 64, 1)
            k1n = _bits64(feat, base + 64, 2)
        else:
            k0n = k1n = zero
        valid = ~zero if n - base >= 64 else (one << np.uint64(n - base)) - one
        lw = ~k0 & ~k1 & valid      # (the zero padding would read as word characters)
        nw = k0 & ~k1
        ww = ~k0 & k1
        ow = k0 & k1
        sp = _bits64(feat, base, OSP)
        nl = _bits64(feat, base, ONL)
        ap = _bits64(feat, base, OAP)
        up = _bits64(feat, base, OU)
        low = _bits64(feat, base, OLOW)
        mk = _bits64(feat, base, OM)
        bw = lw & ~up & ~low
        q_w = _next(ww, ~k0n & k1n)
        st, rs_l, rs_w, rs_o, _ = _cl100k_starts(lw, ww, ow, sp, nl, q_w, lp, wp, op, spp, nlp)
        rs_n = nw & ~_prev(nw, np_)
        st |= rs_n | (up & _prev(low, lowp))
        fix = (rs_w & q_w) | (rs_n & ~(~nw >> one)) | (rs_o & _prev(nl, nlp))
        fix |= (rs_l & _prev(ap, app) & ~_prev2(ow, op) & _prev2(lw, lp)) | (up & _prev(bw, bp))
        if owned > base:        # a region of the loop's reached into this word
            st &= zero if owned - base >= 64 else ~((one << np.uint64(owned - base)) - one)
        sb[g] |= st
        while fix != zero:
            h = base + np.int64(_trailing_zeros(fix))
            fix &= fix - one
            if h < owned:
                continue
            kind = feat[h] & 3
            if kind == 2:
                b = _kind_end(feat, n, h, 2)
                first, mid, last = _whitespace_run_cuts(c, h, b, h > 0 and (feat[h - 1] & 3) == 3, b == n, False)
                _set_cuts(sb, first, mid, last)
            elif kind == 1:
                _digit_groups(sb, h, _kind_end(feat, n, h, 1), 3)
            elif kind == 3:
                if c[h] == 47:      # `[\r\n/]*` may chain the CR/LF run into this '/': rare if it ends an other run
                    j = h - 1
                    while j >= 0 and (c[j] == 10 or c[j] == 13):
                        j -= 1
                    if j >= 0 and ((feat[j] & 3) == 3 or (feat[j] & OM) != 0):
                        rare[nrare] = h
                        nrare += 1
            else:
                if tmp.shape[0] < n:
                    tmp = np.empty(n, np.bool_)
                owned = _o200k_region(c, feat, n, h, sb, _borrowed(tmp), rare, nrare)
        marks = rs_l & mk & _prev(ow, op)
        while marks != zero:
            rare[nrare] = base + np.int64(_trailing_zeros(marks))
            nrare += 1
            marks &= marks - one
        lp, np_, wp, op, spp, nlp, app, lowp, bp = lw, nw, ww, ow, sp, nl, ap, low, bw
    return nrare


_set_bit = njit(cache=True, nogil=True, inline="always")(_set_bit)
_set_cuts = njit(cache=True, nogil=True, inline="always")(_set_cuts)
_prev = njit(cache=True, nogil=True, inline="always")(_prev)
_prev2 = njit(cache=True, nogil=True, inline="always")(_prev2)
_next = njit(cache=True, nogil=True, inline="always")(_next)
_clear = njit(cache=True, nogil=True, inline="always")(_clear)
_run_end = njit(cache=True, nogil=True, inline="always")(_run_end)
_digit_groups = njit(cache=True, nogil=True, inline="always")(_digit_groups)
_fold = njit(cache=True, nogil=True, inline="always")(_fold)
_contraction_end = njit(cache=True, nogil=True, inline="always")(_contraction_end)
_cl100k_starts = njit(cache=True, nogil=True, inline="always")(_cl100k_starts)
_gpt4_scalar = njit(cache=True, nogil=True, inline="always")(_gpt4_scalar)
_deepseek_scalar = njit(cache=True, nogil=True, inline="always")(_deepseek_scalar)
_gpt4_bits = njit(cache=True, nogil=True)(_gpt4_bits_impl)
_smollm2_bits = njit(cache=True, nogil=True)(_smollm2_bits_impl)
_deepseek_bits = njit(cache=True, nogil=True)(_deepseek_bits_impl)
_kind_end = njit(cache=True, nogil=True, inline="always")(_kind_end)
_o200k_region = njit(cache=True, nogil=True)(_o200k_region)
_o200k_bits = njit(cache=True, nogil=True)(_o200k_bits_impl)


BitsFn = Callable[[np.ndarray, np.ndarray, np.ndarray], "np.ndarray | None"]


def _o200k_run(c: np.ndarray, feat: np.ndarray, sb: np.ndarray) -> np.ndarray:
    rare = np.empty(c.shape[0] + 64, np.int64)
    return np.sort(rare[:_o200k_bits(c, feat, sb, rare)])


def bitmap_form(family: str) -> tuple[np.ndarray, BitsFn]:
    """(feature table, fn(code points as int32, their feature bytes + PAD zeros, bitmap)) of the family's bitmap
    pre-tokenizer with its flags bound; for o200k fn also returns the rare positions its rescan must visit (sorted),
    as pretokenize._o200k_loop finds them. The fused kernels call the kernels directly; this is the one place that
    says which table and kernel each loop's bitmap form is."""
    loop, args = loop_tables(family)
    engine = _family(family).engine
    if loop == "o200k":
        return o200k_feature_table(engine), _o200k_run
    if loop == "gpt4":
        digits, whole_at_end = args[1], args[2]
        return gpt4_feature_table(engine), lambda c, feat, sb: _gpt4_bits(c, feat, digits, whole_at_end, sb)
    if loop == "smollm2":
        return smollm2_feature_table(engine), lambda c, feat, sb: _smollm2_bits(c, feat, sb)
    if loop == "deepseek":
        return deepseek_feature_table(engine), lambda c, feat, sb: _deepseek_bits(c, feat, sb)
    raise ValueError(f"{family}: its pre-tokenizer loop {loop!r} has no bitmap form")
