"""The ahead-of-time kernel module (cpu/kernels.py, cpu/aotbuild.py): same IDs as the numba JIT kernels and the
reference on adversarial and real text for every family, on every kernel of the default encode path (serial,
chunk-parallel, NFC regions, segments between allowed specials); a damaged, stale or foreign module is refused and
the JIT kernels answer; a fresh process encodes, and keeps a session, through it without importing numba (and without
building the reference engine).

The module is built once per test session into a temporary folder (~15-25 s on one core)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_pretokenize import ALPHABET, FRAGMENTS, _corpus_docs
from test_startbits import _cps, _loop_starts

import tokenplane
from tokenplane.tokenize import appendwin
from tokenplane.tokenize.cpu import aotbuild, fullencode, kernels, segments, window
from tokenplane.tokenize.cpu.parallel import CpuEncoder
from tokenplane.tokenize.errors import InvalidTextError

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["cl100k_base", "o200k_base", "llama3", "qwen3", "deepseek_v4", "smollm2"]


@pytest.fixture(scope="session")
def aot_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("aot")
    aotbuild.build(root)
    return root


@pytest.fixture(scope="session")
def aot(aot_root) -> kernels.Kernels:
    return kernels.aot_kernels(kernels.module_folder(aot_root))


@pytest.fixture
def use(monkeypatch):
    """Make `k` the process's kernel set for one test (restored afterwards)."""
    def set_kernels(k: kernels.Kernels) -> None:
        monkeypatch.setattr(kernels, "_active", k)
    return set_kernels


def _texts(name: str, n: int) -> list[str]:
    rng = random.Random(name + "aot")
    out = ["".join(rng.choice(ALPHABET + FRAGMENTS) for _ in range(rng.randint(1, 300))) for _ in range(n)]
    return out + [doc[:3000] for doc in _corpus_docs(3000)]


def _both(enc: CpuEncoder, aot: kernels.Kernels, use, run) -> tuple:
    out = []
    for k in (aot, kernels.jit_kernels()):
        use(k)
        enc.bpe.clear_caches()       # a piece cached by one kernel set must not answer for the other
        out.append(run())
    return tuple(out)


@pytest.mark.parametrize("name", FAMILIES)
def test_aot_equals_jit_and_reference(name, aot, use):
    tok = tokenplane.load(name)
    enc = CpuEncoder(tok, workers=2)
    before = dict(kernels.guard_fallbacks)
    rng = random.Random(name)
    for text in _texts(name, 120):
        ref = tok.reference.encode_ordinary(text).tolist()
        a, j = _both(enc, aot, use, lambda: enc.encode(text, parallel=False).tolist())
        assert a == j == ref, repr(text[:200])
        if len(text) > 40:      # the chunk-parallel path on small chunks: cut search, byte profile, NFC regions
            chunks = rng.randint(2, 12)
            a, j = _both(enc, aot, use, lambda: enc.encode_parallel(text, n_chunks=chunks).tolist())
            assert a == j == ref, repr(text[:200])
    real = "".join(_corpus_docs(100_000))[:400_000]     # > PARALLEL_MIN_CHARS: the default path of a long text
    ref = tok.reference.encode_ordinary(real).tolist()
    a, j = _both(enc, aot, use, lambda: enc.encode(real).tolist())
    assert a == j == ref
    assert enc.stats["cut_rejected"] == 0
    assert kernels.guard_fallbacks == before, "an argument of the default path missed its AOT signature"


