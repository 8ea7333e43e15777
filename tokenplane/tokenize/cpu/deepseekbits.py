"""DeepSeek V4's pre-tokenizer 64 characters at a time, as bit masks (startbits.py's method for its loop,
pretokenize._deepseek_loop).

A letter run glued to one ASCII punctuation mark (`[!-/:-@[-`{-~][A-Za-z]+`: its ASCII letters go with the mark) is
read from the masks too (`_glued_letters`): the run's end is the trailing ones of the letter word, its first
character that is no ASCII letter a trailing-zero count; a run of 64 characters or more takes the loop's code.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from ..spec import charclass
from .lazyjit import njit, numba_global  # numba itself only when a JIT kernel runs (lazyjit.py)
from .maskbits import (
    _clear,
    _digit_groups,
    _digit_run,
    _next,
    _prev,
    _prev2,
    _run_end,
    _set_bit,
    _set_cuts,
    _window,
    _ws_cuts,
    _ws_run,
)
from .pretokenize import _cp_feat_deepseek, _whitespace_run_cuts

_bits64 = numba_global("tokenplane.tokenize.cpu.simdbits", "bits64")
_borrowed = numba_global("tokenplane.tokenize.cpu.borrow", "borrowed")
_trailing_zeros = numba_global("numba.cpython.unsafe.numbers", "trailing_zeros")

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


def _glued_letters(sb, feat, base, i, lw, ln, cjk, cjkn, al):
    """_deepseek_scalar's letter run glued to one ASCII punctuation mark (it starts at a = base + i with an ASCII
    letter, so outside the CJK ranges) from the masks: the run is the letters from a that are not CJK (lw, cjk: this
    word's flags; ln, cjkn: the next word's), and its first character that is no ASCII letter (al) starts a piece.
    False where the run is 64 characters or longer (the caller runs the scalar code)."""
    r = np.uint64(i)
    run = _window(lw, ln, r) & ~_window(cjk, cjkn, r)
    if run == ~np.uint64(0):
        return False
    length = np.int64(_trailing_zeros(~run))
    ascii_letters = al >> r
    if i + length > 64:     # (the run reaches into the next word: it lies inside the text)
        ascii_letters = _window(al, _bits64(feat, base + 64, DAL), r)
    k = np.int64(_trailing_zeros(~ascii_letters))
    if k < length:
        _set_bit(sb, base + i + k)
    return True


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
        # whitespace and digit runs of 2+ from the masks while short (maskbits.py; on whitespace DAL marks CR/LF),
        # longer ones and letter runs glued to punctuation with the loop's scalar code
        fix = rs_w & _next(ww, wn)
        while fix != zero:
            i = np.int64(_trailing_zeros(fix))
            fix &= fix - one
            a = base + i
            length, crlf = _ws_run(feat, base, i, ww, wn, al, DAL)
            if length > 0:
                head = a == 0 or (feat[a - 1] & (DN | DCJK)) != 0
                b = a + length
                _ws_cuts(sb, a, length, crlf, not head and (feat[a - 1] & DPS) != 0,
                         b == n or (feat[b] & (DN | DCJK)) != 0, False)
            else:
                _deepseek_scalar(c, feat, n, a, sb)
        fix = nw & ~p_n & ~(~nw >> one)
        while fix != zero:
            i = np.int64(_trailing_zeros(fix))
            fix &= fix - one
            if not _digit_run(sb, base + i, i, nw, 3):
                _deepseek_scalar(c, feat, n, base + i, sb)
        fix = punct_glue
        while fix != zero:
            i = np.int64(_trailing_zeros(fix))
            fix &= fix - one
            if not _glued_letters(sb, feat, base, i, lw, ln, cjk, cjkn, al):
                _deepseek_scalar(c, feat, n, base + i, sb)
        lp, psp, wp, op, np_, cjkp, alp, app, hp = lw, ps, ww, ow, nw, cjk, al, ap, h


_deepseek_scalar = njit(cache=True, nogil=True, inline="always")(_deepseek_scalar)
_glued_letters = njit(cache=True, nogil=True, inline="always")(_glued_letters)
_deepseek_bits = njit(cache=True, nogil=True)(_deepseek_bits_impl)
