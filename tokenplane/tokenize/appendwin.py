"""The first repair window of an append in one compiled call: window start, encode, splice search, kept-token compare.

A session append (or a `sync` whose stored text is a prefix of the resent one) is repaired by repair.WindowRepair:
pick a clean cached boundary ~`window` characters left of the change, encode new[s:end] (window.py's fused kernel),
find the rightmost certified splice point in [s, d] (splice.py's search), and keep the cached tokens that equal the
fresh ones after it. On real agent traces the first window certifies every append, and these steps ran as four kernel
calls with ~40 Python-level calls of glue between them (argument guards, small arrays, tuples, slices): about half
of a sync's per-call fixed cost (benchmarks/session_repair.py). Here the same steps run back to back in one compiled
function per pre-tokenizer family, with every constant table bound once per thread (kernels.bind).

A pure restructuring of the first attempt of WindowRepair.repair for an append without allowed literals: the same
kernels (records.py's `_clean_before`, window.py's family window, splice.py's `_search`) with the same arguments, and
the same `_fill_window` arithmetic. Whatever it does not cover answers a nonzero status before anything is decided,
and the caller runs the general repair from its first attempt: a window start left of the text handed in, an NFC
window holding a code point that is not inert (cpu/nfc.py: the general path asks the normalizer), anything the fused
window kernel declines, no certified point on the first window. tests/test_appendwin.py checks every family, AOT and
JIT, against the general repair and the reference.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from . import records, splice
from .cpu import bpe as bpe_mod
from .cpu import kernels, piecemap, window
from .cpu import pretokenize as pt
from .cpu.lazyjit import njit, numba_global  # numba itself only when a JIT kernel runs (lazyjit.py)

_get_code_point = numba_global("numba.cpython.unicode", "_get_code_point")

OK, BEFORE_TEXT, NOT_INERT, WINDOW_DECLINED, NO_POINT, SCRATCH, COMMITTED = 0, 1, 2, 3, 4, 5, 6
ACCEPTED = (OK, COMMITTED)


@njit(cache=True, nogil=True)
def _start(text, base, d, w, nfc, ids, ck, tc, ex_i, ex_v, n, cont):
    """WindowRepair._window_start(rec, norm, d - w), reading the normalized text from `text` (absolute positions
    [base, base + len(text))): (start, OK) or (0, BEFORE_TEXT) when it would read left of `text`."""
    target = d - w
    if target <= 0:
        return 0, OK
    i, pos = splice._clean_before(ids, ck, tc, ex_i, ex_v, n, cont, target, -1)
    if i < 0:
        return 0, OK
    if not nfc:
        return pos, OK
    if pos < base:
        return 0, BEFORE_TEXT
    if _get_code_point(text, pos - base) < 0x80:
        return pos, OK
    fallback = pos
    for _ in range(255):        # NFC: the window must start at an ASCII character (a split point)
        i, pos = splice._clean_before(ids, ck, tc, ex_i, ex_v, n, cont, target, i - 1)
        if i < 0:
            return 0, OK
        if pos < base:
            return 0, BEFORE_TEXT
        if _get_code_point(text, pos - base) < 0x80:
            return pos, OK
    return fallback, OK


@njit(cache=True, nogil=True)
def _inert(text, a, inert):
    """Every code point of text[a:] is inert under NFC (then the window is its own NFC: cpu/nfc.py)."""
    for k in range(a, len(text)):
        if not inert[_get_code_point(text, k)]:
            return False
    return True


@njit(cache=True, nogil=True)
def _declined(status):
    return status, 0, 0


@njit(cache=True, nogil=True)
def _finish(text, base, s, d, f_ids, f_ends, ids, ck, tc, ex_i, ex_v, n, commit, cont, sig, pair, use_stable,
            max_chars, max_stable, max_cand, out_ids, out_ends):
    """_find_left (rightmost certified point in [s, d]; hard boundary: the text start), then _fill_window with the
    append's right point (the text end, the last cached and the last fresh record): (OK, keep, count) with the
    count new records in out_ids / out_ends, or (SCRATCH, records needed, 0) when they do not fit."""
    hard = np.empty(1 if s == 0 else 0, np.int64)
    if s == 0:
        hard[0] = 0
    m = f_ids.shape[0]
    p, ci_p, fj_p = splice._search(text, base, s, d, hard, sig, pair, use_stable, ids, ck, tc, ex_i, ex_v, n, f_ids,
                                   f_ends, m, cont, max_chars, True, 0, s, max_stable, max_cand)
    if p < 0:
        return _declined(NO_POINT)
    a = fj_p + 1
    cap = min(m - a, max(0, n - 1 - ci_p))
    k = 0
    while k < cap and ids[ci_p + 1 + k] == f_ids[a + k]:
        k += 1
    count = m - a - k
    if count > out_ids.shape[0] or count > out_ends.shape[0]:
        return SCRATCH, count, 0
    for j in range(count):
        out_ids[j] = f_ids[a + k + j]
        out_ends[j] = f_ends[a + k + j]
    keep = ci_p + 1 + k
    if (commit and ex_i.shape[0] == 0 and keep + count <= ids.shape[0]
            and ((keep + count) >> records.SHIFT) < ck.shape[0]
            and records._append_tail(ids, ck, tc, keep, n, out_ids[:count], out_ends[:count])):
        return COMMITTED, keep, count
    return OK, keep, count


@njit(cache=True, nogil=True)
def _pre(text, base, d, w, nfc, inert, ids, ck, tc, ex_i, ex_v, n, cont):
    """The window start, or a status: (start, OK), (0, BEFORE_TEXT), (0, NOT_INERT)."""
    s, status = _start(text, base, d, w, nfc, ids, ck, tc, ex_i, ex_v, n, cont)
    if status != OK or s < base:
        return 0, BEFORE_TEXT
    if nfc and not _inert(text, s - base, inert):
        return 0, NOT_INERT
    return s, OK


def _append_gpt4_impl(text, base, d, w, ids, ck, ex_i, ex_v, n, commit, nfc, inert, cont, sig, pair, use_stable,
                      max_chars, max_stable, max_cand, kind_table, digits, whole_at_end, tc, has_missing, missing,
                      byte_ids, ptab, batch, whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena,
                      state, valid, ws, out_ids, out_ends):
    s, status = _pre(text, base, d, w, nfc, inert, ids, ck, tc, ex_i, ex_v, n, cont)
    if status != OK:
        return _declined(status)
    f_ids, f_ends, _, st = window._window_gpt4(
        text, s - base, len(text), np.zeros((0, 2), np.int64), base, kind_table, digits, whole_at_end, tc,
        has_missing, missing, byte_ids, ptab, batch, whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots,
        arena, state, valid, ws)
    if st != window.OK:
        return _declined(WINDOW_DECLINED)
    return _finish(text, base, s, d, f_ids, f_ends, ids, ck, tc, ex_i, ex_v, n, commit, cont, sig, pair,
                   use_stable, max_chars, max_stable, max_cand, out_ids, out_ends)


def _append_o200k_impl(text, base, d, w, ids, ck, ex_i, ex_v, n, commit, nfc, inert, cont, sig, pair,
                       use_stable, max_chars, max_stable, max_cand, table, cls_table, tc, has_missing, missing,
                       byte_ids, ptab, batch, whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena,
                       state, valid, ws, out_ids, out_ends):
    s, status = _pre(text, base, d, w, nfc, inert, ids, ck, tc, ex_i, ex_v, n, cont)
    if status != OK:
        return _declined(status)
    f_ids, f_ends, _, st = window._window_o200k(
        text, s - base, len(text), np.zeros((0, 2), np.int64), base, table, cls_table, tc, has_missing, missing,
        byte_ids, ptab, batch, whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena, state, valid,
        ws)
    if st != window.OK:
        return _declined(WINDOW_DECLINED)
    return _finish(text, base, s, d, f_ids, f_ends, ids, ck, tc, ex_i, ex_v, n, commit, cont, sig, pair,
                   use_stable, max_chars, max_stable, max_cand, out_ids, out_ends)


def _append_deepseek_impl(text, base, d, w, ids, ck, ex_i, ex_v, n, commit, nfc, inert, cont, sig, pair,
                          use_stable, max_chars, max_stable, max_cand, table, tc, has_missing, missing, byte_ids, ptab,
                          batch, whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena, state, valid,
                          ws, out_ids, out_ends):
    s, status = _pre(text, base, d, w, nfc, inert, ids, ck, tc, ex_i, ex_v, n, cont)
    if status != OK:
        return _declined(status)
    f_ids, f_ends, _, st = window._window_deepseek(
        text, s - base, len(text), np.zeros((0, 2), np.int64), base, table, tc, has_missing, missing, byte_ids, ptab,
        batch, whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena, state, valid, ws)
    if st != window.OK:
        return _declined(WINDOW_DECLINED)
    return _finish(text, base, s, d, f_ids, f_ends, ids, ck, tc, ex_i, ex_v, n, commit, cont, sig, pair,
                   use_stable, max_chars, max_stable, max_cand, out_ids, out_ends)


def _append_smollm2_impl(text, base, d, w, ids, ck, ex_i, ex_v, n, commit, nfc, inert, cont, sig, pair,
                         use_stable, max_chars, max_stable, max_cand, table, tc, has_missing, missing, byte_ids, ptab,
                         batch, whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena, state, valid,
                         ws, out_ids, out_ends):
    s, status = _pre(text, base, d, w, nfc, inert, ids, ck, tc, ex_i, ex_v, n, cont)
    if status != OK:
        return _declined(status)
    f_ids, f_ends, _, st = window._window_smollm2(
        text, s - base, len(text), np.zeros((0, 2), np.int64), base, table, tc, has_missing, missing, byte_ids, ptab,
        batch, whole, wkeys, wids, tok_flat, tok_off, wmap, btda, btrec, slots, arena, state, valid, ws)
    if st != window.OK:
        return _declined(WINDOW_DECLINED)
    return _finish(text, base, s, d, f_ids, f_ends, ids, ck, tc, ex_i, ex_v, n, commit, cont, sig, pair,
                   use_stable, max_chars, max_stable, max_cand, out_ids, out_ends)


_append_gpt4 = njit(cache=True, nogil=True)(_append_gpt4_impl)
_append_o200k = njit(cache=True, nogil=True)(_append_o200k_impl)
_append_deepseek = njit(cache=True, nogil=True)(_append_deepseek_impl)
_append_smollm2 = njit(cache=True, nogil=True)(_append_smollm2_impl)

# -- binding: the constant tables of one (encoder, family, search, thread) fixed once ---------------------------------
# The new records come back in the thread's scratch arrays, not as returned arrays: an AOT kernel boxes a returned
# array through numba's serialized type (~2.5 us each on this VM), as much as the splice search itself.
AppendFn = Callable[[str, int, int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, bool],
                    tuple[int, np.ndarray, np.ndarray]]
_NO_INERT = np.zeros(1, np.bool_)
MIN_SCRATCH = 4096          # records; grown to what a window needs (a declined call says how many)


class _Bound:
    """One thread's fused kernel with its tables and scratch bound (kept on the BPE thread cache)."""

    # fn: the kernel behind its per-call guard; raw, raw_tail: the same kernel unguarded, called as
    # raw(*head, *raw_tail) by asciiappend.py, whose head arguments are a str, ints and the records' own arrays
    __slots__ = ("kernels", "batch", "whole", "tc", "search", "inert", "loop", "tail", "fn", "raw", "raw_tail",
                 "out_ids", "out_ends")

    def __init__(self, bpe: bpe_mod.BPE, tc: np.ndarray, search: splice.SpliceSearch, inert: np.ndarray | None,
                 loop: str, tail: tuple[object, ...]):
        self.kernels, self.batch, self.whole = kernels.get(), bpe.batch, bpe.whole
        self.tc, self.search, self.inert = tc, search, inert
        self.loop, self.tail = loop, tail
        self.grow(0)

    def grow(self, need: int) -> None:
        """Scratch for a window of `need` new records (what a SCRATCH answer says), with room to spare."""
        size = max(2 * need, MIN_SCRATCH)
        self.out_ids = np.empty(size, np.uint32)
        self.out_ends = np.empty(size, np.int64)
        self.fn = self.kernels.bind(f"append_{self.loop}", 10, *self.tail, self.out_ids, self.out_ends)
        self.raw, self.raw_tail = self.kernels.bind_unchecked(f"append_{self.loop}", 10, *self.tail, self.out_ids,
                                                              self.out_ends)

    def __call__(self, text: str, base: int, d: int, w: int, ids: np.ndarray, ck: np.ndarray, ex_i: np.ndarray,
                 ex_v: np.ndarray, n: int, commit: bool = False) -> tuple[int, int, np.ndarray, np.ndarray]:
        """(status, keep, mid_ids, mid_ends): the mid records are views of this thread's scratch, valid until its
        next call (the session copies them into its records at commit, before any other repair on this thread).
        `commit`: also write them into the records (`ids` / `ck`) when that is the plain tail write (see
        `_finish`), answering COMMITTED; the caller then sets the record count to keep + len(mid_ids)."""
        status, keep, count = self.counted(text, base, d, w, ids, ck, ex_i, ex_v, n, commit)
        return status, keep, self.out_ids[:count], self.out_ends[:count]

    def counted(self, text: str, base: int, d: int, w: int, ids: np.ndarray, ck: np.ndarray, ex_i: np.ndarray,
                ex_v: np.ndarray, n: int, commit: bool = False) -> tuple[int, int, int]:
        """`__call__` answering the mid records' count instead of views of them (they are out_ids[:count],
        out_ends[:count]): a caller that commits them in place never looks at them."""
        status, keep, count = self.fn(text, base, d, w, ids, ck, ex_i, ex_v, n, commit)
        if status == SCRATCH:       # `keep` says how many records the window needs: once per larger window
            self.grow(keep)
            status, keep, count = self.fn(text, base, d, w, ids, ck, ex_i, ex_v, n, commit)
        return status, keep, count


