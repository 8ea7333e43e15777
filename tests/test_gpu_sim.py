"""GPU tokenizer body on numba-cuda's CUDA simulator: differential at the piece level and the ID level.

The simulator runs the same kernels as Python threads (warp intrinsics come from gpu/simwarp.py), so inputs are kept
to a few hundred characters and batched into one device pass per family (documents are cut on the device exactly as
in `encode_batch`). Skipped when numba-cuda is not installed.
"""

from __future__ import annotations

import glob
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

numba = pytest.importorskip("numba", reason="numba-cuda not installed (pip install numba-cuda)")
try:
    import numba_cuda  # noqa: F401
except ImportError:
    pytest.skip("numba-cuda not installed (pip install numba-cuda)", allow_module_level=True)

import tokenplane  # noqa: E402
from tokenplane.tokenize import gpu  # noqa: E402
from tokenplane.tokenize.evidence import adversarial  # noqa: E402

FAMILIES = ["cl100k_base", "llama3", "o200k_base", "qwen3", "deepseek_v4", "smollm2"]
DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces" / "mini-swe-agent"
ROOT = Path(__file__).resolve().parents[1]

MARK_AFTER_PUNCT = "a \u0301b \u00a7\u0301c \u2603abc \u00bfQu\u00e9?\r\n\r\nok"
ADVERSARIAL = [
    "Hello world! 12345 don't", "a  b\n\n  c!\n\nx  ", "I'm ſ'S 'll x'sY", " 's", "\t's x", "!!'s", "''s", "a'", "'",
    "don'tcha DON'T x'LL 'Re 'VE 'M 'D", "1234567 ½²³4 x1y22z333 ١٢٣٤", "a\r\n\r\nb\n \n c\r\n", "  \n\n  ",
    "x \t y\u3000z\u00a0w", "!\n\n/x", "!\n/-abc", "a/b//c", "x!/\n/\n y", "!\r\n/\r\n/ z", "HelloWorld ABCdef abcDEF aBC",
    "中A 中AB 中ABc A中B A中Bc Ab中CD", "ǅungla ǅUNGLA xǅ", "ʰʰA aʰB", "日本語のテキスト、です。", "emoji 👍🏽 🙂🙂 x",
    "naïve café", "Привет, МИР мир", "    x", "x    ", "\n", " ", "x's", "x'sAb", "x'sアBc", "$$$x", " $x", "=\"'s'\"",
    "foo.bar(baz)\n\treturn x\r\n", "über Über ÜBER", "     1", "a1b2c3", "<|endoftext|> text", "\x00\x01 \x7f",
    "e\u0301x a\u0300B", "A\u0300B\u0301c", "it's's'sx", "!!\u0301abc", " \u2764\ufe0f x", "\u2764\ufe0fx",
    "a\u0301!", "\u0301AB \u0301ab", "!\u0301AB", "x\u0301'S", "\u0915\u094d\u0937\u093f \u0928\u092e\u0938\u094d\u0924\u0947",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35 1\u0301", "!\n/\u0301", "tests/validators/\nx", "a/\n/\n", "a //\n-", "q/\r\n\r\n/", "/\n", "\n/\n", "a/\n/b", "x\u2028y\u2029z\u0085", "\ufeffBOM", "\U0010ffff\U000e0001",
    "\u1100\u1161\u11a8 \uf900x A\u030a\u212b 12\u0301 \u0958\u093c",   # NFC changes these (qwen3 normalizes on the host)
    # DeepSeek's stages: digit groups and CJK ranges cut segments; ASCII punctuation glues to ASCII letters
    "!abc !ab\u00e9c  !abc x!abc ..abc (Hello) #include<stdio.h> $x1 _ab", "\u4e2d\u6587abc\u65e5\u672c\u8a9e123x",
    "\u30ab\u30bf\u30ab\u30ca\u30fb\u30c6\u30b9\u30c8\u3002\n\nx", "\u30fb\n\u30a0x!\n\n x", "\uff11\uff12\uff13\uff14a",
    MARK_AFTER_PUNCT, "1234567890!x", "\u3042\u3044 \u3046!\u4e00",
]


