"""Slow oracles of the CPU pre-tokenizer, kept as test code: the per-character (dense) form of each family's rule
and the run-vectorized numpy form. Production runs only the compiled loops in tokenplane.tokenize.cpu.pretokenize;
tests compare the loops against both forms here and against the reference engine's own splitter."""

from __future__ import annotations

import numpy as np

from tokenplane.tokenize.cpu.o200k_rescan import (
    APOS,
    CR,
    LF,
    SLASH,
    SPACE,
    _merge_windows,
    _o200k_rescan,
    _o200k_scan,
    _sorted_union,
)
from tokenplane.tokenize.cpu.pretokenize import (  # noqa: F401 - shared tables and constants of the rules
    _ASCII_PUNCT,
    _B,
    _KIND_DS,
    _KIND_GPT4,
    _KIND_O200K,
    _L,
    _LL,
    _LT,
    _LU,
    _M,
    _N,
    _P,
    _S,
    _SY,
)


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


def utf8_offsets(cps: np.ndarray) -> np.ndarray:
    """Byte offset of every code point in the UTF-8 encoding (length len(cps)+1): the numpy form of
    cpu.bpe.piece_byte_bounds and cpu.strbuf.utf8_and_bounds."""
    width = 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
    off = np.zeros(cps.shape[0] + 1, dtype=np.int64)
    np.cumsum(width, out=off[1:])
    return off


def _starts_smollm2_scan(cps: np.ndarray, cls: np.ndarray, numeric: np.ndarray) -> np.ndarray:
    """smollm2 by emulation, independent of the run-level loop: HF Digits isolates every numeric character (the probed
    Rust is_numeric table), then the GPT-2 pattern `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|
    \\s+(?!\\S)|\\s+` is matched alternative by alternative from each match end, inside each digit-free segment."""
    n = cps.shape[0]
    starts = np.zeros(n, dtype=bool)
    cp = cps.tolist()
    def is_l(i: int) -> bool:
        return bool(cls[i] & _L)

    def is_n(i: int) -> bool:
        return bool(cls[i] & _N)

    def is_s(i: int) -> bool:
        return bool(cls[i] & _S)

    def match(p: int, end: int) -> int:
        for word in ("s", "t", "re", "ve", "m", "ll", "d"):
            w = "'" + word
            if p + len(w) <= end and "".join(map(chr, cp[p:p + len(w)])) == w:
                return p + len(w)
        for test in (is_l, is_n, lambda i: not (is_s(i) or is_l(i) or is_n(i))):
            q = p + 1 if cp[p] == SPACE and p + 1 < end else p
            e = q
            while e < end and test(e):
                e += 1
            if e > q:
                return e
        e = p
        while e < end and is_s(e):
            e += 1
        if e == end or e - p == 1:      # \s+(?!\S) at the segment end, else \s+ of one character
            return e
        return e - 1                    # \s+(?!\S) gives the last whitespace character back

    seg = 0
    while seg < n:
        if numeric[cp[seg]]:
            starts[seg] = True
            seg += 1
            continue
        end = seg
        while end < n and not numeric[cp[end]]:
            end += 1
        p = seg
        while p < end:
            starts[p] = True
            p = match(p, end)
        seg = end
    return starts
