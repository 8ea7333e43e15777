"""nfc.normalize (regions-only NFC) against the reference normalizer itself, on adversarial and real text."""

from __future__ import annotations

import random

import numpy as np
import pytest
from realtext import corpus_texts

import tokenplane
from tokenplane.tokenize.cpu import nfc, strbuf

# Characters where NFC acts: marks of many combining classes (incl. 240 and 232, the probe marks), Hangul L/V/T
# jamo and syllables, compatibility ideographs (singletons), composition exclusions, kana voicing marks, Indic
# two-part vowels, Greek with ypogegrammeni, marks newer than Python's Unicode tables, and inert neighbours.
TRICKY = (
    "ae\u00e9\u0301\u0300\u0316\u0345\u0315\u0327\u0328\u0308\u0344\u0340\u0958\u093c\u094d\u0915"
    "\u1100\u1161\u11a8\uac00\uac01\u3131\uf900\u2126\u212b\u0041\u030a\u304b\u3099\u309a\u30cf\u309a"
    "\u09c7\u09be\u09d7\u0b47\u0b3e\u0bc6\u0bbe\u0d46\u0d3e\u03b1\u1f00\u0313\u0342\u07fd\u0898\u08ca"
    "\u4e00 \n\t.1\U0001d15e\U0001d165\U0001d16e\U000110a5\U000110ba\U00011127\U00011131\ufb2c\u05e9\u05bc\u05c1"
)


@pytest.fixture(scope="module")
def qwen3():
    return tokenplane.load("qwen3").reference


def test_table_basics():
    table = nfc.inert_table()
    assert all(table[c] for c in range(128))            # ASCII: starters, never composed with
    for c in (0x0301, 0x0345, 0x0315, 0x1161, 0x11A8, 0x3099, 0x09BE, 0xF900, 0x212B, 0x0344):
        assert not table[c], hex(c)                      # marks, jamo V/T, seconds, singletons, exclusions
    for c in (0x4E00, 0xAC00, 0x00E9, 0x0915):
        assert table[c], hex(c)                          # composed and plain starters stay inert


def test_table_pinned_for_this_engine():
    import tokenizers
    pin = nfc.PINNED.get(f"tokenizers-{tokenizers.__version__}")
    if pin is None:
        pytest.skip("no pin for this tokenizers version (the probed table is still exact)")
    assert nfc.table_hash(nfc.inert_table()) == pin


def test_adversarial_equals_reference(qwen3):
    hf = qwen3._normalizer.normalize_str
    rng = random.Random(11)
    for trial in range(400):
        n = rng.choice([1, 5, 40, 300, nfc.SMALL_TEXT, 600, 2000, 5000, nfc.PRECHECK_TEXT + 10])
        dense = rng.random()      # from mostly-ASCII with rare tricky characters to all tricky
        chars = [rng.choice(TRICKY) if rng.random() < dense else rng.choice("abc xyz\n") for _ in range(n)]
        if trial % 7 == 0:        # every separator candidate inside a region (each widened onto the control left of
            chars += [chr(c) + "\u0301" for c in range(9)]     # its mark): the per-region fallback
        text = "".join(chars)
        assert nfc.normalize(text, hf) == hf(text), trial


def test_many_texts_each_equal_its_own_reference(qwen3):
    """normalize_many (one scan of the joined texts, then only the texts that hold a non-inert code point): each
    text's own NFC, whatever its neighbours; a mark at a text's start never composes with the text before it."""
    hf = qwen3._normalizer.normalize_str
    rng = random.Random(12)
    for trial in range(60):
        texts = []
        for _ in range(rng.choice([1, 3, 40])):
            n = rng.choice([0, 1, 3, 20, 200])
            dense = rng.choice([0.0, 0.05, 0.5])
            texts.append("".join(rng.choice(TRICKY) if rng.random() < dense else rng.choice("abc e\n")
                                 for _ in range(n)))
        texts += ["e", "\u0301x", "\u1100", "\u1161\u11a8", "plain", "y" * 600 + "e\u0301" + "z" * 100, "\u0300"]
        checked: list[int] = []
        got = nfc.normalize_many(texts, "".join(texts), hf, checked.append)
        assert got == [hf(t) for t in texts], trial
        assert set(checked) >= {i for i, t in enumerate(texts) if nfc.false_at(t, nfc.inert_table()).size}
    plain = ["abc", "d\u00e9f", "\u4e00"]
    assert nfc.normalize_many(plain, "".join(plain), hf) is plain      # all inert: the same list, no copy
    with_surrogate = ["fine", "bad \ud800", "e\u0301"]

    def refuse(i: int) -> None:
        if "\ud800" in with_surrogate[i]:
            raise ValueError(i)
    with pytest.raises(ValueError, match="1"):     # a lone surrogate is never inert: its text is checked first
        nfc.normalize_many(with_surrogate, "".join(with_surrogate), hf, refuse)


