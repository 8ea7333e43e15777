"""Stable (synchronizing) boundaries: character-class transitions at which a family's pre-tokenizer provably splits.

A position p of a text T is *stable* for a family when the two characters x = T[p-1] and y = T[p] alone guarantee:

  (i)  p is a piece boundary of every text that has x at p-1 and y at p, whatever lies left of p-1 or right of p;
  (ii) every regex match attempt that starts left of p reads nothing at or beyond p+1.

Splice theorem (docs/boundaries.md): matching restarts at each match end and no pattern looks behind, so the pieces
right of a boundary p are a function of T[p:] alone; by (ii) the pieces left of p are a function of T[:p+1]. Hence if
old and new text agree on [0, d) and p is stable with p + 1 <= d, the cached tokens left of p are the new tokens left
of p, and the tokens of any window T[s:] with s <= p - 1 right of p are the new tokens right of p.

Every rule below is derived alternative by alternative in docs/boundaries.md for one frozen splitter configuration
(`Family.splitter_hash`) and one probed class table (`charclass.table_hash`). `rule_for` refuses (returns None, i.e.
always full encode) when either hash differs from the one the derivation names. The rules are conservative: they
may miss boundaries (a miss costs a wider window), never accept a wrong one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Callable

import numpy as np

from ..spec.charclass import (
    BIT,
    N_CODEPOINTS,
    class_table,
    derived_table,
    numeric_hash,
    numeric_table,
    table_hash,
)
from ..spec.families import Family
from . import kernels
from .lazyjit import njit, numba_global  # numba itself only when a JIT kernel runs (lazyjit.py)

_get_code_point = numba_global("numba.cpython.unicode", "_get_code_point")

LOOKBACK = 1    # a: characters left of p the predicate reads (x = T[p-1])
LOOKAHEAD = 1   # b: characters from p on the predicate and every left match attempt read (y = T[p])

# The probed class table every derivation was checked against (charclass.PINNED).
TABLE_SHA256 = "7b30e600dcd6942538555137b4ce7b90ef70889e3cc72b5dc6f8d5e334a229de"

_L, _N, _M, _S, _P, _SYM = BIT["L"], BIT["N"], BIT["M"], BIT["s"], BIT["P"], BIT["S"]
_CR, _LF, _APOS, _SLASH, _SPACE = 0x0D, 0x0A, 0x27, 0x2F, 0x20
# The probed HF Digits table (charclass.numeric_table) the smollm2 derivation was checked against.
NUMERIC_SHA256 = "febbf9708ac79170530336d86cb39e21b93086b2a1a9a1b6a55f98345167797c"

Predicate = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def _crlf(cp: np.ndarray) -> np.ndarray:
    return (cp == _CR) | (cp == _LF)


def _cl100k_like(digits_single: bool) -> Predicate:
    """cl100k_base, llama3 (digit groups of 3) and qwen3 (single digits): contractions first, letters after an
    optional one-char prefix, digits, punctuation runs with a CR/LF tail, whitespace alternatives."""
    def rule(cx, x, cy, y):
        letter_end = ((cx & _L) != 0) & ((cy & _L) == 0)                      # R1
        nx, ny = (cx & _N) != 0, (cy & _N) != 0
        digit_edge = (nx | ny) if digits_single else (nx != ny)               # R2
        newline_end = _crlf(x) & ((cy & _S) == 0)                             # R3
        other = (cx & (_L | _N | _S)) == 0
        punct_space = other & ((cy & _S) != 0) & ~_crlf(y)                   # R4
        return letter_end | digit_edge | newline_end | punct_space
    return rule


def _o200k(cx, x, cy, y):
    """o200k_base: case-split letter runs (marks inside), contractions AFTER letters, `[\\r\\n/]*` punctuation tail."""
    letter_end = ((cx & _L) != 0) & ((cy & (_L | _M)) == 0) & (y != _APOS)    # R1
    digit_edge = ((cx & _N) != 0) != ((cy & _N) != 0)                        # R2
    newline_end = _crlf(x) & ((cy & _S) == 0) & (y != _SLASH)                # R3
    other = (cx & (_L | _N | _S)) == 0                                       # marks included
    punct_space = other & ((cy & _S) != 0) & ~_crlf(y)                       # R4
    return letter_end | digit_edge | newline_end | punct_space


def _cjk(cp: np.ndarray) -> np.ndarray:
    return (((cp >= 0x4E00) & (cp <= 0x9FA5)) | ((cp >= 0x3040) & (cp <= 0x309F)) | ((cp >= 0x30A0) & (cp <= 0x30FF)))


def _deepseek(cx, x, cy, y):
    """deepseek_v4: Split(\\p{N}{1,3}) -> Split(CJK runs) -> Split(main); each stage re-splits every piece."""
    digit_edge = ((cx & _N) != 0) != ((cy & _N) != 0)                        # D1 (stage 1)
    cjk_edge = _cjk(x) != _cjk(y)                                            # D2 (stage 2)
    letter_end = ((cx & _L) != 0) & ((cy & (_L | _M)) == 0)                  # D3 (stage 3)
    newline_end = _crlf(x) & ((cy & _S) == 0)                                # D4
    punct_space = ((cx & (_P | _SYM)) != 0) & ((cy & _S) != 0) & ~_crlf(y)   # D5
    return digit_edge | cjk_edge | letter_end | newline_end | punct_space


def _smollm2(cx, x, cy, y):
    """smollm2: HF Digits (every Rust-numeric character alone) -> the GPT-2 pattern on each piece (a single space is
    the only prefix, contractions are lowercase and lead their letters, `\\s+(?!\\S)` leaves a run's last character)."""
    num = numeric_table()
    nx, ny = num[x], num[y]
    wx, wy = (cx & _S) != 0, (cy & _S) != 0
    lx, ly = (cx & _L) != 0, (cy & _L) != 0
    digit_edge = nx | ny                                                     # G1 (stage 1)
    letter_end = lx & ~ly                                                    # G2
    space_end = wx & (x != _SPACE) & ~wy                                     # G3
    other = ~lx & ~wx & ~nx
    other_end = other & (wy | (ly & (x != _APOS)))                           # G4
    return digit_edge | letter_end | space_end | other_end


@dataclass(frozen=True)
class BoundaryRule:
    family: str
    splitter_hash: str          # Family.splitter_hash the derivation was made for
    engine: str                 # which probed class table ("tiktoken" | "hf")
    predicate: Predicate
    lookback: int = LOOKBACK
    lookahead: int = LOOKAHEAD

    def first_stable(self, text: str, start: int, stop: int, inert: np.ndarray | None = None) -> int | None:
        """The first stable position p with start <= p < stop (1 <= start, stop <= len(text)), or None; the same
        answer as the first of `stable_positions` over that range. `inert` (an NFC inert table): text[p-1], text[p]
        and text[p+1] (when there is one) must be inert too. A numba scan of the str's own buffer through the
        rule's pair table (~1 us), instead of ~30 numpy calls under the GIL."""
        if not (1 <= start and stop <= len(text)):
            raise IndexError(f"search range [{start}, {stop}) outside 1..{len(text)}")
        sig, pair = pair_table(self)
        use_inert = inert is not None
        p = kernels.get().scan_first_stable(text, start, stop, sig, pair, inert if use_inert else _NO_INERT, use_inert)
        return p if p >= 0 else None

    def stable_positions(self, text: str, offset: int = 0) -> np.ndarray:
        """Absolute positions offset+i (1 <= i <= len(text)-1) that are stable, judged from text[i-1] and text[i].
        The caller passes a slice that holds every character the predicate reads."""
        if len(text) < 2:
            return np.zeros(0, dtype=np.int64)
        cp = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
        cls = class_table(self.engine)[cp]
        x, y = cp[:-1], cp[1:]
        hit = self.predicate(cls[:-1], x, cls[1:], y)
        return np.flatnonzero(hit) + (offset + 1)


def _signatures(engine: str) -> tuple[np.ndarray, np.ndarray]:
    """Per code point, the id of everything a predicate reads about a character (its class bits among L, N, M, \\s,
    P, S; whether it is CR, LF, an apostrophe, a slash or a space; CJK-range membership; for HF, Digits-numeric
    beyond \\p{N}), and one representative code point per id. Equal ids mean the predicates cannot tell two
    characters apart."""
    cls = class_table(engine)
    cp = np.arange(cls.shape[0], dtype=np.int32)
    key = (cls.astype(np.int32) & (_L | _N | _M | _S | _P | _SYM)) * 32 + _cjk(cp) * 8
    if engine == "hf":      # HF's Digits splits on Rust's is_numeric, a superset of \\p{N} (smollm2)
        key += (numeric_table() & ((cls & _N) == 0)) * 16
    for code, ch in enumerate((_CR, _LF, _APOS, _SLASH, _SPACE), start=1):
        key[ch] += code
    # ids by a dense key table (np.unique would sort 1.1M keys: ~50 ms on the first parallel encode)
    present = np.zeros(int(key.max()) + 1, dtype=bool)
    present[key] = True
    n_sig = int(present.sum())
    if n_sig > 255:
        raise ValueError(f"{n_sig} character signatures do not fit a uint8 id")
    ids = (np.cumsum(present) - 1).astype(np.uint8)[key]
    first = np.empty(n_sig, dtype=np.uint32)
    first[ids[::-1]] = cp[::-1]          # the last write per id wins: its smallest code point
    return ids, first


@cache
def pair_table(rule: BoundaryRule) -> tuple[np.ndarray, np.ndarray]:
    """(signature id per code point, uint8[n_sig, n_sig] stable flag): the predicate itself evaluated once on every
    pair of representatives, so the table says exactly what the predicate says (tests compare the two). For the
    frozen rules both arrays are cached on disk (charclass.derived_table: keyed by the pinned tables and this
    file's source), which saves ~25-30 ms of a fresh process's first parallel encode."""
    if RULES.get(rule.family) is not rule:
        return _pair_table(rule)
    built: list[tuple[np.ndarray, np.ndarray]] = []

    def build(i: int) -> np.ndarray:
        if not built:
            built.append(_pair_table(rule))
        return built[0][i]

    numeric = rule.engine == "hf"
    sig = derived_table(f"boundary-sig-{rule.family}", rule.engine, (N_CODEPOINTS,), np.uint8, lambda: build(0),
                        __file__, numeric=numeric)
    n = int(sig.max()) + 1
    pair = derived_table(f"boundary-pair-{rule.family}", rule.engine, (n, n), np.uint8, lambda: build(1), __file__,
                         numeric=numeric)
    return sig, pair


def _pair_table(rule: BoundaryRule) -> tuple[np.ndarray, np.ndarray]:
    sig, rep = _signatures(rule.engine)
    n = rep.shape[0]
    cls = class_table(rule.engine)
    x = np.repeat(rep, n)
    y = np.tile(rep, n)
    stable = rule.predicate(cls[x], x, cls[y], y).reshape(n, n)
    return sig, np.ascontiguousarray(stable, dtype=np.uint8)


_NO_INERT = np.ones(1, dtype=np.bool_)


def _scan_first_stable_impl(text, start, stop, sig, pair, inert, use_inert):
    if start >= stop:
        return -1
    n = len(text)
    x = _get_code_point(text, start - 1)
    for p in range(start, stop):
        y = _get_code_point(text, p)
        if pair[sig[x], sig[y]]:
            if not use_inert:
                return p
            if inert[x] and inert[y] and (p + 1 >= n or inert[_get_code_point(text, p + 1)]):
                return p
        x = y
    return -1


# holds the GIL: a scan is ~1 us, and releasing the GIL would hand it to a waiting chunk thread, which keeps it
# for its own glue before this thread gets it back (measured: 25-70 us per cut under contention)
_scan_first_stable = njit(cache=True)(_scan_first_stable_impl)


RULES: dict[str, BoundaryRule] = {
    "cl100k_base": BoundaryRule("cl100k_base", "39f535afc04f0a03fb7cf890321b8114d5fb1ec6b67e8bf959697f7f91589579",
                                "tiktoken", _cl100k_like(digits_single=False)),
    "o200k_base": BoundaryRule("o200k_base", "5c820f4df683f5eea5aa0db12b8350ba0afebc7fe6eb13c7b5382a2e201103ed",
                               "tiktoken", _o200k),
    "llama3": BoundaryRule("llama3", "680ad71cfc89194a87121c77061171f76db6c979ed0ea55a49b1f363ccf84e94",
                           "tiktoken", _cl100k_like(digits_single=False)),
    "qwen3": BoundaryRule("qwen3", "c6965e385661ec033ac6ffb1f8d5fb7a16d3a912c9c940b44dbc7d804d9df966",
                          "hf", _cl100k_like(digits_single=True)),
    "deepseek_v4": BoundaryRule("deepseek_v4", "59a6898ff02e65f945412edccde80a37e370b03a027088f580d434dab5a41b8b",
                                "hf", _deepseek),
    "smollm2": BoundaryRule("smollm2", "a9301d28c2c1ceed6ebba71008926e184b3d5c77a28bd82e5a2aca59b7a61f27",
                            "hf", _smollm2),
}


def rule_for(family: Family) -> BoundaryRule | None:
    """The derived rule for a frozen family, or None (always full encode) when the splitter configuration or the
    probed class table is not the one the derivation in docs/boundaries.md was made for."""
    rule = RULES.get(family.name)
    if rule is None or rule.splitter_hash != family.splitter_hash:
        return None
    if not _table_ok(rule.engine):
        return None
    if family.name == "smollm2" and not _numeric_ok():
        return None
    return rule


@cache
def _numeric_ok() -> bool:
    return numeric_hash(numeric_table()) == NUMERIC_SHA256


@cache
def _table_ok(engine: str) -> bool:
    return table_hash(class_table(engine)) == TABLE_SHA256
