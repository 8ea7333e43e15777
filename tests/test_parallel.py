"""Chunk-parallel CPU encode == serial == reference; routing and path registration never change IDs."""

import random

import numpy as np
import pytest
from test_pretokenize import ALPHABET, FRAGMENTS, _corpus_docs

import tokenplane
from tokenplane.tokenize import router as router_mod
from tokenplane.tokenize.cpu import nfc as nfc_mod
from tokenplane.tokenize.cpu.parallel import CpuEncoder
from tokenplane.tokenize.registry import build
from tokenplane.tokenize.spec.families import Family

FAMILIES = ["cl100k_base", "o200k_base", "llama3", "qwen3", "deepseek_v4", "smollm2"]
_ENC: dict[str, CpuEncoder] = {}


def encoder(name: str) -> CpuEncoder:
    if name not in _ENC:
        _ENC[name] = CpuEncoder(tokenplane.load(name), workers=2)
    return _ENC[name]


@pytest.mark.parametrize("name", FAMILIES)
def test_many_small_chunks_equal_reference(name):
    enc = encoder(name)
    rng = random.Random(name + "par")
    for _ in range(120):
        text = "".join(rng.choice(ALPHABET + FRAGMENTS) for _ in range(rng.randint(20, 200)))
        norm = enc.tok.reference.normalize(text)
        ref = enc.tok.reference.encode_ordinary(text)
        got = enc.encode_parallel_normalized(norm, n_chunks=rng.randint(2, 40))
        assert got.tolist() == ref.tolist(), repr(text)
    assert enc.stats["cut_rejected"] == 0


@pytest.mark.parametrize("name", FAMILIES)
def test_cuts_are_stable_and_increasing(name):
    enc = encoder(name)
    text = "Hello world, 12345 (x)\n\tfoo  bar 你好。 " * 200
    cuts = enc.cuts(text, 16)
    assert cuts == sorted(set(cuts)) and all(0 < c < len(text) for c in cuts)
    assert len(cuts) >= 8


@pytest.mark.parametrize("name", FAMILIES)
def test_corpus_parallel_equals_serial(name):
    enc = encoder(name)
    docs = _corpus_docs(200_000)
    text = "".join(docs)[:300_000]
    ref = enc.tok.reference.encode_ordinary(text)
    serial = enc.encode(text, parallel=False)
    par = enc.encode(text, parallel=True)
    many = enc.encode_parallel_normalized(enc.tok.reference.normalize(text), n_chunks=64)
    assert np.array_equal(serial, ref) and np.array_equal(par, ref) and np.array_equal(many, ref)


@pytest.mark.parametrize("name", FAMILIES)
def test_blocked_serial_encode_and_scratch_reuse_equal_reference(name):
    """Serial encodes run block by block (blocks cut at stable positions) through per-thread scratch arrays that
    are reused: small blocks (many cuts, random texts and corpus text) and a long text, a short one and the long
    one again on one encoder (stale scratch contents must never leak into a shorter call) all equal the reference."""
    enc = CpuEncoder(tokenplane.load(name), workers=2)
    enc.block_chars = 700
    rng = random.Random(name + "blocks")
    long_text = "".join(_corpus_docs(40_000))[:40_000]
    texts = [long_text, "Hi", long_text[:5_000], long_text]
    texts += ["".join(rng.choice(ALPHABET + FRAGMENTS) for _ in range(rng.randint(900, 3000))) for _ in range(30)]
    for text in texts:
        ref = enc.tok.reference.encode_ordinary(text)
        assert enc.encode(text, parallel=False).tolist() == ref.tolist(), repr(text[:200])
        assert enc.encode_parallel_normalized(enc.tok.reference.normalize(text), n_chunks=3).tolist() == ref.tolist()
    assert enc.stats["cut_rejected"] == 0


@pytest.mark.parametrize("name", FAMILIES)
def test_registered_paths_equal_reference(name):
    tok = tokenplane.load(name)
    assert {"cpu", "auto"} <= tok.fast_paths
    text = "Hello <|endoftext|> world 12345\n\n  don't ſ'S 你好 " * 30
    for path in ("cpu", "auto"):
        assert tok.encode(text, path=path).tolist() == tok.encode(text, path="reference").tolist()
        assert tok.encode(text, path=path, allowed_special="all").tolist() == \
            tok.encode(text, path="reference", allowed_special="all").tolist()
    router = tok.path("auto")
    before = router.stats["cpu"]
    assert tok.encode("short text", path="auto").tolist() == tok.encode("short text", path="reference").tolist()
    assert router.stats["cpu"] == before + 1      # "cpu" was built above, so "auto" now takes it


