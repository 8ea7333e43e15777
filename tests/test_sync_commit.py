"""Session.sync's and Session.append's committed append (Session._fast_append: the fused append window writes the
records itself; a resent ASCII str becomes the stored text): every step equals the general plan-and-commit path (the fused call
switched off) and the reference encode, with exported IDs held across steps (copy-on-write), through record growth
in place and by copy, non-ASCII tails, edits after an adopted text, and long resends and their edits."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_pretokenize import ALPHABET, FRAGMENTS

import tokenplane
from tokenplane.tokenize import appendwin, textstore
from tokenplane.tokenize import session as session_mod
from tokenplane.tokenize.records import Records
from tokenplane.tokenize.repair import WindowRepair

FAMILIES = ["cl100k_base", "o200k_base", "llama3", "qwen3", "deepseek_v4", "smollm2"]
PROSE = ("An agent's context grows turn by turn: tool output, code like f(x) = x**2 + 1, numbers 2024 and 3.14, "
         "and prose. ") * 30


def _steps(seed: str, n: int, wide: bool) -> list[tuple[str, object]]:
    """("sync", whole text) and ("append", text) steps, with a few edits (a resend that changes the middle) and,
    when `wide`, tails with non-ASCII characters."""
    rng = random.Random(seed)
    pieces = ALPHABET + FRAGMENTS + [" " * 40, "9" * 30, "\n\n", "def f():\n    return 1\n"]
    if wide:
        pieces += ["caf\u00e9 ", "\u4e2d\u6587 " * 5, "\U0001F44D", "e\u0301"]
    else:
        pieces = [p for p in pieces if p.isascii()]
    text, steps = PROSE, [("sync", PROSE)]
    for _ in range(n):
        add = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 400)))
        if rng.random() < 0.1 and len(text) > 200:
            a = rng.randrange(len(text) // 2, len(text) - 50)
            text = text[:a] + add[:30] + text[a + 20:]
            steps.append(("sync", text))
        elif rng.random() < 0.4:
            text += add
            steps.append(("append", add))
        else:
            text += add
            steps.append(("sync", text))
    return steps


def _replay(tok, steps, *, fused: bool, monkeypatch, hold: bool):
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(WindowRepair, "_fused_append", lambda *a, **k: None)
            m.setattr(session_mod, "append_ascii", lambda *a, **k: None)     # (asciiappend.py: the same call)
        sess = tok.session(encode_path="cpu")
        out, held = [], []
        for kind, arg in steps:
            sp = sess.sync(arg) if kind == "sync" else sess.append(arg)
            out.append((sp.keep, sp.ids.tolist(), sp.path))
            text = sess.text
            want = np.asarray(tok.encode(text, path="reference")).tolist()
            assert sess.ids.tolist() == want, len(text)
            if kind == "sync":
                assert text == arg
            if hold:
                held.append((sess.ids, want))       # exported views must never change afterwards
        for ids, want in held:
            assert ids.tolist() == want
    return out, sess.stats


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("wide", [False, True])
def test_committed_sync_equals_general_path(name, wide, monkeypatch, appendwin_statuses):
    tok = tokenplane.load(name)
    steps = _steps(name + str(wide), 40, wide)
    general, g_stats = _replay(tok, steps, fused=False, monkeypatch=monkeypatch, hold=False)
    n0 = len(appendwin_statuses)
    for hold in (False, True):
        fused, f_stats = _replay(tok, steps, fused=True, monkeypatch=monkeypatch, hold=hold)
        assert fused == general
        assert (f_stats.repairs, f_stats.first_window_accepts) == (g_stats.repairs, g_stats.first_window_accepts)
    if not wide:      # (qwen3's wide tails are not NFC-inert)
        assert appendwin.COMMITTED in appendwin_statuses[n0:]


def test_growth_in_place_and_by_copy():
    """Records.reserve keeps the IDs when it grows in place and when a live view forces a copy."""
    rng = np.random.default_rng(0)
    rec = Records(np.ones(1000, np.uint16))
    ids = rng.integers(0, 1000, 300).astype(np.uint32)
    rec.splice(0, ids, np.arange(1, 301, dtype=np.int64), 0, 0)
    rec.reserve(5000)
    assert len(rec.buf) >= 5000 and rec.ids.tolist() == ids.tolist() and rec.end(299) == 300
    view = rec.exported()
    old = rec.buf
    rec.reserve(20000)
    assert rec.buf is not old and len(rec.buf) >= 20000
    assert view.tolist() == ids.tolist() and rec.ids.tolist() == ids.tolist() and rec.end(299) == 300


def test_prefix_check_across_widths_and_long_chunks():
    """is_prefix_of on a store of narrow and wide chunks, long enough for the compiled cross-width compare, against
    a resent text of another width: a match, and a change at every kind of place is seen."""
    store = textstore.TextStore()
    parts = ["a" * 3000, "\u20ac" * 100 + "b" * 2000, "c\u00e9" * 800, "\U0001F600x" * 300]
    for part in parts:
        store.append(part)
    text = "".join(parts)
    assert len(store.chunks) > 2
    for resent in (text, text + "tail\u20ac", text + "\U0001F601"):
        assert store.is_prefix_of(resent)
    for pos in (0, 1500, 2999, 3000, 3050, 4500, 5200, 6500, len(text) - 1):
        changed = text[:pos] + ("Z" if text[pos] != "Z" else "Y") + text[pos + 1:]
        assert not store.is_prefix_of(changed + "more"), pos
    assert not store.is_prefix_of(text[:-1])


def test_an_adopted_text_of_any_length_is_one_chunk_until_cut():
    store = textstore.TextStore()
    store.append("hello ")
    text = "hello world " * 10
    store.adopt(text)
    assert store.chunks == (text,) and store.chunks[0] is text and len(store) == len(text)
    assert store.is_prefix_of(text + "more") and not store.is_prefix_of("hellO" + text[5:])
    store.replace(3, 5, "XY")
    assert store.joined() == "helXY" + text[5:]
    big = "".join(random.Random(3).choice(FRAGMENTS) for _ in range(120_000))
    big = big.encode("ascii", "replace").decode()
    assert len(big) > 8 * textstore.CHUNK_MERGE      # (what a cut keeps of it on either side is over 4 chunks)
    store = textstore.TextStore(["a" * 100])
    store.adopt(big)
    assert store.chunks == (big,) and store.chunks[0] is big
    assert store.is_prefix_of(big + "x") and not store.is_prefix_of(big[:-1])
    # a cut keeps what it leaves of the long chunk as CHUNK_MERGE chunks (later cuts copy at most a chunk)
    mid = len(big) // 2
    store.replace(mid, mid + 7, "\u4e2d")
    want = big[:mid] + "\u4e2d" + big[mid + 7:]
    assert store.joined() == want and max(len(c) for c in store.chunks) <= 4 * textstore.CHUNK_MERGE
    assert store.common_prefix(want[:mid] + "Q") == mid and store.common_suffix("Q" + want[mid:], len(want)) == \
        len(want) - mid
    store = textstore.TextStore()
    store.adopt(big)
    store.replace(len(big) - 3, len(big), "e\u0301")       # (a tail replace, as NFC appends make)
    assert store.joined() == big[:-3] + "e\u0301" and max(len(c) for c in store.chunks) <= 4 * textstore.CHUNK_MERGE


@pytest.mark.parametrize("name", ["cl100k_base", "qwen3"])
def test_long_resends_and_their_edits_stay_exact(name):
    """Resends that grow an ASCII text far past a chunk (each adopted whole), then resends that change its middle
    (the store keeps the ASCII resend itself) or put a wide character there (the store cuts it), then appends."""
    tok = tokenplane.load(name)
    rng = random.Random(7)
    text = "".join(rng.choice(FRAGMENTS) for _ in range(2000)).encode("ascii", "replace").decode()
    sess = tok.session(encode_path="cpu")
    sess.sync(text)
    while len(text) < 4 * textstore.CHUNK_MERGE + 5000:
        text += "".join(rng.choice(FRAGMENTS) for _ in range(3000)).encode("ascii", "replace").decode()
        sess.sync(text)
        assert sess._raw.chunks == (text,) and sess._raw.chunks[0] is text
    for k, repl in enumerate(["Edited middle: x = 1", "", "caf\u00e9 \u4e2d", "more ASCII again", "\U0001F44D"]):
        a = rng.randrange(len(text) // 5, 4 * len(text) // 5)
        text = text[:a] + repl + text[a + 25:]
        sess.sync(text)
        if text.isascii():
            assert sess._raw.chunks[0] is text
        assert sess.text == text, k
        assert sess.ids.tolist() == np.asarray(tok.encode(text, path="reference")).tolist(), k
        text += f" tail {k}"
        sess.sync(text)
    assert sess.text == text
    assert sess.ids.tolist() == np.asarray(tok.encode(text, path="reference")).tolist()