@pytest.mark.parametrize("name", FAMILIES)
def test_batch_of_texts_equals_jit_and_reference(name, aot, use):
    """fullbatch.py: many texts in one call, each its own encode, AOT == JIT == the reference text by text."""
    tok = tokenplane.load(name)
    enc = CpuEncoder(tok, workers=1)
    before = dict(kernels.guard_fallbacks)
    texts = [tok.normalize(t) for t in _texts(name, 60) if t]
    joined = "".join(texts)
    ends = np.cumsum([len(t) for t in texts])
    spans = np.stack([ends - [len(t) for t in texts], ends], axis=1).astype(np.int64)
    a, j = _both(enc, aot, use, lambda: enc.encode_texts(joined, spans))
    assert a is not None and j is not None      # (no text here holds a byte smollm2's vocabulary lacks)
    assert np.array_equal(a[0], j[0]) and np.array_equal(a[1], j[1])
    parts = np.split(a[0], np.cumsum(a[1])[:-1])
    assert all(p.tolist() == tok.reference.encode_ordinary(t).tolist() for p, t in zip(parts, texts))
    assert kernels.guard_fallbacks == before, "an argument of the batch path missed its AOT signature"


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base", "qwen3", "deepseek_v4", "smollm2"])
def test_segments_between_specials_equal_jit_and_reference(name, aot, use):
    """Many segments in one BPE call (allowed specials, session repair windows): IDs, token ends and counts."""
    tok = tokenplane.load(name)
    enc = CpuEncoder(tok)
    literals = sorted(tok.specials)[:3]
    rng = random.Random(name + "seg")
    before = dict(kernels.guard_fallbacks)
    for text in _texts(name, 40)[:40]:
        parts = [text[i:i + 37] for i in range(0, len(text), 37)] or [""]
        chosen = [rng.choice(literals) for _ in parts]
        full = "".join(p + lit for p, lit in zip(parts, chosen))
        ref = [t for p, lit in zip(parts, chosen)
               for t in tok.reference.encode_ordinary(p).tolist() + [tok.specials[lit]]]
        a, j = _both(enc, aot, use, lambda: tok.encode(full, allowed_special="all", path="cpu").tolist())
        assert a == j == ref, repr(full[:200])
        norm = tok.normalize(text)
        spans = [(i, min(len(norm), i + 23)) for i in range(0, len(norm), 31)] if norm else []
        if spans:
            a, j = _both(enc, aot, use, lambda: segments.encode_segments(enc.bpe, tok.family.name, norm, spans))
            if a is None or j is None:
                assert a is None and j is None
                continue
            assert all(np.array_equal(x, y) for x, y in zip(a, j))
            want = [tok.reference.encode_ordinary(norm[s:e]).tolist() for s, e in spans]
            assert a[0].tolist() == [t for w in want for t in w]
            assert a[2].tolist() == [len(w) for w in want]
    assert kernels.guard_fallbacks == before


def _window_texts(name: str) -> list[str]:
    """Real agent-trace windows (the tail of each call's prompt: what a session's repair window encodes),
    adversarial strings, corpus documents, and cuts that start or end inside a run."""
    from realtext import traces_dir

    from tokenplane.tokenize.evidence.traces import load_trajectories, render_prompts

    out = []
    for messages in load_trajectories(traces_dir(), limit=4):
        prompts = render_prompts(messages)
        out += [b[len(a) - 256:] for a, b in zip(prompts[:6], prompts[1:7])]
    rng = random.Random(name + "window")
    out += _texts(name, 60)
    out += [t[rng.randrange(len(t)):] for t in out[-20:] if t]
    return [t for t in out if t]


def _has_rare(norm: str, spans: list[tuple[int, int]]) -> bool:
    """Whether o200k's run loop finds a rare shape in one of the spans (what its rescan must visit)."""
    return any(len(_loop_starts("o200k_base", _cps(norm[a:b]))[1]) for a, b in spans if b > a)