class _FakeGpu:
    def __init__(self, fn):
        self.fn = fn
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        return self.fn(text)


def test_router_routes_by_size_and_spills_under_backpressure():
    tok = tokenplane.load("cl100k_base")
    ref = tok.reference.encode_ordinary
    fake = _FakeGpu(ref)
    cpu_calls = []

    def cpu(text):
        cpu_calls.append(len(text))
        return ref(text)

    r = router_mod.Router(tok, cpu, gpu_min_chars=100, gpu_max_inflight=1, gpu_factory=lambda t: fake)
    small, large = "x" * 50, "word " * 100
    assert r(small).tolist() == ref(small).tolist() and fake.calls == 0
    assert r(large).tolist() == ref(large).tolist() and fake.calls == 1
    r._slots.acquire()            # the one GPU slot is busy: the large segment spills to the CPU
    try:
        assert r(large).tolist() == ref(large).tolist()
    finally:
        r._slots.release()
    assert fake.calls == 1 and r.stats["spill"] == 1 and r.stats["gpu"] == 1


def test_auto_builds_the_cpu_path_on_first_call_and_never_answers_from_the_reference():
    tok = tokenplane.load("llama3")
    built = []

    def build():
        built.append(1)
        return tok.reference.encode_ordinary

    lazy = router_mod._Lazy(build)
    r = router_mod.Router(tok, lazy, gpu_factory=lambda t: None)
    assert r("hello there").tolist() == tok.reference.encode_ordinary("hello there").tolist()
    assert lazy.ready and built == [1] and "reference" not in r.stats and r.stats["cpu"] == 1
    assert r("hello again").tolist() == tok.reference.encode_ordinary("hello again").tolist()
    assert built == [1] and r.stats["cpu"] == 2


def test_router_without_gpu_uses_cpu():
    tok = tokenplane.load("o200k_base")
    r = router_mod.Router(tok, tok.reference.encode_ordinary, gpu_min_chars=10, gpu_factory=lambda t: None)
    text = "a much longer segment than ten characters"
    assert r(text).tolist() == tok.reference.encode_ordinary(text).tolist()
    assert r.stats == {"cpu": 1, "gpu": 0, "spill": 0}


def test_unsupported_family_takes_reference():
    from tokenplane.tokenize.spec.artifacts import artifact_bytes

    base = tokenplane.load("qwen3")
    generic = Family(name="hf-generic", engine="hf", patterns=base.family.patterns,
                     onig_patterns=base.family.onig_patterns, normalizer="nfc")
    tok = build("qwen3-as-generic", generic, artifact_bytes("qwen3"))
    assert tok.fast_paths == frozenset()
    text = "Hello 12345 世界"
    assert tok.encode(text, path="cpu").tolist() == base.encode(text, path="reference").tolist()
    assert tok.encode(text, path="auto").tolist() == base.encode(text, path="reference").tolist()


def test_campaign_counts_and_catches_planted_faults(monkeypatch):
    """run_campaign reports zero on clean text and catches a wrong split and a wrong ID (it can fail)."""
    from tokenplane.tokenize.cpu import pretokenize
    from tokenplane.tokenize.evidence import campaign_fullencode as cf

    clean = cf.run_campaign("cl100k_base", ["hello world 12345", "x  \n\n y"])
    assert clean["divergences"] == 0 and clean["pieces_checked"] > 5 and clean["ids_checked"] > 5
    orig_pieces = pretokenize.pieces

    def fused(family, text):
        p = orig_pieces(family, text)
        return [(p[0][0], p[1][1])] + p[2:] if len(p) > 1 else p
    monkeypatch.setattr(pretokenize, "pieces", fused)
    res = cf.run_campaign("cl100k_base", ["hello world"])
    assert res["piece_divergences"] == 1 and res["reproduction"][0]["level"] == "pieces"
    monkeypatch.setattr(pretokenize, "pieces", orig_pieces)
    orig_encode = CpuEncoder.encode
    monkeypatch.setattr(CpuEncoder, "encode", lambda self, text, parallel=None: orig_encode(self, text)[:-1])
    res = cf.run_campaign("cl100k_base", ["hello world"])
    assert res["id_divergences"] == 1 and res["reproduction"][0]["level"] == "ids"


