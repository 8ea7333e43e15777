"""Packed wide runs of session text (tokenize/packedrun.py) read exactly as the strs they replace: slices, characters,
the prefix check against resent text of every width, and a text store built of them under appends and edits."""

from __future__ import annotations

import random

import pytest

from tokenplane.tokenize.packedrun import PackedRun, pack
from tokenplane.tokenize.textstore import TextStore, char_width

CZECH = "Albánie, Alžírsko, Americká Samoa, Andorra, Angola, Anguilla, Antarktida, Argentina, Arménie, Česko. "
DENSE = "Příliš žluťoučký kůň úpěl ďábelské ódy. "
WIDE = "ďťňěščřžůŁłŐőΩЖ€—“”…"


def _mixed(rng: random.Random, n: int, density: float, emoji: bool = False) -> str:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < density:
            out.append(rng.choice(WIDE + ("🙂𝔘" if emoji else "")))
        elif r < density + 0.05:
            out.append(rng.choice("áéíóúýÄÖÜß"))
        else:
            out.append(rng.choice("abcdefghij klmnop\n\t(){}0123"))
    return "".join(out)


def _packed(s: str) -> PackedRun:
    run = pack(s, char_width(s))
    assert run is not None
    return run


def test_pack_roundtrip_and_slices() -> None:
    rng = random.Random(0)
    for emoji in (False, True):
        s = _mixed(rng, 6000, 0.03, emoji)
        run = _packed(s)
        assert len(run) == len(s) and str(run) == s
        assert run.nbytes < len(s) * char_width(s)
        for _ in range(300):
            a, b = sorted(rng.randrange(len(s) + 1) for _ in range(2))
            assert run[a:b] == s[a:b]
        for i in list(range(20)) + [len(s) - 1, -1, -len(s)]:
            assert run[i] == s[i]
        assert run[10:5] == "" and run[::7] == s[::7]
        with pytest.raises(IndexError):
            run[len(s)]


def test_pack_declines_where_it_saves_little() -> None:
    assert pack("ascii only " * 300, 1) is None
    assert pack("ř" * 3000, 2) is None               # every character wide: the str is smaller
    assert pack(DENSE * 80, 2) is None                # a fifth of the characters wide: no smaller
    assert pack("short ř text", 2) is None            # under MIN_SAVING
    assert pack(CZECH * 40, 2) is not None


@pytest.mark.parametrize("emoji", [False, True])
def test_match_at_equals_startswith(emoji: bool) -> None:
    rng = random.Random(1)
    s = _mixed(rng, 9000, 0.02, emoji)       # past one 4,096-character block
    run = _packed(s)
    prefix, suffix = "head ž ", " tail 🙂"
    for text in (prefix + s + suffix, prefix + s, s, s + "x"):
        off = text.find(s)
        assert run.match_at(text, off)
    text = prefix + s + suffix
    off = len(prefix)
    positions = [0, 1, 4095, 4096, 4097, len(s) - 1] + [rng.randrange(len(s)) for _ in range(40)]
    for p in positions:
        c = s[p]
        for other in {chr(ord(c) ^ 1), chr(ord(c) & 0xFF), chr((ord(c) & 0xFF) | 0x100), chr((ord(c) & 0xFF) | 0x1F100),
                      "a", "ř"} - {c}:
            changed = text[:off + p] + other + text[off + p + 1:]
            assert run.match_at(changed, off) == changed.startswith(s, off), (p, c, other)
    assert not run.match_at(text, off + 1)
    assert not run.match_at(text[:off + len(s) - 1], off)       # too short
    assert not run.match_at(s.encode("latin-1", "replace").decode("latin-1"), 0)   # 1 byte a character


def test_store_with_packed_runs_reads_as_its_text() -> None:
    rng = random.Random(2)
    store, text = TextStore(), ""
    parts = [("english text, plain ASCII. " * 90), CZECH * 30, "def f(x):\n    return x\n" * 120, CZECH * 25,
             _mixed(rng, 3000, 0.02, True), "more ascii " * 200]
    for part in parts:
        store.append(part)
        text += part
    assert any(isinstance(c, PackedRun) for c in store.chunks)
    assert store.joined() == text and len(store) == len(text)
    for _ in range(200):
        a, b = sorted(rng.randrange(len(text) + 1) for _ in range(2))
        assert store.slice(a, b) == text[a:b]
    assert all(store.char(i) == text[i] for i in rng.sample(range(len(text)), 200))
    assert store.is_prefix_of(text) and store.is_prefix_of(text + "ř more")
    for p in rng.sample(range(len(text)), 60):
        changed = text[:p] + ("Ř" if text[p] != "Ř" else "R") + text[p + 1:]
        assert not store.is_prefix_of(changed)
        assert store.common_prefix(changed) == p
        assert store.common_suffix(changed, len(text)) == len(text) - p - 1
    seen: set[int] = set()
    assert store.nbytes(seen) < sum(len(c) * char_width(c) for c in map(str, store.chunks))
    # edits cut packed runs back into strs; the store still reads as the edited text
    for _ in range(30):
        a, b = sorted(rng.randrange(len(text) + 1) for _ in range(2))
        s = rng.choice(["", "x", "ž new ", CZECH])
        store.replace(a, b, s)
        text = text[:a] + s + text[b:]
        assert store.joined() == text
        assert store.slice(max(0, a - 50), a + 50) == text[max(0, a - 50):a + 50]
