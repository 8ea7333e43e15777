import numpy as np
import pytest

import tokenplane
from tokenplane import InvalidTextError, TextTooLargeError

NAMES = ["cl100k_base", "o200k_base", "llama3", "qwen3", "deepseek_v4", "smollm2"]
TEXT = "Hello world! 12345 <|endoftext|> 你好 <think>x</think> don't ſ'S\r\n\n  x"


@pytest.mark.parametrize("name", NAMES)
def test_encode_equals_reference_and_roundtrips(name):
    tok = tokenplane.load(name)
    ids = tok.encode(TEXT)
    assert ids.dtype == np.uint32
    if tok.family.engine == "tiktoken":
        assert ids.tolist() == tok.reference.encoding.encode_ordinary(TEXT)
    assert tok.decode(ids) == tok.normalize(TEXT)


@pytest.mark.parametrize("name", NAMES)
def test_allowed_special_matches_reference(name):
    tok = tokenplane.load(name)
    special = next(iter(tok.specials))
    text = f"a{special}b {special}"
    ordinary = tok.encode(text)
    allowed = tok.encode(text, allowed_special="all")
    assert tok.specials[special] not in ordinary.tolist()
    assert allowed.tolist().count(tok.specials[special]) == 2
    if tok.family.engine == "tiktoken":
        assert allowed.tolist() == tok.reference.encoding.encode(text, allowed_special="all")
    else:
        assert allowed.tolist() == tok.reference.full.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("bad", [b"\xff\xfe", "a\ud800b", 12, None])
def test_bad_input_gets_clear_error(bad):
    tok = tokenplane.load("cl100k_base")
    with pytest.raises(InvalidTextError):
        tok.encode(bad)


def test_oversize_and_nul():
    tok = tokenplane.load("cl100k_base")
    small = tokenplane.tokenize.tokenizer.Tokenizer("tiny-limit", tok.family,
                                                    tokenplane.tokenize.spec.artifacts.artifact_bytes("cl100k_base"),
                                                    max_chars=10)
    with pytest.raises(TextTooLargeError):
        small.encode("x" * 11)
    assert tok.encode("a\x00b").tolist() == tok.reference.encoding.encode_ordinary("a\x00b")
    assert tok.encode(b"caf\xc3\xa9").tolist() == tok.encode("café").tolist()


@pytest.mark.parametrize("name", NAMES)
def test_ends_are_character_offsets(name):
    tok = tokenplane.load(name)
    text = "naïve 你好 🙂👍🏽 x"
    ids, ends = tok.encode_with_ends(text)
    assert ends[-1] == len(tok.normalize(text))
    assert np.all(np.diff(ends) >= 0)
    for i in range(len(ids)):
        # every prefix up to a token end that falls on a character boundary decodes to that text prefix
        prefix = tok.decode_bytes(ids[: i + 1])
        try:
            s = prefix.decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert s == tok.normalize(text)[: ends[i]]


@pytest.mark.parametrize("name", NAMES)
def test_batch_api_equals_one_by_one(name):
    """encode_batch / encode_ordinary_batch / decode_batch (tiktoken's names) give each text's own IDs in order,
    on several threads (enough text to leave the serial path), and the reference's."""
    from realtext import corpus_texts

    from tokenplane.tokenize.batch import BATCH_SERIAL_CHARS

    tok = tokenplane.load(name)
    texts = corpus_texts("mixed")[:40] + corpus_texts("nonen")[:20] + ["", TEXT, "x"]
    assert sum(map(len, texts)) >= BATCH_SERIAL_CHARS
    one = [tok.encode(t) for t in texts]
    for threads in (1, 4):
        got = tok.encode_batch(texts, num_threads=threads)
        assert len(got) == len(texts) and all(np.array_equal(a, b) for a, b in zip(got, one))
        assert all(g.dtype == np.uint32 for g in got)
    ref = [tok.encode(t, path="reference") for t in texts[::7]]
    assert all(np.array_equal(a, b) for a, b in zip(tok.encode_ordinary_batch(texts[::7], num_threads=3), ref))
    special = next(iter(tok.specials))
    allowed = tok.encode_batch([f"a{special}", "b"], allowed_special="all")
    assert allowed[0].tolist() == tok.encode(f"a{special}", allowed_special="all").tolist()
    assert tok.decode_batch(one[:10]) == [tok.decode(ids) for ids in one[:10]]


