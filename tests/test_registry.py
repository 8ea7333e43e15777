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
    # IDs (4 bytes, ends derived) plus <= 6.25% growth slack and a checkpoint (8 bytes) per 64 tokens
    assert sess.array_nbytes <= 4.4 * len(sess) + 512
    for _ in range(300):
        sess.append(" more")
    assert sess.array_nbytes <= 4.4 * len(sess) + 512


def test_a_registered_files_content_loads_as_its_family(tmp_path):
    """The server loads a model folder's tokenizer.json by path: SmolLM2's is the smollm2 family, not hf-generic."""
    data = artifact_bytes("smollm2")
    path = tmp_path / "tokenizer.json"
    path.write_bytes(data)
    tok = tokenplane.load(path)
    assert tok is tokenplane.load("smollm2") and tok.family.name == "smollm2" and {"cpu", "auto"} <= tok.fast_paths
    assert tokenplane.load(path, max_chars=77).max_chars == 77


def test_unknown_configuration_is_exact_through_the_reference_and_logged_once(tmp_path, caplog):
    import json
    import logging

    from tokenizers import Tokenizer as HFTokenizer

    config = json.loads(artifact_bytes("smollm2"))
    config["pre_tokenizer"] = config["pre_tokenizer"]["pretokenizers"][1]     # GPT-2's ByteLevel alone: no family
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="tokenplane.tokenize.registry"):
        tok = tokenplane.load(path)
        tokenplane.load(path, max_chars=1000)
    assert tok.family.name == "hf-generic" and not tok.fast_paths
    assert len([r for r in caplog.records if "no registered family" in r.getMessage()]) == 1
    hf = HFTokenizer.from_file(str(path))
    text = "x  1 it's 2024 ok"
    assert tok.encode(text).tolist() == hf.encode(text, add_special_tokens=False).ids
    sess = tok.session(text=text)
    sess.append(" 99")
    assert sess.ids.tolist() == hf.encode(text + " 99", add_special_tokens=False).ids


def test_a_chain_with_an_extra_step_is_not_mistaken_for_a_family(tmp_path):
    """Only the whole pre-tokenizer chain names a family: Digits in front of DeepSeek's Splits is hf-generic
    (reference), not deepseek_v4."""
    import json

    from tokenizers import Tokenizer as HFTokenizer

    config = json.loads(artifact_bytes("deepseek_v4"))
    config["pre_tokenizer"]["pretokenizers"].insert(0, {"type": "Digits", "individual_digits": False})
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(config))
    tok = tokenplane.load(path)
    assert tok.family.name == "hf-generic" and not tok.fast_paths
    text = "x 2024ab 12345678 don't"
    assert tok.encode(text, path="cpu").tolist() == HFTokenizer.from_file(str(path)).encode(text).ids


def test_a_family_config_with_other_merges_uses_its_own_merges(tmp_path):
    """A file with DeepSeek's splitter but other merges gets its fast path with ITS merges (never the pinned file's)."""
    import json

    from tokenizers import Tokenizer as HFTokenizer

    config = json.loads(artifact_bytes("deepseek_v4"))
    merges = config["model"]["merges"]
    config["model"]["merges"] = merges[:50] + merges[60:]        # ten merges fewer: some words split differently
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(config))
    tok = tokenplane.load(path)
    assert tok.family.name == "deepseek_v4" and "cpu" in tok.fast_paths
    hf = HFTokenizer.from_file(str(path))
    gone = ["".join(m) if isinstance(m, list) else m.replace(" ", "") for m in merges[50:60]]
    text = " ".join(w.replace("Ġ", " ").strip() or "x" for w in gone) + " the theory of 2024 don't stop"
    assert tok.encode(text, path="cpu").tolist() == hf.encode(text, add_special_tokens=False).ids
    pinned = tokenplane.load("deepseek_v4").encode(text, path="reference")
    assert tok.encode(text, path="cpu").tolist() != pinned.tolist()
