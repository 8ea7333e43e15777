"""GIL-free string reads (strbuf) equal CPython's own encoders on every string kind."""

import random

import numpy as np
import pytest

from tokenplane.tokenize.cpu import fullencode, strbuf
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


def _mostly_ascii_texts():
    rng = random.Random(11)
    wide = ["\u00e9", "\u20ac", "\u65e5", "\U0001F44D", "\U0010FFFF", "\u0080", "\u07ff", "\u0800", "\uffff"]
    out = []
    for n in (1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 4099):
        base = [rng.choice("abc xyz\n\t.,") for _ in range(n)]
        out.append("".join(base))
        for density in (1, 3, 40):            # wide characters per 1000
            t = list(base)
            for i in range(n):
                if rng.random() * 1000 < density:
                    t[i] = rng.choice(wide)
            out.append("".join(t))
        out.append(rng.choice(wide) + "".join(base) + rng.choice(wide))     # at both ends
        out.append("".join(base) + "\u65e5" * 50)                           # a dense tail after an ASCII head
    return out


@pytest.mark.parametrize("form", ["_utf8_by_runs", "_utf8_one_pass", "_utf8_and_bounds"])
def test_utf8_forms_equal_encode(form):
    """Both forms of the UTF-8 + bounds pass (by ASCII runs for mostly-ASCII text, one pass for dense text; the
    public kernel picks one from a sample) equal CPython's encoder and the bounds reference on any text."""
    fn = getattr(strbuf, form)
    rng = random.Random(form)
    for text in _mostly_ascii_texts() + _texts():
        n = len(text)
        cps = strbuf.codepoints(text, extra="z")
        starts = np.array([rng.random() < 0.3 for _ in range(n + 1)], dtype=bool)
        if n:
            starts[0] = True
        buf = np.zeros(4 * n + 16, np.uint8)
        bounds = np.zeros(n + 1, np.int64)
        k, size = fn(cps, n, starts, buf, bounds)
        assert buf[:size].tobytes() == text.encode("utf-8"), repr(text[:80])
        if n:
            assert bounds[:k].tolist() == piece_byte_bounds(cps[:n], starts[:n]).tolist(), repr(text[:80])


def _edge_texts():
    """Wide characters at the edges of the 64-character steps of _utf8_ascii_runs (first, last, both, in runs) and
    texts whose ASCII tail is 63-129 characters long (the last 64 to 127 are written one at a time)."""
    rng = random.Random(13)
    out = []
    for wide in ("\u00e9", "\u65e5", "\U0001F44D"):
        for n in (127, 128, 129, 191, 192, 193, 255, 256, 257, 640):
            for spots in ([0], [63], [64], [63, 64], [n - 129], [n - 128], [n - 65], [n - 64], [n - 1],
                          list(range(60, 70)), list(range(0, n, 5)), [rng.randrange(n) for _ in range(4)]):
                t = [rng.choice("ab cd\n.") for _ in range(n)]
                for i in spots:
                    if 0 <= i < n:
                        t[i] = wide
                out.append("".join(t))
    return out


def _units(text, width):
    """text's code units at `width` bits, as a str of that PEP 393 kind holds them (None: it needs wider units)."""
    if width == 8:
        return np.frombuffer(text.encode("latin-1"), np.uint8) if max(text, default="a") <= "\xff" else None
    if width == 16:
        return np.frombuffer(text.encode("utf-16-le"), np.uint16) if max(text, default="a") <= "\uffff" else None
    return np.frombuffer(text.encode("utf-32-le"), np.uint32)


_NO_FEATURES = np.zeros(0x110000, np.uint8)      # (the UTF-8 and bounds do not depend on the feature bytes)


def bits_form_utf8(c, n, sb, buf, bounds):
    """The fused encode's UTF-8 and piece bounds of c[:n] (fullencode._features_utf8, then _pieces_utf8 with the
    piece starts `sb`; a lookahead unit past n is taken as a stable cut): (bound count, UTF-8 size)."""
    _, _, bad, buf2, bounds2, size, wide_pos, wide_add, nw = fullencode._features_utf8(
        c, n, np.empty(0, np.uint8), np.empty(0, np.bool_), _NO_FEATURES, buf, bounds)
    assert bad < 0 and buf2.ctypes.data == buf.ctypes.data and bounds2.ctypes.data == bounds.ctypes.data
    if c.shape[0] > n:
        sb[n >> 6] |= np.uint64(1) << np.uint64(n & 63)
    _, _, k, status = fullencode._pieces_utf8(c, n, sb, buf, bounds, size, wide_pos, wide_add, nw)
    assert status == fullencode.OK
    return k, (bounds[k - 1] if k else 0)


@pytest.mark.parametrize("width", [8, 16, 32])
def test_utf8_bits_form_equal_encode(width):
    """The fused encode's UTF-8 and bounds (a str's own 8-, 16- or 32-bit units, piece starts as a bitmap) equal
    CPython's encoder and the bounds reference, wide characters at every edge of its 64-character steps included."""
    rng = random.Random(width)
    for text in _edge_texts() + _mostly_ascii_texts() + _texts():
        c = _units(text + "z", width)
        if c is None:
            continue
        n = len(text)
        starts = np.array([rng.random() < 0.3 for _ in range(n + 1)], dtype=bool)
        if n:
            starts[0] = True
        sb = np.zeros((n >> 6) + 2, np.uint64)
        sb.view(np.uint8)[:len(np.packbits(starts, bitorder="little"))] = np.packbits(starts, bitorder="little")
        buf = np.full(4 * n + 16, 0xAA, np.uint8)
        # bounds of the exact size (the last words' starts one at a time) and with room to spare (as a thread's
        # scratch: every word's starts through the byte tables)
        for spare in (0, 64):
            bounds = np.zeros(n + 1 + spare, np.int64)
            k, size = bits_form_utf8(c, n, sb, buf, bounds)
            assert buf[:size].tobytes() == text.encode("utf-8"), repr(text[:80])
            if n:
                cps = strbuf.codepoints(text)
                assert bounds[:k].tolist() == piece_byte_bounds(cps, starts[:n]).tolist(), repr(text[:80])
        # the runs pass alone (the bitmap form takes the one-pass writer for dense text)
        pos, wide_pos, wide_add, nw = strbuf._utf8_ascii_runs(c, n, buf)
        assert buf[:pos].tobytes() == text.encode("utf-8"), repr(text[:80])
        assert wide_pos[:nw].tolist() == [i for i, ch in enumerate(text) if ch >= "\x80"]


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
