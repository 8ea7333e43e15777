"""The ASCII append path (tokenize/asciiappend.py) against the general append of the same session state: the same
records, text chunks and counters, or a decline that leaves everything as it was."""

import random

import numpy as np
import pytest
from test_pretokenize import _corpus_docs

import tokenplane
from tokenplane import TextTooLargeError
from tokenplane.tokenize import asciiappend
from tokenplane.tokenize import session as session_mod
from tokenplane.tokenize.errors import StaleRevisionError
from tokenplane.tokenize.textstore import CHUNK_MERGE, TextStore, _offsets, _str, width_runs

FAMILIES = ["cl100k_base", "o200k_base", "llama3", "qwen3", "deepseek_v4", "smollm2"]


def _state(s):
    raw = s._raw
    return (np.asarray(s.ids).tolist(), raw.chunks, raw.starts, raw.length, s.revision,
            s.stats.repairs, s.stats.windows_tried, s.stats.first_window_accepts, s.stats.last_path)


def _twins(tok, text, **options):
    a, b = tok.session(**options), tok.session(**options)
    a.append(text)
    b.append(text)
    return a, b


class _Spy:
    """asciiappend.append_ascii as the session calls it, its answers recorded (None: declined); `off` makes it
    decline every call (the general path's twin)."""

    def __init__(self):
        self.answers, self.off = [], False

    def taken(self):
        return [a is not None for a in self.answers]


@pytest.fixture
def spy(monkeypatch):
    s = _Spy()
    real = asciiappend.append_ascii

    def call(*args):
        if s.off:
            return None
        out = real(*args)
        s.answers.append(out)
        return out

    monkeypatch.setattr(session_mod, "append_ascii", call)
    return s


@pytest.mark.parametrize("name", FAMILIES)
def test_ascii_appends_equal_the_general_path(name, spy):
    """Random ASCII appends (code, prose, whitespace runs, digits) to a session that holds wide and Latin-1 text
    too: the fast path (taken on every one) and the general path leave identical state, equal to a full encode."""
    tok = tokenplane.load(name)
    text = "".join(_corpus_docs(40_000))[:30_000] + " café ünïcödé 你好 🙂\n"
    fast, general = _twins(tok, text)
    rng = random.Random(name + "ascii")
    pieces = ["def f(x):\n    return x + 1\n", " the quick brown fox", "  \n\n\t", "12345678901", "'s", "(a, b)",
              "x" * 70, " " * 40, "\r\n", "Don't", "ALLCAPS", "a.b.c"]
    for _ in range(60):
        chunk = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        sp_fast = fast.append(chunk)
        sp_general = general._append(chunk, None)
        assert sp_fast.keep == sp_general.keep and np.array_equal(sp_fast.ids, sp_general.ids)
        assert _state(fast)[:-1] == _state(general)[:-1]
        assert np.array_equal(np.asarray(fast.ids), tok.encode(fast.text, path="reference"))
    assert all(spy.taken()) and len(spy.answers) == 60


@pytest.mark.parametrize("name", ["cl100k_base", "qwen3"])
def test_text_store_chunks_as_the_general_append(name):
    """The store's merge rule at its edges: a last chunk near CHUNK_MERGE, a Latin-1 and a wide last chunk."""
    tok = tokenplane.load(name)
    for head in ("a" * (CHUNK_MERGE - 10), "x " * 2000 + "é", "x " * 2000 + "你"):
        fast, general = _twins(tok, head)
        for chunk in ("0123456789", "abcdefghijklmnop", " tail"):
            fast.append(chunk)
            general._append(chunk, None)
            assert _state(fast)[:-1] == _state(general)[:-1], (head[-3:], chunk)
        assert np.array_equal(np.asarray(fast.ids), tok.encode(fast.text, path="reference"))