@pytest.mark.parametrize("name", FAMILIES)
def test_fused_window_equals_staged_jit_and_reference(name, aot, use):
    """window.py's one-call kernel (session repair windows) == the staged segments path == the reference, IDs,
    absolute ends and tokens per span, with the AOT and the JIT kernels; whatever it declines (status != OK: o200k's
    a byte the vocabulary lacks) the staged path answers, so encode_segments(tc=...) stays exact. o200k's windows with
    rare shapes are answered by the compiled rescan, not declined."""
    tok = tokenplane.load(name)
    enc = CpuEncoder(tok)
    tc = tok.vocab_facts.token_chars
    rng = random.Random(name + "fused")
    before = dict(kernels.guard_fallbacks)
    checked = rare = 0
    for text in _window_texts(name):
        norm = tok.normalize(text)
        n = len(norm)
        cuts = sorted(rng.sample(range(1, n), min(n - 1, 4))) if n > 2 else []
        multi = [(a, b) for a, b in zip([0, *cuts[1::2]], [*cuts[::2], n]) if a < b]
        for spans in ([(0, n)], multi):
            if not spans:
                continue
            shift = rng.randrange(0, 10_000)
            checked += 1
            want = [tok.reference.encode_with_ends(norm[a:b]) for a, b in spans]
            staged = segments.encode_segments(enc.bpe, name, norm, spans)
            arr = segments.NO_SPANS if len(spans) == 1 else np.array(spans, dtype=np.int64)
            lo, hi = spans[0] if len(spans) == 1 else (0, 0)
            fused = _both(enc, aot, use, lambda: segments.window_encoder(enc.bpe, name, tc)(norm, lo, hi, arr, shift))
            (a_ids, a_ends, a_counts, a_st), (j_ids, j_ends, j_counts, j_st) = fused
            assert a_st == j_st, repr(norm[:200])
            if staged is None:      # a byte the vocabulary lacks: the reference path answers the session
                assert a_st == window.DROPPED
                continue
            assert a_st == window.OK, (a_st, repr(norm[:200]))     # o200k's rare shapes included
            if name == "o200k_base" and _has_rare(norm, spans):
                rare += 1
            assert np.array_equal(a_ids, j_ids) and np.array_equal(a_ends, j_ends)
            assert np.array_equal(a_counts, j_counts)
            assert a_ids.dtype == np.uint32 and a_ends.dtype == np.int64
            assert np.array_equal(a_ids, staged[0]) and np.array_equal(a_ends, staged[1] + shift)
            assert a_counts.tolist() == staged[2].tolist()
            assert a_ids.tolist() == [t for ids, _ in want for t in ids.tolist()], repr(norm[:200])
            assert a_ends.tolist() == [e + a + shift for (a, _), (_, ends) in zip(spans, want)
                                       for e in ends.tolist()]
            both = segments.encode_segments(enc.bpe, name, norm, spans, tc=tc, shift=shift)
            assert both is not None
            assert np.array_equal(both[0], staged[0]) and np.array_equal(both[1], staged[1] + shift)
    assert checked and (name != "o200k_base" or rare > 0)     # o200k: windows with rare shapes were among them
    assert kernels.guard_fallbacks == before, "an argument of the fused window missed its AOT signature"


def test_fused_window_refuses_a_lone_surrogate(aot, use):
    tok = tokenplane.load("cl100k_base")
    enc = CpuEncoder(tok)
    for k in (aot, kernels.jit_kernels()):
        use(k)
        fn = segments.window_encoder(enc.bpe, "cl100k_base", tok.vocab_facts.token_chars)
        assert fn("ab\ud800c", 0, 4, segments.NO_SPANS, 0)[3] == window.SURROGATE
        with pytest.raises(InvalidTextError):
            segments.encode_segments(enc.bpe, "cl100k_base", "ab\ud800c", [(0, 4)], tc=tok.vocab_facts.token_chars)


def test_cross_kind_prefix_compare_equals_startswith(aot):
    """The text store's cross-kind compare (textstore._match_at: one loop per pair of str widths) on both kernel
    sets, every pair of PEP 393 kinds, a mismatch planted at and around its 4,096-character block edges or nowhere:
    equal to str.startswith (1: same kind, the caller's memcmp answers)."""
    rng = random.Random(11)
    narrow, wide, astral = ["a", " ", "\u00e9", "\x00", "\u00ff"], ["\u0100", "\u4e2d", "\uffff"], ["\U0001F642", "\U0010ffff"]
    pools = {1: narrow, 2: narrow + wide, 4: narrow + wide + astral}
    top = {1: "\u00ff", 2: "\uffff", 4: "\U0010ffff"}

    def make(kind: int, n: int) -> str:
        body = "".join(rng.choice(pools[kind]) for _ in range(n))
        return body + top[kind] if n else ""

    for k in (aot, kernels.jit_kernels()):
        for ck in (1, 2, 4):
            for tk in (1, 2, 4):
                for n in (0, 5, 4095, 4097, 9000):
                    chunk = make(ck, n)
                    head = make(tk, rng.randint(0, 3))
                    for where in (None, 0, 4095, 4096, 4097, len(chunk) - 1):
                        text = head + chunk + make(tk, 2)
                        if where is not None and 0 <= where < len(chunk):
                            p = len(head) + where
                            text = text[:p] + ("b" if text[p] != "b" else "c") + text[p + 1:]
                        for off in (len(head), max(0, len(head) - 1), len(text)):
                            r = k.text_match_at(chunk, text, off)
                            want = text.startswith(chunk, off)
                            assert (want if r == 1 else r == 2) == want, (k.kind, ck, tk, n, where, off, r)


