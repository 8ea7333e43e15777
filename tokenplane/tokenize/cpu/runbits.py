"""Run ends of a pre-tokenizer loop taken in order from a bitmap of run starts (the gpt4, smollm2 and DeepSeek loops
of pretokenize.py).

A loop over runs used to find each run's end by scanning its characters: one load-compare chain a run, whose exit
mispredicted once a run. Here the bitmap is built first, 8 characters a step from whole words with no dependence
between words, and the loop takes the next run start with tzcnt and clears it: finding a run's end no longer waits
on the kinds' loads. Loops alone on 1M characters, same starts (docs/pretokenizer.md): gpt4 1.13-1.17x for an 8-at-a-
time scan then 1.12-1.29x for the bitmap, smollm2 1.34-1.62x, DeepSeek 1.27-1.47x.
"""

from __future__ import annotations

import numpy as np

from .lazyjit import njit, numba_global  # numba itself only when a JIT kernel runs (lazyjit.py)

_trailing_zeros = numba_global("numba.cpython.unsafe.numbers", "trailing_zeros")


def _run_bits_impl(kind, n, segments):
    """uint64 bitmap of run starts: bit i set where a run starts at i (0 < i < n), and bit n. A run is a stretch of
    one kind; with `segments` (the DeepSeek loop, `kind` = its feature bytes) it is one kind (feat & 7) inside one
    stage-1/2 segment (`_ds_seg_head`: a CJK-range edge, bit 8, between two non-digits; digit runs, kind 4, are edges
    already). Built eight characters at a time from whole words, no dependence between words: a byte's flag is
    nonzero exactly where its high bit is set after adding 0x7F (the flags are < 0x80: no carry crosses a byte), and
    a multiply gathers the eight high bits into one byte (each lands on its own bit: no two products share one)."""
    rb = np.zeros((n >> 6) + 1, np.uint64)
    n8 = n >> 3
    k64 = kind[:n8 << 3].view(np.uint64)
    low = np.uint64(0x7F7F7F7F7F7F7F7F)
    high = np.uint64(0x8080808080808080)
    gather = np.uint64(0x0102040810204080)
    for g in range(n8):
        w = k64[g]
        carry = k64[g - 1] >> np.uint64(56) if g > 0 else w & np.uint64(0xFF)
        x = w ^ ((w << np.uint64(8)) | carry)        # each byte: its kind ^ the previous character's
        if segments:
            edge = ((x & np.uint64(0x0707070707070707)) + low) & high
            cjk = ((x & np.uint64(0x0808080808080808)) + low) & high
            not_digit = (((w & np.uint64(0x0707070707070707)) ^ np.uint64(0x0404040404040404)) + low) & high
            nz = edge | (cjk & not_digit)
        else:
            nz = (x + low) & high
        rb[g >> 3] |= (((nz >> np.uint64(7)) * gather) >> np.uint64(56)) << np.uint64(8 * (g & 7))
    for i in range(max(n8 << 3, 1), n):       # the last n % 8 characters: the same flags one at a time
        x = kind[i] ^ kind[i - 1]
        if ((x & 7) != 0 or ((x & 8) != 0 and (kind[i] & 7) != 4)) if segments else x != 0:
            rb[i >> 6] |= np.uint64(1) << np.uint64(i & 63)
    rb[n >> 6] |= np.uint64(1) << np.uint64(n & 63)
    return rb


def _next_run_impl(rb, wi, cur):
    """(the next run start after the last one taken, word index, remaining bits of that word): run ends are taken
    in order from the bitmap, so finding one does not wait on the kinds' loads (the loop's run scan was one serial
    load-compare chain per run)."""
    while cur == np.uint64(0):
        wi += 1
        cur = rb[wi]
    b = (wi << 6) + np.int64(_trailing_zeros(cur))
    return b, wi, cur & (cur - np.uint64(1))


_run_bits = njit(cache=True, nogil=True, inline="always")(_run_bits_impl)
_next_run = njit(cache=True, nogil=True, inline="always")(_next_run_impl)
