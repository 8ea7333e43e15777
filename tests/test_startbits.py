"""The bit-parallel pre-tokenizers (cpu/startbits.py: the cl100k lineage, smollm2, DeepSeek V4, o200k) against the run
loops they replace in the full encode (pretokenize's loops, themselves checked against the reference tokenizers in
test_pretokenize.py): the same piece starts (and for o200k the same rare positions) on random text over the characters
every rule distinguishes, on runs placed across the 64-character word edges, and on real text; the bitmap UTF-8 +
bounds pass against the bool one; and the comparison is shown to catch a wrong feature table."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_pretokenize import ALPHABET, FRAGMENTS, _corpus_docs
from test_strbuf import bits_form_utf8

from tokenplane.tokenize.cpu import o200kbits, pretokenize, startbits, strbuf

FAMILIES = ["cl100k_base", "llama3", "qwen3", "smollm2", "deepseek_v4", "o200k_base"]


def _cps(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


def _loop_starts(name: str, cps: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """The run loop's starts, and for o200k its rare positions (before the rescan, which both forms share)."""
    if name != "o200k_base":
        return pretokenize.piece_starts(name, cps), None       # these families run no rescan
    table = pretokenize.loop_tables(name)[1][0]
    starts = np.zeros(cps.shape[0], dtype=np.bool_)
    rare = np.empty(cps.shape[0] + 1, dtype=np.int64)
    count = pretokenize._o200k_loop(cps.view(np.int32), table[cps], starts, rare)
    return starts, np.sort(rare[:count])


def _bits_starts(name: str, cps: np.ndarray, feat_table: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray | None]:
    form = startbits.bitmap_form(name)
    assert form is not None
    table, run = form
    table = table if feat_table is None else feat_table
    n = cps.shape[0]
    feat = np.zeros(n + startbits.PAD, dtype=np.uint8)
    feat[:n] = table[cps]
    sb = np.full((n >> 6) + 1, 0xFFFF, dtype=np.uint64)     # garbage: the kernel clears it
    rare = run(cps.view(np.int32), feat, sb)
    bits = np.unpackbits(sb.view(np.uint8), bitorder="little")
    assert not bits[n:].any()                                 # nothing past the text
    return bits[:n].astype(np.bool_), rare


def _assert_same(name: str, text: str) -> None:
    cps = _cps(text)
    ref, ref_rare = _loop_starts(name, cps)
    got, got_rare = _bits_starts(name, cps)
    if not np.array_equal(got, ref):
        i = int(np.flatnonzero(got != ref)[0])
        raise AssertionError(f"{name}: starts differ at {i} ({text[max(0, i - 12):i + 12]!r}): loop {ref[i]}, "
                             f"bits {got[i]}")
    if ref_rare is not None:
        assert got_rare is not None and np.array_equal(got_rare, ref_rare), (text[:80], ref_rare, got_rare)


def _random_texts(seed: str, count: int) -> list[str]:
    rng = random.Random(seed)
    units = ALPHABET + FRAGMENTS
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.choice([1, 2, 5, 20, 60])):
            u = rng.choice(units)
            parts.append(u * rng.choice([1, 1, 1, 2, 3, 7, 40, 70]))
        out.append("".join(parts))
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_bits_equal_loop_on_random_text(name):
    for text in _random_texts(name + "bits", 1500):
        _assert_same(name, text)


@pytest.mark.parametrize("name", FAMILIES)
def test_bits_equal_loop_across_word_edges(name):
    # every rule's context (one or two characters left, the run's own characters, the one right) placed so that it
    # straddles bit 63 / 64 of the masks, and runs longer than a word
    shapes = [" 's", "x'sy", "x'LLy", "x're", " .x", "..x", "\n.x", "\t(x", "a b", "a  b", "a\n b", ")\n x", "a\r\n",
              ".\n", "x \n\n  y", "1234567", "a12345b", " 12", "x" + " " * 70 + "y", "x" + "\n" * 65 + "y",
              "7" * 130 + "x", "'" * 3 + "s", ".'ve", " 've", "x\u00a0y", "x  ", "x \n",
              # o200k's case rule, contraction chains and rare shapes
              "aB", "ab\u0301Cd", "HTTPServer", "x'sY", "a'b'c's", "don't's", "x'rEad", ".\u0301a", ";\n/x", "é\u0301Z"]
    for shape in shapes:
        for offset in range(54, 74):
            for fill in ("a", " ", ".", "1"):
                _assert_same(name, fill * offset + shape)
                _assert_same(name, fill * offset + shape + fill * 3)


