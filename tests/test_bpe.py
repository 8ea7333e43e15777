"""ID-level differential tests of the numba BPE kernel (pieces from the per-character pre-tokenizer) vs the reference
encoder, plus the kernel's own edge cases (ties, repeated pairs, whole-piece lookup, long pieces)."""

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from pretokenize_oracles import utf8_offsets
from test_pretokenize import ALPHABET, FRAGMENTS, _corpus_docs, _text_strategy

import tokenplane
from tokenplane.tokenize.cpu import bpe as bpe_mod
from tokenplane.tokenize.cpu import merge as merge_mod
from tokenplane.tokenize.cpu.parallel import CpuEncoder

FAMILIES = ["cl100k_base", "o200k_base", "llama3", "qwen3", "deepseek_v4", "smollm2"]
_ENC: dict[str, CpuEncoder] = {}


def encoder(name: str) -> CpuEncoder:
    if name not in _ENC:
        _ENC[name] = CpuEncoder(tokenplane.load(name), workers=1)
    return _ENC[name]


def _check(name: str, text: str) -> None:
    enc = encoder(name)
    ref = enc.tok.reference.encode_ordinary(text)
    got = enc.encode(text, parallel=False)
    assert got.dtype == np.uint32
    assert got.tolist() == ref.tolist(), f"{name}: {text!r}"


@pytest.mark.parametrize("name", FAMILIES)
def test_tables(name):
    b = encoder(name).bpe
    # SmolLM2 lacks 21 single bytes (C0 C1 F1 F2 F5-FF, six ASCII controls): -1, and texts holding them raise
    # DroppedBytes (the CPU encoder then answers from the reference, which drops them)
    n_missing = 0 if b.missing is None else int(b.missing.sum())
    assert n_missing == (21 if name == "smollm2" else 0)
    kept = b.byte_ids[b.byte_ids >= 0].tolist()
    assert b.byte_ids.shape == (256,) and len(set(kept)) == len(kept) == 256 - n_missing
    # tiktoken checks the whole piece against every token; the HF configs shipped here have ignore_merges false,
    # so only tokens whose own bytes merge back to themselves may answer a piece in one lookup
    ref = encoder(name).tok.reference
    n_multi = int(np.count_nonzero(ref.token_lengths[:ref.n_ordinary] >= 2))
    if encoder(name).tok.family.engine == "tiktoken":
        assert b.n_whole == n_multi
        assert 0.9 * n_multi < b.n_pairs <= n_multi
    else:
        assert 0.9 * n_multi < b.n_whole <= n_multi
        assert b.n_pairs == b.n_whole       # one pair per self-encoding token (bpetables._own_pairs)
    assert b.n_pairs == int(np.count_nonzero(b.pkeys != merge_mod.EMPTY))
    assert b.n_pairs <= 0.5 * b.ptab.shape[1]


