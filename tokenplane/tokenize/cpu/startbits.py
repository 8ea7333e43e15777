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

smollm2, DeepSeek V4 and o200k get the same treatment from their own loops (`_smollm2_bits_impl` here,
deepseekbits.py and o200kbits.py say which of their rules are masks and which stay scalar); the masks and short
runs they share are in maskbits.py. Every full encode runs its family's bitmap form (o200k's followed, in the same
call, by the rescan of its rare shapes).

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
from .deepseekbits import _deepseek_bits, deepseek_feature_table
from .lazyjit import njit, numba_global  # numba itself only when a JIT kernel runs (lazyjit.py)
from .maskbits import (
    _cl100k_starts,
    _clear,
    _digit_groups,
    _digit_run,
    _next,
    _prev,
    _prev2,
    _run_end,
    _set_bit,
    _set_cuts,
    _ws_cuts,
    _ws_run,
)
from .o200kbits import _o200k_run, o200k_feature_table
from .pretokenize import _cp_kind_gpt4, _cp_kind_smollm2, _family, _whitespace_run_cuts, loop_tables

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
        if digits == 1:
            st |= nw
        else:
            st |= rs_n
        sb[g] |= st
        # whitespace and digit runs of 2+ from the masks while short (maskbits.py), each kind in its own loop (no
        # branch on the kind); longer ones and contractions take the loop's scalar code
        fix = rs_w & q_w
        while fix != zero:
            i = np.int64(_trailing_zeros(fix))
            fix &= fix - one
            a = base + i
            length, crlf = _ws_run(feat, base, i, ww, wnext, nl, FNL)
            if length > 0:
                at_end = a + length == n
                _ws_cuts(sb, a, length, crlf, a > 0 and (feat[a - 1] & FO) != 0, at_end, whole_at_end and at_end)
            else:
                _gpt4_scalar(c, feat, n, a, digits, whole_at_end, sb)
        fix = rs_n & ~(~nw >> one) if digits != 1 else zero     # runs of two or more digits (or into the next word)
        while fix != zero:
            i = np.int64(_trailing_zeros(fix))
            fix &= fix - one
            if not _digit_run(sb, base + i, i, nw, digits):
                _gpt4_scalar(c, feat, n, base + i, digits, whole_at_end, sb)
        fix = rs_l & opre & _prev(ap, app)
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


_fold = njit(cache=True, nogil=True, inline="always")(_fold)
_contraction_end = njit(cache=True, nogil=True, inline="always")(_contraction_end)
_gpt4_scalar = njit(cache=True, nogil=True, inline="always")(_gpt4_scalar)
_gpt4_bits = njit(cache=True, nogil=True)(_gpt4_bits_impl)
_smollm2_bits = njit(cache=True, nogil=True)(_smollm2_bits_impl)


BitsFn = Callable[[np.ndarray, np.ndarray, np.ndarray], "np.ndarray | None"]


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
