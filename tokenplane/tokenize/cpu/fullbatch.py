"""Many short texts in one compiled call: each text through the stages of its family's fused block kernel.

A batch of short texts (chat messages, tool results) spends most of a per-text `encode` around the encode itself:
the Python layers of the call and the unboxing of the block kernel's ~25 array arguments (~8.5 of ~10 us for a
110-character text). Here the texts are one str and a table of spans, and one call runs, on each span as a whole text
of its own (no lookahead: the span's end is a text end), the stages of the family's block kernel (fullencode.py:
code points and features, the bitmap pre-tokenizer, UTF-8 and piece bounds, the piece map walk) with the same
scratch arrays and the thread's piece map: the IDs of every text, back to back, and how many each produced. The
walk writes into the batch's output with one merge scratch for the whole call (piecemap._walk_into), so a text
allocates nothing: 0.82 -> 0.43 us of fixed cost a text (1-character texts, Xeon VM). The same stages as a text's own
encode (a text under a block's size is one block), so the same IDs; tests/test_tokenizer.py and
tests/test_aot_kernels.py check each batch text against its own encode. What a stage declines for a text (a byte
the vocabulary lacks) ends the call with that status, and the caller encodes the texts one by one.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import bpe as bpe_mod
from . import deepseekbits, o200k_rescan, o200kbits, startbits
from .fullencode import _block_start_bits, _pieces_utf8, block_tables, bound_kernel
from .lazyjit import njit, numba_global  # numba itself only when a JIT kernel runs (lazyjit.py)
from .piecemap import OK, OVERRUN, SURROGATE, _walk_into

_borrowed = numba_global("tokenplane.tokenize.cpu.borrow", "borrowed")
BatchFn = Callable[..., tuple[np.ndarray, np.ndarray, int]]


@njit(cache=True, nogil=True, inline="always")
def _start(spans):
    """The counts, a first output array (a token holds a byte at least: ASCII texts never grow it) and the longest
    span."""
    total = 0
    longest = 0
    for j in range(spans.shape[0]):
        total += spans[j, 1] - spans[j, 0]
        longest = max(longest, spans[j, 1] - spans[j, 0])
    return np.zeros(spans.shape[0], np.int64), np.empty(total + 16, np.int32), longest


# The four families' block kernels differ in their pre-tokenizer and its tables only: one batch kernel takes the
# union of the tables (`form` picks the pre-tokenizer; gpt4 reads the digit group and whole-run flags, o200k the
# class table of its rare shapes, the others neither) so one export serves every family.
FORMS = {"gpt4": 0, "deepseek": 1, "smollm2": 2, "o200k": 3}
_NO_CLASSES = np.zeros(0, np.uint16)


@njit(cache=True, nogil=True)
def _starts(form, cps, feat, sb, digits, whole_at_end, cls_table, rare):
    """The piece starts of cps into the bitmap sb by the form's pre-tokenizer, as the family's block kernel
    (fullencode._full_*) runs it: OK, or OVERRUN (o200k's rare-shape rescan; rare: >= len(cps) + 64 entries)."""
    c = cps.view(np.int32)
    if form == 0:
        startbits._gpt4_bits(c, feat, digits, whole_at_end, sb)
    elif form == 1:
        deepseekbits._deepseek_bits(c, feat, sb)
    elif form == 2:
        startbits._smollm2_bits(c, feat, sb)
    else:
        nr = o200kbits._o200k_bits(c, feat, sb, rare)
        if nr > 0 and o200k_rescan._rescan_bits(cps, cls_table, np.sort(rare[:nr]), sb) < 0:
            return OVERRUN
    return OK


# Arguments: the texts as one str, their spans | scratch (code points, features, starts, UTF-8, bounds), each long
# enough for the longest span | the form and the union of the families' tables | missing bytes, the BPE tables, the
# thread's piece map. Each text runs the stages of its family's block kernel (fullencode._full_* then _pieces_utf8)
# with its IDs written straight into the batch's output and one merge scratch for the whole batch: the block kernel
# allocates its output and scratch per call (~0.5 us of a short text). Arrays reach the stages as borrowed views
# (borrow.py): a call per text would otherwise count ~20 references in and out.
def _batch_impl(s, spans, cps, feat, starts, buf, bounds, form, feat_table, cls_table, digits, whole_at_end,
                has_missing, missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec,
                slots, arena, state, valid):
    cps, feat, starts, buf, bounds, feat_table = _borrowed(cps), _borrowed(feat), _borrowed(starts), \
        _borrowed(buf), _borrowed(bounds), _borrowed(feat_table)
    cls_table, missing, byte_ids, ptab, wkeys = _borrowed(cls_table), _borrowed(missing), _borrowed(byte_ids), \
        _borrowed(ptab), _borrowed(wkeys)
    wids, tok_flat, tok_off, wmap, slots = _borrowed(wids), _borrowed(tok_flat), _borrowed(tok_off), \
        _borrowed(wmap), _borrowed(slots)
    arena, state, btda, btrec, valid = _borrowed(arena), _borrowed(state), _borrowed(btda), _borrowed(btrec), \
        _borrowed(valid)
    end = s[:0]     # no lookahead: a span ends its text (an empty str of the text's type, not a literal)
    s = _borrowed(s)
    counts, out, longest = _start(spans)
    ms = np.empty(5 * 64, np.int32)
    heap = np.empty(3 * 64, np.int64)
    rare = np.empty(longest + 66 if form == 3 else 0, np.int64)
    o = 0
    for j in range(spans.shape[0]):
        a, b = spans[j, 0], spans[j, 1]
        n = b - a
        if n == 0:
            continue
        c, f, sb, bad, bf, bd, size, wide_pos, wide_add, nw = _block_start_bits(s, a, b, end, cps, feat, starts,
                                                                                feat_table, buf, bounds)
        if bad >= 0:
            return out[:0], counts, SURROGATE
        if _starts(form, c, f, sb, digits, whole_at_end, cls_table, _borrowed(rare)) != OK:
            return out[:0], counts, OVERRUN
        bf, bd, nb, _ = _pieces_utf8(c, n, sb, bf, bd, size, wide_pos, wide_add, nw)
        size = bd[nb - 1]
        if o + size + 16 > out.shape[0]:
            grown = np.empty(max(2 * out.shape[0], o + size + 16), np.int32)
            grown[:o] = out[:o]
            out = grown
        end_o, status = _walk_into(bf, bd, nb, _borrowed(out), o, _borrowed(ms), _borrowed(heap), has_missing,
                                   missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat, tok_off, wmap, btda,
                                   btrec, slots, arena, state, valid)
        if status != OK:
            return out[:0], counts, status
        counts[j] = end_o - o
        o = end_o
    return out[:o], counts, OK


_batch = njit(cache=True, nogil=True)(_batch_impl)


def _union(family: str) -> tuple[str, tuple[Any, ...]]:
    """The batch export and its family arguments: the form, then the union of the block kernels' tables."""
    loop, fam_args = block_tables(family)
    if loop == "gpt4":
        feat_table, digits, whole_at_end = fam_args
        return "batch", (FORMS[loop], feat_table, _NO_CLASSES, digits, whole_at_end)
    cls_table = fam_args[1] if loop == "o200k" else _NO_CLASSES
    return "batch", (FORMS[loop], fam_args[0], cls_table, 0, False)


def batch_encoder(bpe: bpe_mod.BPE, family: str) -> BatchFn:
    """The batch kernel for `family` with `bpe`'s tables and the calling thread's piece map bound
    (fullencode.bound_kernel): fn(text, spans int64[k, 2], cps, kind, starts, buf, bounds) -> (IDs int32 of every
    span back to back, int64 count per span, status)."""
    fn: BatchFn = bound_kernel(bpe, "batch:" + family, 7, lambda: _union(family))
    return fn


__all__ = ["batch_encoder"]
