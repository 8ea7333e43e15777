"""GIL-free string reads (strbuf) equal CPython's own encoders on every string kind."""

import random

import numpy as np
import pytest

from tokenplane.tokenize.cpu import strbuf
from tokenplane.tokenize.cpu.bpe import piece_byte_bounds

# one string per PEP 393 kind: ASCII, Latin-1, UCS-2, UCS-4 (and mixtures the slices below cut into)
KINDS = ["plain ascii text\n\t", "caf\u00e9 \u00ff\u00a0x", "\u65e5\u672c\u8a9e \u0301e\u0301 \uffff",
         "emoji \U0001F44D\U0001F3FD \U0010FFFF a"]


def _texts():
    rng = random.Random(7)
    out = list(KINDS) + ["".join(KINDS) * 3, ""]
    pool = "".join(KINDS)
    out += ["".join(rng.choice(pool) for _ in range(rng.randint(1, 300))) for _ in range(40)]
    return out


@pytest.mark.parametrize("text", _texts())
def test_codepoints_equal_utf32(text):
    rng = random.Random(text)
    for _ in range(5):
        a = rng.randint(0, len(text))
        b = rng.randint(a, len(text))
        extra = rng.choice(["", "x", "\u00e9", "\U0001F44D", "ab"])
        want = np.frombuffer((text[a:b] + extra).encode("utf-32-le"), dtype="<u4")
        got = strbuf.codepoints(text, a, b, extra)
        assert got.dtype == np.uint32 and got.tolist() == want.tolist()


@pytest.mark.parametrize("text", _texts())
def test_utf8_and_bounds_equal_encode(text):
    rng = random.Random(len(text))
    cps = strbuf.codepoints(text, extra="z")
    n = len(text)
    starts = np.array([rng.random() < 0.3 for _ in range(n + 1)], dtype=bool)
    if n:
        starts[0] = True
    buf, bounds = strbuf.utf8_and_bounds(cps, n, starts)
    assert buf.tobytes() == text.encode("utf-8")
    if n:
        assert bounds.tolist() == piece_byte_bounds(cps[:n], starts[:n]).tolist()


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_sampled_utf8_sizes(step):
    text = "".join(KINDS) * 20
    want = np.cumsum([len(c.encode("utf-8")) for c in text[::step]])
    assert strbuf.sampled_utf8_sizes(text, step).tolist() == want.tolist()


def test_out_of_range_is_an_error():
    with pytest.raises(IndexError):
        strbuf.codepoints("abc", 2, 5)


def test_lone_surrogate_is_a_clear_error():
    from tokenplane.tokenize.errors import InvalidTextError

    for text in ("ab\ud800c", "\udfff", "\u65e5\ud83d"):
        with pytest.raises(InvalidTextError, match="surrogate"):
            strbuf.codepoints(text)
    assert strbuf.codepoints("ab\ud800c", 0, 2).tolist() == [97, 98]     # outside the range: fine
