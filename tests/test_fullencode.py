"""The fused full-encode block kernel (cpu/fullencode.py + cpu/piecemap.py): the same IDs as the staged chain and
the reference, for every family, on real text (corpus documents, agent-trace prompts) and adversarial text (the
pre-tokenizer's alphabet and fragments, long pieces past the map's limit, pieces of more than two IDs, a map small
enough to be emptied mid-text), through the process's kernel set and the JIT kernels; and the comparison is shown to
catch a wrong map entry."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_pretokenize import ALPHABET, FRAGMENTS, _corpus_docs

import tokenplane
from tokenplane.tokenize.cpu import fullencode, kernels, piecemap
from tokenplane.tokenize.cpu.parallel import CpuEncoder
from tokenplane.tokenize.cpu.piecemap import PieceMap

FAMILIES = ["cl100k_base", "o200k_base", "llama3", "qwen3", "deepseek_v4", "smollm2"]


def _texts(name: str) -> list[str]:
    from realtext import traces_dir

    from tokenplane.tokenize.evidence.traces import load_trajectories, render_prompts

    rng = random.Random(name + "full")
    out = ["".join(rng.choice(ALPHABET + FRAGMENTS) for _ in range(rng.randint(1, 400))) for _ in range(80)]
    out += ["a" * 2000, " " * 3000 + "x", "日本語" * 400, "👍🏽" * 300, "\n" * 1500 + "/", "x" + "!?" * 700,
            "".join(chr(rng.randrange(0x4E00, 0x9FA5)) for _ in range(3000))]
    out += [doc[:20_000] for doc in _corpus_docs(20_000)]
    for messages in load_trajectories(traces_dir(), limit=3):
        out += render_prompts(messages)[-1:]
    return [t for t in out if t]


def _staged(enc: CpuEncoder, text: str) -> list[int]:
    enc.fused = False
    try:
        return enc.encode(text, parallel=False).tolist()
    finally:
        enc.fused = True


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("kind", ["process", "jit"])
def test_fused_equals_staged_and_reference(name, kind, monkeypatch):
    if kind == "jit":
        monkeypatch.setattr(kernels, "_active", kernels.jit_kernels())
    tok = tokenplane.load(name)
    enc = CpuEncoder(tok, workers=2)
    small = CpuEncoder(tok, workers=1)
    small.bpe.thread_cache().pmap = PieceMap(slots=256, arena_words=512, max_load=150)   # emptied again and again
    seeded = CpuEncoder(tok, workers=1)     # seeded with the small whole tokens, refilled from them again and again
    seeded.bpe.thread_cache().pmap = _small_seeded(seeded)
    rng = random.Random(name)
    texts = _texts(name)
    for text in texts:
        ref = tok.reference.encode_ordinary(text).tolist()
        assert enc.encode(text, parallel=False).tolist() == ref, repr(text[:200])
        assert enc.encode(text, parallel=False).tolist() == ref, repr(text[:200])   # now from the map
        assert small.encode(text, parallel=False).tolist() == ref, repr(text[:200])
        assert seeded.encode(text, parallel=False).tolist() == ref, repr(text[:200])
        assert _staged(enc, text) == ref, repr(text[:200])
        if len(text) > 40:       # chunks: the fused call reads the cut's lookahead character
            assert enc.encode_parallel(text, n_chunks=rng.randint(2, 9)).tolist() == ref, repr(text[:200])
    assert small.bpe.thread_cache().pmap.state[3] > 0       # the small map was emptied and refilled
    assert seeded.bpe.thread_cache().pmap.state[3] > 0
    _assert_chains_whole(seeded.bpe.thread_cache().pmap)
    declined = enc.stats.get("fused_declined", 0)
    if name != "smollm2":     # smollm2's missing bytes go staged
        assert declined == 0
    assert enc.stats["cut_rejected"] == 0


def _small_seeded(enc: CpuEncoder) -> PieceMap:
    """A map seeded with the tokenizer's whole tokens that holds only 150 pieces more before it is emptied."""
    pm = PieceMap(seed=enc.bpe.wmap, seed_arena=enc.bpe.warena)
    pm.state[2] = pm.state[4] + 150
    return pm


