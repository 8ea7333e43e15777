"""Many ordinary segments of one text, each encoded as a text of its own, in one BPE call.

A session's repair window, like a rendered chat prompt, is ordinary text cut by special-token literals: a turn of
an agent conversation is five or so short segments ("assistant\\n", the answer, "\\n", "user\\n" + the tool output,
...). Encoded one by one, each segment pays the whole call chain (code points, pre-tokenizer, UTF-8 + piece bounds,
BPE, then the character ends of its tokens): ~20 us of dispatch and numpy glue each, more than the BPE of a typical
segment. Here the pre-tokenizer still runs on each segment alone (its matches must not see across a literal), but
the pieces of all segments go to BPE together, and the character ends of every token come from one pass.

The IDs are the serial encoder's: a piece's tokens depend only on the piece's bytes, and the pieces are exactly each
segment's own pieces.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from . import pretokenize, strbuf
from .bpe import BPE, DroppedBytes


def encode_segments(bpe: BPE, family: str, token_lengths: np.ndarray, text: str,
                    spans: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """For non-empty, sorted, disjoint character spans of `text` (normalized, validated): the IDs of every
    text[a:b] encoded on its own, concatenated (uint32), each token's end in characters of `text` (int64), and how
    many tokens each span produced. None when some span holds a byte the vocabulary lacks (the caller encodes such
    text through the reference)."""
    lo, hi = spans[0][0], spans[-1][1]
    window = strbuf.codepoints(text, lo, hi)
    lengths = np.array([b - a for a, b in spans], dtype=np.int64)
    total = int(lengths.sum())
    cps = np.empty(total, dtype=np.uint32)
    starts = np.empty(total, dtype=np.bool_)
    pos = 0
    for a, b in spans:
        part = window[a - lo:b - lo]
        cps[pos:pos + b - a] = part
        starts[pos:pos + b - a] = pretokenize.piece_starts(family, part)
        starts[pos] = True          # a segment is a text of its own: its first character starts a piece
        pos += b - a
    buf, bounds = strbuf.utf8_and_bounds(cps, total, starts)
    try:
        ids = bpe.encode_bytes(buf, bounds).view(np.uint32)
    except DroppedBytes:
        return None
    byte_ends = np.cumsum(token_lengths[ids], dtype=np.int64)
    if buf.shape[0] == total:                       # ASCII: one byte per character
        char_ends = byte_ends
    else:
        width = 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
        char_starts = np.cumsum(width) - width
        # characters that start before a token's byte end: a token ending inside a character covers it
        char_ends = np.searchsorted(char_starts, byte_ends, side="left")
    span_ends = np.cumsum(lengths)
    which = np.searchsorted(span_ends, char_ends, side="left")
    shift = np.array([a for a, _ in spans], dtype=np.int64) - (span_ends - lengths)
    return ids, char_ends + shift[which], np.bincount(which, minlength=len(spans))


__all__ = ["encode_segments"]
