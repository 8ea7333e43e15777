"""Pre-tokenization as a per-character predicate: no backtracking regex on the common path.

Each code point is classified with the class table probed out of the reference engine (`charclass`), the text is cut
into maximal same-class runs, and "a piece starts here" is decided per character from its offset inside its run, at
most two characters of lookback across the run boundary, and per-run aggregates computed with prefix scans (run start,
run end, first non-CR/LF position, last CR/LF position, last non-B letter kind, next non-upper letter). Everything is
vectorized numpy over the code-point array. The derivation, one regex alternative at a time, is in
docs/pretokenizer.md; it is claimed only for the frozen splitter configurations (`Family.splitter_hash`) and the
pinned class tables (`charclass.PINNED`), which `supported()` checks.

o200k has two rare local shapes the vectorized rule does not cover (a combining mark right after punctuation, which
the punctuation alternative can swallow, and `/` right after CR/LF, which `[\\r\\n/]*` can chain into). Around those the
pieces are recomputed by a scalar matcher (`_o200k_scan`, the regex emulated alternative by alternative) between two
synchronizing positions, where a piece starts whatever the left context is.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import charclass
from .families import FAMILIES, Family

_B = charclass.BIT
_L, _N, _S, _M, _P, _SY = _B["L"], _B["N"], _B["s"], _B["M"], _B["P"], _B["S"]
_LU, _LT, _LL = _B["Lu"], _B["Lt"], _B["Ll"]
CR, LF, SPACE, APOS, SLASH = 13, 10, 32, 39, 47

# Splitter configurations this module was derived for (Family.splitter_hash of the frozen families).
_DERIVED = {name: fam.splitter_hash for name, fam in FAMILIES.items()}


class UnsupportedFamily(ValueError):
    """The family's splitter (or the probed class table) is not one the predicate was derived for."""


def supported(family: Family) -> bool:
    """True when the family's splitter hash and the engine's class table are the ones the rules were derived on."""
    return _DERIVED.get(family.name) == family.splitter_hash and charclass.table_is_pinned(family.engine)


def _family(family: Family | str) -> Family:
    fam = FAMILIES.get(family) if isinstance(family, str) else family
    if fam is None or _DERIVED.get(fam.name) != fam.splitter_hash:
        raise UnsupportedFamily(f"no per-character pre-tokenizer for family {getattr(family, 'name', family)!r}")
    return fam


@lru_cache(maxsize=None)
def _table(engine: str) -> np.ndarray:
    return charclass.class_table(engine)


