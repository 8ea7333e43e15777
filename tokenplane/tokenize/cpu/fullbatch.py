"""Many short texts in one compiled call: each text through the fused block kernel of its family (fullencode.py).

A batch of short texts (chat messages, tool results) spends most of a per-text `encode` around the encode itself:
the Python layers of the call and the unboxing of the block kernel's ~25 array arguments (~8.5 of ~10 us for a
110-character text). Here the texts are one str and a table of spans, and one call runs the family's fused block
kernel on each span as a whole text of its own (no lookahead: the span's end is a text end), with the same scratch
arrays and the thread's piece map: the IDs of every text, back to back, and how many each produced. The same kernel
as a text's own encode (a text under a block's size is one block), so the same IDs; tests/test_tokenizer.py and
tests/test_aot_kernels.py check each batch text against its own encode. What the block kernel declines for a text
(a byte the vocabulary lacks) ends the call with that status, and the caller encodes the texts one by one.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import bpe as bpe_mod
from .fullencode import _full_deepseek, _full_gpt4, _full_o200k, _full_smollm2, block_tables, bound_kernel
from .lazyjit import njit, numba_global  # numba itself only when a JIT kernel runs (lazyjit.py)
from .piecemap import OK

_borrowed = numba_global("tokenplane.tokenize.cpu.borrow", "borrowed")
BatchFn = Callable[..., tuple[np.ndarray, np.ndarray, int]]


@njit(cache=True, nogil=True, inline="always")
def _take(out, o, ids):
    """ids appended to out at o (out doubled when short): (out, new o)."""
    m = ids.shape[0]
    if o + m > out.shape[0]:
        grown = np.empty(max(2 * out.shape[0], o + m), np.int32)
        grown[:o] = out[:o]
        out = grown
    out[o:o + m] = ids
    return out, o + m


@njit(cache=True, nogil=True, inline="always")
def _start(spans):
    """The counts and a first output array (a token holds a byte at least: ASCII texts never grow it)."""
    total = 0
    for j in range(spans.shape[0]):
        total += spans[j, 1] - spans[j, 0]
    return np.zeros(spans.shape[0], np.int64), np.empty(total + 16, np.int32)


# The four families' block kernels differ in their family arguments only: one batch kernel takes their union
# (`form` picks the kernel; gpt4 reads the digit group and whole-run flags, o200k the class table of its rare
# shapes, the others neither) so one export serves every family.
FORMS = {"gpt4": 0, "deepseek": 1, "smollm2": 2, "o200k": 3}
_NO_CLASSES = np.zeros(0, np.uint16)


# Arguments: the texts as one str, their spans | scratch (code points, features, starts, UTF-8, bounds) | the form
# and the union of the families' tables | missing bytes, the BPE tables, the thread's piece map. The arrays go to the
# block kernel as borrowed views (borrow.py): a call per text would otherwise count ~20 references in and out.
def _batch_impl(s, spans, cps, feat, starts, buf, bounds, form, feat_table, cls_table, digits, whole_at_end,
                has_missing, missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat, tok_off, wmap, slots, arena,
                state):
    cps, feat, starts, buf, bounds, feat_table = _borrowed(cps), _borrowed(feat), _borrowed(starts), \
        _borrowed(buf), _borrowed(bounds), _borrowed(feat_table)
    cls_table, missing, byte_ids, ptab, wkeys = _borrowed(cls_table), _borrowed(missing), _borrowed(byte_ids), \
        _borrowed(ptab), _borrowed(wkeys)
    wids, tok_flat, tok_off, wmap, slots = _borrowed(wids), _borrowed(tok_flat), _borrowed(tok_off), \
        _borrowed(wmap), _borrowed(slots)
    arena, state = _borrowed(arena), _borrowed(state)
    counts, out = _start(spans)
    end = s[:0]     # no lookahead: a span ends its text (an empty str of the text's type, not a literal)
    o = 0
    for j in range(spans.shape[0]):
        a, b = spans[j, 0], spans[j, 1]
        if form == 0:
            ids, status = _full_gpt4(s, a, b, end, cps, feat, starts, buf, bounds, feat_table, digits, whole_at_end,
                                     has_missing, missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat,
                                     tok_off, wmap, slots, arena, state)
        elif form == 1:
            ids, status = _full_deepseek(s, a, b, end, cps, feat, starts, buf, bounds, feat_table, has_missing,
                                         missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat, tok_off, wmap,
                                         slots, arena, state)
        elif form == 2:
            ids, status = _full_smollm2(s, a, b, end, cps, feat, starts, buf, bounds, feat_table, has_missing,
                                        missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat, tok_off, wmap,
                                        slots, arena, state)
        else:
            ids, status = _full_o200k(s, a, b, end, cps, feat, starts, buf, bounds, feat_table, cls_table,
                                      has_missing, missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat,
                                      tok_off, wmap, slots, arena, state)
        if status != OK:
            return out[:0], counts, status
        out, o = _take(out, o, ids)
        counts[j] = ids.shape[0]
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