def test_text_store_one_run_merge_equals_its_run_by_run_route():
    """TextStore.append's merge of one ASCII run into the last chunk (the branch every ASCII session append takes)
    leaves the chunks, offsets and length that its run-by-run route (`width_runs`, `_add`) leaves."""
    def by_runs(store, text):
        chunks, starts = list(store.chunks), list(store.starts)
        for run in width_runs(text):
            store._add(chunks, starts, run)
        store.chunks, store.starts = tuple(chunks), _offsets(starts)

    # appended part by part; the last: narrow and wide parts alternating until the chunk budget merges across widths
    heads = [["a" * (CHUNK_MERGE - 10)], ["x " * 2000 + "\u00e9"], ["x " * 2000 + "\u4f60"], ["y" * 100],
             [p for i in range(90) for p in ("z" * 700, f"{i}\u4f60")]]
    for parts in heads:
        head = "".join(parts)
        for text in ("0123456789", "tail", "q" * 11, "w" * 5000, "a" * CHUNK_MERGE):
            fast, slow = TextStore(), TextStore()
            for part in parts:
                fast.append(part)
                slow.append(part)
            fast.append(text)
            by_runs(slow, text)
            shape = [(type(c), _str(c)) for c in fast.chunks], fast.starts, fast.length    # (packed runs: by content)
            assert shape == ([(type(c), _str(c)) for c in slow.chunks], slow.starts, slow.length), (head[-3:], text)
            full, n, o = head + text, fast.length, fast.starts[-1]
            for x, y in ((0, n), (n - 1, n), (o, n), (o - 1, n), (o + 3, n - 2), (n - 5, n + 10), (o, o + 1)):
                assert fast.slice(x, y) == full[max(x, 0):min(y, n)], (x, y)     # (the last chunk's own slice)


def test_declines_leave_the_session_as_it_was(spy):
    """What the fast path does not take goes to the general path, with its errors: an empty session, allowed
    literals, the reference path, non-ASCII text, a stale revision, text over the size limit."""
    tok = tokenplane.load("cl100k_base")
    answers = spy.answers
    s = tok.session()
    s.append("hello world")                       # empty session: declined
    assert answers[-1] is None
    lit = tok.session(allowed_special="all", text="a <|endoftext|> b")
    lit.append(" more text")
    assert answers[-1] is None
    assert np.array_equal(lit.ids, tok.encode(lit.text, allowed_special="all", path="reference"))
    ref = tok.session(text="some text", encode_path="reference")
    ref.append(" and more")
    assert answers[-1] is None and np.array_equal(ref.ids, tok.encode(ref.text, path="reference"))
    n = len(answers)
    s.append(" naïve")                            # not ASCII: never asked
    assert len(answers) == n
    with pytest.raises(StaleRevisionError):
        s.append(" x", expect_revision=s.revision - 1)
    before = _state(s)
    small = tokenplane.load("cl100k_base", max_chars=40)
    t = small.session(text="x" * 30)
    with pytest.raises(TextTooLargeError):
        t.append("y" * 20)
    assert answers[-1] is None and t.text == "x" * 30
    s.append(" ok")
    assert answers[-1] is not None and _state(s)[4] == before[4] + 1


