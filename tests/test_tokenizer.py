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
