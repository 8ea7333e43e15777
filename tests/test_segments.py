"""cpu/segments.py: many ordinary segments of one text in one BPE call equal each segment encoded on its own by the
reference (IDs and character ends), for every family, on real and adversarial text."""

import random

import numpy as np
import pytest
from realtext import corpus_texts

import tokenplane
from tokenplane.tokenize.cpu.segments import encode_segments
from tokenplane.tokenize.router import segment_encoder

NAMES = ["cl100k_base", "o200k_base", "llama3", "qwen3", "deepseek_v4", "smollm2"]
ATOMS = ["a", "Z", "'s", " ", "  ", "\n", "\r\n", "\t", "1", "234", "é", "e\u0301", "中文", "あ", "🙂", "\u200d",
         "x\U00040000", "\x04", ".", "...", "(", "it's", " don't", "\u3000", "\xa0", "½", "٣", "<|", "|>"]


@pytest.fixture(scope="module", params=NAMES)
def tok(request):
    t = tokenplane.load(request.param)
    t.encode("warm the cpu path", path="cpu")
    return t


def _expected(tok, text, spans):
    ids, ends, counts = [], [], []
    for a, b in spans:
        piece_ids, piece_ends = tok.reference.encode_with_ends(text[a:b])
        ids.append(piece_ids.astype(np.uint32))
        ends.append(piece_ends + a)
        counts.append(len(piece_ids))
    return np.concatenate(ids), np.concatenate(ends), counts


def _random_spans(rng, n):
    cuts = sorted(rng.sample(range(n + 1), min(n + 1, 2 * rng.randint(1, 6))))
    spans = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
    return [(a, b) for a, b in spans if a < b] or [(0, n)]


def _check(tok, text, spans):
    cpu = segment_encoder(tok.path("cpu"), 0)
    assert cpu is not None
    out = encode_segments(cpu.bpe, tok.family.name, text, spans)
    if out is None:     # a byte the vocabulary lacks (smollm2): the caller takes the reference path
        assert tok.reference.missing_bytes is not None
        assert any(tok.reference.missing_bytes[np.frombuffer(text[a:b].encode(), np.uint8)].any() for a, b in spans)
        return
    ids, ends, counts = out
    e_ids, e_ends, e_counts = _expected(tok, text, spans)
    assert ids.dtype == np.uint32 and ends.dtype == np.int64
    assert np.array_equal(ids, e_ids), (text, spans)
    assert np.array_equal(ends, e_ends), (text, spans)
    assert counts.tolist() == e_counts


def test_adversarial_segments(tok):
    rng = random.Random(5)
    for _ in range(300):
        text = tok.normalize("".join(rng.choice(ATOMS) for _ in range(rng.randint(1, 30))))
        _check(tok, text, _random_spans(rng, len(text)))


def test_real_text_segments(tok):
    rng = random.Random(6)
    texts = [tok.normalize(t) for t in corpus_texts("mixed")[:40] + corpus_texts("nonen")[:40] if t]
    for text in texts:
        _check(tok, text, _random_spans(rng, len(text)))
        _check(tok, text, [(0, len(text))])


def test_session_windows_take_the_batched_path():
    tok = tokenplane.load("smollm2")
    tok.encode("warm", path="cpu")
    sess = tok.session(text="<|im_start|>user\nhi<|im_end|>\n" * 40, allowed_special="all")
    calls = []
    import tokenplane.tokenize.router as session_module
    real = session_module.encode_segments
    try:
        session_module.encode_segments = lambda *a, **k: calls.append(a[-1]) or real(*a, **k)
        sess.append("<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nok<|im_end|>\n")
    finally:
        session_module.encode_segments = real
    assert len(calls) == 1 and len(calls[0]) >= 4
    assert np.array_equal(sess.ids, tok.encode(sess.text, allowed_special="all"))


def test_span_starts_equal_piece_starts_of_each_span(tok):
    from tokenplane.tokenize.cpu import pretokenize
    from tokenplane.tokenize.cpu.segments import span_starts
    from tokenplane.tokenize.cpu.strbuf import codepoints
    rng = random.Random(8)
    for _ in range(200):
        text = tok.normalize("".join(rng.choice(ATOMS) for _ in range(rng.randint(2, 40))))
        cuts = sorted({0, len(text), *rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 5)))})
        cps = codepoints(text)
        expect = np.concatenate([pretokenize.piece_starts(tok.family, cps[a:b]) for a, b in zip(cuts, cuts[1:])])
        assert span_starts(tok.family.name, cps, np.array(cuts, dtype=np.int64)).tolist() == expect.tolist(), text


def _reference_with_specials(tok, text):
    if tok.family.engine == "tiktoken":
        return tok.reference.encoding.encode(text, allowed_special="all")
    return tok.reference.full.encode(text, add_special_tokens=False).ids


def test_encode_with_allowed_specials_equals_the_reference(tok):
    """Tokenizer.encode of texts cut by allowed literals (chat-shaped, adversarial, real) takes the one-call path
    where it applies and equals the reference engine's own encode with specials."""
    import tokenplane.tokenize.router as tokenizer_module
    rng = random.Random(9)
    specials = sorted(tok.specials)[:6]
    real = [t for t in corpus_texts("mixed")[:30] if t]
    calls = []
    real_encode = tokenizer_module.encode_segments
    tokenizer_module.encode_segments = lambda *a, **k: calls.append(1) or real_encode(*a, **k)
    try:
        for k in range(150):
            parts = []
            for _ in range(rng.randint(2, 8)):
                parts.append(rng.choice(specials))
                if k % 3 == 0:
                    parts.append(rng.choice(real)[:rng.randint(0, 400)])
                else:
                    parts.append("".join(rng.choice(ATOMS) for _ in range(rng.randint(0, 12))))
            text = "".join(parts)
            assert tok.encode(text, allowed_special="all").tolist() == _reference_with_specials(tok, text), text
    finally:
        tokenizer_module.encode_segments = real_encode
    assert (len(calls) > 100) == (tok.family.normalizer is None)


def test_with_literals_slices_equal_the_interleave_kernel(monkeypatch):
    """Few literals are merged by slices, many by the interleave kernel: the same records (literals at span edges,
    back to back, before and after every span, spans that produced no token)."""
    from tokenplane.tokenize.cpu import segments
    rng = random.Random(3)
    for _ in range(300):
        n_spans = rng.randint(0, 6)
        pos, spans, literals = 0, [], []
        for _ in range(n_spans + 1):
            for _ in range(rng.randint(0, 3)):   # literals before the next span
                width = rng.randint(1, 12)
                literals.append((pos, pos + width, rng.randrange(1 << 20)))
                pos += width
            if len(spans) < n_spans:
                width = rng.randint(1, 30)
                spans.append((pos, pos + width))
                pos += width
        counts = np.array([rng.randint(0, b - a) for a, b in spans], np.int64)
        total = int(counts.sum())
        ids = np.arange(total, dtype=np.uint32)
        ends = np.arange(1, total + 1, dtype=np.int64)
        shift = rng.randint(0, 1000)
        monkeypatch.setattr(segments, "_FEW_LITERALS", 1 << 30)
        few = segments.with_literals(ids, ends, counts, spans, literals, shift)
        monkeypatch.setattr(segments, "_FEW_LITERALS", -1)
        kernel = segments.with_literals(ids, ends, counts, spans, literals, shift)
        assert few[0].tolist() == kernel[0].tolist() and few[1].tolist() == kernel[1].tolist()
        assert len(few[0]) == total + len(literals)
        assert sorted(few[0].tolist()) == sorted(ids.tolist() + [sid for _, _, sid in literals])
