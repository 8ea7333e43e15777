"""Pre-tokenization as a per-character predicate: no backtracking regex on the common path.

Each code point is classified with the class table probed out of the reference engine (`charclass`), the text is cut
into maximal same-class runs, and "a piece starts here" is decided per character from its offset inside its run, at
most two characters of lookback across the run boundary, and per-run aggregates computed with prefix scans (run start,
run end, first non-CR/LF position, last CR/LF position, last non-B letter kind, next non-upper letter). Each family's
rule runs as one numba-compiled loop over the code points, without the GIL; the per-character and run-vectorized numpy
forms of the same rules are test oracles (tests/pretokenize_oracles.py). The derivation, one regex alternative at a
time, is in docs/pretokenizer.md; it is claimed only for the frozen splitter configurations (`Family.splitter_hash`)
and the pinned class tables (`charclass.PINNED`), which `supported()` checks.

o200k has two rare local shapes the run rule does not cover (a combining mark right after punctuation, which
the punctuation alternative can swallow, and `/` right after CR/LF, which `[\\r\\n/]*` can chain into). Around those the
pieces are recomputed by a scalar matcher between two synchronizing positions, where a piece starts whatever the left
context is (o200k_rescan.py).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

from ..errors import UnsupportedFamily
from ..spec import charclass
from ..spec.families import FAMILIES, Family
from . import kernels
from .lazyjit import njit, numba_global  # numba itself only when a JIT kernel runs (lazyjit.py)
from .o200k_rescan import _o200k_rescan_local
from .runbits import _next_run, _run_bits

_borrowed = numba_global("tokenplane.tokenize.cpu.borrow", "borrowed")

_B = charclass.BIT
_L, _N, _S, _M, _P, _SY = _B["L"], _B["N"], _B["s"], _B["M"], _B["P"], _B["S"]
_LU, _LT, _LL = _B["Lu"], _B["Lt"], _B["Ll"]
_CP_SHAPE = (charclass.N_CODEPOINTS,)    # per-code-point tables (cached on disk: charclass.derived_table)

# Splitter configurations this module was derived for (Family.splitter_hash of the frozen families).
_DERIVED = {name: fam.splitter_hash for name, fam in FAMILIES.items()}


def supported(family: Family) -> bool:
    """True when the family's splitter hash and the engine's class table are the ones the rules were derived on."""
    if _DERIVED.get(family.name) != family.splitter_hash or not charclass.table_is_pinned(family.engine):
        return False
    return family.name != "smollm2" or charclass.numeric_is_pinned()


def _family(family: Family | str) -> Family:
    fam = FAMILIES.get(family) if isinstance(family, str) else family
    if fam is None or _DERIVED.get(fam.name) != fam.splitter_hash:
        raise UnsupportedFamily(f"no per-character pre-tokenizer for family {getattr(family, 'name', family)!r}")
    return fam


@cache
def _table(engine: str) -> np.ndarray:
    return charclass.class_table(engine)


def codepoints(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


# -- the compiled loops: one pass per text, the predicate evaluated once per same-kind run ---------------------------
def _kind_table(word_bits: int) -> np.ndarray:
    """class bitmask -> run kind (0 letter-ish, 1 digit, 2 whitespace, 3 other), one gather per text."""
    masks = np.arange(1 << len(charclass.CLASSES), dtype=np.int64)
    return np.where(masks & word_bits, 0, np.where(masks & _N, 1, np.where(masks & _S, 2, 3))).astype(np.int8)


_KIND_GPT4 = _kind_table(_L)
_KIND_O200K = _kind_table(_L | _M)


@cache
def _cp_kind_gpt4(engine: str) -> np.ndarray:
    """Run kind per code point (0 L, 1 N, 2 whitespace, 3 other): one gather per text instead of two."""
    return charclass.derived_table("kind-gpt4", engine, _CP_SHAPE, np.int8, lambda: _KIND_GPT4[_table(engine)],
                                   __file__)


def _whitespace_run_cuts(c, a, b, absorbed, at_end, keep_whole):
    """The piece starts inside one whitespace run [a, b), as (first, after the last CR/LF, last), -1 where there is
    none (the loop form of the oracles' `_whitespace_run_starts`, shared by the run loops here and the bitmap forms
    in startbits.py): CR/LF absorbed by the previous punctuation piece are skipped, a piece starts after the last
    CR/LF (unless the whole run is one piece: cl100k's `\\s++$` at the end of text), and before the last character
    when a non-space follows (`\\s+(?!\\S)`)."""
    s0 = a
    if absorbed:
        while s0 < b and (c[s0] == 10 or c[s0] == 13):
            s0 += 1
    last_nl = -1
    for j in range(b - 1, a - 1, -1):
        if c[j] == 10 or c[j] == 13:
            last_nl = j
            break
    first = s0 if s0 < b else -1
    mid = last_nl + 1 if last_nl >= a and last_nl + 1 < b and last_nl + 1 > s0 and not keep_whole else -1
    last = b - 1 if not at_end and b - 1 > s0 and c[b - 1] != 10 and c[b - 1] != 13 else -1
    return first, mid, last


def _whitespace_run_loop(c, starts, a, b, absorbed, at_end, keep_whole):
    """`_whitespace_run_cuts` written into a bool start mask."""
    first, mid, last = _whitespace_run_cuts(c, a, b, absorbed, at_end, keep_whole)
    if first >= 0:
        starts[first] = True
    if mid >= 0:
        starts[mid] = True
    if last >= 0:
        starts[last] = True


def _gather(table, cps):
    """table[cps] as a compiled loop: numpy's fancy index holds the GIL and costs ~3x this on 4M characters, and
    it runs once per chunk thread."""
    out = np.empty(cps.shape[0], dtype=table.dtype)
    _gather_into(table, cps, out)
    return out


def _gather_into(table, cps, out):
    """`_gather` into out[:len(cps)] (the fused append window's scratch, window.py)."""
    for i in range(cps.shape[0]):
        out[i] = table[cps[i]]


_whitespace_run_cuts = njit(cache=True, nogil=True, inline="always")(_whitespace_run_cuts)
_whitespace_run_loop = njit(cache=True, nogil=True, inline="always")(_whitespace_run_loop)
_gather_into = njit(cache=True, nogil=True, inline="always")(_gather_into)
_gather = njit(cache=True, nogil=True)(_gather)


def _gpt4_loop_impl(c, kind, digits, whole_at_end, starts):
    """The run-level cl100k-lineage rules as one loop over runs (same rules as `_starts_gpt4`, numba-compiled)."""
    c, kind, starts = _borrowed(c), _borrowed(kind), _borrowed(starts)     # (borrow.py)
    n = c.shape[0]
    rb = _run_bits(kind, n, False)
    wi = 0
    cur = rb[0]
    a = 0
    prev_kind = -1
    prev_len = 0
    while a < n:
        k = kind[a]
        b, wi, cur = _next_run(rb, wi, cur)
        pc = c[a - 1] if a > 0 else -1
        p2 = c[a - 2] if a > 1 else -1
        if k == 2 and b == a + 1 and c[a] == 32 and b < n and kind[b] == 0:
            # " word", the commonest pair of runs in prose, in one step: what the two branches below do for it (the
            # space starts a piece, `[^\r\n\p{L}\p{N}]?+` glues it to the letter run, and no contraction follows a
            # space); -25% loop time on English, -12% on code (one core, CPU time)
            starts[a] = True
            a = b
            b, wi, cur = _next_run(rb, wi, cur)
            prev_kind = 0
            prev_len = b - a
            a = b
            continue
        if k == 3:
            if pc != 32:
                starts[a] = True
        elif k == 0:
            ws_prefix = prev_kind == 2 and pc != 10 and pc != 13
            o_prefix = prev_kind == 3 and prev_len == 1 and p2 != 32
            if not ws_prefix and not o_prefix:
                starts[a] = True
            if o_prefix and pc == 39:
                f0 = c[a]
                f0 = f0 + 32 if 65 <= f0 <= 90 else (115 if f0 == 0x17F else f0)
                f1 = -1
                if a + 1 < b:
                    f1 = c[a + 1]
                    f1 = f1 + 32 if 65 <= f1 <= 90 else (115 if f1 == 0x17F else f1)
                cut = 0
                if f0 == 115 or f0 == 100 or f0 == 109 or f0 == 116:
                    cut = a + 1
                elif (f0 == 108 and f1 == 108) or (f0 == 118 and f1 == 101) or (f0 == 114 and f1 == 101):
                    cut = a + 2
                if cut > 0 and cut < b:
                    starts[cut] = True
        elif k == 1:
            for j in range(a, b, digits):
                starts[j] = True
        else:
            _whitespace_run_loop(c, starts, a, b, prev_kind == 3, b == n, whole_at_end and b == n)
        prev_kind = k
        prev_len = b - a
        a = b


_gpt4_loop = njit(cache=True, nogil=True)(_gpt4_loop_impl)


def _zeroed(scratch: np.ndarray | None, n: int) -> np.ndarray:
    """A zeroed bool[n]: a view of `scratch` when it is long enough (reused across calls: a fresh multi-MB array
    costs a page fault per 4 KB on first touch), else a new array."""
    if scratch is None or scratch.shape[0] < n:
        return np.zeros(n, dtype=np.bool_)
    out = scratch[:n]
    out[:] = False
    return out


def _starts_gpt4_loop(cps: np.ndarray, engine: str, digits: int, whole_at_end: bool,
                      starts: np.ndarray | None = None) -> np.ndarray:
    starts = _zeroed(starts, cps.shape[0])
    k = kernels.get()
    k.gpt4_loop(cps.view(np.int32), k.gather_i8(_cp_kind_gpt4(engine), cps), digits, whole_at_end, starts)
    return starts


@cache
def _cp_kind_o200k(engine: str) -> np.ndarray:
    """Per code point: run kind (bits 0-1: 0 word, 1 N, 2 whitespace, 3 other) | 4 upper (Lu/Lt) | 8 lower (Ll) |
    16 mark."""
    def build() -> np.ndarray:
        t = _table(engine).astype(np.int64)
        kind = _KIND_O200K[t].astype(np.int64)
        kind |= np.where(t & (_LU | _LT), 4, 0) | np.where(t & _LL, 8, 0) | np.where(t & _M, 16, 0)
        return kind.astype(np.uint8)
    return charclass.derived_table("kind-o200k", engine, _CP_SHAPE, np.uint8, build, __file__)


def _o200k_loop_impl(c, feat, starts, rare):
    """The run-level o200k rules as one loop over runs (same rules as `_starts_o200k`); returns how many rare
    positions (mark after punctuation, '/' after CR/LF) it wrote to `rare` for the scalar rescan."""
    return _o200k_runs(c, feat, starts, rare, 0, 0, c.shape[0], -1, 0, -1, False)


def _o200k_runs_impl(c, feat, starts, rare, nrare, a, stop, prev_kind, prev_len, pprev_kind, prev_tail_full):
    """`_o200k_loop_impl` over the runs from a (a run start) until one ends at or past `stop`, from the state the
    runs before a leave: the previous run's kind and length, the kind of the one before it (-1: none), whether the
    last word run was entirely a contraction tail; rare positions appended to rare[nrare:]; returns the new count.
    startbits' o200k bitmap kernel runs it over the stretches its masks do not decide. `feat` may carry more bits
    than the kind table's (it reads bits 0-4 only)."""
    c, feat, starts, rare = _borrowed(c), _borrowed(feat), _borrowed(starts), _borrowed(rare)     # (borrow.py)
    n = c.shape[0]
    while a < stop:
        k = feat[a] & 3
        b = a + 1
        inner = 0                # feature bits of the run's characters after its first
        while b < n and (feat[b] & 3) == k:
            inner |= feat[b]
            b += 1
        pc = c[a - 1] if a > 0 else -1
        p2 = c[a - 2] if a > 1 else -1
        if k == 2 and b == a + 1 and c[a] == 32 and b < n and (feat[b] & 3) == 0:
            # " word" with no upper-case letter after the word's first: what the branches below do for the pair of
            # runs in one step (the space starts a piece and glues to the word; no rare shape, contraction or case
            # split can occur); otherwise the two runs take the general path
            e = b + 1
            word_inner = 0
            while e < n and (feat[e] & 3) == 0:
                word_inner |= feat[e]
                e += 1
            if (word_inner & 4) == 0:
                starts[a] = True
                prev_tail_full = False
                pprev_kind = 2
                prev_kind = 0
                prev_len = e - b
                a = e
                continue
        tail_full = False
        if k == 3:
            if pc != 32:
                starts[a] = True
            if c[a] == 47 and (pc == 10 or pc == 13):
                # `[\r\n/]*` can chain CR/LF into '/' only as the tail of a punctuation match, whose
                # `[^\s\p{L}\p{N}]+` part must end right before the CR/LF run (a mark counts: \p{M} is in that
                # class). Any other left neighbour (letter, digit, other whitespace, the text's start) ends its piece
                # before the run, and the run rule is exact there: no rescan ('\n/' starts every path line of `ls`).
                j = a - 1
                while j >= 0 and (c[j] == 10 or c[j] == 13):
                    j -= 1
                if j >= 0 and ((feat[j] & 3) == 3 or (feat[j] & 16) != 0):
                    rare[nrare] = a
                    nrare += 1
        elif k == 0:
            if prev_kind == 3 and (feat[a] & 16) != 0:
                rare[nrare] = a
                nrare += 1
            ws_prefix = prev_kind == 2 and pc != 10 and pc != 13
            o_prefix = prev_kind == 3 and prev_len == 1 and p2 != 32
            x = a
            if pc == 39 and prev_len == 1 and prev_kind == 3 and pprev_kind == 0 and not prev_tail_full:
                f0 = c[a]
                f0 = f0 + 32 if 65 <= f0 <= 90 else (115 if f0 == 0x17F else f0)
                f1 = -1
                if a + 1 < b:
                    f1 = c[a + 1]
                    f1 = f1 + 32 if 65 <= f1 <= 90 else (115 if f1 == 0x17F else f1)
                kk = 0
                if f0 == 115 or f0 == 116 or f0 == 109 or f0 == 100:
                    kk = 1
                elif (f0 == 114 and f1 == 101) or (f0 == 118 and f1 == 101) or (f0 == 108 and f1 == 108):
                    kk = 2
                if kk > 0:
                    starts[a - 1] = False        # the apostrophe and the letters continue the left piece
                    x = a + kk
                    if x < b:
                        starts[x] = True
                    else:
                        tail_full = True
            if x == a and not ws_prefix and not o_prefix:
                starts[a] = True
            if x < b and (inner & 4) != 0:
                # case rule: [PB]*[WB]+ | P+ from the sub-run start x (it starts a piece only at an upper-case letter
                # right of x >= a: a run with none after its first character has nothing to split)
                t = b
                while t > x and (feat[t - 1] & 4) != 0:
                    t -= 1
                last_nb = 0                  # 0 none, 4 upper, 8 lower: kind of the nearest non-B letter
                for j in range(x, b):
                    f = feat[j]
                    if j > x and (f & 4) != 0:
                        pf = feat[j - 1]
                        prev_b = (pf & 12) == 0
                        if last_nb == 8 or (prev_b and j >= t):
                            starts[j] = True
                    if (f & 12) != 0:
                        last_nb = f & 12
        elif k == 1:
            for j in range(a, b, 3):
                starts[j] = True
        else:
            _whitespace_run_loop(c, starts, a, b, prev_kind == 3, b == n, False)
        if k == 0:
            prev_tail_full = tail_full
        pprev_kind = prev_kind
        prev_kind = k
        prev_len = b - a
        a = b
    return nrare


_o200k_runs = njit(cache=True, nogil=True)(_o200k_runs_impl)
_o200k_loop = njit(cache=True, nogil=True)(_o200k_loop_impl)


def _starts_o200k_loop(cps: np.ndarray, engine: str, starts: np.ndarray | None = None) -> np.ndarray:
    n = cps.shape[0]
    starts = _zeroed(starts, n)
    rare = np.empty(n, dtype=np.int64)
    c = cps.view(np.int32)
    k = kernels.get()
    nr = k.o200k_loop(c, k.gather_u8(_cp_kind_o200k(engine), cps), starts, rare)
    if nr:
        _o200k_rescan_local(cps, _table(engine), c, np.sort(rare[:nr]), starts)
    return starts


# -- deepseek (three chained Split stages) ----------------------------------------------------------------------------
_ASCII_PUNCT = np.zeros(128, dtype=bool)
_ASCII_PUNCT[[ord(ch) for ch in "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"]] = True


def _ds_kind_table() -> np.ndarray:
    masks = np.arange(1 << len(charclass.CLASSES), dtype=np.int64)
    return np.where(masks & _N, 4, np.where(masks & (_L | _M), 0, np.where(masks & (_P | _SY), 1,
                    np.where(masks & _S, 2, 3)))).astype(np.int8)


_KIND_DS = _ds_kind_table()


_GPT4 = {"cl100k_base": (3, True), "llama3": (3, False), "qwen3": (1, False)}   # digit group, `\s++$`


@cache
def _cp_feat_deepseek(engine: str) -> np.ndarray:
    """Per code point: kind (bits 0-2: 0 LM, 1 PS, 2 whitespace, 3 other, 4 N) | 8 CJK range | 16 ASCII letter |
    32 ASCII punctuation."""
    def build() -> np.ndarray:
        f = _KIND_DS[_table(engine)].astype(np.int64)
        cp = np.arange(f.shape[0])
        f |= np.where(((cp >= 0x4E00) & (cp <= 0x9FA5)) | ((cp >= 0x3040) & (cp <= 0x309F))
                      | ((cp >= 0x30A0) & (cp <= 0x30FF)), 8, 0)
        f |= np.where(((cp >= 65) & (cp <= 90)) | ((cp >= 97) & (cp <= 122)), 16, 0)
        f[:128] |= np.where(_ASCII_PUNCT, 32, 0)
        return f.astype(np.uint8)
    return charclass.derived_table("feat-deepseek", engine, _CP_SHAPE, np.uint8, build, __file__)


def _ds_seg_head(feat, i):
    """A stage-1/2 piece starts at i: digit-run edge or CJK-range edge between non-digits (digit groups aside)."""
    if i == 0:
        return True
    k, pk = feat[i] & 7, feat[i - 1] & 7
    if k == 4 or pk == 4:
        return k != pk
    return (feat[i] & 8) != (feat[i - 1] & 8)


def _deepseek_loop_impl(c, feat, starts):
    """The run-level DeepSeek rules (`_starts_deepseek`) as one loop over runs that never cross a segment."""
    c, feat, starts = _borrowed(c), _borrowed(feat), _borrowed(starts)     # (borrow.py)
    n = c.shape[0]
    rb = _run_bits(feat, n, True)
    wi = 0
    cur = rb[0]
    a = 0
    prev_kind = -1
    prev_len = 0
    seg_start = 0
    while a < n:
        k = feat[a] & 7
        b, wi, cur = _next_run(rb, wi, cur)
        head = _ds_seg_head(feat, a)
        if head:
            seg_start = a
            starts[a] = True
        if k == 2 and b == a + 1 and c[a] == 32 and b < n and (feat[b] & 7) == 0 and not _ds_seg_head(feat, b):
            # " word" in one step (as in the gpt4 loop): the space starts a piece and glues to the letter run of
            # the same segment after it, whatever came before the space; -20..-27% loop time on english / code (the
            # same step measured no gain in the smollm2 loop, whose runs carry less per-run work)
            starts[a] = True
            e, wi, cur = _next_run(rb, wi, cur)
            prev_kind = 0
            prev_len = e - b
            a = e
            continue
        same = not head
        pk = prev_kind if same else -1
        pc = c[a - 1] if same else -1
        p2 = c[a - 2] if same and a - 2 >= seg_start else -1
        single = same and prev_len == 1
        next_same = b < n and not _ds_seg_head(feat, b)
        if k == 4:
            for j in range(a, b, 3):
                starts[j] = True
        elif k == 1:
            if pc != 32:
                starts[a] = True
        elif k == 0:
            glued = (pk == 2 and pc != 10 and pc != 13) or pk == 3
            punct_glue = pk == 1 and single and p2 != 32 and (feat[a - 1] & 32) != 0 and (feat[a] & 16) != 0
            if not glued and not punct_glue:
                starts[a] = True
            if punct_glue:
                j = a
                while j < b and (feat[j] & 16) != 0:
                    j += 1
                if j < b:
                    starts[j] = True
        elif k == 3:
            starts[a] = True
            if next_same and (feat[b] & 7) == 0:
                starts[b - 1] = True
        else:
            _whitespace_run_loop(c, starts, a, b, pk == 1, not next_same, False)
        prev_kind = k
        prev_len = b - a
        a = b


_ds_seg_head = njit(cache=True, nogil=True)(_ds_seg_head)
_deepseek_loop = njit(cache=True, nogil=True)(_deepseek_loop_impl)


def _starts_deepseek_loop(cps: np.ndarray, engine: str, starts: np.ndarray | None = None) -> np.ndarray:
    starts = _zeroed(starts, cps.shape[0])
    k = kernels.get()
    k.deepseek_loop(cps.view(np.int32), k.gather_u8(_cp_feat_deepseek(engine), cps), starts)
    return starts


# -- smollm2 (HF Digits, then the GPT-2 pattern on each piece) -------------------------------------------------------
@cache
def _cp_kind_smollm2(engine: str) -> np.ndarray:
    """Run kind per code point: 0 letter (\\p{L}), 1 Digits-numeric (Rust's is_numeric, probed: a superset of \\p{N}),
    2 whitespace, 3 other (marks included: GPT-2's letter run is \\p{L} alone)."""
    def build() -> np.ndarray:
        kind = _KIND_GPT4[_table(engine)].copy()
        kind[charclass.numeric_table()] = 1
        return kind
    return charclass.derived_table("kind-smollm2", engine, _CP_SHAPE, np.int8, build, __file__, numeric=True)


def _smollm2_loop_impl(c, kind, starts):
    """The run-level smollm2 rules as one loop over runs (docs/pretokenizer.md, smollm2): every numeric character is
    its own piece and ends a segment; inside a segment a single space (U+0020) glues to the letter or other run right
    after it, a whitespace run before a letter/other run leaves its last character to the next piece (`\\s+(?!\\S)`),
    a whitespace run that ends the segment is one piece, and a lone `'` that starts a match takes the contraction
    letters (s t m d / re ve ll, lowercase) of the letter run after it."""
    c, kind, starts = _borrowed(c), _borrowed(kind), _borrowed(starts)     # (borrow.py)
    n = c.shape[0]
    rb = _run_bits(kind, n, False)
    wi = 0
    cur = rb[0]
    a = 0
    glue = False          # the previous run ends in a space that starts the piece holding this run's first char
    apos_start = False    # the previous run is a lone "'" that starts a match attempt (a contraction may follow)
    while a < n:
        k = kind[a]
        b, wi, cur = _next_run(rb, wi, cur)
        next_glue = False
        next_apos = False
        if k == 1:
            for j in range(a, b):
                starts[j] = True
        elif k == 2:
            starts[a] = True
            if b < n and kind[b] != 1:
                if b - a >= 2:
                    starts[b - 1] = True
                next_glue = c[b - 1] == 32
        elif k == 0:
            x = a
            if apos_start:
                f0 = c[a]
                f1 = c[a + 1] if a + 1 < b else -1
                if f0 == 115 or f0 == 116 or f0 == 109 or f0 == 100:          # 's 't 'm 'd
                    x = a + 1
                elif (f0 == 114 and f1 == 101) or (f0 == 118 and f1 == 101) or (f0 == 108 and f1 == 108):
                    x = a + 2                                                  # 're 've 'll
                if x < b and x > a:
                    starts[x] = True
            if x == a and not glue:
                starts[a] = True
        else:
            if not glue:
                starts[a] = True
            next_apos = b - a == 1 and c[a] == 39 and not glue
        glue = next_glue
        apos_start = next_apos
        a = b


_smollm2_loop = njit(cache=True, nogil=True)(_smollm2_loop_impl)


def _starts_smollm2_loop(cps: np.ndarray, engine: str, starts: np.ndarray | None = None) -> np.ndarray:
    starts = _zeroed(starts, cps.shape[0])
    k = kernels.get()
    k.smollm2_loop(cps.view(np.int32), k.gather_i8(_cp_kind_smollm2(engine), cps), starts)
    return starts


# -- public API -----------------------------------------------------------------------------------------------------
def loop_tables(family: Family | str) -> tuple[str, tuple[Any, ...]]:
    """(loop, its tables): which pre-tokenizer loop the family runs ("gpt4", "o200k", "deepseek", "smollm2") and the
    arguments the fused kernels pass it besides the text (its code point class table first, then its flags)."""
    fam = _family(family)
    if fam.name in _GPT4:
        digits, whole = _GPT4[fam.name]
        return "gpt4", (_cp_kind_gpt4(fam.engine), digits, whole)
    if fam.name == "o200k_base":    # + the class table of the rare shapes' matcher (o200k_rescan.py)
        return "o200k", (_cp_kind_o200k(fam.engine), _table(fam.engine))
    if fam.name == "deepseek_v4":
        return "deepseek", (_cp_feat_deepseek(fam.engine),)
    if fam.name == "smollm2":
        return "smollm2", (_cp_kind_smollm2(fam.engine),)
    raise UnsupportedFamily(fam.name)


def piece_starts(family: Family | str, cps: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bool[len(cps)]: True where a piece of the family's pre-tokenizer starts (cps: code points of normalized
    text). `out`: a bool scratch array to write into when it is long enough (the result is then a view of it)."""
    fam = _family(family)
    cps = np.ascontiguousarray(cps, dtype=np.uint32)
    if cps.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    if fam.name in _GPT4:
        digits, whole = _GPT4[fam.name]
        return _starts_gpt4_loop(cps, fam.engine, digits, whole, out)
    if fam.name == "o200k_base":
        return _starts_o200k_loop(cps, fam.engine, out)
    if fam.name == "deepseek_v4":
        return _starts_deepseek_loop(cps, fam.engine, out)
    if fam.name == "smollm2":
        return _starts_smollm2_loop(cps, fam.engine, out)
    raise UnsupportedFamily(fam.name)


def spans_from_starts(starts: np.ndarray) -> np.ndarray:
    """int64[k, 2] (start, end) character spans from a piece-start mask."""
    s = np.flatnonzero(starts)
    return np.stack([s, np.append(s[1:], starts.shape[0])], axis=1)


def pieces(family: Family | str, text: str) -> list[tuple[int, int]]:
    """Piece spans (character offsets), the format of `ReferenceEngine.pretokenize` (text: already normalized)."""
    if not text:
        return []
    spans = spans_from_starts(piece_starts(family, codepoints(text)))
    return list(map(tuple, spans.tolist()))