def _assert_chains_whole(pm: PieceMap) -> None:
    """Every entry is reachable by its lookup: no empty slot between its home slot and where it lies (a swap of a
    displaced hit with its home slot's entry, or an insertion after a seeded refill, that broke a chain fails)."""
    slots = pm.slots
    mask = slots.shape[0] - 1
    full = slots[:, 1] != 0
    for s in np.flatnonzero(full):
        key, meta = int(slots[s, 0]), int(slots[s, 1])
        m = meta & 0xFFFF if meta >> 63 else meta & 15
        home = int(piecemap._home(np.uint64(key), m, mask))
        span = (s - home) & mask
        assert all(full[(home + d) & mask] for d in range(span + 1)), (s, home)


@pytest.mark.parametrize("name", ["cl100k_base", "qwen3", "smollm2"])
def test_seeded_map_hits_every_small_token_and_keeps_its_chains(name):
    """A seeded map answers every small whole token from its seed (a piece of <= 8 bytes it lacks skips the whole
    lookup), and repeated encodes that move displaced pieces to their home slots keep every entry reachable."""
    tok = tokenplane.load(name)
    enc = CpuEncoder(tok, workers=1)
    pm = piecemap.thread_map(enc.bpe)
    assert pm.state[4] > 0 and pm.state[0] == pm.state[4]
    long_checked = 0
    for word in (" the", " and", " information", " understanding", " implementation", " international"):
        if len(tok.reference.encode_ordinary(word)) == 1:      # one token: a hit from the seed, nothing inserted
            assert enc.encode(word * 3, parallel=False).tolist() == tok.reference.encode_ordinary(word * 3).tolist()
            assert pm.state[0] == pm.state[4], word
            long_checked += len(word.encode()) > 8
    assert long_checked
    text = "".join(_corpus_docs(4000))[:40_000]
    ref = tok.reference.encode_ordinary(text).tolist()
    for _ in range(3):
        assert enc.encode(text, parallel=False).tolist() == ref
    _assert_chains_whole(pm)
    seeded = pm.state[4]
    enc.bpe.clear_caches()
    assert pm.state[0] == seeded and np.array_equal(pm.slots, pm.seed)
    assert enc.encode(text, parallel=False).tolist() == ref


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base", "deepseek_v4", "smollm2"])
def test_in_place_code_units_equal_the_copy(name):
    # 1- and 2-byte strs are read in place (fullencode._in_place, 8- and 16-bit code units); the same block of the same
    # text with an astral character appended after it (a 4-byte str) takes the 32-bit copy: same IDs, same status,
    # whole texts and cuts (a lookahead from the same str), Latin-1 and BMP characters among ASCII runs of every length
    tok = tokenplane.load(name)
    fn = fullencode.full_encoder(CpuEncoder(tok, workers=1).bpe, name)
    sc = fullencode.scratch_args(name)
    rng = random.Random(name + "inplace")
    latin1 = list("abcXYZ \n\t.,'s019") + ["\u00e9", "\u00df", "\u00a0", "\u0085", "\u00ff"]
    for units in (latin1, latin1 + ["\u65e5\u672c", "\u0301", "\u03a9", "\u2014", "\u3000"]):
        for _ in range(250):
            text = "".join(rng.choice(units) * rng.choice([1, 1, 2, 9, 40]) for _ in range(rng.randint(1, 60)))
            wide = text + "\U0001F600"
            ids, status = fn(text, 0, len(text), "", *sc)
            assert status == fullencode.OK and ids.tolist() == tok.reference.encode_ordinary(text).tolist(), text
            assert fn(wide, 0, len(text), "", *sc)[0].tolist() == ids.tolist()
            if len(text) < 2:
                continue
            k = rng.randint(1, len(text) - 1)      # (a cut inside the text: both lookaheads are text[k])
            got, got4 = fn(text, 0, k, text[k:k + 1], *sc), fn(wide, 0, k, wide[k:k + 1], *sc)
            assert got[1] == got4[1] and got[0].tolist() == got4[0].tolist(), (text, k)
            if got[1] == fullencode.OK:        # an accepted cut: the two blocks are the whole text's IDs
                rest = fn(text, k, len(text), "", *sc)[0].tolist()
                assert got[0].tolist() + rest == ids.tolist(), (text, k)
            # a 4-byte str is read in place too; a lookahead that is not the str's own next character takes the copy
            own, copied = fn(wide + text[k], 0, len(wide), text[k], *sc), fn(wide, 0, len(wide), text[k], *sc)
            assert own[1] == copied[1] and own[0].tolist() == copied[0].tolist(), (text, k)
    # a lone surrogate in a 2-byte str: in the last partial 64, inside a 64-unit step, on a step's edges
    for text in ("ab\ud800c\u00e9", "\u65e5\udfff", "x" * 70 + "\ud800", "x" * 100 + "\ud800" + "y" * 100,
                 "x" * 63 + "\udc00" + "y" * 130, "x" * 64 + "\udbff" + "y" * 130):
        assert fn(text, 0, len(text), "", *sc)[1] == fullencode.SURROGATE
    assert fn("ab\u65e5c\ud800", 0, 4, "\ud800", *sc)[1] == fullencode.SURROGATE     # ... in the lookahead
    for text in ("ab\ud800c\U0001F600", "\U0001F600" * 70 + "\udfff", "\udbff\U0001F600",    # ... in a 4-byte str
                 "\U0001F600" + "x" * 130 + "\udfff" + "x" * 140):
        assert fn(text, 0, len(text), "", *sc)[1] == fullencode.SURROGATE
        assert fn(text, 0, len(text), "x", *sc)[1] == fullencode.SURROGATE      # (the copy: another lookahead)


