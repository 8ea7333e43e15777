"""The cold path: cached vocabulary records, per-token facts and BPE tables equal what the reference engine gives, a
fresh process encodes (and keeps sessions) through the fast path without building the reference engine, and caches
are built when absent or damaged."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tokenplane
from tokenplane.tokenize.cpu import bpetables
from tokenplane.tokenize.cpu.bpe import BPE
from tokenplane.tokenize.reference import make_reference, vocab_meta
from tokenplane.tokenize.spec.artifacts import ARTIFACTS, artifact_bytes
from tokenplane.tokenize.spec.families import FAMILIES
from tokenplane.tokenize.spec.vocabmeta import VocabFacts, cached_facts, cached_meta

ROOT = Path(__file__).resolve().parents[1]
NAMES = list(ARTIFACTS)


@pytest.mark.parametrize("name", NAMES)
def test_vocab_record_equals_the_reference_engine(name, tmp_path, monkeypatch):
    tok = tokenplane.load(name)
    ref = tok.reference
    assert tok.specials == ref.specials and tok.n_vocab == len(ref.token_bytes)
    assert tok.plain_nfc == ref.plain_nfc
    monkeypatch.setenv("TOKENPLANE_CACHE", str(tmp_path))
    data = artifact_bytes(name)
    fresh = vocab_meta(FAMILIES[name], data)
    assert cached_meta(FAMILIES[name], data, tok.content_hash) == fresh      # derived, then written
    assert cached_meta(FAMILIES[name], data, tok.content_hash) == fresh      # read back
    assert fresh.specials == ref.specials and fresh.n_vocab == len(ref.token_bytes)


@pytest.mark.parametrize("name", NAMES)
def test_vocab_facts_equal_the_reference_engine_and_rebuild_when_damaged(name, tmp_path, monkeypatch):
    tok = tokenplane.load(name)
    ref = tok.reference
    monkeypatch.setenv("TOKENPLANE_CACHE", str(tmp_path))
    calls = []

    def derive() -> VocabFacts:
        calls.append(1)
        return VocabFacts(ref.token_chars, ref.continuation_start, ref.max_token_chars)

    for _ in range(2):      # derived and written, then read back without deriving
        facts = cached_facts(tok.family, tok.content_hash, derive)
        assert facts.token_chars.dtype == np.uint16 and facts.continuation_start.dtype == np.bool_
        assert np.array_equal(facts.token_chars, ref.token_chars)
        assert np.array_equal(facts.continuation_start, ref.continuation_start)
        assert facts.max_token_chars == ref.max_token_chars
    assert calls == [1]
    (path,) = tmp_path.glob("vocab-facts-*.npz")
    path.write_bytes(path.read_bytes()[:200])                        # damaged: derived again
    assert np.array_equal(cached_facts(tok.family, tok.content_hash, derive).token_chars, ref.token_chars)
    assert calls == [1, 1]
    other = "0" * len(tok.content_hash)                              # a file recorded for other content: refused
    path.rename(path.with_name(path.name.replace(tok.content_hash[:32], other[:32])))
    cached_facts(tok.family, other, derive)
    assert calls == [1, 1, 1]


@pytest.mark.parametrize("name", ["qwen3", "smollm2", "o200k_base"])
def test_a_session_never_builds_the_reference_engine(name):
    """Appends, mid-context edits and a shrink on a fresh Tokenizer instance: the session reads the cached facts and
    the CPU path only (the reference is built afterwards, to check the IDs)."""
    from tokenplane.tokenize.registry import build

    _ = tokenplane.load(name).vocab_facts       # cached, as `tokenplane warmup` leaves it
    tok = build(name, FAMILIES[name], artifact_bytes(name), content_hash=ARTIFACTS[name].sha256)   # a new instance
    text = "Hello, World! don't 12345 \u65e5\u672c\u8a9e e\u0301 \U0001F44D \x01\n" * 400
    session = tok.session()
    steps = [text, text + "more text 42", text[:5000] + "an edit" + text[5007:] + "more text 42", text[:3000]]
    for t in steps:
        session.sync(t)
    decoded = tok.decode(session.ids)           # a server decodes every answer: from the CPU path's tables too
    assert tok._reference is None
    assert session.ids.tolist() == tok.encode(steps[-1], path="reference").tolist()
    assert decoded == tok.reference.decode_bytes(session.ids.tolist()).decode("utf-8", errors="replace")


@pytest.mark.parametrize("name", NAMES)
def test_decode_from_the_tables_equals_the_reference(name):
    tok = tokenplane.load(name)
    ref = tok.reference
    n = tok.n_vocab
    every = list(range(n))
    assert tok.decode_bytes(every) == ref.decode_bytes(every)
    rng = random.Random(name)
    for size in (0, 1, 3, 16, 17, 500):
        ids = [rng.randrange(n) for _ in range(size)]
        want = ref.decode_bytes(ids)
        for form in (ids, tuple(ids), np.array(ids, dtype=np.uint32), iter(ids)):
            assert tok.decode_bytes(form) == want
    for bad in ([n], [-1], [3, n + 7] * 20, np.array([-2], dtype=np.int64)):
        with pytest.raises(ValueError, match="out of range"):
            tok.decode_bytes(bad)


@pytest.mark.parametrize("name", ["cl100k_base", "qwen3", "smollm2"])
def test_cached_tables_equal_freshly_built_ones_and_rebuild_when_damaged(name, tmp_path, monkeypatch):
    tok = tokenplane.load(name)
    monkeypatch.setenv("TOKENPLANE_CACHE", str(tmp_path))
    calls = []

    def reference():
        calls.append(1)
        return make_reference(tok.family, artifact_bytes(name))

    built = bpetables.load(tok.family.name, tok.content_hash, reference)
    read = bpetables.load(tok.family.name, tok.content_hash, reference)
    assert calls == [1]     # the second load is the cache, without the reference engine
    for field in bpetables._ARRAYS:
        a, b = getattr(built, field), getattr(read, field)
        assert (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b)), field
    assert read.ptab.flags.writeable and read.ptab.flags.c_contiguous   # same kernel signatures as built tables
    # the same encode from either set of tables
    text = "Hello, World! don't 12345 \u65e5\u672c\u8a9e \U0001F44D " * 20
    raw = np.frombuffer(text.encode(), dtype=np.uint8)
    bounds = np.array([0, raw.size // 2, raw.size], dtype=np.int64)
    assert BPE(built).encode_bytes(raw, bounds).tolist() == BPE(read).encode_bytes(raw, bounds).tolist()
    # damage: a truncated array file is detected and the folder rebuilt
    folder = bpetables.folder(tok.family.name, tok.content_hash)
    (folder / "ptab.npy").write_bytes((folder / "ptab.npy").read_bytes()[:100])
    again = bpetables.load(tok.family.name, tok.content_hash, reference)
    assert calls == [1, 1] and np.array_equal(again.ptab, built.ptab)
    assert bpetables._read(folder, tok.family.name, tok.content_hash) is not None


def test_nfc_without_the_reference_engine_equals_the_reference(tmp_path):
    tok = tokenplane.load("qwen3")
    rng = random.Random(5)
    tricky = "e\u0301\u00e9\u1100\u1161\u11a8\u0345\u0315\u4e00a \n\u212b\u0041\u030a\uac00\u0308"
    for n in (3, 40, 600, 3000):
        for _ in range(30):
            text = "".join(rng.choice(tricky) for _ in range(n))
            assert tok.normalize(text) == tok.reference.normalize(text)


FRESH = """
import json, sys
import tokenplane
text = sys.stdin.read()
out = {}
for name in sys.argv[1:]:
    tok = tokenplane.load(name)
    ids = tok.encode(text)
    out[name] = {"built": tok._reference is not None, "stats": tok.path("auto").stats}
    out[name]["exact"] = ids.tolist() == tok.reference.encode_ordinary(text).tolist()
