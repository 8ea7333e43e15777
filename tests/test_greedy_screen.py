"""The greedy screen (engine/greedy_screen.py) and its bf16 stream (engine/cpu_bf16_gemv.py): the token is the fp32
projection's argmax on random, tied, near-tied and trained-looking logits; the bound holds; the engine's greedy
outputs are the same with the screen and without it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenplane.engine import LLMEngine, SamplingParams, cpu_bf16_gemv, cpu_small_gemm, greedy_screen
from tokenplane.engine.config import PRESETS
from tokenplane.engine.cpu_simd import HOST_AVX512
from tokenplane.engine.greedy_screen import GreedyScreen
from tokenplane.engine.layers import cpu_packing_supported

ONEDNN_BF16 = cpu_packing_supported(torch.bfloat16)
PASSES = ["stream", pytest.param("onednn", marks=pytest.mark.skipif(not ONEDNN_BF16, reason="no oneDNN bf16"))]


@pytest.fixture
def screen_pass(request, monkeypatch):
    """Every row count through one pass: the bf16 stream, or oneDNN's bf16 matmul (wherever oneDNN packs bf16, also
    where the screen would not choose it for speed: its answers must be right there too)."""
    monkeypatch.setattr(greedy_screen, "STREAM_MAX_ROWS", 1 << 30 if request.param == "stream" else 0)
    if request.param == "onednn":
        monkeypatch.setattr(greedy_screen, "NATIVE_BF16", True)
    return request.param


def _full_argmax(h: torch.Tensor, panels: torch.Tensor, n: int) -> list[int]:
    """What the engine's greedy takes without the screen: numpy's argmax of the fp32 panel kernel's logits."""
    return cpu_small_gemm.linear(h, panels, n).numpy().argmax(-1).tolist()