@pytest.mark.parametrize("name", FAMILIES)
def test_pair_filter_passes_every_pair_and_rejects_most_others(name):
    """The filter after row 0 of the pair table (merge.FILTER_SHIFT) holds every pair of the table: `_pair_rank` finds
    each one, with its order (a pair the filter dropped would be merged no more: wrong IDs). Pairs of token IDs that
    are no pair: `_pair_rank` answers none, and the filter alone turns away most of them (at most 10% pass; an
    all-ones filter, the bug this catches, passes all)."""
    b = encoder(name).bpe
    cap, words = merge_mod._filter_split(b.ptab.shape[1], merge_mod.FILTER_SHIFT)
    assert b.ptab.shape[1] == merge_mod.table_width(cap) and cap & (cap - 1) == 0 and words == cap >> 4
    used = b.pkeys != merge_mod.EMPTY
    left = (b.pkeys[used] >> np.uint64(32)).astype(np.int64)
    right = (b.pkeys[used] & np.uint64(0xFFFFFFFF)).astype(np.int64)
    order = b.pnews[used] if b.ptab.shape[0] == 1 else b.pranks[used]
    for a, c, o in zip(left.tolist(), right.tolist(), order.tolist()):
        got, slot = merge_mod._pair_rank(b.ptab, a, c)
        assert slot >= 0 and got == o, (a, c)
    rng = np.random.default_rng(7)
    present = set(zip(left.tolist(), right.tolist()))
    trials = [(int(a), int(c)) for a, c in rng.integers(0, b.n_vocab, (20_000, 2))
              if (int(a), int(c)) not in present]
    passed = 0
    for a, c in trials:
        assert merge_mod._pair_rank(b.ptab, a, c)[1] == -1
        h = (((a << 32) | c) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        at, bits = merge_mod._filter_probe(np.uint64(h), words)
        passed += (int(b.ptab[0, cap + at]) & int(bits)) == int(bits)
    assert passed <= 0.1 * len(trials), passed / len(trials)


@pytest.mark.parametrize("name", FAMILIES)
def test_whole_token_filters_pass_every_token_and_reject_most_pieces(name):
    """The whole-token hash table's filter (wkeys after its slots) and the small whole map's (piecemap.whole_map):
    every token of the whole-piece set is still found, by `_whole_lookup` and, for 2-8 bytes, by `_whole_small`;
    byte strings that are no token are refused, and most of them (at least 90%) by the filters alone."""
    from tokenplane.tokenize.cpu import piecemap
    b = encoder(name).bpe
    cap, words = merge_mod._filter_split(b.wkeys.shape[0], merge_mod.FILTER_SHIFT)
    assert b.wkeys.shape[0] == merge_mod.table_width(cap) and b.wids.shape[0] == cap
    wcap, rows = merge_mod._filter_split(b.wmap.shape[0], piecemap.WMAP_FILTER_SHIFT)
    buf = np.zeros(4096, np.uint8)
    tokens = set()
    for t in b.whole_ids.tolist():
        piece = bytes(b.tok_flat[b.tok_off[t]:b.tok_off[t + 1]])
        tokens.add(piece)
        m = len(piece)
        buf[:m + 16] = 0
        buf[:m] = np.frombuffer(piece, np.uint8)
        got = bpe_mod._whole_lookup(b.wkeys, b.wids, b.tok_flat, b.tok_off, buf, 0, m,
                                    np.uint64(bpe_mod._fnv(buf, 0, m)))      # typed as the kernels pass it
        assert got >= 0 and bytes(b.tok_flat[b.tok_off[got]:b.tok_off[got + 1]]) == piece, (t, piece)
        if m <= 8:
            key = np.uint64(piecemap._word8(buf.view(np.uint64), 0, m))
            assert piecemap._whole_small(b.wmap, key, m) == got, (t, piece)
    rng = random.Random(name + "filters")
    others = [bytes(rng.randrange(256) for _ in range(rng.randint(2, 24))) for _ in range(20_000)]
    others = [p for p in others if p not in tokens]
    long_pass = small_pass = small_n = 0
    for piece in others:
        m = len(piece)
        buf[:m + 16] = 0
        buf[:m] = np.frombuffer(piece, np.uint8)
        h = np.uint64(bpe_mod._fnv(buf, 0, m))
        assert bpe_mod._whole_lookup(b.wkeys, b.wids, b.tok_flat, b.tok_off, buf, 0, m, h) == -1
        long_pass += merge_mod._filter_has(b.wkeys, cap, words, np.uint64((int(h) * 0x9E3779B97F4A7C15) % 2**64))
        if m <= 8:
            key = np.uint64(piecemap._word8(buf.view(np.uint64), 0, m))
            assert piecemap._whole_small(b.wmap, key, m) == -1
            small_n += 1
            small_pass += piecemap._wmap_filter_has(b.wmap, wcap, rows,
                                                    np.uint64(((int(key) + m) * 0x9E3779B97F4A7C15) % 2**64))
    assert long_pass <= 0.1 * len(others) and small_pass <= 0.1 * small_n, (long_pass, small_pass, small_n)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v4"])
def test_whole_lookup_only_for_self_encoding_tokens(name):
    enc = encoder(name)
    ref = enc.tok.reference
    b = enc.bpe
    listed = set(b.wids[b.wids >= 0].tolist())
    multi = np.flatnonzero(ref.token_lengths[:ref.n_ordinary] >= 2)
    outside = [int(t) for t in multi if int(t) not in listed]
    rng = np.random.default_rng(3)
    inside = rng.choice(sorted(listed), 300, replace=False).tolist()
    for t in outside[:300] + inside:   # the reference merges each token's bytes as one piece
        piece = ref.token_bytes[t]
        try:
            text = piece.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if [p for p in ref.pretokenize(ref.normalize(text))] != [(0, len(text))] or ref.normalize(text) != text:
            continue
        want = ref.encode_ordinary(text).tolist()
        assert b.encode_piece(piece) == want
        assert (want == [t]) == (t in listed), t


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("text", FRAGMENTS + ["", " " * 1000, "a" * 3000, "ab" * 777, "\n" * 513, "0" * 1001,
                                              "🙂" * 100, "x" + "\u0301" * 300, "aaaaaaaaa", "ababababa"])
def test_fragments_and_long_pieces(name, text):
    _check(name, text)


@pytest.mark.parametrize("name", FAMILIES)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_text_strategy())
def test_adversarial(name, text):
    _check(name, text)