@pytest.fixture(scope="module", autouse=True)
def simulator():
    """Run numba.cuda in simulator mode for this module only; restore the environment afterwards."""
    saved_env = os.environ.get("NUMBA_ENABLE_CUDASIM")
    saved_switch = sys.getswitchinterval()
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    if "numba.cuda" not in sys.modules:
        numba.core.config.reload_config()   # numba may already be imported (CPU BPE kernels) before this module
    from numba import cuda

    if not cuda.jit.__module__.startswith("numba.cuda.simulator"):
        pytest.skip("numba.cuda was imported in device mode earlier in this process; run this file alone")
    # the simulator polls its Python threads at every syncthreads; a short GIL switch interval makes that fast
    sys.setswitchinterval(0.0005)
    yield
    sys.setswitchinterval(saved_switch)
    if saved_env is None:
        os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    else:
        os.environ["NUMBA_ENABLE_CUDASIM"] = saved_env


_ENCODERS: dict = {}


def encoder(name: str, **options) -> gpu.GpuEncoder:
    key = (name, tuple(sorted(options.items())))
    if key not in _ENCODERS:
        _ENCODERS[key] = gpu.GpuEncoder(tokenplane.load(name), **options)
    return _ENCODERS[key]


def real_slices(n: int, size: int) -> list[str]:
    paths = sorted(glob.glob(str(DATA / "*.traj.json")))
    if not paths:
        return []
    rng = random.Random(7)
    out = []
    for path in rng.sample(paths, min(n, len(paths))):
        msgs = json.loads(Path(path).read_text())["messages"]
        text = "\n".join(m["content"] for m in msgs if isinstance(m.get("content"), str))
        start = rng.randrange(max(1, len(text) - size))
        out.append(text[start:start + size])
    return out


def check_family(name: str, texts: list[str], **options) -> gpu.GpuEncoder:
    """IDs of every text and pieces of every text the device did not flag must equal the reference."""
    tok = tokenplane.load(name)
    enc = encoder(name, **options)
    got = enc.encode_batch(texts)
    for text, ids in zip(texts, got):
        assert ids.dtype == np.uint32
        assert ids.tolist() == tok.reference.encode_ordinary(text).tolist(), (name, text)
    flagged = enc.last_doc_fallback.copy()
    spans = enc.pieces_batch(texts)
    for text, mine, fb in zip(texts, spans, flagged):
        if text and not fb:
            assert mine == tok.reference.pretokenize(tok.reference.normalize(text)), (name, text)
    return enc


@pytest.mark.parametrize("name", FAMILIES)
def test_adversarial_pieces_and_ids(name):
    enc = check_family(name, ADVERSARIAL)
    flagged = {t for t, fb in zip(ADVERSARIAL, enc.last_doc_fallback) if fb}
    if name == "o200k_base":
        # only a mark right after punctuation and chained contractions leave the device rules
        assert flagged == {"it's's'sx", "!!\u0301abc", " \u2764\ufe0f x", "!\n/\u0301", MARK_AFTER_PUNCT}
    else:
        assert not flagged
    assert enc.last_host_syncs == 2


@pytest.mark.parametrize("name", FAMILIES)
def test_generated_and_real_text(name):
    rng = random.Random(1000 + FAMILIES.index(name))
    ref = tokenplane.load(name).reference
    texts = []
    while len(texts) < 8:
        text = adversarial.random_text(rng, max_fragments=10)[:100]
        # long pieces cost one simulated block reduction per merge; the tiers test and -m campaign cover them
        if max((len(text[a:b].encode()) for a, b in ref.pretokenize(text)), default=0) <= 48:
            texts.append(text)
    texts += real_slices(2, 200)
    check_family(name, texts)


