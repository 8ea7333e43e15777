"""Shadow verifier: catches every injected fault class at 100% sampling, no false positives, bounded queue."""

import random
import threading

import numpy as np
import pytest

import tokenplane
from tokenplane.tokenize.evidence.adversarial import FAULTS, inject_fault, materialize, random_text, session_case
from tokenplane.tokenize.reference import make_reference
from tokenplane.tokenize.spec.artifacts import artifact_bytes
from tokenplane.tokenize.verify import ShadowVerifier, VerifierState, first_difference


@pytest.fixture(scope="module")
def tok():
    return tokenplane.load("cl100k_base")


def session_outputs(tok, n_cases=12, seed=0):
    """(text, ids) pairs as a session serves them: every step of adversarial sessions."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_cases):
        base, ops = session_case(rng)
        sess = tok.session()
        sess.sync(base)
        for _op, text in materialize(base, ops):
            sess.sync(text)
            out.append((sess.text, np.asarray(sess.ids).copy()))
    return out


def test_first_difference():
    a = np.array([1, 2, 3])
    assert first_difference(a, np.array([1, 2, 3])) == -1
    assert first_difference(a, np.array([1, 9, 3])) == 1
    assert first_difference(a, np.array([1, 2])) == 2
    assert first_difference(a, np.array([1, 2, 3, 4])) == 3


def test_verifier_uses_fresh_engine(tok):
    with ShadowVerifier(tok, rate=1.0) as v:
        assert v.wait_ready(30)
        ref = v._factory()
        assert ref is not tok.reference
        assert ref.encode_ordinary("hello world").tolist() == tok.reference.encode_ordinary("hello world").tolist()


def test_clean_outputs_no_false_positives(tok):
    pairs = session_outputs(tok)
    with ShadowVerifier(tok, rate=1.0, max_queue=len(pairs) + 1) as v:
        for text, ids in pairs:
            assert v.submit(text, ids)
        assert v.drain(60)
        s = v.stats()
    assert s["checked"] == len(pairs) and s["mismatches"] == 0 and s["dropped"] == 0 and s["errors"] == 0


@pytest.mark.parametrize("kind", FAULTS)
def test_every_fault_kind_is_caught(tok, kind):
    pairs = session_outputs(tok, seed=1)
    rng = random.Random(7)
    byte_index = {b: i for i, b in enumerate(tok.reference.token_bytes) if b}
    faulty = []
    for text, ids in pairs:
        bad = inject_fault(kind, ids, tok.reference.token_bytes, rng, byte_index)
        if bad is not None:
            faulty.append((text, bad))
    assert len(faulty) >= 10, f"too few {kind} faults could be injected"
    if kind == "tail_resplit":   # the silent shape: same length, same decoded text
        for (text, bad), in zip(faulty[:5]):
            assert tok.decode(bad) == tok.normalize(text)
    with ShadowVerifier(tok, rate=1.0, max_queue=len(faulty) + 1) as v:
        for text, bad in faulty:
            v.submit(text, bad)
        assert v.drain(60)
        s = v.stats()
        assert s["checked"] == len(faulty) and s["mismatches"] == len(faulty) and s["dropped"] == 0
        rep = v.reports[0]
        ns: dict = {}
        exec(rep.reproduction(), ns)   # the reproduction runs and shows the reference differs from what was served
        assert ns["ids"][rep.window_start:rep.window_start + len(rep.expected_window)] == rep.expected_window


def test_sampling_rate_and_drop_counter(tok):
    gate = threading.Event()

    def slow_factory():
        gate.wait(30)
        return make_reference(tok.family, artifact_bytes("cl100k_base"))

    v = ShadowVerifier(tok, rate=1.0, max_queue=4, reference_factory=slow_factory)
    try:
        ids = tok.encode("hello world")
        accepted = sum(v.submit("hello world", ids) for _ in range(20))
        s = v.stats()
        assert accepted == 4 and s["dropped"] == 16 and s["sampled"] == 20
        gate.set()
        assert v.drain(30)
        assert v.stats()["checked"] == 4 and v.stats()["mismatches"] == 0
    finally:
        gate.set()
        v.close()

    with ShadowVerifier(tok, rate=0.1, max_queue=10_000, seed=3) as v:
        ids = tok.encode("x")
        for _ in range(5000):
            v.submit("x", ids)
        s = v.stats()
        assert 350 < s["sampled"] < 650   # Bernoulli(0.1) over 5000: mean 500, sd 21
        assert v.drain(30) and v.stats()["mismatches"] == 0


def test_failed_reference_counts_drops_and_never_raises(tok):
    def broken():
        raise RuntimeError("no file")

    with ShadowVerifier(tok, rate=1.0, reference_factory=broken) as v:
        assert v.wait_ready(10)
        assert v.state == VerifierState.FAILED
        v.submit("a", tok.encode("a"))
        assert v.drain(5)
        s = v.stats()
        assert s["checked"] == 0 and s["dropped"] == 1 and "no file" in s["error"]


def test_allowed_special_and_big_text_window(tok):
    special = "<|endoftext|>"
    text = "a" + special + "b" + random_text(random.Random(0), 10)
    ids = tok.encode(text, allowed_special=[special])
    big = ("word " * 20000) + "tail"
    big_ids = tok.encode(big).tolist()
    big_ids[15000] += 1
    with ShadowVerifier(tok, rate=1.0) as v:
        v.submit(text, ids, allowed_special=[special])
        v.submit(text, tok.encode(text), allowed_special=[special])   # served as ordinary text: mismatch
        v.submit(big, big_ids, context={"session": "s1"})
        assert v.drain(30)
        assert v.stats()["mismatches"] == 2
        big_report = v.reports[-1]
        assert big_report.text_is_window and big_report.index == 15000 and big_report.context == {"session": "s1"}
        assert len(big_report.text) <= 8192 + 16


def test_partial_sampling_catches_every_sampled_fault(tok):
    """Mixed traffic at 10% sampling: exactly the sampled faulty requests are reported (paper protocol)."""
    pairs = session_outputs(tok, n_cases=30, seed=4)
    rng = random.Random(11)
    byte_index = {b: i for i, b in enumerate(tok.reference.token_bytes) if b}
    sampled_faulty = sampled_clean = 0
    with ShadowVerifier(tok, rate=0.1, max_queue=10_000, seed=2) as v:
        for _ in range(3):
            for text, ids in pairs:
                bad = inject_fault(rng.choice(FAULTS), ids, tok.reference.token_bytes, rng, byte_index) \
                    if rng.random() < 0.15 else None
                if bad is not None:
                    sampled_faulty += v.submit(text, bad)
                else:
                    sampled_clean += v.submit(text, ids)
        assert v.drain(60)
        s = v.stats()
    assert sampled_faulty >= 1 and sampled_clean >= 10
    assert s["mismatches"] == sampled_faulty and s["checked"] == sampled_faulty + sampled_clean and s["dropped"] == 0


def test_fresh_reference_normalizes_without_the_fast_nfc(monkeypatch):
    """qwen3's fresh reference runs HF's own NFC: the fast path's regions-only NFC is never on its path."""
    from tokenplane.tokenize.cpu import nfc

    tok = tokenplane.load("qwen3")
    text = "Cafe\u0301 \u1100\u1161\u11a8 " * 400       # long enough that the fast NFC would take the region path
    expected = tok.normalize(text)

    def forbidden(*_args, **_kwargs):
        raise AssertionError("the reference called the fast NFC")

    monkeypatch.setattr(nfc, "normalize", forbidden)
    fresh = make_reference(tok.family, artifact_bytes("qwen3"))
    assert fresh.normalize(text) == expected
    assert fresh.encode_ordinary(text).tolist() == tok.encode(text, path="reference").tolist()