@pytest.mark.parametrize("name", FAMILIES)
def test_random_alphabet(name):
    rng = random.Random(name + "bpe")
    for _ in range(300):
        _check(name, "".join(rng.choice(ALPHABET + FRAGMENTS) for _ in range(rng.randint(1, 40))))


@pytest.mark.parametrize("name", FAMILIES)
def test_every_vocab_token_alone(name):
    """Each sampled ordinary token's own text, alone and inside spaces (whole-piece lookup, deep merge chains)."""
    enc = encoder(name)
    rng = random.Random(1)
    toks = enc.tok.reference.token_bytes[:enc.tok.reference.n_ordinary]
    for t in rng.sample(range(len(toks)), 400):
        try:
            s = toks[t].decode("utf-8")
        except UnicodeDecodeError:
            continue
        _check(name, s)
        _check(name, f" {s} {s}{s}")


def token_and_text_pieces(ref, rng: random.Random, n_tokens: int, longest: int) -> list[bytes]:
    """n_tokens sampled ordinary tokens' own bytes, then 3,000 slices of 2..longest bytes of the shipped corpus text
    (cut anywhere: also inside a character)."""
    toks = ref.token_bytes[:ref.n_ordinary]
    pieces = [toks[t] for t in rng.sample(range(len(toks)), n_tokens)]
    text = " ".join(_corpus_docs(4000)).encode()
    for _ in range(3000):
        a = rng.randrange(max(1, len(text) - longest))
        pieces.append(text[a:a + rng.randint(2, longest)])
    return pieces


@pytest.mark.parametrize("name", FAMILIES)
def test_own_pairs_merge_as_every_pair(name):
    """The kernels' table keeps one pair per self-encoding token (bpetables._own_pairs); the table of every pair
    (every split of a token into two tokens, or every HF merge) merges every piece to the same IDs: each token's own
    bytes, pieces of real text, random byte strings, repeats, in all three merge kernels."""
    from tokenplane.tokenize.cpu import bpetables

    enc = encoder(name)
    b, ref = enc.bpe, enc.tok.reference
    if enc.tok.family.engine == "tiktoken":
        every = bpetables._tiktoken_pairs(ref.token_bytes, ref.n_ordinary)
    else:
        every = bpetables._hf_pairs(ref.model_config())
    full = merge_mod.pair_records(*bpe_mod._build_pairs(*every, bpe_mod.table_cap(len(every[0]))))
    assert len(every[0]) >= b.n_pairs
    rng = random.Random(name + "own")
    pieces = token_and_text_pieces(ref, rng, 3000, 40)
    pieces += [bytes(rng.randrange(256) for _ in range(rng.randint(2, 24))) for _ in range(1000)]
    pieces += [x * n for x in (b"a", b"ab", b" ", b"0", "é".encode(), "的".encode()) for n in (2, 3, 9, 17, 64)]
    keep = b.byte_ids >= 0
    pieces = [p for p in pieces if all(keep[c] for c in p)]
    k = max(map(len, pieces))
    sym, rk, nw, prk, pnw = (np.empty(k, np.int32) for _ in range(5))
    heap = np.empty(3 * k, np.int64)
    for p in pieces:
        buf = np.frombuffer(p + bytes(16), dtype=np.uint8)
        got = []
        for table in (b.ptab, full):
            out = np.empty(k, np.int32)
            n1 = merge_mod._merge_piece_scan(buf, 0, len(p), b.byte_ids, table, sym, rk, nw, out, 0)
            out2 = np.empty(k, np.int32)
            n2 = merge_mod._merge_piece_heap(buf, 0, len(p), b.byte_ids, table, sym, rk, nw, prk, pnw, heap, out2, 0)
            out3 = np.empty(k, np.int32)
            n3 = merge_mod._merge_piece(buf, 0, len(p), b.byte_ids, table, True, sym, rk, nw, out3, 0)
            assert out[:n1].tolist() == out2[:n2].tolist() == out3[:n3].tolist()
            got.append(out[:n1].tolist())
        assert got[0] == got[1], (name, p)