def append_encoder(bpe: bpe_mod.BPE, family: str, tc: np.ndarray, search: splice.SpliceSearch,
                   inert: np.ndarray | None) -> _Bound:
    """The fused append-window kernel of `family` with `bpe`'s tables, `tc`, the splice search's tables and the NFC
    inert table (None: the family has no normalizer) bound, and the calling thread's piece map and scratch. Kept
    on that cache beside window.py's binding; bound again when any of them (or the process's kernel set) changes."""
    c = bpe.thread_cache()
    e = c.bound.get("append:" + family)
    if (e is not None and e.kernels is kernels.get() and e.batch == bpe.batch and e.whole == bpe.whole
            and e.tc is tc and e.search is search and e.inert is inert):
        return e
    loop, fam_args = pt.loop_tables(family)
    tail = (inert is not None, inert if inert is not None else _NO_INERT, search.cont, search.sig, search.pair,
            search.use_stable, search.max_token_chars, splice.MAX_STABLE, splice.MAX_CANDIDATES, *fam_args,
            np.ascontiguousarray(tc, np.uint16), *piecemap.walk_tail(bpe), piecemap.thread_map(bpe).window_scratch)
    e = c.bound["append:" + family] = _Bound(bpe, tc, search, inert, loop, tail)
    return e


__all__ = ["OK", "append_encoder"]