def test_batch_errors_name_the_text():
    tok = tokenplane.load("cl100k_base")
    texts = ["fine"] * 30 + ["a\ud800b"] + ["x" * 5000] * 30
    with pytest.raises(InvalidTextError) as ei:
        tok.encode_batch(texts, num_threads=4)
    assert ei.value.index == 30


@pytest.mark.parametrize("name", ["cl100k_base", "qwen3", "smollm2"])
def test_single_token_lookups(name):
    tok = tokenplane.load(name)
    last = tok.n_vocab - len(tok.specials) - 1
    while not tok.decode_single_token_bytes(last):      # (cl100k: IDs 100256 and 100261-100275 are unused)
        last -= 1
    with pytest.raises(KeyError):
        tok.encode_single_token(b"")
    for t in (0, 1000, 5000, last):
        raw = tok.decode_single_token_bytes(t)
        assert raw == tok.decode_bytes([t])
        assert tok.decode_bytes([tok.encode_single_token(raw)]) == raw
    word = tok.encode(" hello").tolist()
    assert len(word) == 1 and tok.encode_single_token(" hello") == word[0] == tok.encode_single_token(b" hello")
    special, sid = next(iter(tok.specials.items()))
    assert tok.encode_single_token(special) == sid
    with pytest.raises(KeyError):
        tok.encode_single_token("definitely not one token at all")
    with pytest.raises(ValueError):
        tok.decode_single_token_bytes(tok.n_vocab + 10)


@pytest.mark.parametrize("name", NAMES)
def test_batch_of_short_texts_goes_in_few_calls(name, monkeypatch):
    """Short texts of a batch are encoded many to one kernel call (tokenize/batch.py): each text's IDs are still
    its own encode's, whatever its neighbours (text ends that would merge with the next text's start, NFC-sensitive
    characters, empty texts, bytes), and the group's call count is far below the text count."""
    from tokenplane.tokenize.cpu.parallel import CpuEncoder

    tok = tokenplane.load(name)
    base = ["hello", " world", "", "x", "123", "4567", "  ", "\n\n", "cafe\u0301", "\u00e9t\u00e9", "日本語", "語の",
            "don't", "'s", "a\u0300", b"bytes \xc3\xa9", "\u0301start", "end\u0301", "\r\n", "tab\t", "\U0001F44D", "ctl\x04"]
    texts = [t + (t[:0] if i % 3 == 0 else (str(i) if isinstance(t, str) else str(i).encode()))
             for i, t in ((i, base[i % len(base)]) for i in range(400))]
    calls = []
    real = CpuEncoder.encode_texts

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CpuEncoder, "encode_texts", counted)
    for threads in (1, 2):
        calls.clear()
        got = tok.encode_batch(texts, num_threads=threads)
        assert all(np.array_equal(g, tok.encode(t)) for g, t in zip(got, texts))
        assert all(g.dtype == np.uint32 for g in got)
        assert 1 <= len(calls) <= 4
    with pytest.raises(InvalidTextError) as ei:
        tok.encode_batch(texts[:5] + ["bad \ud800"] + texts[5:10], num_threads=1)
    assert ei.value.index == 5