def test_single_merge_schedule_equals_batched():
    """The batched-rounds schedule and one-merge-per-round give the same IDs (the equivalence the kernel uses)."""
    enc = encoder("cl100k_base")
    b = enc.bpe
    rng = random.Random(2)
    for _ in range(200):
        text = "".join(rng.choice(ALPHABET + FRAGMENTS) for _ in range(30))
        buf = np.frombuffer(text.encode(), dtype=np.uint8)
        bounds = np.array([0, buf.size], dtype=np.int64)
        batched = b.encode_bytes(buf, bounds, bpe_mod.PieceCache(16))
        b.batch = False
        try:
            single = b.encode_bytes(buf, bounds, bpe_mod.PieceCache(16))
        finally:
            b.batch = True
        assert batched.tolist() == single.tolist()


def test_piece_cache_hits_are_exact():
    enc = encoder("o200k_base")
    cache = bpe_mod.PieceCache(64, tiny_ways=8)      # small: forces collisions and replacement
    text = " the the The THE theme then the 12 12 12 don't don't"
    buf = np.frombuffer(text.encode(), dtype=np.uint8)
    from tokenplane.tokenize.cpu import pretokenize
    cps = pretokenize.codepoints(text)
    off = utf8_offsets(cps)
    bounds = np.append(off[np.flatnonzero(pretokenize.piece_starts("o200k_base", cps))], off[-1])
    first = enc.bpe.encode_bytes(buf, bounds, cache)
    second = enc.bpe.encode_bytes(buf, bounds, cache)
    assert first.tolist() == second.tolist() == enc.tok.reference.encode_ordinary(text).tolist()


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base", "qwen3"])
def test_tiny_tier_hits_are_exact(name):
    """The tiny tier (pieces <= 8 bytes, <= 2 IDs, key = the bytes packed in one word + the length) returns what
    merging returns: pieces that differ only by trailing NUL or low control bytes (equal packed words, other lengths),
    pieces of 1, 2 and more IDs, under collisions and replacement in a 4-slot tier; two passes, each piece checked
    against its own merge in a fresh cache."""
    b = encoder(name).bpe
    rng = random.Random(name)
    alphabet = [b"\x00", b"\x01", b"\x05", b"\x07", b"\x08", b"a", b"e", b"t", b"h", b" ", b"\xc3\xa9", b"\xe4\xb8\x80",
                b"the", b" the", b"ing", b"0", b"12", b"\xff", b"\n"]
    pieces = [b"ab", b"ab\x00", b"ab\x00\x00", b"ab\x00\x00\x00\x00\x00\x00", b"\x00\x00", b"\x00" * 8]
    while len(pieces) < 400:
        p = b"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))[:8]
        if len(p) >= 2:
            pieces.append(p)
    order = pieces + rng.sample(pieces, len(pieces))
    buf = np.frombuffer(b"".join(order), dtype=np.uint8)
    bounds = np.cumsum([0] + [len(p) for p in order]).astype(np.int64)
    want: list[int] = []
    for p in order:
        one = np.frombuffer(p, dtype=np.uint8)
        want += b.encode_bytes(one, np.array([0, len(p)], dtype=np.int64), bpe_mod.PieceCache(16, tiny_ways=4)).tolist()
    counts = [len(b.encode_bytes(np.frombuffer(p, dtype=np.uint8), np.array([0, len(p)], dtype=np.int64),
                                 bpe_mod.PieceCache(16)).tolist()) for p in pieces]
    assert {1, 2} <= set(counts) and max(counts) > 2       # every record shape and the fall-through
    cache = bpe_mod.PieceCache(16, tiny_ways=4)
    assert b.encode_bytes(buf, bounds, cache).tolist() == want
    assert (cache.tiny[:, 1] != 0).any()
    assert b.encode_bytes(buf, bounds, cache).tolist() == want
    big = bpe_mod.PieceCache()
    assert b.encode_bytes(buf, bounds, big).tolist() == want
    assert b.encode_bytes(buf, bounds, big).tolist() == want