def test_length_dispatch_tiers_are_exact():
    """Small thresholds push pieces through the warp-per-piece and block-per-piece kernels on short inputs."""
    texts = ["internationalization antidisestablishmentarianism xxxxxxxxxxxxxxxxxxxxxxx",
             "                              x", "AbCdEfGhIjKlMnOpQrStUvWxYz0123", "日本語のテキストです。人力资源",
             "pipeline tokenizer hello"]
    enc = check_family("o200k_base", texts, small_max=4, medium_max=12)
    enc.encode_batch(texts)
    assert enc.last_meta["small"] > 0 and enc.last_meta["medium"] > 0 and enc.last_meta["large"] > 0


def test_sync_count_baseline_same_ids():
    """Counts stay on the device: 2 host waits per request; the read-back baseline waits 8 times, same IDs."""
    tok = tokenplane.load("cl100k_base")
    text = "Counts stay on the device: 12345 pieces\n\n  and   tokens!"
    fast = encoder("cl100k_base")
    base = encoder("cl100k_base", sync_counts=True)
    assert fast.encode(text).tolist() == base.encode(text).tolist() == tok.reference.encode_ordinary(text).tolist()
    assert fast.last_host_syncs == 2
    assert base.last_host_syncs == 7   # chars, fallback, pieces, dispatch lists, pre-scan, meta, IDs


def test_empty_documents_and_unsupported_family():
    enc = encoder("llama3")
    out = enc.encode_batch(["", "a b", "", "", "x"])
    tok = tokenplane.load("llama3")
    assert [o.tolist() for o in out] == [tok.reference.encode_ordinary(t).tolist() for t in ["", "a b", "", "", "x"]]
    assert enc.encode("").tolist() == []
    from dataclasses import replace

    from tokenplane.tokenize.spec.families import FAMILIES

    # a splitter with no derived device rules: the router keeps such a family on the CPU
    fake = SimpleNamespace(name="custom", family=replace(FAMILIES["llama3"], name="custom", patterns=(r"\S+|\s+",)))
    assert not gpu.supports(fake)
    with pytest.raises(gpu.UnsupportedFamilyError):
        gpu.GpuEncoder(fake)


def test_available_is_false_without_simulator_or_device():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    code = "from tokenplane.tokenize import gpu; print(gpu.available())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    has_gpu = Path("/dev/nvidia0").exists()
    assert out.stdout.strip() == ("True" if has_gpu else "False")


@pytest.mark.campaign
def test_device_benchmark_runs_in_simulator(tmp_path):
    """benchmarks/device/gpu_tokenize.py --sim --small: the prepared device script, end to end on tiny sizes."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", OUT=str(tmp_path), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/device/gpu_tokenize.py"), "--sim", "--small",
                          "--families", "cl100k_base", "--reps", "1"], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_tokenize.json").read_text())
    assert result["families"]["cl100k_base"]["exact"] is True
    assert result["families"]["cl100k_base"]["latency"]


@pytest.mark.campaign
def test_every_kernel_compiles_to_ptx():
    """nopython CUDA typing, which the simulator cannot check; needs NVVM (nvidia-nvvm + nvidia-cuda-nvrtc wheels)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-m", "tokenplane.tokenize.gpu.ptxcheck"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=600)
    if "libnvvm" in out.stdout + out.stderr or "NvvmSupportError" in out.stdout + out.stderr:
        pytest.skip("NVVM not installed")
    assert out.returncode == 0, out.stdout + out.stderr


def test_device_decoder_rejects_invalid_utf8():
    enc = encoder("cl100k_base")
    for bad in [b"a\x80b", b"\xc3", b"\xe2\x82", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"ab\xf0\x9f\x99",
                b"\xe2\x82\xac\x82", b"\xff"]:
        with pytest.raises(tokenplane.InvalidTextError):
            enc.encode(bad)
    ok = "€ ok 🙂".encode()
    assert enc.encode(ok).tolist() == tokenplane.load("cl100k_base").reference.encode_ordinary(ok.decode()).tolist()