FACE_TEXT = "Hello world! naïve 你好世界 🙂👍🏽 don't\r\n\tx = f(1234567)  # ok"


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base", "llama3"])
def test_tiktoken_face_answers_as_tiktoken(name):
    """The rest of tiktoken's Encoding face gives tiktoken's own answers on the same vocabulary."""
    tok = tokenplane.load(name)
    ref = tok.reference.encoding
    assert tok.max_token_value == ref.max_token_value
    assert tok.special_tokens_set == ref.special_tokens_set
    if "<|endoftext|>" in tok.specials:
        assert tok.eot_token == ref.eot_token
    else:
        with pytest.raises(KeyError):
            _ = tok.eot_token
    probe = [*tok.specials.values(), 0, 1, 255, 256, tok.n_vocab // 2, min(tok.specials.values()) - 1]
    assert [tok.is_special_token(t) for t in probe] == [ref.is_special_token(t) for t in probe]
    assert tok.token_byte_values() == ref.token_byte_values()
    ids = tok.encode(FACE_TEXT)
    assert np.array_equal(tok.encode_to_numpy(FACE_TEXT), ref.encode_to_numpy(FACE_TEXT, disallowed_special=()))
    assert tok.decode_tokens_bytes(ids) == ref.decode_tokens_bytes(ids.tolist())
    assert tok.decode_with_offsets(ids) == ref.decode_with_offsets(ids.tolist())
    halves = [ids[:7].tolist(), ids[7:].tolist(), []]
    assert tok.decode_bytes_batch(halves) == ref.decode_bytes_batch(halves)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v4", "smollm2"])
def test_tiktoken_face_on_hf_vocabularies(name):
    """The same face on an HF vocabulary: offsets where each token starts (a token inside a multi-byte character
    starts at that character), the special set, the largest ID and `<|endoftext|>` where the vocabulary has it."""
    tok = tokenplane.load(name)
    ids = tok.encode(FACE_TEXT)
    text, offsets = tok.decode_with_offsets(ids)
    assert text == tok.decode(ids) and len(offsets) == len(ids)
    parts = tok.decode_tokens_bytes(ids)
    assert b"".join(parts) == text.encode()
    for k, off in enumerate(offsets):     # the token's first byte lies in the character at its offset
        start = len(b"".join(parts[:k]))
        assert len(text[:off].encode()) <= start < len(text[:off + 1].encode())
    assert tok.special_tokens_set == set(tok.specials)
    assert all(tok.is_special_token(t) for t in tok.specials.values()) and not tok.is_special_token(int(ids[0]))
    assert tok.max_token_value == tok.n_vocab - 1
    if "<|endoftext|>" in tok.specials:
        assert tok.eot_token == tok.specials["<|endoftext|>"]
    else:
        with pytest.raises(KeyError, match="endoftext"):
            _ = tok.eot_token
    values = tok.token_byte_values()
    assert values == sorted(set(values)) and tok.encode_single_token(values[len(values) // 2]) >= 0
    split = next(ids for ids in map(tok.encode, ("🙂", "🫠", "𝔘", "𓀀")) if len(ids) > 1)
    with pytest.raises(UnicodeDecodeError):
        tok.decode_with_offsets(split[:1])      # part of a character does not decode strictly


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v4", "smollm2"])
def test_token_names_are_hf_names(name):
    """id_to_token / token_to_id name every ID as HF tokenizers does (byte-level strings, special literals)."""
    tok = tokenplane.load(name)
    hf = tok.reference.full
    for t in range(tok.n_vocab + 2):
        want = hf.id_to_token(t)
        assert tok.id_to_token(t) == want, t
        if want is not None:
            assert tok.token_to_id(want) == hf.token_to_id(want), (t, want)
    for bad in ("", "definitely-not-a-token-name", "\u4f60\u597d"):    # (unmapped characters: no byte-level name)
        assert tok.token_to_id(bad) == hf.token_to_id(bad)


def test_token_names_on_a_tiktoken_vocabulary():
    tok = tokenplane.load("cl100k_base")
    assert tok.id_to_token(tok.encode(" hello")[0]) == "\u0120hello"
    assert tok.token_to_id("\u0120hello") == tok.encode_single_token(" hello")
    assert tok.token_to_id("<|endoftext|>") == tok.eot_token and tok.id_to_token(tok.eot_token) == "<|endoftext|>"
    assert tok.id_to_token(100256) is None and tok.id_to_token(-1) is None and tok.id_to_token(tok.n_vocab) is None