def test_piece_byte_bounds_equals_numpy_form():
    rng = np.random.default_rng(7)
    # every UTF-8 width, starts at random positions including the first and the last character
    pool = np.array([0x41, 0x20, 0x7F, 0x80, 0x7FF, 0x800, 0xFFFF, 0x10000, 0x10FFFF, 0x4E00], dtype=np.uint32)
    for n in (1, 2, 17, 1000):
        cps = rng.choice(pool, n).astype(np.uint32)
        starts = rng.random(n) < 0.3
        starts[0] = True
        off = utf8_offsets(cps)
        want = np.append(off[np.flatnonzero(starts)], off[-1])
        assert bpe_mod.piece_byte_bounds(cps, starts).tolist() == want.tolist()
        assert off[-1] == len("".join(map(chr, cps)).encode("utf-8"))


@pytest.mark.parametrize("name", FAMILIES)
def test_corpus_slices(name):
    for doc in _corpus_docs(20_000):
        _check(name, doc)


@pytest.mark.campaign
@pytest.mark.parametrize("name", FAMILIES)
def test_corpus_full(name):
    for doc in _corpus_docs(10 ** 7):
        _check(name, doc)


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base", "qwen3", "deepseek_v4"])
def test_heap_and_scan_merges_equal_rounds_on_long_pieces(name):
    b = encoder(name).bpe
    rng = np.random.default_rng(5)
    alphabets = ["的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年", "abcdefghij", "ab", "\u0301e",
                 "ありがとうございます日本語のテキスト", "0123456789", "ÿ\u00e9\u4e00🙂"]
    for trial in range(150):
        alpha = alphabets[trial % len(alphabets)]
        text = "".join(rng.choice(list(alpha), int(rng.integers(17, 300))))
        buf = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        m = buf.shape[0]
        scratch = [np.empty(m, dtype=np.int32) for _ in range(3)]
        out1 = np.empty(m, dtype=np.int32)
        out2 = np.empty(m, dtype=np.int32)
        n1 = merge_mod._merge_piece(buf, 0, m, b.byte_ids, b.ptab, True, *scratch, out1, 0)
        n2 = merge_mod._merge_piece_heap(buf, 0, m, b.byte_ids, b.ptab, *scratch,
                                       np.empty(m, dtype=np.int32), np.empty(m, dtype=np.int32),
                                       np.empty(3 * m, dtype=np.int64), out2, 0)
        assert out1[:n1].tolist() == out2[:n2].tolist(), (name, text)
        n3 = merge_mod._merge_piece_scan(buf, 0, m, b.byte_ids, b.ptab, *scratch, out2, 0)
        assert out1[:n1].tolist() == out2[:n3].tolist(), (name, text)


