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

import bisect
from typing import Sequence

import numpy as np

from . import kernels, strbuf
from . import pretokenize as pt
from .bpe import BPE, DroppedBytes
from .lazyjit import njit  # numba itself only when a JIT kernel runs (lazyjit.py)
from .window import NO_SPANS, OK, window_encoder

MAX_CHARS = 256 * 1024   # longer texts take the encoder's own (chunk-parallel) path


@njit(cache=True, nogil=True)
def _gather(window, lo, spans, cps):
    # the spans' code points, back to back
    pos = 0
    for k in range(spans.shape[0]):
        for i in range(spans[k, 0], spans[k, 1]):
            cps[pos] = window[i - lo]
            pos += 1


@njit(cache=True, nogil=True)
def _token_ends(ids, tok_off, cps, spans, ends, counts):
    # Each token's end in characters of the text: walk the tokens' byte ends and the characters' UTF-8 widths
    # together (a token ending inside a character covers it), moving to the next span at each span's end.
    k = 0
    span_end = spans[0, 1] - spans[0, 0]     # in characters of the gathered spans
    shift = spans[0, 0]
    c = 0                                    # characters consumed
    c_byte = 0                               # byte offset where character c starts
    byte_end = 0
    for j in range(ids.shape[0]):
        byte_end += tok_off[ids[j] + 1] - tok_off[ids[j]]
        while c_byte < byte_end:
            x = cps[c]
            c_byte += 1 + (x >= 0x80) + (x >= 0x800) + (x >= 0x10000)
            c += 1
        while c > span_end:
            k += 1
            shift = spans[k, 0] - span_end
            span_end += spans[k, 1] - spans[k, 0]
        ends[j] = c + shift
        counts[k] += 1


# The family pre-tokenizer loops, run on every span of the gathered code points in one compiled call (the loops
# are the ones `pretokenize.piece_starts` runs on a whole text; each span is passed as its own text).
@njit(cache=True, nogil=True)
def _spans_gpt4(c, kind, digits, whole_at_end, starts, bounds):
    for k in range(bounds.shape[0] - 1):
        a, b = bounds[k], bounds[k + 1]
        pt._gpt4_loop(c[a:b], kind[a:b], digits, whole_at_end, starts[a:b])


@njit(cache=True, nogil=True)
def _spans_deepseek(c, feat, starts, bounds):
    for k in range(bounds.shape[0] - 1):
        a, b = bounds[k], bounds[k + 1]
        pt._deepseek_loop(c[a:b], feat[a:b], starts[a:b])


@njit(cache=True, nogil=True)
def _spans_smollm2(c, kind, starts, bounds):
    for k in range(bounds.shape[0] - 1):
        a, b = bounds[k], bounds[k + 1]
        pt._smollm2_loop(c[a:b], kind[a:b], starts[a:b])