# Text that NFC changes: decomposed accents, Hangul jamo, reordered marks, singletons, next to ordinary text.
NFC_FRAGMENTS = ["e\u0301", "A\u030a", "\u1100\u1161\u11a8", "\u1112\u1161", "a\u0323\u0302", "a\u0302\u0323",
                 "\u212b", "\u2126", "\u0344", "\u00c5", "\uac00\u11a8", "\u0f73", "q\u0307\u0323", " \u0301",
                 "\u0301\u0301", "\u3099\u304b", "\u304b\u3099", "\U0001109a", "\U00011099\U000110ba"]


def test_qwen3_raw_cuts_normalize_per_chunk():
    """qwen3's parallel path cuts raw text (inert characters around every cut) and normalizes chunk by chunk: the
    IDs equal the reference for every chunk count, and the chunks' NFC joins to the whole text's NFC."""
    enc = encoder("qwen3")
    assert enc._nfc_inert is not None
    nfc = enc.tok.reference._normalizer.normalize_str
    rng = random.Random("qwen3-raw")
    before, changed = enc.stats["cut_rejected"], 0
    for _ in range(150):
        text = "".join(rng.choice(ALPHABET + FRAGMENTS + NFC_FRAGMENTS * 3) for _ in range(rng.randint(20, 300)))
        changed += nfc(text) != text
        k = rng.randint(2, 40)
        got = enc.encode_parallel(text, n_chunks=k)
        assert got.tolist() == enc.tok.reference.encode_ordinary(text).tolist(), repr(text)
        cuts = enc.cuts(text, k, enc._nfc_inert)
        edges = [0, *cuts, len(text)]
        assert "".join(nfc(text[a:b]) for a, b in zip(edges, edges[1:])) == nfc(text)
    assert enc.stats["cut_rejected"] == before and changed > 100


def test_qwen3_serial_blocks_normalize_in_raw_coordinates(monkeypatch):
    """A long non-ASCII qwen3 text that NFC changes encodes serially block by block, each block cut in the raw text
    where NFC cannot act; a block with no changed region is encoded from the text's own buffer, any other is
    built from its text and changed regions, or normalized anew when a region crosses its cut (no whole-text NFC
    str). With small blocks (many cuts) over text NFC changes, the IDs equal the reference, every kind of block
    occurs, and no cut is rejected."""
    enc = CpuEncoder(tokenplane.load("qwen3"), workers=1)
    enc.block_chars = 300
    rng = random.Random("qwen3-raw-blocks")
    calls, kinds = [], {"raw": 0, "normalized": 0, "spliced": 0, "crossed": 0}
    raw_blocks, blocks = enc._encode_raw_blocks, enc._encode_blocks

    def count_blocks(s, a, b, lookahead=""):
        kinds["raw" if len(s) > b - a else "normalized"] += 1
        return blocks(s, a, b, lookahead)

    def count_spliced(text, a, b, *rest):
        block = spliced(text, a, b, *rest)
        if b - a < len(text):       # a block's splice (nfc.normalize splices whole texts)
            kinds["spliced" if block is not None else "crossed"] += 1
        return block

    spliced = nfc_mod.splice
    monkeypatch.setattr(nfc_mod, "splice", count_spliced)
    enc._encode_raw_blocks = lambda text, changes: calls.append(len(changes)) or raw_blocks(text, changes)
    enc._encode_blocks = count_blocks
    changed = 0
    for i in range(60):
        text = "".join(rng.choice(ALPHABET + FRAGMENTS + NFC_FRAGMENTS * 3) for _ in range(rng.randint(500, 4000)))
        if i % 2 == 0:      # mostly NFC already, with a few changed regions
            text = "".join(_corpus_docs(6_000))[:rng.randint(2_000, 6_000)] + "\u00e9" + text[:40]
            for _ in range(3):
                p = rng.randrange(len(text))
                text = text[:p] + rng.choice(NFC_FRAGMENTS) + text[p:]
        changed += enc.tok.reference.normalize(text) != text
        assert enc.encode(text, parallel=False).tolist() == enc.tok.reference.encode_ordinary(text).tolist(), \
            repr(text[:200])
    assert len(calls) == changed > 30 and enc.stats["cut_rejected"] == 0
    assert kinds["raw"] > 20 and kinds["normalized"] == kinds["spliced"] + kinds["crossed"]
    assert kinds["spliced"] > 30 and kinds["crossed"] > 30, kinds