@pytest.mark.parametrize("name", ["cl100k_base", "qwen3", "smollm2"])
def test_pair_table_forms_merge_alike(name):
    """The one-row pair table (merged IDs order the pairs: tiktoken, HF vocabularies numbered in merge order) and
    the two-row form (ranks in the record, merged IDs beside; what any other vocabulary gets) give the same IDs,
    through the rounds, heap and scan kernels (the other tests check the one-row form against the reference); and a
    one-row table is refused where the merged IDs do not follow the ranks."""
    b = encoder(name).bpe
    assert b.ptab.shape[0] == 1         # every family here qualifies for one row
    two = merge_mod.pair_records(b.pkeys, b.pranks, b.pnews, one_row=False)
    assert two.shape[0] == 2 and np.array_equal(two[0] & np.uint64(merge_mod._PAIR_IDS),
                                                b.ptab[0] & np.uint64(merge_mod._PAIR_IDS))
    rng = random.Random(name)
    pieces = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 60))) for _ in range(400)]
    pieces += [w for doc in _corpus_docs(200_000) for w in doc.split(" ")[:300] if len(w.encode()) >= 2]
    for piece in pieces:
        buf = np.frombuffer(piece.encode("utf-8"), dtype=np.uint8)
        m = buf.shape[0]
        got = []
        for tab in (b.ptab, two):
            scratch = [np.empty(m, dtype=np.int32) for _ in range(3)]
            out = np.empty(m, dtype=np.int32)
            n = merge_mod._merge_piece(buf, 0, m, b.byte_ids, tab, True, *scratch, out, 0)
            got.append(out[:n].tolist())
            n = merge_mod._merge_piece_heap(buf, 0, m, b.byte_ids, tab, *scratch, np.empty(m, dtype=np.int32),
                                          np.empty(m, dtype=np.int32), np.empty(3 * m, dtype=np.int64), out, 0)
            got.append(out[:n].tolist())
            n = merge_mod._merge_piece_scan(buf, 0, m, b.byte_ids, tab, *scratch, out, 0)
            got.append(out[:n].tolist())
        assert all(g == got[0] for g in got), (name, piece)
    shuffled = b.pnews.copy()
    used = np.flatnonzero(b.pkeys != merge_mod.EMPTY)
    shuffled[used[:2]] = shuffled[used[1::-1]]      # two pairs' merged IDs swapped: no longer in rank order
    with pytest.raises(ValueError, match="second row"):
        merge_mod.pair_records(b.pkeys, b.pranks, shuffled, one_row=True)
    assert merge_mod.pair_records(b.pkeys, b.pranks, shuffled).shape[0] == 2


@pytest.mark.parametrize("name", ["cl100k_base", "qwen3"])
def test_long_piece_cache_hits_are_exact(name):
    """The long tier (pieces over CACHE_BYTES up to LONG_BYTES) returns what merging returns, under collisions and
    replacement in a tiny cache, and a piece with more IDs than a slot holds is merged every time, never truncated."""
    from tokenplane.tokenize.cpu import pretokenize

    enc = encoder(name)
    cache = bpe_mod.PieceCache(16, long_ways=4, tiny_ways=4)
    rng = random.Random(name)
    cjk = "日本語の文章を書きます中文句子测试鬱龘齉𠀀"
    words = ["".join(rng.choice(cjk) for _ in range(rng.randint(9, 90))) for _ in range(12)]
    words += ["x" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(25, 250)))
              for _ in range(6)]
    text = " ".join(rng.choice(words) for _ in range(120))
    norm = enc.tok.reference.normalize(text)
    cps = pretokenize.codepoints(norm)
    buf = np.frombuffer(norm.encode(), dtype=np.uint8)
    off = utf8_offsets(cps)
    bounds = np.append(off[np.flatnonzero(pretokenize.piece_starts(name, cps))], off[-1])
    assert (np.diff(bounds) > bpe_mod.CACHE_BYTES).any() and (np.diff(bounds) > bpe_mod.LONG_BYTES).any()
    ref = enc.tok.reference.encode_ordinary(text).tolist()
    first = enc.bpe.encode_bytes(buf, bounds, cache).tolist()
    assert (cache.long_length > 0).any()
    second = enc.bpe.encode_bytes(buf, bounds, cache).tolist()
    assert first == second == ref


def test_smollm2_dropped_bytes_fall_back_to_the_reference():
    """HF's BPE drops a byte without a token and merges across it; the CPU encoder hands such texts to the
    reference (serial and chunk-parallel), and the ends the session stores skip the dropped bytes."""
    enc = encoder("smollm2")
    ref = enc.tok.reference
    for text in ["a\x04b", "!!\x04!!", "\x13\x14\x16\x1d", "x\U00040000y\U000bffff", "ok " * 50 + "!\x06!"]:
        assert enc.encode(text, parallel=False).tolist() == ref.encode_ordinary(text).tolist(), repr(text)
        assert enc.encode_parallel(text * 40, n_chunks=3).tolist() == ref.encode_ordinary(text * 40).tolist()
    ids, ends = ref.encode_with_ends("!!\x04!!")
    assert ref.decode_bytes(ids) == b"!!!!" and ends.tolist()[-1] == 5
    assert enc.stats.get("reference", 0) >= 5