def codepoints(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


# -- scans ----------------------------------------------------------------------------------------------------------
def _runs(key: np.ndarray, extra_breaks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per character: start and end index of its maximal same-key run."""
    n = key.shape[0]
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    np.not_equal(key[1:], key[:-1], out=brk[1:])
    if extra_breaks is not None:
        brk |= extra_breaks
    starts = np.flatnonzero(brk)
    rid = np.cumsum(brk) - 1
    ends = np.append(starts[1:], n)
    return starts[rid], ends[rid]


def _shift(a: np.ndarray, k: int, fill) -> np.ndarray:
    """a[i-k] (lookback by k), `fill` before the text start."""
    out = np.empty_like(a)
    out[:k] = fill
    out[k:] = a[:-k] if k else a
    return out


def _last_at_or_before(mask: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Per position i: the largest j <= i with mask[j], or -1."""
    return np.maximum.accumulate(np.where(mask, idx, -1))


def _first_at_or_after(mask: np.ndarray, idx: np.ndarray, n: int) -> np.ndarray:
    """Per position i: the smallest j >= i with mask[j], or n."""
    return np.minimum.accumulate(np.where(mask, idx, n)[::-1])[::-1]


def _fold(cps: np.ndarray) -> np.ndarray:
    """Simple case fold of the contraction letters as both engines apply (?i:): S/ſ->s, T->t, ... (probed)."""
    f = cps.astype(np.int64)
    up = (f >= 65) & (f <= 90)
    f = np.where(up, f + 32, f)
    return np.where(f == 0x17F, ord("s"), f)


# -- shared whitespace rule -----------------------------------------------------------------------------------------
def _whitespace_starts(ws, crlf, idx, rs, re, n, absorbed_head, end_is_boundary, whole_at_end):
    """Piece starts inside whitespace runs.

    s0: the run start, or past the leading CR/LF that the preceding punctuation piece absorbs (`[\\r\\n]*`).
    Then `\\s*[\\r\\n]` ends a piece after the last CR/LF, and `\\s+(?!\\S)` leaves the last character (which starts
    the next piece, alone or as the prefix of a word/punctuation piece) unless the run ends the text (segment).
    `whole_at_end`: cl100k's `\\s++$` takes the whole run when it ends the text.
    """
    first_non_crlf = _first_at_or_after(~crlf, idx, n)
    s0 = np.where(absorbed_head[rs], np.minimum(first_non_crlf[rs], re), rs)
    last_crlf = _last_at_or_before(crlf, idx)[re - 1]           # last CR/LF of the run (may be < rs: none)
    at_end = end_is_boundary[re - 1]
    after_nl = (idx - 1 == last_crlf) & (last_crlf >= rs)
    last_char = (idx == re - 1) & ~crlf & ~at_end
    if whole_at_end:
        inner = ~at_end & (after_nl | last_char)
    else:
        inner = after_nl | last_char
    return ws & (idx >= s0) & ((idx == s0) | inner)


# -- cl100k / llama3 / qwen3 ----------------------------------------------------------------------------------------
def _starts_gpt4_dense(cps: np.ndarray, cls: np.ndarray, digits: int, whole_at_end: bool) -> np.ndarray:
    """Per-character form of the cl100k-lineage rules (every aggregate a full-length scan); `_starts_gpt4` is the
    same predicate evaluated once per run, and the tests hold the two equal."""
    n = cps.shape[0]
    idx = np.arange(n)
    is_l = (cls & _L) != 0
    is_n = (cls & _N) != 0
    ws = (cls & _S) != 0
    other = ~(is_l | is_n | ws)
    kind = np.where(is_l, 0, np.where(is_n, 1, np.where(ws, 2, 3))).astype(np.int8)
    rs, re = _runs(kind)
    head = idx == rs
    crlf = (cps == CR) | (cps == LF)
    prev_cp = _shift(cps.astype(np.int64), 1, -1)
    prev2_cp = _shift(cps.astype(np.int64), 2, -1)
    prev_kind = _shift(kind, 1, -1)
    prev_crlf = _shift(crlf, 1, False)
    prev_single = _shift(rs == idx, 1, False)       # char i-1 is a one-character run

    # Punctuation run: starts a piece unless a space right before opens it (` ?[^\s\p{L}\p{N}]++`).
    o_start = other & head & (prev_cp != SPACE)
    # Letter run: `[^\r\n\p{L}\p{N}]?+\p{L}++` takes one non-CR/LF whitespace or one punctuation character as prefix
    # (punctuation only when it is a run of one that itself starts a piece, i.e. no space before it).
    ws_prefix = (prev_kind == 2) & ~prev_crlf
    o_prefix = (prev_kind == 3) & prev_single & (prev2_cp != SPACE)
    l_head = is_l & head
    starts = (l_head & ~ws_prefix & ~o_prefix) | o_start
    # Contractions `'(?i:[sdmt]|ll|ve|re)` win over the prefix rule when the apostrophe starts a piece.
    site = np.flatnonzero(l_head & o_prefix & (prev_cp == APOS))
    if site.size:
        _contraction_starts(cps, re, site, starts, pairs_first=False)
    starts |= is_n & ((idx - rs) % digits == 0)
    absorbed = _shift(kind == 3, 1, False)          # whitespace run preceded by punctuation: CR/LF absorbed
    end_bd = np.zeros(n, dtype=bool)
    end_bd[-1] = True
    starts |= _whitespace_starts(ws, crlf, idx, rs, re, n, absorbed, end_bd, whole_at_end)
    return starts


def _contraction_starts(cps, re, site, starts, pairs_first: bool) -> None:
    """At letter-run heads `site` right after a piece-starting apostrophe: the piece ends after 1 or 2 letters."""
    n = cps.shape[0]
    f0 = _fold(cps[site])
    nxt = np.minimum(site + 1, n - 1)
    f1 = np.where(site + 1 < re[site], _fold(cps[nxt]), -1)
    one = np.isin(f0, [ord(c) for c in "sdmt"])
    two = ~one & (((f0 == ord("l")) & (f1 == ord("l"))) | ((f0 == ord("v")) & (f1 == ord("e")))
                  | ((f0 == ord("r")) & (f1 == ord("e"))))
    k = np.where(one, 1, np.where(two, 2, 0))
    cut = site + k
    ok = (k > 0) & (cut < re[site])
    starts[cut[ok]] = True


# -- o200k ------------------------------------------------------------------------------------------------------------
def _starts_o200k_dense(cps: np.ndarray, cls: np.ndarray) -> np.ndarray:
    """Per-character form of the o200k rules; `_starts_o200k` evaluates the same predicate once per run."""
    n = cps.shape[0]
    idx = np.arange(n)
    is_m = (cls & _M) != 0
    word = ((cls & _L) != 0) | is_m
    is_n = (cls & _N) != 0
    ws = (cls & _S) != 0
    other = ~(word | is_n | ws)
    kind = np.where(word, 0, np.where(is_n, 1, np.where(ws, 2, 3))).astype(np.int8)
    rs, re = _runs(kind)
    head = idx == rs
    crlf = (cps == CR) | (cps == LF)
    prev_cp = _shift(cps.astype(np.int64), 1, -1)
    prev2_cp = _shift(cps.astype(np.int64), 2, -1)
    prev_kind = _shift(kind, 1, -1)
    prev_crlf = _shift(crlf, 1, False)
    prev_single = _shift(rs == idx, 1, False)

    o_start = other & head & (prev_cp != SPACE)
    ws_prefix = (prev_kind == 2) & ~prev_crlf
    o_prefix = (prev_kind == 3) & prev_single & (prev2_cp != SPACE)
    w_head = word & head
    starts = (w_head & ~ws_prefix & ~o_prefix) | o_start

    # Contraction suffix `(?i:'s|'t|'re|'ve|'m|'ll|'d)?` of a word piece: an apostrophe between two word runs.
    sub_head = w_head.copy()
    covered = np.zeros(n, dtype=bool)
    site = np.flatnonzero(w_head & (prev_cp == APOS) & prev_single & (_shift(kind, 2, -1) == 0))
    if site.size:
        _o200k_contractions(cps, re, rs, site, starts, sub_head, covered)

    # Case rule inside a word run (P = Lu/Lt, W = Ll, B = Lm/Lo/M): a piece is [PB]*[WB]+ or P+, so an upper
    # letter starts a piece when the nearest non-B letter before it (same sub-run) is lower-case, or when a B letter
    # precedes it and only upper letters follow to the run end.
    up = (cls & (_LU | _LT)) != 0
    low = (cls & _LL) != 0
    both = word & ~up & ~low
    sub_start = _last_at_or_before(sub_head, idx)
    last_nb = _shift(_last_at_or_before(word & ~both, idx), 1, -1)
    nb_low = (last_nb >= sub_start) & low[np.maximum(last_nb, 0)]
    next_not_up = _first_at_or_after(~up, idx, n)
    tail_up = next_not_up >= re
    prev_both = _shift(both, 1, False)
    starts |= up & ~sub_head & (nb_low | (prev_both & tail_up))
    starts &= ~covered

    starts |= is_n & ((idx - rs) % 3 == 0)
    absorbed = _shift(kind == 3, 1, False)
    end_bd = np.zeros(n, dtype=bool)
    end_bd[-1] = True
    starts |= _whitespace_starts(ws, crlf, idx, rs, re, n, absorbed, end_bd, whole_at_end=False)

    # Rare shapes -> scalar matcher between synchronizing positions.
    rare = np.flatnonzero((is_m & (prev_kind == 3)) | ((cps == SLASH) & prev_crlf))
    if rare.size:
        sync = np.zeros(n + 1, dtype=bool)
        sync[0] = sync[n] = True
        sync[1:n] |= prev_crlf[1:] & ~ws[1:] & (cps[1:] != SLASH)
        sync[1:n] |= is_n[1:] != is_n[:-1]
        sync_pos = np.flatnonzero(sync)
        lo = sync_pos[np.searchsorted(sync_pos, rare, side="right") - 1]
        hi = sync_pos[np.searchsorted(sync_pos, rare, side="right")]
        for a, b in _merge_windows(lo, hi):
            starts[a:b] = False
            starts[_o200k_scan(cps, cls, a, b)] = True
    return starts


def _o200k_contractions(cps, re, rs, site, starts, sub_head, covered) -> None:
    """Apostrophe at site-1 between word runs: it extends the left word piece when the right run begins with a
    contraction, unless the left run is itself only the tail of a previous contraction (then the apostrophe opens a
    piece as a prefix, the ordinary rule)."""
    n = cps.shape[0]
    f0 = _fold(cps[site])
    nxt = np.minimum(site + 1, n - 1)
    f1 = np.where(site + 1 < re[site], _fold(cps[nxt]), -1)
    one = np.isin(f0, [ord(c) for c in "stmd"])
    two = ~one & (((f0 == ord("r")) & (f1 == ord("e"))) | ((f0 == ord("v")) & (f1 == ord("e")))
                  | ((f0 == ord("l")) & (f1 == ord("l"))))
    k = np.where(one, 1, np.where(two, 2, 0))
    cand = k > 0
    site, k = site[cand], k[cand]
    if not site.size:
        return
    valid = np.ones(site.size, dtype=bool)
    # Chains (`x's's`): the left run of a site is the contraction tail of the previous site. Rare: resolve in order.
    left_start = rs[site - 2]
    j = np.minimum(np.searchsorted(site, left_start), site.size - 1)
    chained = np.flatnonzero((site[j] == left_start) & (left_start + k[j] == site - 1))
    if chained.size:
        pos = {int(s): i for i, s in enumerate(site)}
        for i in range(site.size):
            ls = int(left_start[i])
            j = pos.get(ls)
            if j is not None and valid[j] and ls + int(k[j]) == int(site[i]) - 1:
                valid[i] = False
    site, k = site[valid], k[valid]
    covered[site - 1] = True     # the apostrophe continues the left piece, and so do the contraction letters
    covered[site] = True
    covered[(site + 1)[k == 2]] = True
    cut = site + k
    inside = cut < re[site]
    starts[cut[inside]] = True
    sub_head[cut[inside]] = True


def _merge_windows(lo: np.ndarray, hi: np.ndarray):
    a, b = int(lo[0]), int(hi[0])
    for x, y in zip(lo[1:].tolist(), hi[1:].tolist()):
        if x < b:
            b = max(b, y)
        else:
            yield a, b
            a, b = x, y
    yield a, b


def _o200k_scan(cps: np.ndarray, cls: np.ndarray, a: int, b: int) -> list[int]:
    """Piece starts in [a, b) by emulating the o200k regex alternative by alternative from `a` (a known start)."""
    n = cps.shape[0]
    cp = cps.tolist() if n < 4096 else None
    get = (lambda i: cp[i]) if cp is not None else (lambda i: int(cps[i]))
    c = lambda i: int(cls[i])

    def is_u(i):
        return c(i) & (_LU | _LT | _B["Lm"] | _B["Lo"] | _M) != 0

    def is_lw(i):
        return c(i) & (_LL | _B["Lm"] | _B["Lo"] | _M) != 0

    def fold(x):
        return x + 32 if 65 <= x <= 90 else (115 if x == 0x17F else x)

    def contraction(e):
        if e + 1 < n and get(e) == APOS:
            f1 = fold(get(e + 1))
            if f1 in (115, 116, 109, 100):          # s t m d
                return e + 2
            if e + 2 < n:
                f2 = fold(get(e + 2))
                if (f1, f2) in ((114, 101), (118, 101), (108, 108)):   # re ve ll
                    return e + 3
        return e

    def word(alt, x):
        if x >= n:
            return -1
        y = x
        while y < n and is_u(y):
            y += 1
        if alt == 1:
            if y < n and is_lw(y):
                z = y
                while z < n and is_lw(z):
                    z += 1
                return z
            for j in range(y - 1, x - 1, -1):
                if is_lw(j):
                    return j + 1
            return -1
        if y == x:
            return -1
        while y < n and is_lw(y):
            y += 1
        return y

    def match(p):
        k = c(p)
        ch = get(p)
        prefix_ok = ch not in (CR, LF) and not (k & (_L | _N))
        for alt in (1, 2):
            for pre in ((1, 0) if prefix_ok else (0,)):
                e = word(alt, p + pre)
                if e > p + pre:
                    return contraction(e)
        if k & _N:
            e = p
            while e < n and e - p < 3 and c(e) & _N:
                e += 1
            return e
        for sp in ((1, 0) if ch == SPACE else (0,)):
            x = e = p + sp
            while e < n and not (c(e) & (_S | _L | _N)):
                e += 1
            if e > x:
                while e < n and get(e) in (CR, LF, SLASH):
                    e += 1
                return e
        y = p
        while y < n and c(y) & _S:
            y += 1
        last_nl = -1
        for j in range(y - 1, p - 1, -1):
            if get(j) in (CR, LF):
                last_nl = j
                break
        if last_nl >= 0:
            return last_nl + 1
        if y == n:
            return y
        if y - 1 > p:
            return y - 1
        return y

    out = []
    p = a
    while p < b:
        out.append(p)
        p = match(p)
    if p != b:
        raise RuntimeError(f"o200k scalar scan overran a synchronizing position ({p} != {b})")
    return out


# -- run-level evaluation (the default): the same predicate, aggregates computed once per run ------------------------
def _kind_table(word_bits: int) -> np.ndarray:
    """class bitmask -> run kind (0 letter-ish, 1 digit, 2 whitespace, 3 other), one gather per text."""
    masks = np.arange(1 << len(charclass.CLASSES), dtype=np.int64)
    return np.where(masks & word_bits, 0, np.where(masks & _N, 1, np.where(masks & _S, 2, 3))).astype(np.int8)


_KIND_GPT4 = _kind_table(_L)
_KIND_O200K = _kind_table(_L | _M)


def _sorted_union(*arrays: np.ndarray) -> np.ndarray:
    # np.union1d/np.unique hash-sort here, which is slower than sort + adjacent-difference on these sizes
    x = np.sort(np.concatenate(arrays))
    return x[np.append(True, x[1:] != x[:-1])] if x.size else x


class _Runs:
    """Maximal same-kind runs and the lookback the rules need at each run head."""

    def __init__(self, c: np.ndarray, kind: np.ndarray):
        n = c.shape[0]
        brk = np.empty(n, dtype=bool)
        brk[0] = True
        np.not_equal(kind[1:], kind[:-1], out=brk[1:])
        self.heads = h = np.flatnonzero(brk)
        self.ends = e = np.append(h[1:], n)
        self.kind = kind[h]
        self.prev_kind = np.append(np.int8(-1), self.kind[:-1])
        self.prev_cp = np.where(h > 0, c[np.maximum(h - 1, 0)], -1)
        self.prev2_cp = np.where(h > 1, c[np.maximum(h - 2, 0)], -1)
        self.prev_single = np.append(False, (e - h)[:-1] == 1)
        self.prev_crlf = (self.prev_cp == CR) | (self.prev_cp == LF)


def _digit_group_starts(runs: _Runs, starts: np.ndarray, group: int) -> None:
    r = np.flatnonzero(runs.kind == 1)
    if not r.size:
        return
    h = runs.heads[r]
    counts = (runs.ends[r] - h + group - 1) // group
    first = np.cumsum(counts) - counts
    k = np.arange(counts.sum()) - np.repeat(first, counts)
    starts[np.repeat(h, counts) + group * k] = True


def _whitespace_run_starts(c, runs: _Runs, starts, absorbed, run_at_end, whole_at_end) -> None:
    """`_whitespace_starts` per run: s0 (past CR/LF absorbed by a preceding punctuation piece), after the run's last
    CR/LF, and the run's last character unless the run ends the text/segment (see docs/pretokenizer.md)."""
    r = np.flatnonzero(runs.kind == 2)
    if not r.size:
        return
    wh, we = runs.heads[r], runs.ends[r]
    crlf_pos = np.flatnonzero((c == CR) | (c == LF))
    s0 = wh.copy()
    last_nl = np.full(r.size, -1)
    if crlf_pos.size:
        j = np.searchsorted(crlf_pos, we) - 1
        last_nl = np.where(j >= 0, crlf_pos[np.maximum(j, 0)], -1)
        ab = np.flatnonzero(absorbed[r])
        if ab.size:
            # leading CR/LF streak of the run: consecutive CR/LF positions starting at the head
            streak = np.cumsum(np.append(True, np.diff(crlf_pos) != 1)) - 1
            streak_last = crlf_pos[np.append(np.flatnonzero(np.diff(streak)), crlf_pos.size - 1)]
            k = np.searchsorted(crlf_pos, wh[ab])
            hit = (k < crlf_pos.size) & (crlf_pos[np.minimum(k, crlf_pos.size - 1)] == wh[ab])
            s0[ab[hit]] = streak_last[streak[k[hit]]] + 1
    at_end = run_at_end[r]
    live = s0 < we
    starts[s0[live]] = True
    nl_cut = last_nl + 1
    cond = (last_nl >= wh) & (nl_cut < we) & (nl_cut > s0)
    if whole_at_end:
        cond &= ~at_end
    starts[nl_cut[cond]] = True
    last = we - 1
    last_cp = c[last]
    cond = ~at_end & (last > s0) & (last_cp != CR) & (last_cp != LF)
    starts[last[cond]] = True


def _starts_gpt4(cps: np.ndarray, cls: np.ndarray, digits: int, whole_at_end: bool) -> np.ndarray:
    n = cps.shape[0]
    c = cps.view(np.int32)
    runs = _Runs(c, _KIND_GPT4[cls])
    starts = np.zeros(n, dtype=bool)
    k = runs.kind
    o_start = (k == 3) & (runs.prev_cp != SPACE)
    ws_prefix = (runs.prev_kind == 2) & ~runs.prev_crlf
    o_prefix = (runs.prev_kind == 3) & runs.prev_single & (runs.prev2_cp != SPACE)
    letters = k == 0
    starts[runs.heads[o_start | (letters & ~ws_prefix & ~o_prefix)]] = True
    site = np.flatnonzero(letters & o_prefix & (runs.prev_cp == APOS))
    if site.size:
        re = np.zeros(n, dtype=np.int64)
        re[runs.heads[site]] = runs.ends[site]
        _contraction_starts(cps, re, runs.heads[site], starts, pairs_first=False)
    _digit_group_starts(runs, starts, digits)
    at_end = runs.ends == n
    _whitespace_run_starts(c, runs, starts, runs.prev_kind == 3, at_end, whole_at_end)
    return starts


@lru_cache(maxsize=None)
def _cp_kind_gpt4(engine: str) -> np.ndarray:
    """Run kind per code point (0 L, 1 N, 2 whitespace, 3 other): one gather per text instead of two."""
    return _KIND_GPT4[_table(engine)]


def _whitespace_run_loop(c, starts, a, b, absorbed, at_end, keep_whole):
    """Loop form of `_whitespace_run_starts` for one whitespace run [a, b), shared by the three numba loops: CR/LF
    absorbed by the previous punctuation piece are skipped, a piece starts after the last CR/LF (unless the whole run
    is one piece: cl100k's `\\s++$` at the end of text), and before the last character when a non-space follows
    (`\\s+(?!\\S)`)."""
    s0 = a
    if absorbed:
        while s0 < b and (c[s0] == 10 or c[s0] == 13):
            s0 += 1
    last_nl = -1
    for j in range(b - 1, a - 1, -1):
        if c[j] == 10 or c[j] == 13:
            last_nl = j
            break
    if s0 < b:
        starts[s0] = True
    if last_nl >= a and last_nl + 1 < b and last_nl + 1 > s0 and not keep_whole:
        starts[last_nl + 1] = True
    if not at_end and b - 1 > s0 and c[b - 1] != 10 and c[b - 1] != 13:
        starts[b - 1] = True


def _gather(table, cps):
    """table[cps] as a compiled loop: numpy's fancy index holds the GIL and costs ~3x this on 4M characters, and
    it runs once per chunk thread."""
    out = np.empty(cps.shape[0], dtype=table.dtype)
    for i in range(cps.shape[0]):
        out[i] = table[cps[i]]
    return out


try:
    from numba import njit as _njit_ws
    _whitespace_run_loop = _njit_ws(cache=True, nogil=True, inline="always")(_whitespace_run_loop)
    _gather = _njit_ws(cache=True, nogil=True)(_gather)
except ImportError:   # pragma: no cover - numba absent
    pass


def _gpt4_loop_impl(c, kind, digits, whole_at_end, starts):
    """The run-level cl100k-lineage rules as one loop over runs (same rules as `_starts_gpt4`, numba-compiled)."""
    n = c.shape[0]
    a = 0
    prev_kind = -1
    prev_len = 0
    while a < n:
        k = kind[a]
        b = a + 1
        while b < n and kind[b] == k:
            b += 1
        pc = c[a - 1] if a > 0 else -1
        p2 = c[a - 2] if a > 1 else -1
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


try:
    from numba import njit as _njit
    _gpt4_loop = _njit(cache=True, nogil=True)(_gpt4_loop_impl)
except ImportError:   # pragma: no cover
    _gpt4_loop = None


def _starts_gpt4_loop(cps: np.ndarray, engine: str, digits: int, whole_at_end: bool) -> np.ndarray:
    starts = np.zeros(cps.shape[0], dtype=np.bool_)
    _gpt4_loop(cps.view(np.int32), _gather(_cp_kind_gpt4(engine), cps), digits, whole_at_end, starts)
    return starts


def _starts_o200k(cps: np.ndarray, cls: np.ndarray) -> np.ndarray:
    n = cps.shape[0]
    c = cps.view(np.int32)
    runs = _Runs(c, _KIND_O200K[cls])
    starts = np.zeros(n, dtype=bool)
    k = runs.kind
    o_start = (k == 3) & (runs.prev_cp != SPACE)
    ws_prefix = (runs.prev_kind == 2) & ~runs.prev_crlf
    o_prefix = (runs.prev_kind == 3) & runs.prev_single & (runs.prev2_cp != SPACE)
    words = k == 0
    starts[runs.heads[o_start | (words & ~ws_prefix & ~o_prefix)]] = True
    word_heads = runs.heads[words]
    sub_heads = word_heads
    covered = None
    site_r = np.flatnonzero(words & (runs.prev_cp == APOS) & runs.prev_single
                            & (np.append([-1, -1], k[:-2]) == 0))
    if site_r.size:
        re = np.zeros(n, dtype=np.int64)
        rs = np.zeros(n, dtype=np.int64)
        re[runs.heads[site_r]] = runs.ends[site_r]
        left = runs.heads[site_r] - 2
        rs[left] = runs.heads[np.searchsorted(runs.heads, left, side="right") - 1]
        sub = np.zeros(n, dtype=bool)
        covered = np.zeros(n, dtype=bool)
        _o200k_contractions(cps, re, rs, runs.heads[site_r], starts, sub, covered)
        cuts = np.flatnonzero(sub)
        if cuts.size:
            sub_heads = _sorted_union(word_heads, cuts)
    # Case rule at upper-case letters that are not a (sub-)run head.
    up = (cls & (_LU | _LT)) != 0
    cand = np.flatnonzero(up)
    if cand.size:
        cand = cand[(cand > 0)]
        sub_start = sub_heads[np.maximum(np.searchsorted(sub_heads, cand, side="right") - 1, 0)]
        cand_ok = sub_start < cand
        cand, sub_start = cand[cand_ok], sub_start[cand_ok]
    if cand.size:
        pcls = cls[cand - 1]
        prev_both = (pcls & (_B["Lm"] | _B["Lo"] | _M)) != 0
        nb_low = ~prev_both & ((pcls & _LL) != 0)
        hard = np.flatnonzero(prev_both)
        if hard.size:
            # the nearest non-B letter before i inside the sub-run, and whether only upper letters follow
            wcls = cls
            nonb = np.flatnonzero(((wcls & (_L | _M)) != 0) & ((wcls & (_B["Lm"] | _B["Lo"] | _M)) == 0))
            j = np.searchsorted(nonb, cand[hard]) - 1
            p = np.where(j >= 0, nonb[np.maximum(j, 0)], -1)
            nb_low[hard] = (p >= sub_start[hard]) & ((cls[np.maximum(p, 0)] & _LL) != 0)
            run_end = runs.ends[np.searchsorted(runs.heads, cand[hard], side="right") - 1]
            nonup = np.flatnonzero(~up)
            q = np.searchsorted(nonup, cand[hard])
            nxt = np.where(q < nonup.size, nonup[np.minimum(q, nonup.size - 1)], n)
            nb_low[hard] |= nxt >= run_end
        starts[cand[nb_low]] = True
    if covered is not None:
        starts &= ~covered
    _digit_group_starts(runs, starts, 3)
    at_end = runs.ends == n
    _whitespace_run_starts(c, runs, starts, runs.prev_kind == 3, at_end, whole_at_end=False)
    _o200k_rare(cps, cls, c, runs, starts)
    return starts


@lru_cache(maxsize=None)
def _cp_kind_o200k(engine: str) -> np.ndarray:
    """Per code point: run kind (bits 0-1: 0 word, 1 N, 2 whitespace, 3 other) | 4 upper (Lu/Lt) | 8 lower (Ll) |
    16 mark."""
    t = _table(engine).astype(np.int64)
    kind = _KIND_O200K[t].astype(np.int64)
    kind |= np.where(t & (_LU | _LT), 4, 0) | np.where(t & _LL, 8, 0) | np.where(t & _M, 16, 0)
    return kind.astype(np.uint8)


def _o200k_loop_impl(c, feat, starts, rare):
    """The run-level o200k rules as one loop over runs (same rules as `_starts_o200k`); returns how many rare
    positions (mark after punctuation, '/' after CR/LF) it wrote to `rare` for the scalar rescan."""
    n = c.shape[0]
    nrare = 0
    a = 0
    prev_kind = -1
    prev_len = 0
    pprev_kind = -1          # kind of the run before the previous one
    prev_tail_full = False   # previous word run was entirely a contraction tail
    while a < n:
        k = feat[a] & 3
        b = a + 1
        while b < n and (feat[b] & 3) == k:
            b += 1
        pc = c[a - 1] if a > 0 else -1
        p2 = c[a - 2] if a > 1 else -1
        tail_full = False
        if k == 3:
            if pc != 32:
                starts[a] = True
            if c[a] == 47 and (pc == 10 or pc == 13):
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
            if x < b:
                # case rule: [PB]*[WB]+ | P+ from the sub-run start x
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


try:
    _o200k_loop = _njit(cache=True, nogil=True)(_o200k_loop_impl)
except NameError:   # pragma: no cover - numba absent
    _o200k_loop = None


def _starts_o200k_loop(cps: np.ndarray, engine: str) -> np.ndarray:
    n = cps.shape[0]
    starts = np.zeros(n, dtype=np.bool_)
    rare = np.empty(n, dtype=np.int64)
    c = cps.view(np.int32)
    nr = _o200k_loop(c, _gather(_cp_kind_o200k(engine), cps), starts, rare)
    if nr:
        cls = _table(engine)[cps]
        _o200k_rescan(cps, cls, c, np.sort(rare[:nr]), starts)
    return starts


def _o200k_rare(cps, cls, c, runs: _Runs, starts) -> None:
    """Combining mark right after punctuation; `/` right after CR/LF: rescan between synchronizing positions."""
    m_after_o = runs.heads[(runs.kind == 0) & (runs.prev_kind == 3)]
    m_after_o = m_after_o[(cls[m_after_o] & _M) != 0]
    slash = np.flatnonzero(c == SLASH)
    slash = slash[slash > 0]
    slash = slash[(c[slash - 1] == CR) | (c[slash - 1] == LF)]
    rare = _sorted_union(m_after_o, slash)
    if rare.size:
        _o200k_rescan(cps, cls, c, rare, starts)


def _o200k_rescan(cps, cls, c, rare, starts) -> None:
    """Recompute starts with the scalar matcher between the synchronizing positions around each rare position:
    after CR/LF before a non-whitespace non-'/' character, at digit-run edges, and the text ends."""
    n = c.shape[0]
    is_n = (cls & _N) != 0
    is_ws = (cls & _S) != 0
    after_crlf = np.flatnonzero((c[:-1] == CR) | (c[:-1] == LF)) + 1
    after_crlf = after_crlf[~is_ws[after_crlf] & (c[after_crlf] != SLASH)]
    digit_edge = np.flatnonzero(is_n[1:] != is_n[:-1]) + 1
    sync_pos = _sorted_union(np.array([0, n]), after_crlf, digit_edge)
    lo = sync_pos[np.searchsorted(sync_pos, rare, side="right") - 1]
    hi = sync_pos[np.searchsorted(sync_pos, rare, side="right")]
    for a, b in _merge_windows(lo, hi):
        starts[a:b] = False
        starts[_o200k_scan(cps, cls, a, b)] = True


# -- deepseek (three chained Split stages) ----------------------------------------------------------------------------
_ASCII_PUNCT = np.zeros(128, dtype=bool)
_ASCII_PUNCT[[ord(ch) for ch in "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"]] = True


def _starts_deepseek_dense(cps: np.ndarray, cls: np.ndarray) -> np.ndarray:
    """Per-character form of the DeepSeek rules; `_starts_deepseek` evaluates the same predicate once per run."""
    n = cps.shape[0]
    idx = np.arange(n)
    is_n = (cls & _N) != 0
    # Stage 1 `\p{N}{1,3}`: digit groups of three from each digit-run start; the gaps between are pieces.
    nrs, _ = _runs(is_n)
    seg = (idx == nrs) | (is_n & ((idx - nrs) % 3 == 0))
    # Stage 2: runs of the CJK ranges inside the non-digit pieces.
    cjk = (((cps >= 0x4E00) & (cps <= 0x9FA5)) | ((cps >= 0x3040) & (cps <= 0x309F))
           | ((cps >= 0x30A0) & (cps <= 0x30FF)))
    seg[1:] |= ~is_n[1:] & ~is_n[:-1] & (cjk[1:] != cjk[:-1])
    seg[0] = True
    # Stage 3 inside each segment (a segment end acts as the end of text; digit segments stay whole: no alternative
    # matches a digit, so they survive as unmatched spans).
    lm = ((cls & (_L | _M)) != 0) & ~is_n
    ps = (cls & (_P | _SY)) != 0
    ws = (cls & _S) != 0
    kind = np.where(lm, 0, np.where(ps, 1, np.where(ws, 2, np.where(is_n, 4, 3)))).astype(np.int8)
    rs, re = _runs(kind, seg)
    head = idx == rs
    seg_end = np.zeros(n, dtype=bool)
    seg_end[:-1] = seg[1:]
    seg_end[-1] = True
    in_seg_prev = ~seg                                   # char i-1 is in the same segment
    crlf = (cps == CR) | (cps == LF)
    prev_cp = np.where(in_seg_prev, _shift(cps.astype(np.int64), 1, -1), -1)
    prev_kind = np.where(in_seg_prev, _shift(kind, 1, -1), -1)
    prev_crlf = in_seg_prev & _shift(crlf, 1, False)
    prev_single = in_seg_prev & _shift(rs == idx, 1, False)
    in_seg_prev2 = in_seg_prev & _shift(in_seg_prev, 1, False)
    prev2_cp = np.where(in_seg_prev2, _shift(cps.astype(np.int64), 2, -1), -1)

    starts = seg.copy()
    # Punctuation/symbol run: ` ?[\p{P}\p{S}]+[\r\n]*` opens at the run head unless a space precedes.
    ps_start = (kind == 1) & head & (prev_cp != SPACE)
    # `[!-/...][A-Za-z]+`: a one-character ASCII punctuation run that starts a piece, followed by ASCII letters.
    ascii_letter = ((cps >= 65) & (cps <= 90)) | ((cps >= 97) & (cps <= 122))
    prev_ascii_punct = (prev_cp >= 0) & (prev_cp < 128) & _ASCII_PUNCT[np.clip(prev_cp, 0, 127)]
    punct_glue = (kind == 0) & head & (prev_kind == 1) & prev_single & (prev2_cp != SPACE) & prev_ascii_punct \
        & ascii_letter
    # `[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+`: non-CR/LF whitespace or an "other" character glues to the letters.
    lm_head = (kind == 0) & head
    glued = ((prev_kind == 2) & ~prev_crlf) | (prev_kind == 3)
    starts |= (lm_head & ~glued & ~punct_glue) | ps_start
    glue = np.flatnonzero(punct_glue)
    if glue.size:
        not_ascii = _first_at_or_after(~ascii_letter, idx, n)
        cut = not_ascii[glue]
        starts[cut[cut < re[glue]]] = True
    # Other characters (no alternative matches them): one unmatched span, except the last one before letters, which
    # is the prefix of the letter piece.
    other = kind == 3
    next_lm = np.zeros(n, dtype=bool)
    next_lm[:-1] = (kind[1:] == 0) & ~seg[1:]
    starts |= other & (head | ((idx == re - 1) & next_lm))
    absorbed = prev_kind == 1
    starts |= _whitespace_starts(ws, crlf, idx, rs, re, n, absorbed, seg_end, whole_at_end=False)
    return starts


def _ds_kind_table() -> np.ndarray:
    masks = np.arange(1 << len(charclass.CLASSES), dtype=np.int64)
    return np.where(masks & _N, 4, np.where(masks & (_L | _M), 0, np.where(masks & (_P | _SY), 1,
                    np.where(masks & _S, 2, 3)))).astype(np.int8)


_KIND_DS = _ds_kind_table()


def _starts_deepseek(cps: np.ndarray, cls: np.ndarray) -> np.ndarray:
    n = cps.shape[0]
    c = cps.view(np.int32)
    kind = _KIND_DS[cls]
    # Segments of stages 1-2: digit-run edges, digit groups of three, CJK-range edges between non-digits.
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    np.not_equal(kind[1:], kind[:-1], out=brk[1:])
    heads0 = np.flatnonzero(brk)
    kinds0 = kind[heads0]
    ends0 = np.append(heads0[1:], n)
    is_n = kind == 4
    seg = np.zeros(n + 1, dtype=bool)
    seg[0] = seg[n] = True
    nr = np.flatnonzero(kinds0 == 4)
    seg[heads0[nr]] = True
    seg[ends0[nr]] = True
    if nr.size:
        h = heads0[nr]
        counts = (ends0[nr] - h + 2) // 3
        first = np.cumsum(counts) - counts
        k = np.arange(counts.sum()) - np.repeat(first, counts)
        seg[np.repeat(h, counts) + 3 * k] = True
    cjk = (((c >= 0x4E00) & (c <= 0x9FA5)) | ((c >= 0x3040) & (c <= 0x309F)) | ((c >= 0x30A0) & (c <= 0x30FF)))
    seg[1:n] |= (cjk[1:] != cjk[:-1]) & ~is_n[1:] & ~is_n[:-1]
    brk |= seg[:n]
    runs = _Runs.__new__(_Runs)
    runs.heads = h = np.flatnonzero(brk)
    runs.ends = e = np.append(h[1:], n)
    runs.kind = kind[h]
    seg_head = seg[h]
    same = ~seg_head                                       # run head continues the previous run's segment
    runs.prev_kind = np.where(same, np.append(np.int8(-1), runs.kind[:-1]), -1)
    runs.prev_cp = np.where(same & (h > 0), c[np.maximum(h - 1, 0)], -1)
    prev2_ok = same & (h > 1) & ~seg[np.maximum(h - 1, 0)]
    runs.prev2_cp = np.where(prev2_ok, c[np.maximum(h - 2, 0)], -1)
    runs.prev_single = same & np.append(False, (e - h)[:-1] == 1)
    runs.prev_crlf = (runs.prev_cp == CR) | (runs.prev_cp == LF)

    starts = np.zeros(n, dtype=bool)
    k = runs.kind
    pc = runs.prev_cp
    ps_start = (k == 1) & (pc != SPACE)
    ascii_punct = (pc >= 0) & (pc < 128) & _ASCII_PUNCT[np.clip(pc, 0, 127)]
    head_cp = c[h]
    head_ascii = ((head_cp >= 65) & (head_cp <= 90)) | ((head_cp >= 97) & (head_cp <= 122))
    punct_glue = (k == 0) & (runs.prev_kind == 1) & runs.prev_single & (runs.prev2_cp != SPACE) & ascii_punct \
        & head_ascii
    glued = ((runs.prev_kind == 2) & ~runs.prev_crlf) | (runs.prev_kind == 3)
    starts[h[seg_head | ps_start | (k == 3) | ((k == 0) & ~glued & ~punct_glue)]] = True
    g = np.flatnonzero(punct_glue)
    if g.size:
        non_ascii = np.flatnonzero((kind == 0) & ~(((c >= 65) & (c <= 90)) | ((c >= 97) & (c <= 122))))
        q = np.searchsorted(non_ascii, h[g])
        cut = np.where(q < non_ascii.size, non_ascii[np.minimum(q, max(non_ascii.size - 1, 0))], n) \
            if non_ascii.size else np.full(g.size, n)
        starts[cut[cut < e[g]]] = True
    # the last "other" character before letters (same segment) is the letter piece's prefix
    x_then_lm = np.flatnonzero((k[:-1] == 3) & (k[1:] == 0) & same[1:])
    starts[e[x_then_lm] - 1] = True
    run_at_end = seg[e]
    _whitespace_run_starts(c, runs, starts, runs.prev_kind == 1, run_at_end, whole_at_end=False)
    return starts


_GPT4 = {"cl100k_base": (3, True), "llama3": (3, False), "qwen3": (1, False)}   # digit group, `\s++$`


@lru_cache(maxsize=None)
def _cp_feat_deepseek(engine: str) -> np.ndarray:
    """Per code point: kind (bits 0-2: 0 LM, 1 PS, 2 whitespace, 3 other, 4 N) | 8 CJK range | 16 ASCII letter |
    32 ASCII punctuation."""
    f = _KIND_DS[_table(engine)].astype(np.int64)
    cp = np.arange(f.shape[0])
    f |= np.where(((cp >= 0x4E00) & (cp <= 0x9FA5)) | ((cp >= 0x3040) & (cp <= 0x309F))
                  | ((cp >= 0x30A0) & (cp <= 0x30FF)), 8, 0)
    f |= np.where(((cp >= 65) & (cp <= 90)) | ((cp >= 97) & (cp <= 122)), 16, 0)
    f[:128] |= np.where(_ASCII_PUNCT, 32, 0)
    return f.astype(np.uint8)


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
    n = c.shape[0]
    a = 0
    prev_kind = -1
    prev_len = 0
    seg_start = 0
    while a < n:
        k = feat[a] & 7
        b = a + 1
        while b < n and (feat[b] & 7) == k and not _ds_seg_head(feat, b):
            b += 1
        head = _ds_seg_head(feat, a)
        if head:
            seg_start = a
            starts[a] = True
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


try:
    _ds_seg_head = _njit(cache=True, nogil=True)(_ds_seg_head)
    _deepseek_loop = _njit(cache=True, nogil=True)(_deepseek_loop_impl)
except NameError:   # pragma: no cover - numba absent
    _deepseek_loop = None


def _starts_deepseek_loop(cps: np.ndarray, engine: str) -> np.ndarray:
    starts = np.zeros(cps.shape[0], dtype=np.bool_)
    _deepseek_loop(cps.view(np.int32), _gather(_cp_feat_deepseek(engine), cps), starts)
    return starts


# -- public API -----------------------------------------------------------------------------------------------------
def piece_starts(family: Family | str, cps: np.ndarray) -> np.ndarray:
    """bool[len(cps)]: True where a piece of the family's pre-tokenizer starts (cps: code points of normalized
    text)."""
    fam = _family(family)
    cps = np.ascontiguousarray(cps, dtype=np.uint32)
    if cps.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    if fam.name in _GPT4 and _gpt4_loop is not None:
        digits, whole = _GPT4[fam.name]
        return _starts_gpt4_loop(cps, fam.engine, digits, whole)
    if fam.name == "o200k_base" and _o200k_loop is not None:
        return _starts_o200k_loop(cps, fam.engine)
    if fam.name == "deepseek_v4" and _deepseek_loop is not None:
        return _starts_deepseek_loop(cps, fam.engine)
    cls = _table(fam.engine)[cps]
    if fam.name == "cl100k_base":
        return _starts_gpt4(cps, cls, digits=3, whole_at_end=True)
    if fam.name == "llama3":
        return _starts_gpt4(cps, cls, digits=3, whole_at_end=False)
    if fam.name == "qwen3":
        return _starts_gpt4(cps, cls, digits=1, whole_at_end=False)
    if fam.name == "o200k_base":
        return _starts_o200k(cps, cls)
    if fam.name == "deepseek_v4":
        return _starts_deepseek(cps, cls)
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
