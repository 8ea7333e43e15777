"""Session.sync validates only what is new, and qwen3 edits renormalize locally: adversarial cases for both, every
step compared with a full reference encode (the session contract), and state size per token."""


import random

import numpy as np
import pytest

import tokenplane
from tokenplane import InvalidTextError
from tokenplane.tokenize.records import Records

PROSE = ("Sessions keep state; appended text is repaired near the seam. Numbers like 2024 and 3.14, code such as "
         "f(x) = x**2 + 1, and prose alternate here.\n") * 40


@pytest.fixture(scope="module")
def toks():
    return {name: tokenplane.load(name) for name in ("cl100k_base", "qwen3", "o200k_base")}


def _check(sess, tok):
    assert np.array_equal(sess.ids, tok.encode(sess.text)), repr(sess.text[-60:])


@pytest.mark.parametrize("name", ["cl100k_base", "qwen3"])
def test_sync_refuses_surrogates_wherever_they_are_new(toks, name):
    tok = toks[name]
    sess = tok.session(text=PROSE[:3000] + "caf\u00e9 \U0001F642 ")
    base = sess.text
    state = (sess.text, sess.ids.copy(), sess.revision)
    bad = [base + "\ud800",                                # appended tail, alone
           base + "tail \udfff more",                      # inside the tail
           base[:1500] + "\ud83d" + base[1500:],           # inserted in the middle (an edit)
           "\udc00" + base,                                # at the start: no common prefix
           base[:-1] + "\ud800",                           # replaces the last character
           base[:100] + "\ud83d\ude42" + base[2000:]]      # a surrogate *pair* in a str is two lone surrogates
    for text in bad:
        with pytest.raises(InvalidTextError):
            sess.sync(text)
        assert (sess.text, sess.revision) == (state[0], state[2])
        assert np.array_equal(sess.ids, state[1])
    empty = tok.session()
    with pytest.raises(InvalidTextError):
        empty.sync("ok \ud800")
    assert empty.text == "" and len(empty) == 0
    sess.sync(base + " ok \U0001F642")
    _check(sess, tok)


@pytest.mark.parametrize("name", ["cl100k_base", "qwen3", "o200k_base"])
def test_sync_across_string_kinds(toks, name):
    """Stored chunks and the resent str may have different widths (1, 2, 4 bytes per character): the prefix check
    must still be exact."""
    tok = toks[name]
    sess = tok.session()
    text = ""
    for piece in ["ascii only " * 50, "latin caf\u00e9 ", "cjk \u4e2d\u6587 " * 30, "emoji \U0001F44D\U0001F3FD ",
                  "back to ascii " * 40, "e\u0301 \u212b combining "]:
        text += piece
        sess.sync(text)
        _check(sess, tok)
    # a resend that differs only in the width of one early character is an edit, not an append
    changed = text.replace("caf\u00e9", "cafe", 1)
    sess.sync(changed)
    _check(sess, tok)
    assert sess.text == changed


CZECH = ("Albánie, Alžírsko, Americká Samoa, Andorra, Angola, Anguilla, Antarktida, Argentina, Arménie, Česko, "
         "Dánsko, Egypt, Ekvádor, Eritrea, Estonsko, Etiopie, Fidži, Filipíny, Finsko, Francie, Gabon. ")


@pytest.mark.parametrize("name", ["cl100k_base", "qwen3", "o200k_base"])
def test_sessions_over_packed_wide_runs(toks, name):
    """Runs with sparse wide characters are packed once sealed (packedrun.py): appends past them, resends that edit
    inside them (a wide character swapped for its low byte, a narrow one widened, a change in the last character),
    and a sync that keeps them all read the text exactly."""
    tok = toks[name]
    rng = random.Random(name)
    sess = tok.session()
    text = ""
    for piece in [PROSE[:1500], CZECH * 12, PROSE[:2000], CZECH * 20 + "\U0001F642 ", PROSE[:800]]:
        text += piece
        sess.append(piece)
    _check(sess, tok)
    assert any(type(c).__name__ == "PackedRun" for c in sess._raw.chunks)
    wide = [i for i, ch in enumerate(text) if ord(ch) > 255]
    for _ in range(12):
        p = rng.choice(wide) if rng.random() < 0.5 else rng.randrange(len(text))
        ch = text[p]
        new = chr(ord(ch) & 0xFF) if ord(ch) > 255 else chr(ord(ch) | 0x100)
        text = text[:p] + new + text[p + 1:]
        sess.sync(text)
        _check(sess, tok)
        assert sess.text == text
        text += rng.choice([" more", CZECH[:40], "\u00e9"])
        sess.sync(text)
        _check(sess, tok)


NON_NFC = ["e\u0301", "A\u030a", "\u212b", "\u1100\u1161\u11a8", "o\u0308\u0304", "\u0301", "\u0327", "x\u0323\u0307",
           "\u00e9", "\u0915\u093c", " ", "ab", "\n", "1", "\U0001F642", "\u4e2d"]