def test_regions_cover_every_change(qwen3):
    hf = qwen3._normalizer.normalize_str
    text = ("x" * 300 + "e\u0301" + "y" * 300 + "\u1100\u1161\u11a8" + "z" * 300) * 3
    spans = nfc.regions(text)
    assert spans.shape[0] == 6 and spans[0].tolist() == [300, 302]   # widened one left: the 'e' it composes with
    assert nfc.normalize(text, hf) == hf(text)


def test_regions_scan_equals_a_code_point_gather():
    """The str scan (strbuf.false_at over the str's own buffer, every PEP 393 kind, texts with more non-inert
    characters than its first array holds) finds the same positions, and so the same spans, as a numpy gather of the
    inert table over the code points; `all_inert`, the same scan, agrees with the gather too (a lone surrogate kept
    as its code unit: not inert)."""
    rng = random.Random(5)
    pool = list(TRICKY) + list("abc xyz\n\u00e9\u00ff\u4e00\U0001F44D")
    texts = ["", "abc", "caf\u00e9", "e\u0301", "\u00ff" * 40 + "\u0301", "\U0001F44D\u0301x", "\u0301" * 64,
             "\u0301" * 65]
    texts += ["".join(rng.choice(pool) for _ in range(rng.randint(1, 3000))) for _ in range(60)]
    for text in texts:
        cps = nfc_codepoints(text)
        want = np.flatnonzero(~nfc.inert_table()[cps]) if len(text) else np.zeros(0, np.int64)
        assert strbuf.false_at(text, nfc.inert_table()).tolist() == want.tolist()
        assert nfc.regions(text).tolist() == nfc._spans(want).tolist()
        assert nfc.all_inert(text) == (want.size == 0)
        for _ in range(4):      # a range of the text, read in place: the positions in it, as positions in text
            a = rng.randint(0, len(text))
            b = rng.randint(a, len(text) + 2)
            assert strbuf.false_at(text, nfc.inert_table(), a, b).tolist() == [i for i in want if a <= i < b]
    # mostly ASCII (the scan skips 64 ASCII units a step) with marks on the steps' edges, in each kind; and a table
    # that marks an ASCII letter (no step is skipped then)
    marked = nfc.inert_table().copy()
    marked[ord("q")] = False
    for tail in ("", "\u00e9", "\u4e00", "\U0001F44D"):
        for spots in ([0], [63], [64], [63, 64], [127, 128], [190], [199]):
            chars = [rng.choice("abq xyz\n") for _ in range(200)]
            for i in spots:
                chars[i] = "\u0301"
            text = "".join(chars) + tail
            cps = nfc_codepoints(text)
            for table in (nfc.inert_table(), marked):
                assert strbuf.false_at(text, table).tolist() == np.flatnonzero(~table[cps]).tolist()
    for text in ("abc\ud800", "\udfff", "x" * 100 + "\ud83d"):       # lone surrogates
        units = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        assert not nfc.inert_table()[units].all() and not nfc.all_inert(text)


def nfc_codepoints(text):
    from tokenplane.tokenize.cpu.pretokenize import codepoints
    return codepoints(text)


def test_real_text_equals_reference(qwen3):
    hf = qwen3._normalizer.normalize_str
    texts = corpus_texts("nonen")[:200]
    # decomposed forms of real text: every accented letter becomes a region
    texts += [hf(t).replace("\u00e9", "e\u0301").replace("\u00fc", "u\u0308") for t in texts[:50]]
    for t in texts:
        assert nfc.normalize(t, hf) == hf(t)
    big = "".join(texts)
    assert qwen3.normalize(big) == hf(big)
