"""backtrack.py's BPE (longest match, pair validity, backtracking) against merge.py's kernels, piece by piece, and
the pair check against re-encoding the pair's bytes; then through the full encode (the walk's long new pieces)."""

import random

import numpy as np
import pytest
from test_bpe import FAMILIES, encoder, token_and_text_pieces
from test_pretokenize import _corpus_docs

from tokenplane.tokenize.cpu import backtrack as bt
from tokenplane.tokenize.cpu import merge as merge_mod
from tokenplane.tokenize.cpu.piecemap import thread_map

# llama3's tiktoken ranks order some tokens before one of their own parts: the validity walk's premise does not hold
MONOTONE = {"cl100k_base": True, "o200k_base": True, "llama3": False, "qwen3": True, "deepseek_v4": True,
            "smollm2": True}


def _heap(b, p: bytes) -> list[int]:
    buf = np.frombuffer(p + bytes(16), dtype=np.uint8)
    m = len(p)
    s = [np.empty(m + 1, np.int32) for _ in range(5)]
    out = np.empty(m + 1, np.int32)
    n = merge_mod._merge_piece_heap(buf, 0, m, b.byte_ids, b.ptab, *s, np.empty(3 * m + 3, np.int64), out, 0)
    return out[:n].tolist()


def _backtrack(b, p: bytes, memo: np.ndarray) -> list[int]:
    buf = np.frombuffer(p + bytes(16), dtype=np.uint8)
    m = len(p)
    out = np.empty(m + 1, np.int32)
    n = bt._merge_piece(buf, 0, m, b.ptab, b.tok_off, b.btda, b.btrec, memo, np.empty(m, np.int32),
                        np.empty(m + 1, np.int32), out, 0)
    assert n >= 0, p
    return out[:n].tolist()


@pytest.mark.parametrize("name", FAMILIES)
def test_tables_only_where_orders_are_monotone(name):
    b = encoder(name).bpe
    rec, monotone = bt._records(b.ptab, b.byte_ids, b.n_vocab)
    assert monotone == MONOTONE[name]
    if not monotone:
        assert b.btda.shape == (0,) and b.btrec.shape == (0, 2)
        return
    assert b.btrec.shape == (b.n_vocab, 2) and b.btda.shape[0] > 0
    own = rec[:, 0] >= 0
    assert int(own.sum()) == b.n_pairs      # one order per self-encoding token: its own pair's
    # every byte's token is one transition from the root, and matches alone
    for byte in range(256):
        t = int(b.byte_ids[byte])
        if t >= 0:
            buf = np.array([byte] + [0] * 16, np.uint8)
            assert bt._longest(buf, 0, 1, b.btda) == t


@pytest.mark.parametrize("name", [f for f in FAMILIES if MONOTONE[f]])
def test_backtracking_equals_the_merge_kernels(name):
    """Tokens' own bytes, real text cut anywhere (also mid-character), CJK and Latin runs up to 300 bytes, random
    bytes, repeats of one or two tokens (ties between equal pairs), each through both kernels."""
    b = encoder(name).bpe
    ref = encoder(name).tok.reference
    rng = random.Random(name + "bt")
    toks = ref.token_bytes[:ref.n_ordinary]
    pieces = token_and_text_pieces(ref, rng, 2000, 80)
    for alpha in ("的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年", "ありがとうございます日本語のテキスト",
                  "abcdefghij", "ab", "\u0301e", "0123456789", "ÿé\u4e00🙂"):
        for _ in range(60):
            pieces.append("".join(rng.choice(alpha) for _ in range(rng.randint(2, 100))).encode())
    pieces += [bytes(rng.randrange(256) for _ in range(rng.randint(2, 40))) for _ in range(1500)]
    for _ in range(300):
        x, y = toks[rng.randrange(len(toks))], toks[rng.randrange(len(toks))]
        pieces.append((x + y) * rng.randint(1, 6))
    pieces += [x * n for x in (b"a", b"ab", b" ", b"0", "\u00e9".encode(), "\u7684".encode()) for n in (2, 3, 9, 17, 64)]
    keep = b.byte_ids >= 0
    pieces = [p for p in pieces if len(p) >= 2 and all(keep[c] for c in p)]
    memo = np.zeros(bt.VALID_SLOTS, np.uint64)
    for p in pieces:
        assert _backtrack(b, p, memo) == _heap(b, p), (name, p)
    # answered from the memo the second time round
    for p in pieces[::7]:
        assert _backtrack(b, p, memo) == _heap(b, p), (name, p)