def test_common_prefix_and_suffix_equal_a_character_loop(aot):
    """The text store's common prefix and suffix (textstore._common_prefix / _common_suffix: blocks of one loop per
    pair of str widths, eight 1-byte characters a load) on both kernel sets, every pair of PEP 393 kinds, one
    difference planted at and around the 2,048-character block edges or none, offsets past either end clamped:
    equal to a loop over the characters."""
    rng = random.Random(12)
    pools = {1: ["a", " ", "\u00e9"], 2: ["a", "\u4e2d", "\u0100"], 4: ["a", "\u4e2d", "\U0001F642"]}

    def make(kind: int, n: int) -> str:
        return "".join(rng.choice(pools[kind]) for _ in range(n)) + {1: "\u00ff", 2: "\uffff", 4: "\U0010ffff"}[kind]

    def prefix(a: str, ao: int, b: str, bo: int, n: int) -> int:
        i = 0
        while i < n and ao + i < len(a) and bo + i < len(b) and a[ao + i] == b[bo + i]:
            i += 1
        return i

    def suffix(a: str, ae: int, b: str, be: int, n: int) -> int:
        if ae > len(a) or be > len(b):
            return 0
        k = 0
        while k < min(n, ae, be) and a[ae - 1 - k] == b[be - 1 - k]:
            k += 1
        return k

    for k in (aot, kernels.jit_kernels()):
        for ak in (1, 2, 4):
            for bk in (1, 2, 4):
                for n in (0, 7, 2047, 2049, 5000):
                    a = make(ak, n)
                    for where in (None, 0, 2047, 2048, 2049, len(a) - 1):
                        body = a[:-1] + ("b" if bk == 1 else "\u4e2d" if bk == 2 else "\U0001F642")
                        b = body
                        if where is not None and where < len(a) - 1:
                            b = b[:where] + ("c" if b[where] != "c" else "d") + b[where + 1:]
                        for ao, bo, m in ((0, 0, len(a)), (0, 0, len(a) + 9), (3, 3, len(a)), (0, len(b) + 2, 5),
                                          (-1, 0, 4)):
                            want = prefix(a, ao, b, bo, m) if ao >= 0 else 0
                            assert k.text_common_prefix(a, ao, b, bo, m) == want, (k.kind, ak, bk, n, where, ao, m)
                        for ae, be, m in ((len(a), len(b), len(a)), (len(a) - 1, len(b) - 1, 9000),
                                          (len(a), len(b) + 1, 4), (2, 2, 1)):
                            want = suffix(a, ae, b, be, m)
                            assert k.text_common_suffix(a, ae, b, be, m) == want, (k.kind, ak, bk, n, where, ae, m)


def test_packed_run_compare_equals_startswith(aot):
    """A packed wide run's prefix check (packedrun._match_at: low bytes and the count of wide characters in one pass,
    then the exceptions) on both kernel sets: resent text of 2 and 4 bytes a character, a change planted at an
    exception, at a narrow character (low byte, high byte only, widened) or nowhere, at and around block edges."""
    from tokenplane.tokenize.packedrun import pack

    rng = random.Random(12)
    body = [rng.choice("abc de\u00e9\u00ff") if rng.random() > 0.03 else rng.choice("\u0159\u010d\u4e2d")
            for _ in range(9000)]
    run_text = "".join(body)
    run = pack(run_text, 2)
    assert run is not None
    for k in (aot, kernels.jit_kernels()):
        for tail in ("", "x", "\U0001F642"):
            text = "\u0159 " + run_text + tail
            for where in (None, 0, 4095, 4096, 4097, 8999, *rng.sample(range(9000), 20)):
                for new in ("b", "\u0100", "\u01e9", "\U0001F642"):
                    changed = text
                    if where is not None:
                        p = 2 + where
                        changed = text[:p] + (new if text[p] != new else "c") + text[p + 1:]
                    for off in (2, 1, 3):
                        got = bool(k.packed_match_at(run.low, run.exc, changed, off))
                        assert got == changed.startswith(run_text, off), (k.kind, tail, where, new, off)


