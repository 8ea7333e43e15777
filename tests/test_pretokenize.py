"""Piece-boundary differential tests: the per-character predicate vs the reference splitter (HF Split, Onig).

Both levels are needed (see docs/pretokenizer.md): a wrong split whose halves BPE-encode to the same IDs passes an
ID-level test, so this file compares piece spans directly.
"""

import json
import random
import unicodedata
from functools import cache

import numpy as np
import pretokenize_oracles as oracles
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from realtext import corpus_lines

import tokenplane
from tokenplane.tokenize.cpu import o200k_rescan, pretokenize
from tokenplane.tokenize.spec import charclass

FAMILIES = ["cl100k_base", "o200k_base", "llama3", "qwen3", "deepseek_v4", "smollm2"]


@cache
def unicode_skew() -> tuple[str, ...]:
    """Code points where Python's unicodedata disagrees with the probed class table (L, N, M, whitespace)."""
    table = charclass.class_table("tiktoken")
    bit = charclass.BIT
    out = []
    for cp in range(0x110000):
        if 0xD800 <= cp < 0xE000:
            continue
        cat = unicodedata.category(chr(cp))
        k = int(table[cp])
        if (cat[0] == "L") != bool(k & bit["L"]) or (cat[0] == "N") != bool(k & bit["N"]) \
                or (cat[0] == "M") != bool(k & bit["M"]):
            out.append(chr(cp))
    return tuple(out)


ALPHABET = (list("aAzZ'sStTlLvVeErRdDmM \n\r\t/.,!(_-\"#0123456789") + ["ſ", "日", "本", "ʰ", "ǅ", "é", "ß", "İ", "٣",
            "½", "²", "\u0301", "\u0903", "\u00a0", "\u3000", "\u200d", "\u0085", "\u2028", "\x0b", "\x0c", "あ",
            "ア", "・", "ー", "゛", "\u3099", "中", "。", "，", "👍", "\U0001F3FD", "\ue000", "\u0378", "\x00", "\u00ad"])

FRAGMENTS = ["'s", "'S", "'ſ", "'ll", "'LL", "'Re", "'ve", "don't", "ABCdef", "iPhone", "HTTPServer", "日本B",
             "日Bc", "12345678", "1,000", "  \n  ", "\r\n\r\n", "   ", "\n\n\n    x", "};\n// c", ".\n/\n/", "x/\ny",
             " .\u0301a", "..\u0301a", ".\u0301.", "\u0301A", "e\u0301", "नमस्ते", "สวัสดี", "👨\u200d👩\u200d👧",
             "你好，世界。", "カタカナ・ひらがな", "'hello", "\"Quote\"", "(x)", "a\tb", " \t\n", "x  ", "x \n"]