print(json.dumps(out))
"""


def test_fresh_process_encodes_on_the_fast_path_without_building_the_reference():
    text = "def f(x):\n    return x + 1  # caf\u00e9 \u65e5\u672c\u8a9e\n" * 3000 + "e\u0301 \U0001F44D" * 50
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    names = ["cl100k_base", "qwen3", "deepseek_v4"]
    proc = subprocess.run([sys.executable, "-c", FRESH, *names], input=text, capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in names:
        assert got[name]["exact"], name
        assert not got[name]["built"], f"{name}: the first encode built the reference engine"
        assert got[name]["stats"].get("reference", 0) == 0 and got[name]["stats"]["cpu"] == 1, got[name]


SKIP = """
import sys
from tokenplane.tokenize.cpu.numbastart import skip_blas_probe
skip_blas_probe()
import numba.np.arraymath as am
assert sys.modules.get("scipy.linalg.cython_blas", "absent") is not None   # unmasked again
import numpy as np
from numba import njit
@njit
def dot(a, b):
    return np.dot(a, b)
a = np.arange(6.0).reshape(2, 3)
assert np.allclose(dot(a, a.T), a @ a.T)   # np.dot still finds BLAS when it compiles
print("ok", am._HAVE_BLAS)
"""


def test_blas_probe_skip_leaves_scipy_and_np_dot_working():
    pytest.importorskip("scipy")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SKIP], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["ok", "False"]