def test_qwen3_edits_stay_local_around_non_nfc_text(toks):
    """Raw text that is not NFC in many places; edits next to, inside and across the non-NFC stretches, appends that
    split a combining sequence (base, then its marks), and the map of raw/normalized offsets after every step."""
    tok = toks["qwen3"]
    rng = random.Random(7)
    sess = tok.session(text=PROSE[:1500] + "cafe\u0301 " + PROSE[:1500] + "A\u030a\u212b " + PROSE[:800], window=16)
    _check(sess, tok)
    before, mapped = sess.stats.renormalizations, 0
    for _ in range(120):
        text = sess.text
        kind = rng.random()
        atoms = "".join(rng.choice(NON_NFC) for _ in range(rng.randint(0, 4)))
        if kind < 0.15:
            sess.append("e")                           # a base character ...
            sess.append("\u0301" + atoms)              # ... whose mark arrives in the next append
        elif kind < 0.3:
            sess.sync(text + atoms + " tail")
        else:
            a = rng.randrange(len(text) + 1)
            b = min(len(text), a + rng.randint(0, 6))
            if rng.random() < 0.5:
                sess.edit(a, b, atoms)
            else:
                sess.sync(text[:a] + atoms + text[b:])
        _check(sess, tok)
        norm = tok.normalize(sess.text)
        assert sess.normalized_text == norm
        view = sess._normtext        # the normalized text read through the map: every slice and character
        for _ in range(5):
            a = rng.randrange(len(norm) + 1)
            b = rng.randrange(a, min(len(norm), a + 300) + 1)
            assert view.slice(a, b) == norm[a:b] and (a == len(norm) or view.char(a) == norm[a])
        mapped = max(mapped, len(sess._nmap))
    # every edit stayed local (no whole-text renormalization) while the raw text was not NFC in many places
    assert sess.stats.renormalizations == before and mapped >= 5


def test_records_derive_every_end_through_any_splice():
    """Records keep IDs only (ends derived from per-ID character counts, checkpoints every 64 records, exceptions
    where an end moves further): after random splices of every shape (appends, edits that grow, shrink or keep the
    count, growth past capacity, extras like those of dropped bytes), every end and every position search equals
    an explicit ends array kept beside it."""
    rng = np.random.default_rng(0)
    tc = rng.integers(0, 5, size=50).astype(np.uint16)
    for trial in range(40):
        rec, ids, ends = Records(tc), np.zeros(0, np.int64), np.zeros(0, np.int64)
        for _ in range(30):
            n = len(ids)
            keep = int(rng.integers(0, n + 1))
            right_from = int(rng.integers(keep, n + 1))
            m = int(rng.integers(0, 300 if rng.random() < 0.3 else 20))
            if rng.random() < 0.25:
                keep = right_from = n          # an append, of whole blocks: the next block's first checkpoint
                m = 64 * int(rng.integers(1, 3)) if rng.random() < 0.5 else m
            if rng.random() < 0.2 and n:
                m = right_from - keep          # same count: checkpoints move by the length change
            mid = rng.integers(0, 50, size=m)
            extra = np.where(rng.random(m) < (0.3 if trial % 2 else 0.0), rng.integers(1, 4, size=m), 0)
            base = int(ends[keep - 1]) if keep else 0
            mid_ends = base + np.cumsum(tc[mid].astype(np.int64) + extra)
            old_rest = ends[right_from:] - (int(ends[right_from - 1]) if right_from else 0)
            # the right part keeps its own extents (as in a certified splice) and shifts by the length change
            start_right = int(mid_ends[-1]) if m else base
            delta = start_right - (int(ends[right_from - 1]) if right_from else 0)
            rec.splice(keep, mid.astype(np.uint32), mid_ends, right_from, delta)
            ids = np.concatenate([ids[:keep], mid, ids[right_from:]])
            ends = np.concatenate([ends[:keep], mid_ends, start_right + old_rest])
            assert np.array_equal(rec.ids, ids) and np.array_equal(rec.ends(), ends)
            assert all(rec.end(i) == ends[i] for i in range(len(ids)))
            for x in rng.integers(-1, int(ends[-1]) + 2 if len(ends) else 2, size=20):
                c = int(np.searchsorted(ends, x, side="right"))
                assert rec.locate(int(x)) == (c, int(ends[c - 1]) if c else 0)


def test_prefix_compare_across_kinds_equals_startswith():
    from tokenplane.tokenize.textstore import starts_with_at
    rng = random.Random(3)
    alphabet = ["a", "b", "\u00e9", "\u4e2d", "\U0001F642", "\x00", "\uffff", "\U0010ffff"]
    for _ in range(300):
        chunk = "".join(rng.choice(alphabet[:rng.randint(1, 8)]) for _ in range(rng.choice([0, 7, 4096, 32768, 40000])))
        head = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3)))
        text = head + chunk + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3)))
        if rng.random() < 0.5 and len(text) > len(head):
            k = rng.randrange(len(head), len(text))
            text = text[:k] + rng.choice(alphabet) + text[k + 1:]
        off = len(head) if rng.random() < 0.8 else rng.randint(0, len(text))
        assert starts_with_at(text, chunk, off) == text.startswith(chunk, off)


def test_text_store_keeps_wide_characters_to_their_own_runs():
    """A few wide characters in mostly-ASCII text widen only their own ~1K-character runs (a str stores every
    character at its widest one's width), appends of any size keep the same text, and the chunk count stays within
    its budget even when every append switches width."""
    from tokenplane.tokenize.textstore import TextStore
    rng = random.Random(5)
    base = list("plain ascii text, " * 40000)
    for _ in range(6):
        base[rng.randrange(len(base))] = "\U0001F642"
    text = "".join(base)
    store = TextStore()
    store.append(text)
    want = text
    for k in range(400):
        piece = ("x" * rng.randrange(1, 9000)) if k % 2 else ("\u4e2d" * rng.randrange(1, 50))
        store.append(piece)
        want += piece
    assert store.joined() == want and len(store) == len(want)
    for _ in range(50):
        a = rng.randrange(len(want))
        b = rng.randrange(a, min(len(want), a + 20000) + 1)
        assert store.slice(a, b) == want[a:b]
    assert len(store.chunks) <= 64 + len(want) // 8192 + 1
    wide = TextStore()
    wide.append(text)
    # 6 emoji: 6 runs of <= 2K characters at 4 bytes instead of the whole 720K-character text
    assert wide.nbytes(set()) < 1.05 * len(text)
