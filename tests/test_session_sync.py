"""Session.sync validates only what is new, and qwen3 edits renormalize locally: adversarial cases for both, every
step compared with a full reference encode (the session contract), and state size per token."""


import numpy as np
import pytest

import tokenplane
from tokenplane import InvalidTextError

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