def test_guard_sends_mismatched_arguments_to_the_jit_kernel(aot):
    """A compiled kernel trusts dtypes and layout; the guard must route anything else to numba (no crash)."""
    table = (np.arange(256) % 100).astype(np.int8)
    cps = np.array([1, 5, 200, 7, 99, 255], dtype=np.uint32)
    want = table[cps].tolist()
    assert aot.gather_i8(table, cps).tolist() == want
    n = kernels.guard_fallbacks.get("gather_i8", 0)
    assert aot.gather_i8(table, cps.astype(np.int64)).tolist() == want            # other dtype
    assert aot.gather_i8(table, np.repeat(cps, 2)[::2]).tolist() == want          # not contiguous
    assert aot.gather_i8(table.astype(np.uint8), cps).tolist() == want            # other table dtype
    assert kernels.guard_fallbacks["gather_i8"] == n + 3
    out = np.empty(3, dtype=np.uint32)
    assert aot.codepoints("abc", 0, 3, out) == -1 and out.tolist() == [97, 98, 99]
    assert aot.codepoints("a\ud800c", 0, 3, out) == 1              # the lone surrogate is reported, as by JIT


def test_packed_binding_sends_mismatched_arguments_to_the_jit_kernel(aot, use):
    """A bound kernel runs its packed form (packed.py), its head still guarded: a head argument of another type
    (a str subclass) goes, with the whole bound tail, to the JIT kernel and gets the same IDs."""
    use(aot)
    tok = tokenplane.load("cl100k_base")
    enc = CpuEncoder(tok, workers=1)
    text = "It's 2024: 12345 tokens, they'll see. " * 3
    want = tok.reference.encode_ordinary(text).tolist()
    assert enc.encode(text, parallel=False).tolist() == want
    fn = enc._full_kernel(enc._scratch(len(text)))

    class Text(str):
        pass
    n = kernels.guard_fallbacks.get("full_gpt4", 0)
    ids, status = fn(Text(text), 0, len(text), "")
    assert status == 0 and ids.tolist() == want
    assert kernels.guard_fallbacks["full_gpt4"] == n + 1


def _copy(aot_root: Path, root: Path) -> Path:
    dest = kernels.module_folder(root)
    shutil.copytree(kernels.module_folder(aot_root), dest)
    return dest


def _edit_meta(folder: Path, **changes) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    meta.update(changes)
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "garbage with matching hash", "stale key",
                                    "other numba", "export missing", "no record"])