def test_qwen3_parallel_chunks_in_place_or_spliced(monkeypatch):
    """qwen3's parallel path: each chunk's thread scans its chunk where it lies for what NFC changes; a chunk holding
    no changed region is encoded from the text's own buffer, any other is built from its text and regions. Over
    mostly-NFC texts with a few changed regions (and some dense stretches) both kinds of chunk occur, the IDs equal
    the reference, and no chunk is sliced and normalized whole."""
    enc = encoder("qwen3")
    rng = random.Random("qwen3-parallel-chunks")
    kinds = {"in place": 0, "spliced": 0}
    chunk_nfc = enc._chunk_nfc

    def count_chunk(s, a, b):
        block = chunk_nfc(s, a, b)
        kinds["in place" if block is None else "spliced"] += 1
        return block

    enc._chunk_nfc = count_chunk
    monkeypatch.setattr(enc.tok, "normalize", lambda t: pytest.fail("normalized a chunk whole"))
    base = "".join(_corpus_docs(20_000))
    for i in range(80):
        a = rng.randrange(len(base) - 8_000)
        text = base[a:a + rng.randint(2_000, 8_000)] + "\u00e9"
        for _ in range(rng.randint(1, 4)):
            p = rng.randrange(len(text))
            text = text[:p] + "".join(rng.choice(NFC_FRAGMENTS) for _ in range(rng.randint(1, 3))) + text[p:]
        if i % 4 == 0:      # a stretch NFC changes densely: regions merged across inert characters
            p = rng.randrange(len(text))
            dense = "".join(rng.choice(ALPHABET + NFC_FRAGMENTS * 3) for _ in range(rng.randint(200, 2_000)))
            text = text[:p] + dense + text[p:]
        got = enc.encode_parallel(text, n_chunks=rng.randint(2, 24))
        assert got.tolist() == enc.tok.reference.encode_ordinary(text).tolist(), repr(text[:200])
    assert kinds["in place"] > 100 and kinds["spliced"] > 100, kinds


def test_nfc_changes_in_a_range_are_those_of_its_slice():
    """`Tokenizer.nfc_changes(text, a, b)` (the chunk threads' scan, read in place) gives the regions of
    text[a:b] as positions in text: spliced, they are NFC(text[a:b]), and shifted by a they equal the regions of the
    slice itself, for ranges cut where NFC cannot act across and for the text's own ends; every PEP 393 kind."""
    tok = tokenplane.load("qwen3")
    enc = encoder("qwen3")
    ref = enc.tok.reference._normalizer.normalize_str
    rng = random.Random("nfc-changes-in")
    for i in range(120):
        text = "".join(rng.choice(ALPHABET + FRAGMENTS + NFC_FRAGMENTS) for _ in range(rng.randint(50, 600)))
        text += ["", "\u00ff", "\u4e00", "\U0001f600"][i % 4]
        edges = [0, *enc.cuts(text, rng.randint(2, 8), enc._nfc_inert), len(text)]
        for a, b in zip(edges, edges[1:]):
            found = tok.nfc_changes(text, a, b)
            assert all(a <= x < y <= b for x, y, _ in found)
            assert nfc_mod.splice(text, a, b, found) == ref(text[a:b])
            assert [(x - a, y - a, d) for x, y, d in found] == tok.nfc_changes(text[a:b], 0, b - a)


def test_nfc_cut_needs_inert_neighbours():
    enc = encoder("qwen3")
    text = "word e\u0301 word"
    p = text.index("\u0301")     # raw text is stable between "e" and U+0301, but NFC composes the two into one
    assert enc._cut_at_or_after(text, p - 1, None) == p
    cut = enc._cut_at_or_after(text, p - 1, enc._nfc_inert)
    assert cut is None or cut > p + 1