def test_nfc_session_with_changed_regions_declines():
    """qwen3 text whose NFC differs from it (a map of changed regions): the fast path declines, the general path
    appends in normalized coordinates."""
    tok = tokenplane.load("qwen3")
    s = tok.session(text="cafe\u0301 e\u0301t\u00e9 " * 50)
    assert s._nmap is not None and len(s._nmap) > 0
    keep = asciiappend.append_ascii(s._repairer, s._raw, s._rec, s._nmap, s._path, " plain ascii", s.stats)
    assert keep is None
    s.append(" plain ascii")
    assert np.array_equal(np.asarray(s.ids), tok.encode(s.text, path="reference"))


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("name", ["cl100k_base", "qwen3", "smollm2"])
def test_ascii_resends_equal_the_general_sync(name, wide, spy):
    """Session.sync of a resent text that extends the stored one by ASCII text (the server's path): an ASCII text read
    in place and adopted by the store, a wide one's tail read from the store; state equal to the general route's
    (the fast path switched off for the twin)."""
    tok = tokenplane.load(name)
    docs = [d.encode("ascii", "replace").decode() for d in _corpus_docs(60_000)]
    if wide:    # a wide stored text: its ASCII tails are read from the store, not the resent str
        docs[0] = "na\u00efve \u4f60\u597d " + docs[0]
    fast, general = tok.session(), tok.session()
    text = ""
    for doc in docs[:40]:
        text += doc[:3000]
        sp_fast = fast.sync(text)
        spy.off = True
        sp_general = general.sync(text)
        spy.off = False
        assert sp_fast.keep == sp_general.keep and np.array_equal(sp_fast.ids, sp_general.ids)
        assert _state(fast)[:-1] == _state(general)[:-1]
        if text.isascii():    # the resent str itself is the stored text (no copy)
            assert fast._raw.chunks[-1] is text and general._raw.chunks[-1] is text
    assert all(spy.taken()) and len(spy.answers) >= 20
    assert np.array_equal(np.asarray(fast.ids), tok.encode(fast.text, path="reference"))


def test_nfc_mapped_sessions_take_the_ascii_path(spy):
    """A session of an NFC family whose raw text differs from its NFC (a decomposed character: an NFC map): ASCII
    appends and resends take the fast path once no region is within two windows of the end, read the window
    through the map's shift, and leave the state the general path leaves; a region near the end declines."""
    tok = tokenplane.load("qwen3")      # (the NFC family)
    head = "cafe\u0301 " + "".join(_corpus_docs(20_000))[:12_000].encode("ascii", "replace").decode()
    fast, general = _twins(tok, head)
    resent = tok.session(text=head)
    assert len(fast._nmap) and fast.text != fast.normalized_text
    rng = random.Random("nfc map")
    for k in range(30):
        chunk = "".join(rng.choice([" the cafe", "\n\tx = 1", " 2024", "'s", "  "]) for _ in range(rng.randint(1, 9)))
        if k == 20:     # a region at the end: the fast path must decline until two windows of ASCII follow it
            chunk = " re\u0301sume\u0301"
        sp_fast = fast.append(chunk)
        sp_general = general._append(chunk, None)
        resent.sync(general.text)
        assert sp_fast.keep == sp_general.keep and np.array_equal(sp_fast.ids, sp_general.ids)
        assert _state(fast)[:-1] == _state(general)[:-1]
        ref = tok.encode(general.text, path="reference")
        assert np.array_equal(np.asarray(fast.ids), ref) and np.array_equal(np.asarray(resent.ids), ref)
    taken = spy.taken()
    assert sum(taken) >= 40 and not all(taken)      # (two calls a step: the append's and the resend's)


def test_a_window_larger_than_the_scratch_grows_it(spy, appendwin_statuses):
    """An ASCII append whose window needs more records than the thread's scratch holds: the kernel answers SCRATCH,
    the path grows the scratch and calls again, and the IDs equal the reference (no records lost or doubled)."""
    from tokenplane.tokenize import appendwin

    tok = tokenplane.load("cl100k_base")
    s = tok.session(text="hello world. " * 50)
    s.append(" warm")       # (binds this thread's kernel)
    # this session's own binding: sessions of one tokenizer share their repairer, and another test's session of it
    # on another encode path has an entry (another binding) for it too
    bound = asciiappend._local.bindings[(id(s._repairer), s._path)][0]
    bound.grow(0)           # back to MIN_SCRATCH records, whatever earlier tests grew it to
    big = " ".join(f"word{k % 997} x={k};" for k in range(6000))[:CHUNK_MERGE - 10]
    assert big.isascii() and len(tok.encode(big)) > appendwin.MIN_SCRATCH
    n = len(spy.answers)
    s.append(big)
    assert spy.answers[n] is not None and appendwin.SCRATCH in appendwin_statuses
    assert len(bound.out_ids) > appendwin.MIN_SCRATCH
    assert np.array_equal(np.asarray(s.ids), tok.encode(s.text, path="reference"))