def span_starts(family: str, cps: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """bool[len(cps)]: the piece starts of every cps[bounds[k]:bounds[k+1]] pre-tokenized as a text of its own
    (bounds: int64, 0 = bounds[0] < ... < bounds[-1] = len(cps)); equals concatenating `piece_starts` of each."""
    fam = pt._family(family)
    c = cps.view(np.int32)
    starts = np.zeros(cps.shape[0], dtype=np.bool_)
    k = kernels.get()
    if fam.name in pt._GPT4:
        digits, whole = pt._GPT4[fam.name]
        k.spans_gpt4(c, k.gather_i8(pt._cp_kind_gpt4(fam.engine), cps), digits, whole, starts, bounds)
    elif fam.name == "deepseek_v4":
        k.spans_deepseek(c, k.gather_u8(pt._cp_feat_deepseek(fam.engine), cps), starts, bounds)
    elif fam.name == "smollm2":
        k.spans_smollm2(c, k.gather_i8(pt._cp_kind_smollm2(fam.engine), cps), starts, bounds)
    else:       # o200k_base: its loop hands rare cases to a numpy rescan; span by span
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            starts[a:b] = pt.piece_starts(fam, cps[a:b])
    starts[bounds[:-1]] = True      # a segment is a text of its own: its first character starts a piece
    return starts


def encode_segments(bpe: BPE, family: str, text: str, spans: Sequence[tuple[int, int]], *,
                    tc: np.ndarray | None = None, shift: int = 0
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """For non-empty, sorted, disjoint character spans of `text` (normalized, validated): the IDs of every
    text[a:b] encoded on its own, concatenated (uint32), each token's end in characters of `text` plus `shift`
    (int64), and how many tokens each span produced. None when some span holds a byte the vocabulary lacks (the
    caller encodes such text through the reference). `tc`: the vocabulary's token_chars, which enables the fused
    one-call kernel (window.py; the staged calls below answer what it leaves)."""
    if tc is not None:
        fn = window_encoder(bpe, family, tc)
        if len(spans) == 1:
            ids, ends, counts, status = fn(text, spans[0][0], spans[0][1], NO_SPANS, shift)
        else:
            ids, ends, counts, status = fn(text, 0, 0, np.array(spans, dtype=np.int64), shift)
        if status == OK:
            return ids, ends, counts
    lo, hi = spans[0][0], spans[-1][1]
    window = strbuf.codepoints(text, lo, hi)
    bounds_arr = np.array(spans, dtype=np.int64)
    if len(spans) == 1:     # a session's window without literals: no gather, no per-span arithmetic
        cps, total = window, hi - lo
        offsets = np.array((0, total), dtype=np.int64)
    else:
        widths = bounds_arr[:, 1] - bounds_arr[:, 0]
        total = int(widths.sum())
        cps = np.empty(total, dtype=np.uint32)
        kernels.get().seg_gather(window, lo, bounds_arr, cps)
        offsets = np.zeros(len(spans) + 1, dtype=np.int64)
        np.cumsum(widths, out=offsets[1:])
    starts = span_starts(family, cps, offsets)
    buf, piece_bounds = strbuf.utf8_and_bounds(cps, total, starts)
    try:
        ids = bpe.encode_bytes(buf, piece_bounds).view(np.uint32)
    except DroppedBytes:
        return None
    ends = np.empty(ids.shape[0], dtype=np.int64)
    counts = np.zeros(len(spans), dtype=np.int64)
    if ids.shape[0]:
        kernels.get().token_ends(ids, bpe.tok_off, cps, bounds_arr, ends, counts)
    if shift:
        ends += shift
    return ids, ends, counts


@njit(cache=True, nogil=True)
def _interleave(ids, ends, at, lit_ids, lit_ends, out_ids, out_ends):
    # literal j goes before ordinary record at[j] (at is non-decreasing; equal entries keep the literals' order)
    i = 0
    o = 0
    for j in range(at.shape[0]):
        while i < at[j]:
            out_ids[o] = ids[i]
            out_ends[o] = ends[i]
            i += 1
            o += 1
        out_ids[o] = lit_ids[j]
        out_ends[o] = lit_ends[j]
        o += 1
    while i < ids.shape[0]:
        out_ids[o] = ids[i]
        out_ends[o] = ends[i]
        i += 1
        o += 1


def with_literals(ids: np.ndarray, ends: np.ndarray, counts: Sequence[int] | np.ndarray,
                  spans: Sequence[tuple[int, int]], literals: Sequence[tuple[int, int, int]], shift: int = 0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The records of a text cut by literals: the ordinary spans' records (ids, ends, token count per span) with
    each literal (start, end, id) inserted as one token ending at its end (+ shift), in text order."""
    if not literals:
        return ids, ends
    if len(literals) <= _FEW_LITERALS:
        return _with_few_literals(ids, ends, counts, spans, literals, shift)
    span_ends = [b for _, b in spans]
    before = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
    at = before[[bisect.bisect_right(span_ends, a) for a, _, _ in literals]]
    out_ids = np.empty(ids.shape[0] + len(literals), dtype=np.uint32)
    out_ends = np.empty(out_ids.shape[0], dtype=np.int64)
    kernels.get().interleave(ids, ends, at, np.array([sid for _, _, sid in literals], dtype=np.uint32),
                np.array([b + shift for _, b, _ in literals], dtype=np.int64), out_ids, out_ends)
    return out_ids, out_ends


# A chat turn's window holds ~4 literals (<|im_end|>, <|im_start|> twice): copying the runs between them with slice
# assignments is a handful of numpy calls, where the interleave kernel's path (a cumsum, a fancy index, two small
# arrays and the kernel's argument guard) cost ~4x as much once the caches went cold between two turns.
_FEW_LITERALS = 16


def _with_few_literals(ids: np.ndarray, ends: np.ndarray, counts: Sequence[int] | np.ndarray,
                       spans: Sequence[tuple[int, int]], literals: Sequence[tuple[int, int, int]], shift: int
                       ) -> tuple[np.ndarray, np.ndarray]:
    """with_literals by slices: literal j goes after the tokens of every span ending at or before its start (the
    kernel path's bisect_right over the span ends; literals and spans are both in text order)."""
    cnt = counts.tolist() if isinstance(counts, np.ndarray) else list(counts)
    n = ids.shape[0]
    out_ids = np.empty(n + len(literals), dtype=np.uint32)
    out_ends = np.empty(n + len(literals), dtype=np.int64)
    i = o = si = before = 0
    ns = len(spans)
    for a, b, sid in literals:
        while si < ns and spans[si][1] <= a:
            before += cnt[si]
            si += 1
        if before > i:
            out_ids[o:o + before - i] = ids[i:before]
            out_ends[o:o + before - i] = ends[i:before]
            o += before - i
            i = before
        out_ids[o] = sid
        out_ends[o] = b + shift
        o += 1
    if i < n:
        out_ids[o:] = ids[i:]
        out_ends[o:] = ends[i:]
    return out_ids, out_ends


__all__ = ["encode_segments", "span_starts", "with_literals"]