@pytest.mark.parametrize("name", ["cl100k_base", "qwen3"])
def test_chunk_trace_covers_the_text_once(name):
    """`chunk_trace`: one entry a chunk of a parallel encode, the spans tiling the text in order of position, each
    with its thread and a start before its end; nothing is recorded while it is None."""
    enc = encoder(name)
    text = "".join(_corpus_docs(200_000))[:300_000] + " naïve 你好"      # (qwen3: raw chunks, normalized per thread)
    trace: list = []
    enc.chunk_trace = trace
    try:
        ids = enc.encode_parallel(text, n_chunks=6)
    finally:
        enc.chunk_trace = None
    assert np.array_equal(ids, enc.tok.reference.encode_ordinary(enc.tok.reference.normalize(text)))
    spans = sorted((a, b) for _, a, b, _, _ in trace)
    assert len(spans) == 6 and spans[0][0] == 0 and spans[-1][1] == len(text)
    assert all(spans[k][1] == spans[k + 1][0] for k in range(5))
    assert all(t0 <= t1 for *_, t0, t1 in trace) and all(isinstance(th, int) for th, *_ in trace)
    enc.encode_parallel(text, n_chunks=6)
    assert len(trace) == 6


@pytest.mark.parametrize("name", FAMILIES)
def test_guided_chunks(name):
    enc = encoder(name)
    fr = enc._chunk_fractions(4_000_000, None)
    sizes = np.diff([0.0, *fr, 1.0])
    assert all(0 < f < 1 for f in fr) and fr == sorted(fr)
    assert sizes[0] == pytest.approx(1 / (2 * enc.workers)) and sizes.min() > 0
    assert (np.diff(sizes[:-1]) <= 1e-12).all()       # big chunks first, the small ones even out the end
    assert enc._chunk_fractions(1000, None) == []     # below one minimum chunk: serial
    assert enc._chunk_fractions(10, 4) == [0.25, 0.5, 0.75]


def test_empty_sequence_normalizer_is_identity():
    """deepseek_v4's normalizer is an empty Sequence; it is skipped, which is exact only if HF's own normalizer
    leaves every text unchanged (checked here on adversarial text)."""
    from tokenizers import Tokenizer as HFTokenizer

    from tokenplane.tokenize.spec.artifacts import artifact_bytes

    tok = tokenplane.load("deepseek_v4")
    hf = HFTokenizer.from_str(artifact_bytes("deepseek_v4").decode())
    rng = random.Random("ds-norm")
    for _ in range(100):
        text = "".join(rng.choice(ALPHABET + FRAGMENTS + NFC_FRAGMENTS) for _ in range(rng.randint(1, 80)))
        assert hf.normalizer.normalize_str(text) == text == tok.reference.normalize(text)


@pytest.mark.parametrize("name", FAMILIES)
def test_short_encode_path_equals_reference_and_declines_what_it_cannot_answer(name):
    """`Tokenizer.encode` sends a short str on "auto" straight to the CPU path's block kernel (Router.short ->
    CpuEncoder.encode_short). Its answers equal the reference on random and adversarial short texts, it is taken
    (counted as a CPU call; the checked path would answer too, so the counts tell them apart), and it declines,
    leaving the checked path's answer or error, where it cannot answer: a lone surrogate, a non-ASCII text of a
    normalizing family, a text over SHORT_CHARS, the fused kernels off."""
    from tokenplane.tokenize.cpu.parallel import SHORT_CHARS
    tok = tokenplane.load(name)
    router = tok.path("auto")
    tok.encode("warm the thread's kernel binding")
    enc = router.cpu.get()
    rng = random.Random(name + "short")
    texts = ["", "a", " ", "Hello world", "don't 123456 x\n\n", "x" * SHORT_CHARS, "y " * (SHORT_CHARS // 2 + 1)]
    texts += ["".join(rng.choice(ALPHABET + FRAGMENTS) for _ in range(rng.randint(1, 60))) for _ in range(150)]
    normalizes = tok.normalizer_kind != "none"
    for text in texts:
        expect_short = len(text) <= SHORT_CHARS and (not normalizes or text.isascii())
        got_short = enc.encode_short(text)
        assert (got_short is not None) == expect_short, repr(text[:80])
        before = router.stats["cpu"]
        ids = tok.encode(text)
        assert ids.dtype == np.uint32 and ids.tolist() == tok.encode(text, path="reference").tolist(), repr(text)
        assert router.stats["cpu"] == before + 1, repr(text[:80])    # ("" too, on the short path)
        if got_short is not None:
            assert got_short.tolist() == ids.tolist()
    with pytest.raises(tokenplane.InvalidTextError):
        tok.encode("abc\ud800def")
    assert enc.encode_short("abc\ud800def") is None
    enc.full_kernel = False
    try:
        assert enc.encode_short("plain ascii") is None
        assert tok.encode("plain ascii").tolist() == tok.encode("plain ascii", path="reference").tolist()
    finally:
        enc.full_kernel = True
