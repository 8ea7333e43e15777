"""Chunk-parallel CPU encode == serial == reference; routing and path registration never change IDs."""

import random

import numpy as np
import pytest

import tokenplane
from tokenplane.tokenize import router as router_mod
from tokenplane.tokenize.families import Family
from tokenplane.tokenize.parallel import CpuEncoder
from tokenplane.tokenize.tokenizer import Tokenizer

from test_pretokenize import ALPHABET, FRAGMENTS, _corpus_docs

FAMILIES = ["cl100k_base", "o200k_base", "llama3", "qwen3", "deepseek_v4"]
_ENC: dict[str, CpuEncoder] = {}


def encoder(name: str) -> CpuEncoder:
    if name not in _ENC:
        _ENC[name] = CpuEncoder(tokenplane.load(name), workers=2)
    return _ENC[name]


@pytest.mark.parametrize("name", FAMILIES)
def test_many_small_chunks_equal_reference(name):
    enc = encoder(name)
    rng = random.Random(name + "par")
    for _ in range(120):
        text = "".join(rng.choice(ALPHABET + FRAGMENTS) for _ in range(rng.randint(20, 200)))
        norm = enc.tok.reference.normalize(text)
        ref = enc.tok.reference.encode_ordinary(text)
        got = enc.encode_parallel_normalized(norm, n_chunks=rng.randint(2, 40))
        assert got.tolist() == ref.tolist(), repr(text)
    assert enc.stats["cut_rejected"] == 0


@pytest.mark.parametrize("name", FAMILIES)
def test_cuts_are_stable_and_increasing(name):
    enc = encoder(name)
    text = "Hello world, 12345 (x)\n\tfoo  bar 你好。 " * 200
    cuts = enc.cuts(text, 16)
    assert cuts == sorted(set(cuts)) and all(0 < c < len(text) for c in cuts)
    assert len(cuts) >= 8


@pytest.mark.parametrize("name", FAMILIES)
def test_corpus_parallel_equals_serial(name):
    enc = encoder(name)
    docs = _corpus_docs(200_000)
    text = "".join(docs)[:300_000]
    ref = enc.tok.reference.encode_ordinary(text)
    serial = enc.encode(text, parallel=False)
    par = enc.encode(text, parallel=True)
    many = enc.encode_parallel_normalized(enc.tok.reference.normalize(text), n_chunks=64)
    assert np.array_equal(serial, ref) and np.array_equal(par, ref) and np.array_equal(many, ref)


@pytest.mark.parametrize("name", FAMILIES)
def test_registered_paths_equal_reference(name):
    tok = tokenplane.load(name)
    assert router_mod.enable_fast_paths(tok)
    text = "Hello <|endoftext|> world 12345\n\n  don't ſ'S 你好 " * 30
    for path in ("cpu", "auto"):
        assert tok.encode(text, path=path).tolist() == tok.encode(text, path="reference").tolist()
        assert tok.encode(text, path=path, allowed_special="all").tolist() == \
            tok.encode(text, path="reference", allowed_special="all").tolist()
    router = tok._paths["auto"]
    before = router.stats["cpu"]
    assert tok.encode("short text", path="auto").tolist() == tok.encode("short text", path="reference").tolist()
    assert router.stats["cpu"] == before + 1      # "cpu" was built above, so "auto" now takes it


class _FakeGpu:
    def __init__(self, fn):
        self.fn = fn
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        return self.fn(text)


def test_router_routes_by_size_and_spills_under_backpressure():
    tok = tokenplane.load("cl100k_base")
    ref = tok.reference.encode_ordinary
    fake = _FakeGpu(ref)
    cpu_calls = []

    def cpu(text):
        cpu_calls.append(len(text))
        return ref(text)

    r = router_mod.Router(tok, cpu, gpu_min_chars=100, gpu_max_inflight=1, gpu_factory=lambda t: fake)
    small, large = "x" * 50, "word " * 100
    assert r(small).tolist() == ref(small).tolist() and fake.calls == 0
    assert r(large).tolist() == ref(large).tolist() and fake.calls == 1
    r._slots.acquire()            # the one GPU slot is busy: the large segment spills to the CPU
    try:
        assert r(large).tolist() == ref(large).tolist()
    finally:
        r._slots.release()
    assert fake.calls == 1 and r.stats["spill"] == 1 and r.stats["gpu"] == 1


def test_auto_answers_from_reference_while_cpu_path_builds():
    tok = tokenplane.load("llama3")
    gate = __import__("threading").Event()

    def build():
        gate.wait(10)
        return tok.reference.encode_ordinary

    lazy = router_mod._Lazy(build)
    r = router_mod.Router(tok, lazy, gpu_factory=lambda t: None)
    assert r("hello there").tolist() == tok.reference.encode_ordinary("hello there").tolist()
    assert r.stats.get("reference") == 1 and not lazy.ready
    gate.set()
    lazy.get()
    assert r("hello there").tolist() == tok.reference.encode_ordinary("hello there").tolist()
    assert r.stats["cpu"] == 1


def test_router_without_gpu_uses_cpu():
    tok = tokenplane.load("o200k_base")
    r = router_mod.Router(tok, tok.reference.encode_ordinary, gpu_min_chars=10, gpu_factory=lambda t: None)
    text = "a much longer segment than ten characters"
    assert r(text).tolist() == tok.reference.encode_ordinary(text).tolist()
    assert r.stats == {"cpu": 1, "gpu": 0, "spill": 0}


def test_unsupported_family_takes_reference():
    from tokenplane.tokenize.artifacts import artifact_bytes

    base = tokenplane.load("qwen3")
    generic = Family(name="hf-generic", engine="hf", patterns=base.family.patterns,
                     onig_patterns=base.family.onig_patterns, normalizer="nfc")
    tok = Tokenizer("qwen3-as-generic", generic, artifact_bytes("qwen3"))
    assert router_mod.enable_fast_paths(tok) is False
    text = "Hello 12345 世界"
    assert tok.encode(text, path="cpu").tolist() == base.encode(text, path="reference").tolist()
    assert tok.encode(text, path="auto").tolist() == base.encode(text, path="reference").tolist()


def test_campaign_counts_and_catches_planted_faults(monkeypatch):
    """run_campaign reports zero on clean text and catches a wrong split and a wrong ID (it can fail)."""
    from tokenplane.tokenize import campaign_fullencode as cf
    from tokenplane.tokenize import pretokenize

    clean = cf.run_campaign("cl100k_base", ["hello world 12345", "x  \n\n y"])
    assert clean["divergences"] == 0 and clean["pieces_checked"] > 5 and clean["ids_checked"] > 5
    orig_pieces = pretokenize.pieces

    def fused(family, text):
        p = orig_pieces(family, text)
        return [(p[0][0], p[1][1])] + p[2:] if len(p) > 1 else p
    monkeypatch.setattr(pretokenize, "pieces", fused)
    res = cf.run_campaign("cl100k_base", ["hello world"])
    assert res["piece_divergences"] == 1 and res["reproduction"][0]["level"] == "pieces"
    monkeypatch.setattr(pretokenize, "pieces", orig_pieces)
    orig_encode = CpuEncoder.encode
    monkeypatch.setattr(CpuEncoder, "encode", lambda self, text, parallel=None: orig_encode(self, text)[:-1])
    res = cf.run_campaign("cl100k_base", ["hello world"])
    assert res["id_divergences"] == 1 and res["reproduction"][0]["level"] == "ids"
