"""The masks the bitmap pre-tokenizers share (startbits.py, deepseekbits.py, o200kbits.py), and the short runs they
read from them.

Neighbour flags (p: the character left of each position, p2: two left, q: the one right) carry across words through
the previous and next word's flags; the cl100k masks serve the gpt4 kernel and o200k's (o200k's word prefix is
cl100k's letter prefix).

A whitespace run of two or more characters and a digit run of two or more take code of their own in every loop of
pretokenize.py: the whitespace cuts (`_whitespace_run_cuts`: CR/LF absorbed by the punctuation piece before, a piece
after the last CR/LF, `\\s+(?!\\S)` leaving the last character to the next piece) and the digit groups of
`\\p{N}{1,3}`. The bitmap kernels called that code with a run's start, and it found the run's end, its first
character that is not CR/LF and its last CR/LF by loops over the feature bytes, one load-compare a character with an
exit that mispredicts once a run: on 1M characters of python source (cl100k, 23K whitespace runs of 2+, mostly
indentation) those calls were 0.8 of the kernel's 1.0 ms. Here a run shorter than 64 characters is read from the
masks the kernel already holds: its length is the trailing ones of the whitespace word from its start, its CR/LF
characters one shifted word, its first non-CR/LF character a trailing-zero count and its last CR/LF a leading-zero
count, and the three cuts are bits selected into one word (`_ws_cuts`). The cuts are the same function of the same
characters (tests/test_startbits.py compares the kernels with the loops); a longer run still takes the loop's code.
The kernel alone on 1M characters (scratch timing, medians of 25, old and new revisions in alternated processes):
cl100k english 0.62 -> 0.40 ms, code 1.02 -> 0.43; DeepSeek (with its glued letters, deepseekbits.py) english
0.96 -> 0.51, code 1.78 -> 0.63; o200k (its fix-ups in one loop per kind, o200kbits.py) english 1.36-1.46 -> 0.62,
code 1.70 -> 0.62-0.66.
"""

from __future__ import annotations

import numpy as np

from .lazyjit import njit, numba_global  # numba itself only when a JIT kernel runs (lazyjit.py)

_bits64 = numba_global("tokenplane.tokenize.cpu.simdbits", "bits64")
_trailing_zeros = numba_global("numba.cpython.unsafe.numbers", "trailing_zeros")
_leading_zeros = numba_global("numba.cpython.unsafe.numbers", "leading_zeros")


def _window(x, xn, r):
    """64 flags from bit r of the word x on, continued by the next word xn (r < 64; two shifts, as a shift by 64 is
    undefined)."""
    return (x >> r) | ((xn << np.uint64(1)) << (np.uint64(63) - r))


def _ws_run_impl(feat, base, i, ww, wn, nl, nl_flag):
    """(L, its CR/LF bits) of the whitespace run that starts at base + i (i < 64): ww and wn the whitespace flags of
    this word and the next, nl this word's CR/LF flags (the next word's read from `feat`, flag `nl_flag`, only when
    the run reaches into it: it then lies inside the text). L = 0 for a run of 64 characters or more (the caller
    takes the scalar code)."""
    r = np.uint64(i)
    run = _window(ww, wn, r)
    if run == ~np.uint64(0):
        return 0, np.uint64(0)
    length = np.int64(_trailing_zeros(~run))
    crlf = nl >> r
    if i + length > 64:
        crlf = _window(nl, _bits64(feat, base + 64, nl_flag), r)
    return length, crlf & ((np.uint64(1) << np.uint64(length)) - np.uint64(1))


def _ws_cuts_impl(sb, a, length, crlf, absorbed, at_end, keep_whole):
    """pretokenize._whitespace_run_cuts of the run [a, a + length) whose CR/LF characters are the bits of `crlf`
    (bit k: a + k), written into the bitmap: the first character that the punctuation before does not absorb, the
    one after the last CR/LF (unless the run stays whole), and the last one when a non-space follows. The three
    tests select bits of one word instead of branching (their outcomes vary run by run)."""
    one = np.uint64(1)
    s0 = np.int64(_trailing_zeros(~(crlf & -np.uint64(absorbed))))     # (0 when not absorbed; bits >= length clear)
    k = 63 - np.int64(_leading_zeros(crlf))      # the last CR/LF, -1 when none
    cuts = np.uint64(s0 < length) << np.uint64(s0 & 63)
    mid = (k >= 0) & (not keep_whole) & (k + 1 < length) & (k + 1 > s0)
    cuts |= np.uint64(mid) << np.uint64((k + 1) & 63)
    last = (not at_end) & (length - 1 > s0) & (((crlf >> np.uint64(length - 1)) & one) == 0)
    cuts |= np.uint64(last) << np.uint64(length - 1)
    r = np.uint64(a & 63)
    sb[a >> 6] |= cuts << r
    high = (cuts >> one) >> (np.uint64(63) - r)
    if high != np.uint64(0):
        sb[(a >> 6) + 1] |= high


def _digit_run_impl(sb, a, i, nw, size):
    """The digit groups of `\\p{N}{1,size}` in the digit run at a = base + i, read from this word's digit flags nw:
    False where the run reaches the word's end (the caller finds its end)."""
    rest = ~nw >> np.uint64(i)          # (zeros shift in at the top: a run to the word's end leaves no bit)
    if rest == np.uint64(0):
        return False
    b = a + np.int64(_trailing_zeros(rest))
    for j in range(a + size, b, size):
        _set_bit(sb, j)
    return True


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


_window = njit(cache=True, nogil=True, inline="always")(_window)
_ws_run = njit(cache=True, nogil=True, inline="always")(_ws_run_impl)
_ws_cuts = njit(cache=True, nogil=True, inline="always")(_ws_cuts_impl)
_digit_run = njit(cache=True, nogil=True, inline="always")(_digit_run_impl)
_set_bit = njit(cache=True, nogil=True, inline="always")(_set_bit)
_set_cuts = njit(cache=True, nogil=True, inline="always")(_set_cuts)
_prev = njit(cache=True, nogil=True, inline="always")(_prev)
_prev2 = njit(cache=True, nogil=True, inline="always")(_prev2)
_next = njit(cache=True, nogil=True, inline="always")(_next)
_clear = njit(cache=True, nogil=True, inline="always")(_clear)
_run_end = njit(cache=True, nogil=True, inline="always")(_run_end)
_digit_groups = njit(cache=True, nogil=True, inline="always")(_digit_groups)
_cl100k_starts = njit(cache=True, nogil=True, inline="always")(_cl100k_starts)