@pytest.mark.campaign
@pytest.mark.parametrize("name", FAMILIES)
def test_campaign_generated_text(name):
    """150 generated adversarial texts per family in one device pass, long pieces included (minutes on the simulator)."""
    rng = random.Random(5)
    texts = [adversarial.random_text(rng, max_fragments=8)[:80] for _ in range(150)]
    check_family(name, texts, small_max=32, medium_max=64)


SMOLLM2_DEVICE = ["x  1", "x 1 x1 1x", "a  1 b\t 2", "it's IT'S 's ''s 1's x''s", " 's  's\t'rex 'll've'd'm't",
                  "\U00011de0x \U00016ff5 ", "٣٤ x½y ²", "e\u0301 x  !b ((x))  ", "x\n\n\ny \u00a0 z\u3000",
                  "x\x04y", "!\x06!", "a\U00040000b", "ok 2024"]


def test_smollm2_device_rules():
    """smollm2's local device rules (Digits, the space prefix, lowercase contractions, `\\s+(?!\\S)`) equal the
    reference; documents holding a byte the vocabulary lacks are flagged and answered by the fallback."""
    enc = check_family("smollm2", SMOLLM2_DEVICE)
    flagged = {t for t, fb in zip(SMOLLM2_DEVICE, enc.last_doc_fallback) if fb}
    assert flagged == {"x\x04y", "!\x06!", "a\U00040000b"}
    assert gpu.supports(tokenplane.load("smollm2"))


def test_numpy_names_numba_cuda_registers_are_provided_when_numpy_lacks_them(monkeypatch):
    """numba-cuda 0.30 registers overloads for np.row_stack / np.in1d / np.trapz, which numpy 2.5 removed (on the
    H200 image every kernel compile failed): the gpu package provides working stand-ins, and leaves numpy's own
    functions alone where they exist."""
    from tokenplane.tokenize import gpu

    for name in ("row_stack", "in1d", "trapz"):
        monkeypatch.delattr(np, name, raising=False)
    gpu._numpy_names_for_numba()
    a, b = np.arange(3.0), np.arange(3.0, 6.0)
    assert (np.row_stack((a, b)) == np.vstack((a, b))).all()
    assert np.in1d([[1, 7], [3, 9]], [3, 7]).tolist() == [False, True, True, False]
    assert np.trapz([1.0, 2.0, 3.0]) == 4.0
    kept = np.vstack
    gpu._numpy_names_for_numba()
    assert np.vstack is kept


def test_a_batch_over_one_pass_is_split_and_a_text_over_it_refused():
    """A device pass holds at most MAX_PASS_BYTES (int32 positions, two per scan entry): a batch over it runs as
    several passes with the same IDs, one text over it is refused with the tokenizer's size error."""
    from tokenplane.tokenize.errors import TextTooLargeError
    from tokenplane.tokenize.gpu import encoder as gpu_encoder

    tok = tokenplane.load("o200k_base")
    enc = encoder("o200k_base")
    texts = ["tests/validators/\nx = 1", "über 12345 ok", "a" * 70, "", "b/\n/c " * 9, "end."]
    assert sum(len(t.encode()) for t in texts) > 120
    saved = gpu_encoder.MAX_PASS_BYTES[0]
    gpu_encoder.MAX_PASS_BYTES[0] = 120
    try:
        got = enc.encode_batch(texts)
        with pytest.raises(TextTooLargeError):
            enc.encode("x" * 121)
    finally:
        gpu_encoder.MAX_PASS_BYTES[0] = saved
    assert [g.tolist() for g in got] == [tok.reference.encode_ordinary(t).tolist() for t in texts]