def _text_strategy():
    skew = unicode_skew()
    char = st.one_of(st.sampled_from(ALPHABET), st.sampled_from(skew[:: max(1, len(skew) // 4000)]),
                     st.characters(blacklist_categories=("Cs",)))
    unit = st.one_of(char, st.sampled_from(FRAGMENTS), char.map(lambda c: c * 5))
    return st.lists(unit, max_size=30).map("".join)


def _check(name: str, text: str) -> None:
    tok = tokenplane.load(name)
    norm = tok.normalize(text)
    ref = tok.reference.pretokenize(norm)
    got = pretokenize.pieces(name, norm)
    if got != ref:
        first = min(set(got) ^ set(ref))
        lo = max(0, first[0] - 20)
        raise AssertionError(f"{name}: pieces differ near {norm[lo:first[0] + 20]!r}\n ref {ref[:40]}\n got {got[:40]}")


@pytest.mark.parametrize("name", FAMILIES)
def test_supported_and_pinned(name):
    assert pretokenize.supported(tokenplane.load(name).family)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("text", FRAGMENTS + ["", "a", " ", "\n", "x" * 3 + "  ", "end with space ", "end\n\n \t",
                                              "'", "''s", "x's's", "a's'sb", "A'S'T", "x'vE", " 's", "1'st"])
def test_fragments(name, text):
    _check(name, text)


@pytest.mark.parametrize("name", FAMILIES)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_text_strategy())
def test_adversarial(name, text):
    _check(name, text)


@pytest.mark.parametrize("name", FAMILIES)
def test_dense_random_alphabet(name):
    rng = random.Random(name)
    for _ in range(400):
        _check(name, "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 30))))


def test_o200k_slash_after_newline_every_short_context():
    """'/' after CR/LF is rescanned only when a punctuation (or mark) character precedes the CR/LF run (the one way
    `[\\r\\n/]*` chains into it): every string of up to 4 characters over the characters that decide it, and longer
    random ones, split exactly as the reference splits them."""
    import itertools

    chars = ["a", ".", "/", "\n", "\r", " ", "1", "\u0301", "\t"]
    for n in range(1, 5):
        for combo in itertools.product(chars, repeat=n):
            _check("o200k_base", "".join(combo) + "/x")
    rng = random.Random(17)
    for _ in range(3000):
        _check("o200k_base", "".join(rng.choice(chars + ["A", "é", "!"]) for _ in range(rng.randint(6, 24))))


def _compiled_rescan(cps: np.ndarray, table: np.ndarray, rare: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """o200k_rescan._rescan_bits (the full encode's) on `starts` packed into a bitmap; the starts it leaves, as bools."""
    sb = np.zeros((len(cps) >> 6) + 1, dtype=np.uint64)
    packed = np.packbits(starts, bitorder="little")
    sb.view(np.uint8)[:packed.shape[0]] = packed
    assert o200k_rescan._rescan_bits(cps, table, rare, sb) == 0
    return np.unpackbits(sb.view(np.uint8), bitorder="little")[:len(cps)].astype(np.bool_)


def test_o200k_local_rescan_equals_whole_text_rescan():
    """The local rescans find each rare position's synchronizing positions near it (the staged path's in growing
    numpy windows, the full encode's compiled one by a scan); on texts whose rare positions sit far from any
    synchronizing position (long lines without digits: the windows must grow past 256 and 1024 characters), near the
    ends, and close together, both write the same starts as the whole-text form, and the pieces equal the
    reference."""
    from tokenplane.tokenize.cpu import kernels

    rng = random.Random(5)
    shapes = [".\n/", "!\u0301", "a.\r\n/b", "}\n\n/", "(\u0301\u0301", "/\n/"]
    table = pretokenize._table("tiktoken")
    for trial in range(40):
        parts = []
        for _ in range(rng.randint(1, 6)):
            parts.append("word " * rng.choice([0, 1, 60, 300, 700]))
            parts.append(rng.choice(shapes))
            if rng.random() < 0.3:
                parts.append(str(rng.randint(0, 999)))
        text = "".join(parts)
        cps = pretokenize.codepoints(text)
        c = cps.view(np.int32)
        k = kernels.get()
        starts = np.zeros(len(cps), dtype=np.bool_)
        rare = np.empty(len(cps), dtype=np.int64)
        nr = k.o200k_loop(c, k.gather_u8(pretokenize._cp_kind_o200k("tiktoken"), cps), starts, rare)
        assert nr > 0
        whole, local = starts.copy(), starts.copy()
        o200k_rescan._o200k_rescan(cps, table[cps], c, np.sort(rare[:nr]), whole)
        o200k_rescan._o200k_rescan_local(cps, table, c, np.sort(rare[:nr]), local)
        assert np.array_equal(whole, local), repr(text[:120])
        # the compiled rescan (the full encode's) on the same starts as a bitmap
        assert np.array_equal(_compiled_rescan(cps, table, np.sort(rare[:nr]), starts), local), repr(text[:120])
        if trial % 8 == 0:
            _check("o200k_base", text)


def test_o200k_compiled_rescan_equals_python_rescan_on_random_text():
    """o200k_rescan._rescan_bits (numba, on a bitmap; and _rescan_mask, the session windows' bool-mask form) against
    the Python matcher's local rescan, on random text over
    the pre-tokenizer alphabet with the rare shapes mixed in (a mark after punctuation, '/' after CR/LF after
    punctuation), each rare position's windows and merges included."""
    rng = random.Random(23)
    table = pretokenize._table("tiktoken")
    kind = pretokenize._cp_kind_o200k("tiktoken")
    units = ALPHABET + FRAGMENTS + [".\n/", "!\u0301", ";\r\n/", "(\u0301\u0301", "/\n/", "\u0301", "7"]
    checked = 0
    for _ in range(1500):
        text = "".join(rng.choice(units) * rng.choice([1, 1, 2, 5]) for _ in range(rng.randint(1, 40)))
        cps = pretokenize.codepoints(text)
        c = cps.view(np.int32)
        starts = np.zeros(len(cps), dtype=np.bool_)
        rare = np.empty(len(cps) + 1, dtype=np.int64)
        nr = pretokenize._o200k_loop(c, kind[cps], starts, rare)
        if nr == 0:
            continue
        checked += 1
        local = starts.copy()
        o200k_rescan._o200k_rescan_local(cps, table, c, np.sort(rare[:nr]), local)
        assert np.array_equal(_compiled_rescan(cps, table, np.sort(rare[:nr]), starts), local), repr(text[:120])
        mask = starts.copy()      # the session windows' form (bool mask in, bool mask out)
        assert o200k_rescan._rescan_mask(cps, table, np.sort(rare[:nr]), mask) == 0
        assert np.array_equal(mask, local), repr(text[:120])
    assert checked > 300


@pytest.mark.parametrize("name", FAMILIES)
def test_unicode_skew_code_points(name):
    """Characters whose class Python's unicodedata gets wrong: the probed table must be what decides."""
    skew = unicode_skew()
    assert len(skew) > 1000
    rng = random.Random(0)
    for _ in range(200):
        parts = [rng.choice(skew) if rng.random() < 0.5 else rng.choice(ALPHABET) for _ in range(12)]
        _check(name, "".join(parts))


def _corpus_docs(limit_chars: int):
    """Every len//12-th document of mixed and nonen, cut to limit_chars (the shipped fixtures hold exactly those)."""
    docs = []
    for fname in ("mixed", "nonen"):
        lines = corpus_lines(fname)
        for line in lines[:: max(1, len(lines) // 12)]:
            docs.append(json.loads(line)["text"][:limit_chars])
    return docs


@pytest.mark.parametrize("name", FAMILIES)
def test_corpus_slices(name):
    for doc in _corpus_docs(20_000):
        _check(name, doc)


@pytest.mark.campaign
@pytest.mark.parametrize("name", FAMILIES)
def test_corpus_full(name):
    for doc in _corpus_docs(10 ** 7):
        _check(name, doc)


def test_unsupported_family_raises():
    from tokenplane.tokenize.errors import UnsupportedFamily
    from tokenplane.tokenize.spec.families import Family

    generic = Family(name="hf-generic", engine="hf", patterns=("x",), onig_patterns=("x",))
    assert not pretokenize.supported(generic)
    with pytest.raises(UnsupportedFamily):
        pretokenize.piece_starts(generic, np.array([65], dtype=np.uint32))


@pytest.mark.parametrize("name", FAMILIES)
def test_run_level_equals_dense_form(name):
    """The run-level evaluation and the per-character (dense) form of the same predicate agree."""
    table = charclass.class_table("tiktoken")
    rng = random.Random(name + "dense")
    for _ in range(300):
        text = "".join(rng.choice(ALPHABET + FRAGMENTS) for _ in range(rng.randint(1, 25)))
        cps = pretokenize.codepoints(text)
        cls = table[cps]
        if name == "o200k_base":
            run, dense = oracles._starts_o200k(cps, cls), oracles._starts_o200k_dense(cps, cls)
            assert pretokenize._starts_o200k_loop(cps, "tiktoken").tolist() == run.tolist(), text
        elif name == "deepseek_v4":
            run, dense = oracles._starts_deepseek(cps, cls), oracles._starts_deepseek_dense(cps, cls)
            assert pretokenize._starts_deepseek_loop(cps, "hf").tolist() == run.tolist(), text
        elif name == "smollm2":
            run = pretokenize._starts_smollm2_loop(cps, "hf")
            dense = oracles._starts_smollm2_scan(cps, cls, charclass.numeric_table())
        else:
            digits = 1 if name == "qwen3" else 3
            whole = name == "cl100k_base"
            run = oracles._starts_gpt4(cps, cls, digits, whole)
            dense = oracles._starts_gpt4_dense(cps, cls, digits, whole)
            loop = pretokenize._starts_gpt4_loop(cps, "tiktoken", digits, whole)
            assert loop.tolist() == run.tolist(), text
        assert run.tolist() == dense.tolist(), text


SMOLLM2_CASES = ["x  1", "x 1", "x1", "1x", "a 1 b", "12 34", "x   \t1", "1  ", "  1", "1 x", "x\n1", "x \n 1",
                 "it's", "IT'S", "'s", " 's", "  's", "\t's", "x''s", "1's", "'re'll've'd'm't", "'rex", "'Re",
                 "don't 2", "٣٤ x", "x½y", "²x", "\U00011de0x", "a\U00016ff5 b", " \U00011de1 ", "x  ", "x\n\n\ny",
                 "x \u00a0 y", "a\u3000\u3000b", "e\u0301 x", " \u0301", "((x))  ", "a  !b", "\r\n\r\n x",
                 "ab12cd 34 ef", "v1.2.3", "$ 100", "x\x04y", "!\x04!", "\U00040000a"]


@pytest.mark.parametrize("text", SMOLLM2_CASES)
def test_smollm2_digits_and_gpt2_cases(text):
    """Digits next to letters and spaces ('x  1': the space run ends a Digits piece, so it is one piece), the
    Digits-only numerics (U+11DE0, U+16FF5: Rust is_numeric, not \\p{N}), lowercase-only contractions, whitespace runs,
    and bytes SmolLM2's vocabulary lacks (U+0004, lead byte F1)."""
    _check("smollm2", text)
    tok = tokenplane.load("smollm2")
    assert tok.encode(text, path="cpu").tolist() == tok.encode(text, path="reference").tolist()


def test_smollm2_x_two_spaces_1():
    tok = tokenplane.load("smollm2")
    assert tok.reference.pretokenize("x  1") == [(0, 1), (1, 3), (3, 4)]
    assert pretokenize.pieces("smollm2", "x  1") == [(0, 1), (1, 3), (3, 4)]


# Units around the loops' " word" step (a single space, then a letter run, taken in one step when nothing else can
# happen there) and the o200k loop's skip of the case rule for runs without an inner upper-case letter: the pairs it
# takes, and every neighbour that must send the pair back to the general path (two spaces, tab, CR/LF, a contraction
# or mark after the word, upper / title case inside the word, the text's end right after the space or the word).
SPACE_WORD_UNITS = [" ", "  ", " \t", "\t", "\n", "\r\n", " x", " word", " Word", " wORD", " WoRd", " ABC", " aBc",
                    " ǅx", " xǅ", " İx", " xİ", " ſ", " e\u0301", " \u0301a", "'s", "'S", "'ll", "'LL", "'ve", "'Re",
                    "don't", " don'T", ".", "..", "!", " .", "(", "12", "1234567", " 5", "日本", " 日", " ʰx",
                    " x\u0903", "_", "/", "\u00a0", " \u00a0x", "\u3000x", "é", " É", " éÉ", "ß", " ẞ", "'sAbC",
                    "'tXyZ", "'llaB"]


@pytest.mark.parametrize("name", FAMILIES)
def test_space_word_step_and_case_rule_skip(name):
    rng = random.Random(name + "space-word")
    texts = ["".join(rng.choice(SPACE_WORD_UNITS) for _ in range(rng.randint(1, 12))) for _ in range(400)]
    texts += [u for u in SPACE_WORD_UNITS] + [u + " " for u in SPACE_WORD_UNITS] + [" " + u for u in SPACE_WORD_UNITS]
    for text in texts:
        _check(name, text)