def test_fused_declines_what_it_does_not_cover():
    tok = tokenplane.load("cl100k_base")
    enc = CpuEncoder(tok, workers=1)
    fn = fullencode.full_encoder(enc.bpe, "cl100k_base")
    sc = fullencode.scratch_args("cl100k_base")     # empty: the kernel makes its own arrays
    assert fn("ab\ud800c", 0, 4, "", *sc)[1] == fullencode.SURROGATE
    assert fn("hello world", 0, 5, "w", *sc)[1] == fullencode.CUT_REJECTED      # "hellow": the cut is inside a word
    ids, status = fn("hello world", 0, 5, " ", *fullencode.scratch_args("cl100k_base", 64))
    assert status == fullencode.OK and ids.tolist() == tok.reference.encode_ordinary("hello").tolist()
    smol = tokenplane.load("smollm2")
    senc = CpuEncoder(smol, workers=1)
    if senc.bpe.missing is not None and senc.bpe.missing.any():
        byte = int(np.flatnonzero(senc.bpe.missing)[0])
        if byte < 0x80:
            text = f"ab{chr(byte)}cd"
            fn = fullencode.full_encoder(senc.bpe, "smollm2")
            assert fn(text, 0, len(text), "", *fullencode.scratch_args("smollm2"))[1] == fullencode.DROPPED
            assert senc.encode(text, parallel=False).tolist() == smol.reference.encode_ordinary(text).tolist()


@pytest.mark.parametrize("name", ["cl100k_base", "qwen3"])
def test_a_wrong_map_entry_is_caught(name):
    """The differential check above sees the map: entries rewritten to other IDs change the fused output."""
    tok = tokenplane.load(name)
    enc = CpuEncoder(tok, workers=1)
    text = "".join(_corpus_docs(5000))[:50_000] + "日本語のテキスト" * 50
    ref = tok.reference.encode_ordinary(text).tolist()
    assert enc.encode(text, parallel=False).tolist() == ref
    pm = enc.bpe.thread_cache().pmap
    used = pm.slots[:, 1] != 0
    inline = used & ((pm.slots[:, 1] >> np.uint64(63)) == 0)
    pm.slots[inline, 1] ^= np.uint64(1 << 8)             # every inline entry's first ID off by one
    pm.arena[:pm.state[1]] ^= np.uint32(1)                # every arena entry's IDs and bytes
    assert enc.encode(text, parallel=False).tolist() != ref
    enc.bpe.clear_caches()
    assert enc.encode(text, parallel=False).tolist() == ref