@pytest.mark.parametrize("name", [f for f in FAMILIES if MONOTONE[f]])
def test_pair_validity_is_reencoding_the_pair(name):
    """`_valid(t1, t2)` says whether the merges of t1's bytes then t2's give back exactly (t1, t2): pairs of
    self-encoding tokens drawn at random, the adjacent pairs of real text's BPE (mostly valid ones), and tokens'
    own parts and their subparts (mostly invalid)."""
    b = encoder(name).bpe
    ref = encoder(name).tok.reference
    rng = random.Random(name + "valid")
    ok = np.flatnonzero(b.btrec[:, 0] >= -1)
    pairs = [(int(rng.choice(ok)), int(rng.choice(ok))) for _ in range(4000)]
    ids = encoder(name).encode(" ".join(_corpus_docs(3000))[:60_000], parallel=False).tolist()
    pairs += [(ids[i], ids[i + 1]) for i in rng.sample(range(len(ids) - 1), 3000) if b.btrec[ids[i], 0] >= -1
              and b.btrec[ids[i + 1], 0] >= -1]
    # a token's own parts merge (invalid), and so may a part with a piece of the other part's merge tree
    own = np.flatnonzero(b.btrec[:, 0] >= 0)
    for t in rng.sample(own.tolist(), 2000):
        left, right = int(b.btrec[t, 1] & 0x1FFFFF), int((b.btrec[t, 1] >> 21) & 0x1FFFFF)
        pairs.append((left, right))
        pairs.append((left, int(b.btrec[right, 1] & 0x1FFFFF)))
        pairs.append((int((b.btrec[left, 1] >> 21) & 0x1FFFFF), right))
    seen = {True: 0, False: 0}
    for t1, t2 in pairs:
        both = bytes(ref.token_bytes[t1]) + bytes(ref.token_bytes[t2])
        want = _heap(b, both) == [t1, t2]
        assert bool(bt._valid(b.ptab, b.btrec, t1, t2)) == want, (name, t1, t2)
        seen[want] += 1
    assert min(seen.values()) > 500


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v4", "o200k_base"])
def test_full_encode_takes_long_new_pieces_through_backtracking(name):
    """A fresh thread map, CJK text whose runs are long new pieces: the walk answers them with the backtracking
    kernel (its memo fills) and the IDs equal the reference's."""
    enc = encoder(name)
    rng = random.Random(name + "walk")
    alpha = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年日本語のテキストありがとう"
    text = "、".join("".join(rng.choice(alpha) for _ in range(rng.randint(6, 40))) for _ in range(400))
    pm = thread_map(enc.bpe)
    pm.valid[:] = 0
    pm.clear()
    got = enc.encode(text, parallel=False)
    assert got.tolist() == enc.tok.reference.encode_ordinary(text).tolist()
    assert np.count_nonzero(pm.valid) > 100


def test_no_tables_keep_the_merge_kernels():
    """llama3 (orders not monotone): empty tables, the walk merges as before, same IDs as the reference."""
    enc = encoder("llama3")
    assert enc.bpe.btda.shape[0] == 0
    text = "、".join("的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年" * 3 for _ in range(20))
    pm = thread_map(enc.bpe)
    pm.valid[:] = 0
    assert enc.encode(text, parallel=False).tolist() == enc.tok.reference.encode_ordinary(text).tolist()
    assert not pm.valid.any()


@pytest.mark.campaign
@pytest.mark.parametrize("name", [f for f in FAMILIES if MONOTONE[f]])
def test_every_corpus_piece_campaign(name):
    """Every distinct piece of the whole corpus (mixed + nonen; TOKENPLANE_CORPUS points at build_corpus.py's
    output for the full one) through both kernels, pieces cut by the family's own pre-tokenizer (~180K a family)."""
    from realtext import corpus_texts

    from tokenplane.tokenize.cpu import pretokenize, strbuf

    enc = encoder(name)
    b = enc.bpe
    keep = b.byte_ids >= 0
    pieces: set[bytes] = set()
    for text in corpus_texts("mixed") + corpus_texts("nonen"):
        norm = enc.tok.normalize(text)
        cps = strbuf.codepoints(norm, 0, len(norm))
        starts = np.flatnonzero(pretokenize.piece_starts(enc.family, cps)[:len(norm)]).tolist() + [len(norm)]
        pieces.update(norm[x:y].encode() for x, y in zip(starts, starts[1:]))
    memo = np.zeros(bt.VALID_SLOTS, np.uint64)
    for p in pieces:
        if len(p) >= 2 and all(keep[c] for c in p):
            assert _backtrack(b, p, memo) == _heap(b, p), (name, p)
