"""o200k_base's pre-tokenizer 64 characters at a time, as bit masks (startbits.py's method for its loop,
pretokenize._o200k_loop), with the rare positions the rescan (o200k_rescan.py) must visit.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from ..spec import charclass
from .lazyjit import njit, numba_global  # numba itself only when a JIT kernel runs (lazyjit.py)
from .maskbits import (
    _cl100k_starts,
    _clear,
    _digit_groups,
    _digit_run,
    _next,
    _prev,
    _prev2,
    _set_cuts,
    _ws_cuts,
    _ws_run,
)
from .pretokenize import _cp_kind_o200k, _o200k_runs, _whitespace_run_cuts

_bits64 = numba_global("tokenplane.tokenize.cpu.simdbits", "bits64")
_borrowed = numba_global("tokenplane.tokenize.cpu.borrow", "borrowed")
_trailing_zeros = numba_global("numba.cpython.unsafe.numbers", "trailing_zeros")

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
        if owned > base:        # a region of the loop's reached into this word
            st &= zero if owned - base >= 64 else ~((one << np.uint64(owned - base)) - one)
        sb[g] |= st
        # whitespace and digit runs of 2+ from the masks while short (maskbits.py), each kind in its own loop; no
        # region of the loop's holds either (a region is word runs and apostrophes), so they need no `owned` test
        fix = rs_w & q_w
        while fix != zero:
            i = np.int64(_trailing_zeros(fix))
            fix &= fix - one
            h = base + i
            length, crlf = _ws_run(feat, base, i, ww, ~k0n & k1n, nl, ONL)
            absorbed = h > 0 and (feat[h - 1] & 3) == 3
            if length > 0:
                _ws_cuts(sb, h, length, crlf, absorbed, h + length == n, False)
            else:
                b = _kind_end(feat, n, h, 2)
                first, mid, last = _whitespace_run_cuts(c, h, b, absorbed, b == n, False)
                _set_cuts(sb, first, mid, last)
        fix = rs_n & ~(~nw >> one)
        while fix != zero:
            i = np.int64(_trailing_zeros(fix))
            fix &= fix - one
            if not _digit_run(sb, base + i, i, nw, 3):
                _digit_groups(sb, base + i, _kind_end(feat, n, base + i, 1), 3)
        fix = (rs_o & _prev(nl, nlp)) | (rs_l & _prev(ap, app) & ~_prev2(ow, op) & _prev2(lw, lp))
        fix |= up & _prev(bw, bp)
        while fix != zero:
            h = base + np.int64(_trailing_zeros(fix))
            fix &= fix - one
            if h < owned:
                continue
            if (feat[h] & 3) == 3:
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


_kind_end = njit(cache=True, nogil=True, inline="always")(_kind_end)
_o200k_region = njit(cache=True, nogil=True)(_o200k_region)
_o200k_bits = njit(cache=True, nogil=True)(_o200k_bits_impl)


def _o200k_run(c: np.ndarray, feat: np.ndarray, sb: np.ndarray) -> np.ndarray:
    rare = np.empty(c.shape[0] + 64, np.int64)
    return np.sort(rare[:_o200k_bits(c, feat, sb, rare)])