@pytest.mark.parametrize("n,k", [(1, 1), (33, 7), (1000, 64), (4099, 96)])
def test_bf16_stream_sums_within_the_bound_and_alike_at_every_row_count(n, k):
    """Every output within g_K sum |x| |wb| of the float64 product over the bf16 weight, at 1-17 rows (8-row passes,
    the 1..7-row tails, an odd panel count), and a row's values equal whatever rows come with it."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    wp = cpu_bf16_gemv.pack_bf16(w)
    wb = w.to(torch.bfloat16).double()
    gamma = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)
    x = torch.randn(17, k, generator=g)
    alone = np.concatenate([cpu_bf16_gemv.linear_bf16(x[i:i + 1].contiguous(), wp)[:, :n] for i in range(17)])
    for rows in range(1, 18):
        got = cpu_bf16_gemv.linear_bf16(x[:rows].contiguous(), wp)[:, :n]
        ref = (x[:rows].double() @ wb.t()).numpy()
        mag = (x[:rows].double().abs() @ wb.abs().t()).numpy()
        assert np.all(np.abs(got - ref) <= gamma * mag + 1e-30)
        assert np.array_equal(got, alone[:rows])


def _screen(n: int, k: int, seed: int, scale: float = 0.05) -> tuple[torch.Tensor, torch.Tensor, GreedyScreen]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * scale
    panels = cpu_small_gemm.pack(w)
    return w, panels, GreedyScreen(w, panels)


@pytest.mark.parametrize("screen_pass", PASSES, indirect=True)
@pytest.mark.parametrize("n,k", [(4096, 64), (20000, 256), (3001, 96)])
def test_screen_token_is_the_fp32_argmax(one_thread, screen_pass, n, k):
    w, panels, screen = _screen(n, k, n + k)
    assert screen.onednn or screen_pass == "stream"     # the parameter's pass is the one that runs
    g = torch.Generator().manual_seed(k)
    engaged = 0
    for rows in (1, 2, 3, 5, 8, 16, 41):
        for trial in range(6):
            h = torch.randn(rows, k, generator=g) * (1 + 4 * trial)   # logits from ~1 to ~20 wide
            got = screen.argmax(h)
            if got is not None:
                engaged += 1
                assert got == _full_argmax(h, panels, n), (rows, trial)
    assert engaged >= 30     # the screen answered (not only fallbacks) on these well-separated logits


def test_screen_bound_holds_for_every_vocabulary_row(one_thread):
    """|bf16 pass - fp32 kernel| <= |h| (g_K (|wb_i| + |w_i|) + |wb_i - w_i|) for every row i (the screen doubles it)."""
    n, k = 5000, 128
    w, panels, screen = _screen(n, k, 3)
    g = torch.Generator().manual_seed(4)
    for rows in (1, 7):
        h = torch.randn(rows, k, generator=g) * 3
        exact = cpu_small_gemm.linear(h, panels, n).numpy().astype(np.float64)
        approx = cpu_bf16_gemv.linear_bf16(h, screen.bf16)[:, :n].astype(np.float64)
        nh = torch.linalg.vector_norm(h.double(), dim=-1).numpy()[:, None]
        assert np.all(np.abs(approx - exact) <= nh * screen.row_bound[None, :])


@pytest.mark.skipif(not ONEDNN_BF16, reason="no oneDNN bf16")
@pytest.mark.parametrize("scale", [0.05, 3.0])
def test_onednn_pass_bound_holds_for_every_vocabulary_row(one_thread, scale):
    """oneDNN's bf16 matmul (bf16 input, float32 accumulation, bf16 output): |approx - fp32 kernel| <= the bound the
    screen takes before doubling, for every row i, with the worst row's constants and each row's own."""
    n, k = 5000, 320
    w, panels, screen = _screen(n, k, 13, scale)
    w[7] *= 1000.0                   # one large row: the worst-row constants are far from the typical row's
    panels = cpu_small_gemm.pack(w)
    screen = GreedyScreen(w, panels)
    g = torch.Generator().manual_seed(14)
    for rows in (5, 64):
        h = torch.randn(rows, k, generator=g) * 7
        exact = cpu_small_gemm.linear(h, panels, n).numpy().astype(np.float64)
        n_h = torch.linalg.vector_norm(h.double(), dim=-1).numpy()
        ap = screen._onednn(h, n_h)
        approx = greedy_screen._values(greedy_screen._keys(ap.bits, True), True)[:, :n]
        slack = ap.e * np.abs(approx)
        assert np.all(np.abs(approx - exact) <= ap.bound_c[:, None] + slack)
        each = np.stack([ap.per_row(r, np.arange(n)) for r in range(rows)])
        assert np.all(np.abs(approx - exact) <= each + slack)
        assert np.all(each <= ap.bound_c[:, None] * (1 + 1e-12))


def test_ties_and_near_ties_take_the_first_maximum(one_thread, monkeypatch):
    """Duplicated vocabulary rows (exact ties: the lowest index wins, as numpy's argmax), rows one float32 ulp apart,
    and rows equal after bf16 rounding but not before: the screen cannot tell them apart in bf16, the fp32 recompute
    must."""
    monkeypatch.setattr(greedy_screen, "STREAM_ONLY_MAX_ROWS", 16)   # 8 rows: the stream where oneDNN has no bf16
    n, k = 4096, 64
    g = torch.Generator().manual_seed(9)
    w = torch.randn(n, k, generator=g) * 0.05
    h = torch.randn(8, k, generator=g)
    best = int(cpu_small_gemm.linear(h[:1], cpu_small_gemm.pack(w), n).argmax())
    w[3000] = w[best]                                     # an exact tie at a later index
    w[100] = w[best] * (1 + 2.0 ** -20)                   # equal in bf16, a hair larger in fp32
    w[2000] = torch.nextafter(w[best], torch.full_like(w[best], 1.0))  # one ulp towards 1 in every entry
    panels = cpu_small_gemm.pack(w)
    screen = GreedyScreen(w, panels)
    for rows in (1, 8):      # 8 rows: oneDNN's pass where it has bf16
        got = screen.argmax(h[:rows])
        assert got is not None and got == _full_argmax(h[:rows], panels, n)
    w2 = w.clone()
    w2[[100, 2000]] = w2[best].clone()                          # now three exact ties: the first index
    panels2 = cpu_small_gemm.pack(w2)
    got = GreedyScreen(w2, panels2).argmax(h[:1])
    assert got == _full_argmax(h[:1], panels2, n) == [min(best, 100)]


def test_screen_declines_what_it_cannot_prove(one_thread):
    n, k = 4096, 64
    w, panels, screen = _screen(n, k, 5)
    h = torch.randn(2, k)
    h[1, 3] = float("nan")
    assert screen.argmax(h) is None                        # a non-finite input
    flat = torch.zeros(n, k)
    flat[:, 0] = 1.0                                       # every logit equal: every panel is a candidate
    assert GreedyScreen(flat, cpu_small_gemm.pack(flat)).argmax(torch.ones(1, k)) is None
    tiny_w = w * 1e-12                                     # |h| |w_i| stays far below overflow ...
    huge = torch.randn(8, k)
    huge[:, 5] = 3.39e38                                   # ... but h is inf once rounded to bf16 (oneDNN's input)
    assert GreedyScreen(tiny_w, cpu_small_gemm.pack(tiny_w)).argmax(huge) is None
    wbad = w.clone()
    wbad[17, 2] = float("inf")
    assert GreedyScreen(wbad, cpu_small_gemm.pack(wbad)).argmax(torch.randn(1, k)) is None


def test_without_onednn_bf16_the_stream_screens_up_to_its_measured_limit(one_thread):
    """Past STREAM_ONLY_MAX_ROWS the full fp32 projection is faster than the stream (benchmarks/vocab_screen_rows.py:
    from 6 rows on an 8-lane host, whose stream passes outgrow its 16 vector registers)."""
    limit = greedy_screen.STREAM_ONLY_MAX_ROWS
    assert limit == (16 if HOST_AVX512 else 5)
    w, panels, screen = _screen(4096, 64, 17)
    screen.onednn = False      # as on a CPU without bf16 instructions
    h = torch.randn(limit + 1, 64, generator=torch.Generator().manual_seed(18)) * 4
    assert screen.argmax(h[:limit]) == _full_argmax(h[:limit], panels, 4096)
    assert screen.argmax(h) is None       # past the stream's measured gain: the caller projects in full


def _engine(screen: bool) -> LLMEngine:
    cfg = dict(PRESETS["test-small"], vocab_size=8192)
    return LLMEngine(cfg, dtype=torch.float32, seed=3, num_blocks=256, block_size=4, max_num_seqs=8,
                     num_threads=1, greedy_screen=screen)


def test_only_greedy_requests_without_logprobs_skip_the_logits():
    assert not SamplingParams(temperature=0.0).needs_logits
    assert SamplingParams(temperature=0.7).needs_logits
    assert SamplingParams(temperature=0.0, logprobs=0).needs_logits


def test_engine_greedy_outputs_equal_with_and_without_the_screen(one_thread, monkeypatch):
    monkeypatch.setattr(greedy_screen, "STREAM_ONLY_MAX_ROWS", 16)   # 7-row steps screened on every host
    on, off = _engine(True), _engine(False)
    calls = {"screened": 0, "steps": 0}
    run_greedy = on.runner.run_greedy

    def spy(*args, **kwargs):
        out = run_greedy(*args, **kwargs)
        calls["steps"] += 1
        calls["screened"] += out.screened
        return out
    monkeypatch.setattr(on.runner, "run_greedy", spy)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 8192, int(rng.integers(3, 40))).tolist() for _ in range(7)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert on.generate(prompts, greedy) == off.generate(prompts, greedy)
    assert calls["screened"] > calls["steps"] // 2        # most steps took the screen
    # a step holding a sampled request (or one asking for logprobs) projects in full: same outputs again
    mixed = [greedy, SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)]
    plist = [mixed[i % 3] for i in range(len(prompts))]
    assert on.generate(prompts, plist) == off.generate(prompts, plist)


def test_runner_greedy_equals_run_and_projects_rows_on_demand(one_thread):
    """ModelRunner.run_greedy: the tokens sampler.greedy takes from run()'s logits, through the screen, and each
    row's `project` equal to run()'s logits row bit for bit (what a deferred StepResult reads)."""
    from tokenplane.engine import Sequence
    from tokenplane.engine.sampler import greedy

    a, b = _engine(True), _engine(False)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 8192, int(rng.integers(3, 30))).tolist() for _ in range(5)]
    sa = [Sequence(f"s{i}", p) for i, p in enumerate(prompts)]
    sb = [Sequence(f"s{i}", p) for i, p in enumerate(prompts)]
    for s in sa:
        a.runner.prepare(s)
    for s in sb:
        b.runner.prepare(s)
    screened = 0
    for _ in range(6):
        g = a.runner.run_greedy(sa)
        r = b.runner.run(sb)
        assert g.tokens == greedy(r.logits).tolist()
        assert torch.equal(g.hidden, r.hidden)
        for i in (0, len(sa) - 1):
            assert torch.equal(g.project(i), r.logits[i])
        screened += g.screened
        for s, u, t in zip(sa, sb, g.tokens):
            s.append_token(t)
            u.append_token(t)
            a.runner.prepare(s)
            b.runner.prepare(u)
    assert screened >= 4


@pytest.mark.parametrize("screen_pass", PASSES, indirect=True)
@pytest.mark.parametrize("k", [1, 7, 100])
def test_screen_top_values_are_topk_of_the_fp32_logits(one_thread, screen_pass, k):
    """screen(h, k)'s values: torch.topk of the fp32 projection's row, descending (R2R's router input), and its
    token the argmax, on rows with ties and near ties among the top k."""
    n, kdim = 60000, 128
    w, panels, screen = _screen(n, kdim, 21)
    w[59000:59010] = w[5]           # ten exact copies of a row: ties wherever row 5 ranks
    panels = cpu_small_gemm.pack(w)
    screen = GreedyScreen(w, panels)
    assert screen.onednn or screen_pass == "stream"
    g = torch.Generator().manual_seed(22)
    engaged = 0
    for rows in (1, 3, 9, 40):
        for scale in (1.0, 4.0, 16.0):
            h = torch.randn(rows, kdim, generator=g) * scale
            h[0] = w[5] * 40               # row 0: row 5 (and its copies) on top
            got = screen.screen(h, k)
            if got is None:
                continue
            engaged += 1
            tokens, top = got
            full = cpu_small_gemm.linear(h, panels, n)
            assert tokens == full.numpy().argmax(-1).tolist()
            assert top is not None and torch.equal(torch.from_numpy(top), torch.topk(full, k).values)
    assert engaged >= 8


def test_run_greedy_top_values_without_the_screen_are_topk(one_thread):
    """The full-projection fallback answers the same values (a float64 model has no screen; its one-row projection
    differs from the batched one in the last bits only, as float64 BLAS sums by batch shape)."""
    from tokenplane.engine import Sequence

    eng = LLMEngine("test-small", dtype=torch.float64, seed=2, num_blocks=64, block_size=4, num_threads=1)
    seqs = [Sequence(f"q{i}", [3 + i, 9, 27, 81 % 512]) for i in range(3)]
    for s in seqs:
        eng.runner.prepare(s)
    g = eng.runner.run_greedy(seqs, top_k=600)      # more than the 512-token vocabulary: all of it
    assert not g.screened and g.top is not None and g.top.shape == (3, 512)
    for i in range(3):
        assert torch.allclose(g.top[i], torch.sort(g.project(i), descending=True).values, rtol=0, atol=1e-12)


def test_weight_norms_equal_float64_norms_across_chunks():
    from tokenplane.engine.greedy_screen import weight_norms

    w = torch.randn(1000, 37, generator=torch.Generator().manual_seed(6))
    n_w, n_wb, n_d = weight_norms(w, chunk=300)
    wb = w.to(torch.bfloat16).double()
    for got, want in ((n_w, w.double()), (n_wb, wb), (n_d, wb - w.double())):
        assert np.allclose(got, torch.linalg.vector_norm(want, dim=-1).numpy(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("copies", [1, 3])
def test_trained_model_greedy_outputs_equal_with_and_without_the_screen(one_thread, copies, monkeypatch):
    """SmolLM2-135M-Instruct (trained logits, tied 49152 x 576 embeddings): every decode step takes the screen and
    the greedy outputs equal the full projection's, at 3 rows (the stream) and 9 (oneDNN's bf16 pass, where the CPU
    has one; else the stream, past its speed limit for the test)."""
    import importlib.util

    monkeypatch.setattr(greedy_screen, "STREAM_ONLY_MAX_ROWS", 16)

    from tokenplane.engine import artifacts
    smol = artifacts.MODELS["smollm2-135m-instruct"]
    if importlib.util.find_spec(smol.package) is None:
        pytest.skip(f"registry model not installed (`{smol.install}`)")
    prompts = [[1, 504, 3575, 282, 4649, 314], [1, 563, 28267, 30, 94, 1843, 42], [1, 9519, 2379, 253, 655, 28]]
    prompts = [p[:len(p) - i] for i in range(copies) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = []
    for screen in (True, False):
        eng = LLMEngine(smol.name, num_blocks=64, max_num_seqs=9, num_threads=1, greedy_screen=screen)
        if screen:
            seen: list[bool] = []
            run_greedy = eng.runner.run_greedy

            def spy(*args, **kwargs):
                out = run_greedy(*args, **kwargs)
                seen.append(out.screened)
                return out
            eng.runner.run_greedy = spy  # type: ignore[method-assign]
        outs.append(eng.generate(prompts, params))
    assert outs[0] == outs[1]
    assert len(seen) >= 23 and sum(seen) >= len(seen) - 1      # the prefill step may project in full


def test_onednn_pass_only_where_the_cpu_multiplies_bf16_natively(monkeypatch):
    """oneDNN packs bf16 on any AVX-512 CPU but emulates its products without AVX512-BF16 or AMX (2.5-4.8x slower
    than the stream there: benchmarks/results/vocab_screen_rows_xeon.md), so the screen takes it only with them."""
    w = torch.randn(512, 64, generator=torch.Generator().manual_seed(5))
    panels = cpu_small_gemm.pack(w)
    monkeypatch.setattr(greedy_screen, "NATIVE_BF16", False)
    assert GreedyScreen(w, panels).onednn is False
    monkeypatch.setattr(greedy_screen, "NATIVE_BF16", True)
    assert GreedyScreen(w, panels).onednn is ONEDNN_BF16
    h = torch.randn(12, 64, generator=torch.Generator().manual_seed(6)) * 4
    monkeypatch.setattr(greedy_screen, "NATIVE_BF16", False)
    screen = GreedyScreen(w, panels)
    monkeypatch.setattr(screen, "_onednn", None)       # any call to the oneDNN pass fails the test
    assert screen.argmax(h[:greedy_screen.STREAM_ONLY_MAX_ROWS]) == _full_argmax(
        h[:greedy_screen.STREAM_ONLY_MAX_ROWS], panels, 512)