@pytest.mark.parametrize("name", ["cl100k_base", "qwen3", "smollm2"])
def test_small_whole_map_answers_as_the_whole_lookup(name):
    """piecemap.whole_map: for every vocabulary token of 2-8 bytes and for short byte strings that are no token (or
    a token outside the whole-piece set), the same answer as bpe._whole_lookup, which it replaces in the walk."""
    from tokenplane.tokenize.cpu import bpe as bpe_mod
    from tokenplane.tokenize.cpu import merge as merge_mod
    from tokenplane.tokenize.cpu.piecemap import WMAP_FILTER_SHIFT, _home, _whole_small, _word8, whole_map

    enc = CpuEncoder(tokenplane.load(name), workers=1)
    bpe = enc.bpe
    wmap, warena = whole_map(bpe.tok_flat, bpe.tok_off, bpe.whole_ids, bpe.wkeys, bpe.wids)
    assert np.array_equal(bpe.wmap, wmap) and np.array_equal(bpe.warena, warena)
    rng = random.Random(name)
    n = bpe.tok_off.shape[0] - 1
    samples = [bytes(bpe.tok_flat[bpe.tok_off[t]:bpe.tok_off[t + 1]]) for t in range(n)]
    samples = [s for s in samples if 2 <= len(s) <= 8]
    samples += [bytes(rng.randrange(256) for _ in range(rng.randint(2, 8))) for _ in range(20_000)]
    samples += [s[:-1] + b"\x00" for s in samples[:5000]]
    cap = int(merge_mod._filter_split(bpe.wmap.shape[0], WMAP_FILTER_SHIFT)[0])
    mask = cap - 1
    assert bpe.wmap.shape[0] == merge_mod.table_width(cap, WMAP_FILTER_SHIFT)
    hits = 0
    for piece in samples:
        m = len(piece)
        buf = np.zeros(32, np.uint8)
        buf[:m] = np.frombuffer(piece, np.uint8)
        want = bpe_mod._whole_lookup(bpe.wkeys, bpe.wids, bpe.tok_flat, bpe.tok_off, buf, 0, m,
                                     np.uint64(bpe_mod._fnv(buf, 0, m)))    # typed as the kernel's
        key = np.uint64(_word8(buf.view(np.uint64), 0, m))
        got = _whole_small(bpe.wmap, key, m)        # (its filter first, then the probe sequence)
        s, probed = _home(key, m, mask), -1         # the probe sequence alone: what the filter must never cut short
        while bpe.wmap[s, 1] != 0:
            if bpe.wmap[s, 0] == key and int(bpe.wmap[s, 1]) & 15 == m:
                probed = int(bpe.wmap[s, 1]) >> 8
                break
            s = (s + 1) & mask
        assert got == probed == want, (piece, got, probed, want)
        hits += want >= 0
    assert hits > 10_000


@pytest.mark.parametrize("name", ["cl100k_base", "qwen3", "smollm2"])
def test_whole_map_seeds_every_longer_token_as_the_walk_inserts_it(name):
    """Every whole token of more than 8 bytes is in whole_map's slots as the walk would insert that piece after a
    miss (its hash key and length, an arena entry holding the whole lookup's ID, then the bytes), so a seeded map
    that lacks a piece may skip the lookup."""
    from tokenplane.tokenize.cpu import bpe as bpe_mod
    from tokenplane.tokenize.cpu.piecemap import _home, _long_hash, _long_hash2, _word4, _word8

    bpe = CpuEncoder(tokenplane.load(name), workers=1).bpe
    cap = 1 << (bpe.wmap.shape[0].bit_length() - 1)
    mask = cap - 1
    checked = 0
    for t in bpe.whole_ids:
        piece = bytes(bpe.tok_flat[bpe.tok_off[t]:bpe.tok_off[t + 1]])
        m = len(piece)
        if m <= 8:
            continue
        buf = np.zeros(m + 24, np.uint8)
        buf[:m] = np.frombuffer(piece, np.uint8)
        b64 = buf[:(buf.shape[0] >> 3) << 3].view(np.uint64)
        # (the words as uint64: a Python int would type the hash's arithmetic as signed)
        key = (_long_hash2(np.uint64(_word8(b64, 0, 8)), np.uint64(_word8(b64, 8, m - 8)), m) if m <= 16
               else _long_hash(b64, 0, m))
        s = _home(np.uint64(key), m, mask)
        while True:
            meta = int(bpe.wmap[s, 1])
            assert meta != 0, piece          # reached an empty slot: not seeded
            if int(bpe.wmap[s, 0]) == int(key) and meta >> 63 and meta & 0xFFFF == m:
                break
            s = (s + 1) & mask
        off, cnt = (meta >> 24) & 0x7FFFFFFFFF, (meta >> 16) & 0xFF
        want = bpe_mod._whole_lookup(bpe.wkeys, bpe.wids, bpe.tok_flat, bpe.tok_off, buf, 0, m,
                                     np.uint64(bpe_mod._fnv(buf, 0, m)))
        assert cnt == 1 and int(bpe.warena[off]) == want, piece
        words = [int(_word4(b64, 4 * w, min(4, m - 4 * w))) for w in range((m + 3) >> 2)]
        assert [int(x) for x in bpe.warena[off + 1:off + 1 + len(words)]] == words, piece
        checked += 1
    assert checked > 10_000