def test_damaged_or_stale_module_is_refused_and_jit_answers(damage, aot_root, tmp_path, monkeypatch):
    folder = _copy(aot_root, tmp_path)
    so = kernels.module_file(folder)
    data = bytearray(so.read_bytes())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0xFF
        so.write_bytes(bytes(data))
    elif damage == "truncated":
        so.write_bytes(bytes(data[: len(data) // 3]))
    elif damage == "garbage with matching hash":
        so.write_bytes(b"not an ELF file" * 100)
        _edit_meta(folder, sha256=kernels.file_digest(so))
    elif damage == "stale key":
        _edit_meta(folder, key="0" * 24)
    elif damage == "other numba":
        meta = json.loads((folder / "meta.json").read_text())
        _edit_meta(folder, fields=dict(meta["fields"], numba="0.0.0"))
    elif damage == "export missing":
        meta = json.loads((folder / "meta.json").read_text())
        _edit_meta(folder, exports=meta["exports"][1:])
    else:
        (folder / "meta.json").unlink()
    with pytest.raises(kernels.AotUnavailable):
        kernels.load_module(folder)
    monkeypatch.setenv("TOKENPLANE_AOT_DIR", str(tmp_path))
    monkeypatch.setenv("TOKENPLANE_AOT_BUILD", "0")
    monkeypatch.setattr(kernels, "_active", None)
    k = kernels.get()
    assert k.kind == "jit"
    tok = tokenplane.load("cl100k_base")
    text = "".join(_corpus_docs(2000))[:20_000]
    assert tok.encode(text, path="cpu").tolist() == tok.reference.encode_ordinary(text).tolist()


def test_build_replaces_a_damaged_module_and_keeps_a_valid_one(aot_root, tmp_path, monkeypatch):
    folder = _copy(aot_root, tmp_path)
    good = kernels.module_file(kernels.module_folder(aot_root))
    compiled = []

    def fake_compile(dest: Path) -> None:      # the compiler's output, without the 20 s of compiling
        compiled.append(dest)
        shutil.copy(good, kernels.module_file(dest))

    monkeypatch.setattr(aotbuild, "_compile", fake_compile)
    assert aotbuild.build(tmp_path) == folder and not compiled          # valid: kept
    so = kernels.module_file(folder)
    head = so.read_bytes()[:1000]
    so.unlink()     # a new file, as any writer but an in-place one makes: this process has the old one mapped
    so.write_bytes(head)
    assert aotbuild.build(tmp_path) == folder and len(compiled) == 1   # damaged: rebuilt in place
    kernels.load_module(folder)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".build-")]


def _session_steps(name: str) -> list[str]:
    """Whole-text resends of one growing, edited context: appends, mid-context edits, wide characters in ASCII text
    (a cross-kind prefix compare), a non-NFC edit for the NFC family, a control byte smollm2's vocabulary lacks."""
    rng = random.Random(name + "session")
    docs = _corpus_docs(40_000)
    text = "".join(docs)[:30_000]
    steps = [text]
    for k in range(12):
        if k % 3 == 2:
            a = rng.randrange(len(text) // 5, 4 * len(text) // 5)
            text = text[:a] + rng.choice(["e\u0301 x", "\u65e5\u672c\u8a9e", "\x01 y", " 123 ", "\U0001F44D"]) + text[a + 7:]
        else:
            text += rng.choice(docs)[:rng.randint(50, 3000)] + rng.choice(["", " \u00e9t\u00e9", "\x01", "\u4e2d\u6587"])
        steps.append(text)
    steps.append(text[:len(text) // 2])        # a shrink: an edit that deletes the tail
    return steps


@pytest.mark.parametrize("name", FAMILIES)
def test_session_kernels_equal_jit_and_reference(name, aot, use, appendwin_statuses):
    """A session's own kernels (records, splice-point search, cross-kind prefix compare, the fused append window) on
    the AOT module answer as the JIT kernels do, every step equal to the reference, with no argument missing its
    signature; the fused append window answers some appends on both kernel sets."""
    tok = tokenplane.load(name)
    steps = _session_steps(name)
    before = dict(kernels.guard_fallbacks)
    statuses = appendwin_statuses
    splices = []
    for k in (aot, kernels.jit_kernels()):
        use(k)
        session = tok.session(encode_path="cpu")
        n_before = len(statuses)
        run = []
        for text in steps:
            sp = session.sync(text)
            run.append((sp.keep, sp.ids.tolist()))
            assert session.ids.tolist() == tok.encode(text, path="reference").tolist()
        splices.append(run)
        assert session.stats.windows_tried > 0
        assert set(appendwin.ACCEPTED) & set(statuses[n_before:])
    assert splices[0] == splices[1]
    assert kernels.guard_fallbacks == before, "a session argument missed its AOT signature"


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base", "qwen3", "deepseek_v4", "smollm2"])
def test_bound_kernels_run_packed_and_return_arrays_of_their_own(name, aot_root, use, monkeypatch):
    """Every kernel the encoder binds runs the module's packed form (packed.py: the tail as one handle, the head
    borrowed), whose returned arrays must be its own: a view of an argument would have no owner. Each packed call
    is checked for it, its result compared with the unpacked export's on the same arguments, and the IDs with
    the reference (full encode, a batch, session appends and edits)."""
    tok = tokenplane.load(name)
    seen: dict[str, int] = {}
    tails: dict[int, tuple] = {}        # each handle's bound arguments (the scratch arrays bound in it included)
    real_pack = kernels.pack_tail

    def pack(tail):
        h = real_pack(tail)
        tails[id(h)] = (h, tail)
        return h
    monkeypatch.setattr(kernels, "pack_tail", pack)
    k = kernels.aot_kernels(kernels.module_folder(aot_root))      # (its own: the wrappers below stay in it)
    for base in kernels.PACKED:
        packed = k._raw[kernels.packed_name(base)]

        def checked(*args, _packed=packed, _base=base):
            got = _packed(*args)
            bound = tails[id(args[-1])][1]
            arrays = [a for a in (got if isinstance(got, tuple) else (got,)) if isinstance(a, np.ndarray)]
            for r in arrays:
                assert r.size == 0 or not any(np.shares_memory(r, a) for a in (*args, *bound)
                                              if isinstance(a, np.ndarray))
            seen[_base] = seen.get(_base, 0) + 1
            return got
        k._raw[kernels.packed_name(base)] = checked
    use(k)
    enc = CpuEncoder(tok, workers=1)
    texts = [t for t in _texts(name, 20) if t]
    for text in texts[:30]:
        assert enc.encode(text, parallel=False).tolist() == tok.reference.encode_ordinary(text).tolist()
    got = tok.encode_batch(texts, num_threads=1)
    assert all(g.tolist() == tok.encode(t, path="reference").tolist() for g, t in zip(got, texts))
    session = tok.session(encode_path="cpu")
    for text in _session_steps(name):
        session.sync(text)
        assert session.ids.tolist() == tok.encode(text, path="reference").tolist()
    loop = fullencode.block_tables(name)[0]
    assert seen.get(f"full_{loop}", 0) > 0 and seen.get("batch", 0) > 0
    assert seen.get(f"append_{loop}", 0) + seen.get(f"window_{loop}", 0) > 0


def test_key_changes_with_the_kernel_sources(monkeypatch):
    key = kernels.cache_key()
    fields = dict(kernels.key_fields())
    monkeypatch.setattr(kernels, "key_fields", lambda: dict(fields, sources="x"))
    assert kernels.cache_key() != key


def test_jit_kernels_cache_under_the_sources_key(monkeypatch):
    """numba checks a cached kernel against its own file only, while a kernel compiles in what it calls from other
    files: the JIT kernels' caches live under the key of every kernel source (lazyjit._keyed_cache), so a change in
    merge.py cannot leave piecemap.py's cached walk running the old merge code. Kernels made before and after
    materialization alike; numba's own setting is restored for everyone else's kernels."""
    from numba import njit
    from numba.core import config

    from tokenplane.tokenize.cpu import lazyjit, merge, piecemap

    lazyjit.materialize()
    keyed = str(kernels.numba_cache_dir())
    assert kernels.cache_key() in keyed
    for fn in (piecemap._walk, merge._merge_piece_scan):
        assert fn._cache._cache_path.startswith(keyed + os.sep)
    late = lazyjit.njit(cache=True)(lambda x: x + 1)
    assert late._cache._cache_path.startswith(keyed + os.sep)
    assert not njit(cache=True)(lambda x: x + 1)._cache._cache_path.startswith(keyed)
    assert config.CACHE_DIR != keyed


_CHILD = """
import json, sys
import tokenplane
from tokenplane.tokenize.cpu import kernels
text = open(sys.argv[1], encoding="utf-8", newline="").read()
tok = tokenplane.load(sys.argv[2])
ids = tok.encode(text)
session = tok.session()
session.sync(text[:len(text) // 2])
session.sync(text[:len(text) // 4] + "x" + text[len(text) // 4 + 1:len(text) // 2] + text[len(text) // 2:])
session.sync(text)
print(json.dumps({"numba": "numba" in sys.modules, "kind": kernels.get().kind, "ids": ids.tolist(),
                  "session": session.ids.tolist(), "reference_built": tok._reference is not None}))
"""


@pytest.mark.parametrize("damaged", [False, True])
def test_fresh_process_encodes_without_numba(damaged, aot_root, tmp_path):
    root = tmp_path / "aot"
    folder = _copy(aot_root, root)
    if damaged:
        so = kernels.module_file(folder)
        so.write_bytes(so.read_bytes()[:5000])
    text = "".join(_corpus_docs(100_000))[:300_000] + " e\u0301 \u65e5\u672c"
    (tmp_path / "t.txt").write_bytes(text.encode("utf-8"))
    env = dict(os.environ, TOKENPLANE_AOT_DIR=str(root), TOKENPLANE_AOT_BUILD="0", PYTHONPATH=str(ROOT))
    env.pop("TOKENPLANE_AOT", None)
    for name in ("qwen3", "o200k_base"):
        _ = tokenplane.load(name).vocab_facts       # cached, as `tokenplane warmup` leaves it
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "t.txt"), name], capture_output=True,
                              text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["ids"] == tokenplane.load(name).reference.encode_ordinary(text).tolist()
        assert got["session"] == got["ids"]
        assert got["kind"] == ("jit" if damaged else "aot")
        assert got["numba"] == damaged
        assert not got["reference_built"]     # the vocabulary facts a session needs come from the cache


def test_import_and_load_never_import_numba():
    code = "import sys, tokenplane; tokenplane.load('llama3'); print('numba' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), TOKENPLANE_AOT="0"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


def test_engine_versions_read_without_import_equal_the_imported_ones():
    import tiktoken
    import tokenizers

    from tokenplane.tokenize.spec import charclass

    assert charclass._installed_version("tiktoken") == tiktoken.__version__
    assert charclass._installed_version("tokenizers") == tokenizers.__version__


def test_background_build_starts_once_and_not_after_a_failure(tmp_path, monkeypatch):
    started = []
    monkeypatch.setenv("TOKENPLANE_AOT_DIR", str(tmp_path))
    monkeypatch.delenv("TOKENPLANE_AOT_BUILD", raising=False)
    monkeypatch.setattr(kernels.subprocess, "Popen", lambda cmd, **kw: started.append(cmd))
    monkeypatch.setattr(kernels, "_build_started", False)
    marker = kernels.failure_marker()
    marker.write_text("Traceback: the compiler failed")
    assert not kernels.start_background_build() and not started
    marker.unlink()
    assert kernels.start_background_build() and started[0][1:3] == ["-m", "tokenplane.tokenize.cpu.aotbuild"]
    assert not kernels.start_background_build() and len(started) == 1      # once per process


def test_key_sources_cover_every_kernel_module():
    """The AOT key hashes kernels.SOURCES: every module a kernel's code comes from must be there (a kernel module,
    or one whose intrinsics the kernels name through lazyjit.numba_global), else an edit of it would leave a
    stale module loaded under the old key."""
    import re

    cpu = Path(kernels.__file__).parent
    keyed = {(cpu / s).resolve() for s in kernels.SOURCES}
    assert all(p.exists() for p in keyed)
    named = set()
    for path in [*cpu.glob("*.py"), *cpu.parent.glob("*.py")]:
        src = path.read_text()
        named.update(re.findall(r'numba_global\(\s*"tokenplane\.tokenize\.([\w.]+)"', src))
        if "@njit" in src:
            named.add(str(path.relative_to(cpu.parent).with_suffix("")).replace("/", "."))
    missing = sorted(m for m in named if (cpu.parent / (m.replace(".", "/") + ".py")).resolve() not in keyed)
    assert not missing, missing


def test_unchecked_binding_is_the_export_without_its_guard(aot, use):
    """asciiappend.py calls the append kernel through Kernels.bind_unchecked: the module's packed export (AOT) or
    the JIT kernel, with the tail bound as `bind` binds it; the session's IDs equal the reference either way."""
    from tokenplane.tokenize import asciiappend

    tok = tokenplane.load("cl100k_base")
    for k in (aot, kernels.jit_kernels()):
        use(k)
        s = tok.session(text="hello world, " * 400)
        for chunk in (" and more", " 12345 text\n", "  indented(x)"):
            s.append(chunk)
            assert s.ids.tolist() == tok.encode(s.text, path="reference").tolist()
        bound = next(e[0] for e in asciiappend._local.bindings.values() if e[0].kernels is k)
        if k.kind == "aot":
            assert bound.raw is k._raw["append_gpt4_packed"] and len(bound.raw_tail) == 1
        else:
            assert bound.raw is kernels._jit_kernel("append_gpt4") and bound.raw_tail[-1] is bound.out_ends
        with pytest.raises(TypeError):
            k.bind_unchecked("append_gpt4", 10, 1)      # the tail is still checked against the signature
