"""A session's repair window encoded in one compiled call: str -> (IDs, character ends, tokens per span).

The staged path (segments.encode_segments) runs the window through six kernel calls (code points, feature gather,
pre-tokenizer loop, UTF-8 + piece bounds, BPE, token ends) with Python and numpy glue between them. On real agent
traces a window is ~1.6K characters (P50) and the glue (argument guards, small-array allocations, slicing) cost as
much as the kernels themselves (benchmarks/session_repair.py, per-call fixed cost). Here the same kernels run back
to back inside one compiled function per pre-tokenizer family, with their constant tables bound once per thread
(kernels.bind: the guard then checks only the per-call arguments).

The same code points, the same pre-tokenizer loops on each span alone, the same piece bounds; the pieces go
through the calling thread's piece map (piecemap.py), the cache its full encodes fill, so a session's windows find
the pieces its `sync` of the whole context saw (the staged path keeps bpe.py's piece tiers). Token ends: each
token moves the character count by the characters its bytes start (the vocabulary's `token_chars`), which is what
the staged path's byte walk computes for valid UTF-8 (a token ending inside a character covers it; the token
holding the rest starts no character).
Whatever the common case does not cover answers a nonzero status and the caller runs the staged path: a lone
surrogate (it raises there), a byte the vocabulary lacks, an o200k window whose rare-shape matcher overran (the
staged path raises; o200k's rare shapes are rescanned here by the compiled matcher, o200k_rescan._rescan_mask).
tests/test_aot_kernels.py checks fused == staged == reference, AOT and JIT, for every family.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from . import bpe as bpe_mod
from . import kernels, o200k_rescan, piecemap, strbuf
from . import pretokenize as pt
from .fullencode import _pad, binding, still_bound
from .lazyjit import njit  # numba itself only when a JIT kernel runs (lazyjit.py)

OK, SURROGATE, DROPPED, RARE = 0, 1, 2, 3      # status of a fused call: anything but OK -> the staged path
NO_SPANS = np.zeros((0, 2), np.int64)          # "one span: [lo, hi)" (no literal inside the window)
# the general path's scratch: none, so the IDs and ends it returns are arrays of their own
_NO_SCRATCH = np.zeros(0, np.uint8)


@njit(cache=True, nogil=True, inline="always")
def _take(ws, at, nbytes):
    """nbytes of the scratch `ws` from `at` on (rounded up to 64 bytes) and the offset after them, or a new array
    and `at` where ws has no room (an empty ws: every array is a new one, as the general path's results must be)."""
    a = (at + 63) & -64
    if a + nbytes <= ws.shape[0]:
        return ws[a:a + nbytes], a + nbytes
    return np.empty(nbytes, np.uint8), at


@njit(cache=True, nogil=True)
def _window_cps(s, lo, hi, spans, ws, at):
    """(code points of s[lo:hi], or of every span back to back; int64 offsets of the spans in them plus the end;
    index of a lone surrogate or -1; the scratch offset after the code points)."""
    if spans.shape[0] == 0:
        raw, at = _take(ws, at, 4 * (hi - lo))
        cps = raw.view(np.uint32)
        offsets = np.empty(2, np.int64)
        offsets[0] = 0
        offsets[1] = hi - lo
        bad = strbuf._codepoints(s, lo, hi, cps) if hi > lo else -1
        return cps, offsets, bad, at
    k = spans.shape[0]
    offsets = np.empty(k + 1, np.int64)
    offsets[0] = 0
    for j in range(k):
        offsets[j + 1] = offsets[j] + spans[j, 1] - spans[j, 0]
    raw, at = _take(ws, at, 4 * offsets[k])
    cps = raw.view(np.uint32)
    bad = -1
    for j in range(k):
        got = strbuf._codepoints(s, spans[j, 0], spans[j, 1], cps[offsets[j]:offsets[j + 1]])
        if got >= 0 and bad < 0:
            bad = got
    return cps, offsets, bad, at


@njit(cache=True, nogil=True)
def _window_start(s, lo, hi, spans, table, ws, at):
    """What every family's window starts with: the code points (of each span back to back) and their offsets, the
    table's class of each, an all-False piece-start mask, the index of a lone surrogate or -1, and the scratch
    offset after them. On a surrogate the classes are not gathered: not every code point was written."""
    cps, offsets, bad, at = _window_cps(s, lo, hi, spans, ws, at)
    n = cps.shape[0]
    raw, at = _take(ws, at, n)
    starts = raw.view(np.bool_)
    starts[:] = False
    raw, at = _take(ws, at, n * table.itemsize)
    feat = raw.view(table.dtype)
    if bad >= 0:
        return cps, offsets, feat[:0], starts, bad, at
    pt._gather_into(table, cps, feat)
    return cps, offsets, feat, starts, bad, at


@njit(cache=True, nogil=True)
def _declined(status):
    """The answer of a window the fused call does not cover: the staged path encodes it."""
    return np.empty(0, np.uint32), np.empty(0, np.int64), np.empty(0, np.int64), status


@njit(cache=True, nogil=True)
def _window_finish(cps, offsets, starts, lo, spans, shift, tc, has_missing, missing, byte_ids, ptab, batch, whole,
                   wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena, state, valid, ws, at):
    """UTF-8 + piece bounds, the piece map walk (the thread's map: piecemap.py), then each token's end (absolute:
    + shift) and the tokens per span. Every array of the call is carved from the scratch `ws` from `at` on while it
    has room (the fused append kernel's thread scratch; appendwin.py consumes the IDs and ends before its next
    call): a malloc a call of these sizes searched glibc's large bins, which after a 1M-character HF `tokenizers`
    encode in the same process held that encode's freed chunks (33% of a cold append in `_int_malloc`)."""
    n = cps.shape[0]
    k = offsets.shape[0] - 1
    for j in range(k):
        starts[offsets[j]] = True      # a segment is a text of its own: its first character starts a piece
    buf, at = _take(ws, at, 4 * n + 16)
    raw, at = _take(ws, at, 8 * (n + 1))
    bounds = raw.view(np.int64)
    nb, size = strbuf._utf8_and_bounds(cps, n, starts, buf, bounds)
    _pad(buf, size)     # (the walk reads a small piece's two words)
    counts = np.zeros(k, np.int64)
    piecemap._prefetch_homes(buf, bounds, nb, slots)
    cap = bounds[nb - 1] + 16       # a piece yields at most one ID per byte
    raw, at = _take(ws, at, 4 * cap)
    out = raw.view(np.int32)
    raw, at = _take(ws, at, 4 * 5 * 64)
    ms = raw.view(np.int32)
    raw, at = _take(ws, at, 8 * 3 * 64)
    heap = raw.view(np.int64)
    m, status = piecemap._walk_into(buf, bounds, nb, out, 0, ms, heap, has_missing, missing, byte_ids, ptab, batch,
                                    whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena, state,
                                    valid)
    if status != piecemap.OK:       # DROPPED: a byte the vocabulary lacks
        return np.empty(0, np.uint32), np.empty(0, np.int64), counts, DROPPED
    raw, at = _take(ws, at, 4 * m)
    ids = raw.view(np.uint32)
    raw, at = _take(ws, at, 8 * m)
    ends = raw.view(np.int64)
    # span j of the gathered code points starts at text position (spans[j, 0] or lo) + shift
    span = 0
    span_end = offsets[1]
    base = (spans[0, 0] if spans.shape[0] else lo) + shift
    c = 0
    for t in range(m):
        x = out[t]
        ids[t] = x
        c += tc[x]
        while c > span_end:
            span += 1
            base = spans[span, 0] + shift - span_end
            span_end = offsets[span + 1]
        ends[t] = c + base
        counts[span] += 1
    return ids, ends, counts, OK


def _window_gpt4_impl(s, lo, hi, spans, shift, kind_table, digits, whole_at_end, tc, has_missing, missing, byte_ids,
                      ptab, batch, whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena, state,
                      valid, ws):
    cps, offsets, kind, starts, bad, at = _window_start(s, lo, hi, spans, kind_table, ws, 0)
    if bad >= 0:
        return _declined(SURROGATE)
    c = cps.view(np.int32)
    for j in range(offsets.shape[0] - 1):
        a, b = offsets[j], offsets[j + 1]
        pt._gpt4_loop(c[a:b], kind[a:b], digits, whole_at_end, starts[a:b])
    return _window_finish(cps, offsets, starts, lo, spans, shift, tc, has_missing, missing, byte_ids, ptab, batch,
                          whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena, state, valid, ws,
                          at)


def _window_o200k_impl(s, lo, hi, spans, shift, feat_table, cls_table, tc, has_missing, missing, byte_ids, ptab,
                       batch, whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena, state, valid, ws):
    # the run loop on each span, then the compiled rescan of the windows around its rare shapes (cls_table: the
    # matcher's class table); RARE only where the matcher overran a window (the staged path raises there)
    cps, offsets, feat, starts, bad, at = _window_start(s, lo, hi, spans, feat_table, ws, 0)
    if bad >= 0:
        return _declined(SURROGATE)
    c = cps.view(np.int32)
    raw, at = _take(ws, at, 8 * cps.shape[0])
    rare = raw.view(np.int64)
    for j in range(offsets.shape[0] - 1):
        a, b = offsets[j], offsets[j + 1]
        nr = pt._o200k_loop(c[a:b], feat[a:b], starts[a:b], rare[a:b])
        if nr > 0 and o200k_rescan._rescan_mask(cps[a:b], cls_table, np.sort(rare[a:a + nr]), starts[a:b]) < 0:
            return _declined(RARE)
    return _window_finish(cps, offsets, starts, lo, spans, shift, tc, has_missing, missing, byte_ids, ptab, batch,
                          whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena, state, valid, ws,
                          at)


def _window_deepseek_impl(s, lo, hi, spans, shift, feat_table, tc, has_missing, missing, byte_ids, ptab, batch,
                          whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena, state, valid,
                          ws):
    cps, offsets, feat, starts, bad, at = _window_start(s, lo, hi, spans, feat_table, ws, 0)
    if bad >= 0:
        return _declined(SURROGATE)
    c = cps.view(np.int32)
    for j in range(offsets.shape[0] - 1):
        a, b = offsets[j], offsets[j + 1]
        pt._deepseek_loop(c[a:b], feat[a:b], starts[a:b])
    return _window_finish(cps, offsets, starts, lo, spans, shift, tc, has_missing, missing, byte_ids, ptab, batch,
                          whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena, state, valid, ws,
                          at)


def _window_smollm2_impl(s, lo, hi, spans, shift, kind_table, tc, has_missing, missing, byte_ids, ptab, batch,
                         whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena, state, valid,
                         ws):
    cps, offsets, kind, starts, bad, at = _window_start(s, lo, hi, spans, kind_table, ws, 0)
    if bad >= 0:
        return _declined(SURROGATE)
    c = cps.view(np.int32)
    for j in range(offsets.shape[0] - 1):
        a, b = offsets[j], offsets[j + 1]
        pt._smollm2_loop(c[a:b], kind[a:b], starts[a:b])
    return _window_finish(cps, offsets, starts, lo, spans, shift, tc, has_missing, missing, byte_ids, ptab, batch,
                          whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena, state, valid, ws,
                          at)


_window_gpt4 = njit(cache=True, nogil=True)(_window_gpt4_impl)
_window_o200k = njit(cache=True, nogil=True)(_window_o200k_impl)
_window_deepseek = njit(cache=True, nogil=True)(_window_deepseek_impl)
_window_smollm2 = njit(cache=True, nogil=True)(_window_smollm2_impl)

# -- binding: the constant tables of one (encoder, family, thread) fixed once -----------------------------------------
WindowFn = Callable[[str, int, int, np.ndarray, int], tuple[np.ndarray, np.ndarray, np.ndarray, int]]


def window_encoder(bpe: bpe_mod.BPE, family: str, tc: np.ndarray) -> WindowFn:
    """The fused window kernel of `family` with `bpe`'s tables, `tc` (token_chars) and the calling thread's piece
    map bound: fn(text, lo, hi, spans, shift) -> (ids uint32, ends int64 (+ shift), tokens per span, status).
    Kept on the thread's cache; bound again when the process's kernel set or the encoder's schedule flags change
    (tests switch them)."""
    c = bpe.thread_cache()
    entry = c.bound.get(family)     # (tc, fullencode.binding)
    if entry is not None and entry[0] is tc and still_bound(entry[1], bpe):
        return entry[1][3]
    loop, fam_args = pt.loop_tables(family)
    fn = kernels.get().bind(f"window_{loop}", 5, *fam_args, np.ascontiguousarray(tc, np.uint16),
                            *piecemap.walk_tail(bpe), _NO_SCRATCH)
    c.bound[family] = (tc, binding(bpe, fn))
    return fn


__all__ = ["NO_SPANS", "OK", "window_encoder"]
