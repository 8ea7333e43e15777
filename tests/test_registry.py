"""load() honours its options: distinct options give a distinct shared instance, contradictions are errors."""

import numpy as np
import pytest

import tokenplane
from tokenplane.tokenize import TextTooLargeError
from tokenplane.tokenize.registry import build
from tokenplane.tokenize.spec.artifacts import artifact_bytes


def test_same_options_share_one_instance():
    assert tokenplane.load("cl100k_base") is tokenplane.load("cl100k_base")
    assert tokenplane.load("cl100k_base", max_chars=50) is tokenplane.load("cl100k_base", max_chars=50)


def test_other_options_are_another_instance():
    default = tokenplane.load("qwen3")
    small = tokenplane.load("qwen3", max_chars=10)
    assert small is not default and small.max_chars == 10 and default.max_chars > 10
    with pytest.raises(TextTooLargeError):
        small.encode("x" * 11)
    assert default.encode("x" * 11).tolist() == small.reference.encode_ordinary("x" * 11).tolist()
    router = tokenplane.load("qwen3", gpu_min_chars=100).path("auto")
    assert router.gpu_min_chars == 100 and default.path("auto").gpu_min_chars != 100


def test_contradicting_options_are_errors():
    with pytest.raises(ValueError):
        tokenplane.load("cl100k_base", family="llama3")
    with pytest.raises(tokenplane.ArtifactError):
        tokenplane.load("cl100k_base", sha256="0" * 64)
    with pytest.raises(TypeError):
        tokenplane.load("cl100k_base", max_char=10)     # a misspelt option is not silently dropped
    with pytest.raises(ValueError):
        tokenplane.load("cl100k_base", max_chars=0)


def test_build_is_private_and_has_fast_paths():
    tok = tokenplane.load("o200k_base")
    mine = build("o200k_base", tok.family, artifact_bytes("o200k_base"))
    assert mine is not tok and {"cpu", "auto"} <= mine.fast_paths
    text = "private instance 12345 don't"
    assert np.array_equal(mine.encode(text, path="cpu"), tok.encode(text, path="reference"))


def test_session_arrays_grow_by_a_fraction():
    tok = tokenplane.load("cl100k_base")
    sess = tok.session(text="word " * 1500)
    assert len(sess) == 1501
    assert sess.array_nbytes <= 9.2 * len(sess) + 256      # ids + ends (8 bytes) plus <= 12.5% slack
    for _ in range(300):
        sess.append(" more")
    assert sess.array_nbytes <= 9.2 * len(sess) + 256