@pytest.mark.parametrize("name", FAMILIES)
def test_bits_equal_loop_on_whitespace_and_digit_runs(name):
    # the runs maskbits.py reads from the masks: whitespace runs mixing spaces, tabs, CR, LF and U+3000, and digit runs,
    # of 2 to 70 characters (a run of 64 or more takes the scalar code), after a letter, punctuation (which absorbs
    # leading CR/LF), a digit, a CJK character or nothing, before a letter, a digit, a CJK character, punctuation or
    # the text's end, starting anywhere in a word
    rng = random.Random(name + "runs")
    for _ in range(1500):
        length = rng.choice([2, 3, 4, 5, 6, 8, 13, 31, 57, 62, 63, 64, 65, 70])
        units = " \t\r\n\u3000" if rng.random() < 0.75 else "0123456789\u0663"
        run = "".join(rng.choice(units) for _ in range(length))
        before = rng.choice(["a", ".", ")", "1", "\u65e5", "", "'"])
        after = rng.choice(["b", "2", "\u672c", "", ".", " x", "\n"])
        text = rng.choice("a .1") * rng.randrange(0, 72) + before + run + after
        _assert_same(name, text)
    # DeepSeek's letter run glued to one ASCII punctuation mark: its ASCII letters go with the mark, the first other
    # letter (a mark, a non-ASCII letter) starts a piece, a CJK character ends the run
    for _ in range(1500):
        length = rng.choice([1, 2, 3, 5, 9, 31, 62, 63, 64, 65, 70])
        letters = "".join(rng.choice("abcXYZ\u00e9\u00df\u0301\u65e5") for _ in range(length))
        text = rng.choice("a .1") * rng.randrange(0, 72) + rng.choice([".", "(", "_", " .", "..", ""]) + letters
        _assert_same(name, text + rng.choice(["", " ", "1", "."]))
    for offset in range(40, 66):      # glued runs of ASCII letters ending on each side of a word's edge
        for tail in ("", "\u00e9", "x\u00e9"):
            _assert_same(name, "1" * offset + "." + "ab" * 10 + tail + " y")


@pytest.mark.parametrize("name", FAMILIES)
def test_bits_equal_loop_on_real_text(name):
    for doc in _corpus_docs(60_000):
        _assert_same(name, doc)


@pytest.mark.parametrize("name", ["cl100k_base", "smollm2"])
def test_a_wrong_feature_table_is_caught(name):
    form = startbits.bitmap_form(name)
    assert form is not None
    table = form[0].copy()
    table[0x27] &= ~np.uint8(startbits.FAP)      # the apostrophe no longer marked: contractions are missed
    cps = _cps("we'll say it's x'sy")
    assert not np.array_equal(_bits_starts(name, cps, table)[0], _loop_starts(name, cps)[0])
    assert np.array_equal(_bits_starts(name, cps)[0], _loop_starts(name, cps)[0])


def test_o200k_wrong_case_flags_are_caught():
    form = startbits.bitmap_form("o200k_base")
    assert form is not None
    table = form[0].copy()
    table[ord("B")] &= ~np.uint8(o200kbits.OU)      # 'B' no longer upper-case: the camelCase start is missed
    cps = _cps("camelBack and aBc")
    assert not np.array_equal(_bits_starts("o200k_base", cps, table)[0], _loop_starts("o200k_base", cps)[0])
    assert np.array_equal(_bits_starts("o200k_base", cps)[0], _loop_starts("o200k_base", cps)[0])


@pytest.mark.parametrize("wide", [False, True])
def test_bitmap_bounds_equal_bool_bounds(wide):
    rng = random.Random(f"bounds{wide}")
    pool = "abc xyz\n" if not wide else "日本語 ab é👍"
    for n in (1, 2, 63, 64, 65, 127, 128, 129, 1000, 5000):
        text = "".join(rng.choice(pool) for _ in range(n))
        cps = _cps(text)
        starts = np.array([i == 0 or rng.random() < 0.3 for i in range(n)], dtype=np.bool_)
        sb = np.zeros((n >> 6) + 2, dtype=np.uint64)
        packed = np.packbits(starts, bitorder="little")
        sb.view(np.uint8)[:packed.shape[0]] = packed
        sb[-1] |= np.uint64(1) << np.uint64(63)                       # a bit past n: ignored
        buf_a, bounds_a = np.zeros(4 * n + 16, np.uint8), np.zeros(n + 1, np.int64)
        buf_b, bounds_b = np.zeros(4 * n + 16, np.uint8), np.zeros(n + 1, np.int64)
        k_a, size_a = strbuf._utf8_and_bounds(cps, n, starts, buf_a, bounds_a)
        k_b, size_b = bits_form_utf8(cps, n, sb, buf_b, bounds_b)
        assert (k_a, size_a) == (k_b, size_b)
        assert np.array_equal(bounds_a[:k_a], bounds_b[:k_b])
        assert bytes(buf_b[:size_b]) == text.encode("utf-8")
