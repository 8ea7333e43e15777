"""The five algorithms: decisions on hand-made StepResults, calibration, synthetic reproducibility and statistics, and
routed generation on the test presets (float64) against an independent no-KV-reuse implementation."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from tokenplane.engine.sampler import SamplingParams
from tokenplane.route.algorithms import make_algorithm
from tokenplane.route.algorithms.base import calibrate_threshold, fires
from tokenplane.route.algorithms.r2r import R2RRouter, save_router
from tokenplane.route.api import RequestView, StepResult
from tokenplane.route.reference import SequentialRouter, build_runner, calibrate, run_sequential, warmup_signals

sys.path.insert(0, os.path.dirname(__file__))
from test_route_api import FakeRunner  # noqa: E402

F64 = torch.float64
H = 16


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: 1 torch thread for the module


def res(logits, model=0, position=0, token=None, hidden=None, rid="r"):
    logits = torch.as_tensor(logits, dtype=F64)
    token = int(torch.argmax(logits)) if token is None else token
    hidden = torch.ones(H, dtype=F64) if hidden is None else hidden
    return StepResult(rid, model, position, token, logits, hidden)


def view(model=0):
    return RequestView.new("r", [1, 2, 3], 2, max_tokens=100, model=model)


FLAT = [0.0] * 32
PEAKED = [0.0] * 31 + [40.0]


# -- decisions on hand-made results ------------------------------------------------------------------------------------
def test_r2r_router_weights_decide(tmp_path):
    router = R2RRouter(H, dim=8, num_blocks=1)
    for sign, expect in ((+1, 1), (-1, 0)):
        with torch.no_grad():
            router.output.weight.zero_()
            router.output.bias.fill_(sign * 30.0)
        path = tmp_path / f"router{sign}.safetensors"
        save_router(router, path, embedding=torch.randn(32, H))
        alg = make_algorithm("r2r", router_weights=str(path), router_dim=8, router_blocks=1)
        r = res(FLAT)
        assert alg.route(r, view()) == expect
        assert math.isclose(alg.divergence(r), 1.0 if sign > 0 else 0.0, abs_tol=1e-9)
    # the large model always hands back after exactly one token; the small token is dropped, the large one kept
    assert alg.route(res(FLAT, model=1), view(1)) == 0
    assert alg.keep_last(res(FLAT), view(), 1) is False
    assert alg.keep_last(res(FLAT, model=1), view(1), 0) is True


def test_r2r_missing_weights_are_an_error(tmp_path):
    from safetensors.torch import save_file
    path = tmp_path / "partial.safetensors"
    save_file({"output.weight": torch.zeros(1, 8)}, str(path))
    alg = make_algorithm("r2r", router_weights=str(path), router_dim=8, router_blocks=1)
    with pytest.raises(ValueError, match="missing router weights"):
        alg.route(res(FLAT), view())


def test_r2r_uses_all_three_inputs_and_the_small_models_embedding():
    alg = make_algorithm("r2r", router_dim=8, router_blocks=1, seed=4)
    module = torch.nn.Module()
    module.embed_tokens = torch.nn.Embedding(32, H)
    alg.attach(0, module)
    assert alg.embedding is not None and alg.embedding.shape == (32, H)
    base = alg.divergence(res(FLAT, token=3))
    assert alg.divergence(res(FLAT, token=4)) != base                              # sampled-token embedding
    assert alg.divergence(res(FLAT, token=3, hidden=torch.zeros(H, dtype=F64))) != base   # hidden state
    assert alg.divergence(res([float(i) for i in range(32)], token=3)) != base     # top-100 logit values


def test_random_router_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = make_algorithm("r2r", router_dim=8, router_blocks=2, seed=9).divergence(res(FLAT))
    assert torch.equal(torch.rand(3), expected)
    b = make_algorithm("r2r", router_dim=8, router_blocks=2, seed=9).divergence(res(FLAT))
    c = make_algorithm("r2r", router_dim=8, router_blocks=2, seed=10).divergence(res(FLAT))
    assert a == b != c


def test_citer_confidence():
    alg = make_algorithm("citer")   # max-prob confidence, tau 0.9
    assert alg.route(res(PEAKED), view()) == 0
    assert alg.route(res(FLAT), view()) == 1
    assert alg.route(res(FLAT, model=1), view(1)) == 0
    mlp = make_algorithm("citer", signal="router", seed=1)
    c = mlp.confidence(res(FLAT, hidden=torch.randn(H, dtype=F64)))
    assert 0.0 < c < 1.0
    with pytest.raises(ValueError):
        make_algorithm("citer", signal="vibes")


def test_co_llm_deferral_head(tmp_path):
    from safetensors.torch import save_file
    w = torch.zeros(H)
    w[0] = 10.0
    path = tmp_path / "head.safetensors"
    save_file({"weight": w, "bias": torch.tensor([-5.0])}, str(path))
    alg = make_algorithm("co_llm", head_weights=str(path))
    hi = torch.zeros(H, dtype=F64)
    hi[0] = 1.0
    assert math.isclose(alg.defer_prob(res(FLAT, hidden=hi)), 1 / (1 + math.exp(-5)))
    assert alg.route(res(FLAT, hidden=hi), view()) == 1                       # P(defer) = 0.993 > 0.5
    assert alg.route(res(FLAT, hidden=torch.zeros(H, dtype=F64)), view()) == 0   # 0.0067
    assert alg.route(res(PEAKED, model=1), view(1)) == 0
    assert make_algorithm("co_llm", signal="max_prob").route(res(FLAT), view()) == 1


def test_r_stitch_entropy_both_directions():
    alg = make_algorithm("r_stitch", tau=0.5)
    assert alg.thresholds == {"switch": 0.5, "return": 0.5}
    assert alg.route(res(FLAT), view()) == 1          # uncertain small model: hand over, token dropped
    assert alg.route(res(PEAKED), view()) == 0
    assert alg.route(res(FLAT, model=1), view(1)) == 1   # uncertain large model keeps going
    assert alg.route(res(PEAKED, model=1), view(1)) == 0  # confident: its token is kept, back to small
    assert alg.keep_last(res(FLAT), view(), 1) is False
    assert alg.keep_last(res(PEAKED, model=1), view(1), 0) is True


def test_ensemble_gate_and_combination():
    alg = make_algorithm("ensemble", weights=[1.0, 3.0])   # gate: primary max-prob <= 0.5
    assert alg.ensemble_peers(res(PEAKED), view()) == []
    assert alg.ensemble_peers(res(FLAT), view()) == [1]
    assert alg.ensemble_peers(res(FLAT, model=1), view(1)) == []
    assert alg.route(res(FLAT), view()) == 0
    primary = res([2.0, 1.0] + [0.0] * 30)               # primary prefers token 0
    peer = alg.score(res([0.0, 3.0] + [0.0] * 30, model=1))   # peer prefers token 1
    assert alg.combine(view(), primary, {1: peer}) == 1   # weight 3 on the peer wins
    even = make_algorithm("ensemble", weights=[1.0, 0.0])
    assert even.combine(view(), primary, {1: peer}) == 0
    full = make_algorithm("ensemble", topk=0, weights=[1.0, 3.0])
    assert full.combine(view(), primary, {1: full.score(res([0.0, 3.0] + [0.0] * 30, model=1))}) == 1
    with pytest.raises(ValueError, match="missing peer"):
        make_algorithm("ensemble", num_models=3).combine(view(), primary, {1: peer})
    always = make_algorithm("ensemble", always=True, num_models=3)
    assert always.ensemble_peers(res(PEAKED), view()) == [1, 2]
    with pytest.raises(ValueError):
        make_algorithm("ensemble", num_models=4)


def test_bad_configuration_is_rejected():
    with pytest.raises(ValueError, match="unknown routing algorithm"):
        make_algorithm("medusa")
    with pytest.raises(ValueError, match="mode"):
        make_algorithm("r2r", mode="vibes")
    with pytest.raises(ValueError, match="unknown gate"):
        make_algorithm("r2r", rates={"return": 0.2})
    with pytest.raises(ValueError, match="probability"):
        make_algorithm("citer", rates={"switch": 1.5})
    with pytest.raises(RuntimeError, match="calibrate"):
        make_algorithm("citer", mode="calibrated").route(res(FLAT), view())


# -- calibration ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("direction", ["above", "below", "at_most"])
@pytest.mark.parametrize("rate", [0.0, 0.1, 0.37, 0.5, 1.0])
def test_calibrate_threshold_fires_at_the_rate(direction, rate):
    signals = [counter for counter in torch.rand(200, generator=torch.Generator().manual_seed(1)).tolist()]
    t = calibrate_threshold(signals, rate, direction)
    assert sum(fires(s, t, direction) for s in signals) == round(rate * 200)


def test_calibrated_rebuild_decides_identically():
    alg = make_algorithm("r_stitch", mode="calibrated", rates={"switch": 0.2, "return": 0.6})
    alg.calibrate({"switch": [0.1 * i for i in range(10)], "return": [0.05 * i for i in range(10)]})
    clone = make_algorithm(alg.name, **alg.config())
    assert clone.thresholds == alg.thresholds and clone.calibrated
    uncal = make_algorithm("citer", mode="calibrated")
    assert not make_algorithm("citer", **uncal.config()).calibrated   # never silently uses default thresholds
    for i in range(40):
        logits = torch.randn(32, dtype=F64, generator=torch.Generator().manual_seed(i)) * (i % 5)
        for m in (0, 1):
            r = res(logits, model=m)
            assert alg.route(r, view(m)) == clone.route(r, view(m))


@pytest.fixture(scope="module")
def presets():
    """test-small / test-large in float64 (ULP-level differences cannot flip argmax or threshold decisions)."""
    return [build_runner(p, dtype=F64, num_blocks=256) for p in ("test-small", "test-large")]


WARMUP = [[5, 17, 99, 3], [250, 251, 252, 7, 8, 9], [42] * 5]


@pytest.mark.parametrize("name,rates,kwargs", [
    ("r2r", {"switch": 0.15}, {"router_dim": 32, "router_blocks": 2}),
    ("citer", {"switch": 0.2}, {}),
    ("co_llm", {"switch": 0.1}, {}),
    ("r_stitch", {"switch": 0.1, "return": 0.5}, {}),
    ("ensemble", {"gate": 0.25}, {}),
])
def test_calibrated_mode_hits_target_rate_on_warmup(presets, name, rates, kwargs):
    alg = make_algorithm(name, mode="calibrated", rates=rates, **kwargs)
    sp = SamplingParams(max_tokens=20)
    router = SequentialRouter(alg, presets)
    signals = warmup_signals(alg, router, WARMUP, sp)
    thresholds = alg.calibrate(signals)
    for gate in alg.calibration_gates():
        values = signals[gate.name]
        assert len(values) == 60
        got = sum(fires(v, thresholds[gate.name], gate.direction) for v in values) / len(values)
        assert abs(got - rates[gate.name]) <= 1 / len(values)
    # routed generation with the calibrated thresholds: statistics consistent with the tokens
    outs = [router.generate(p, SamplingParams(max_tokens=24), f"c{i}") for i, p in enumerate(WARMUP)]
    for o in outs:
        d = o.stats.to_dict()
        assert d["num_tokens"] == len(o.token_ids) == 24 and sum(d["tokens_per_model"]) == 24
        assert math.isclose(sum(d["token_share"]), 1.0)
        assert sum(length for _, length in o.stats.runs()) == 24
        assert d["routing_rate"] == sum(1 for s, _ in o.stats.switches if s == 0) / 24
    total = sum(o.stats.to_dict()["routing_rate"] for o in outs) / len(outs)
    if name == "ensemble":
        frac = sum(o.stats.ensembled for o in outs) / 72
        assert 0.0 < frac < 0.75 and all(m == 0 for o in outs for m in o.token_models)
    else:
        assert 0.0 < total < 0.6


def test_calibrate_helper_returns_thresholds(presets):
    alg = make_algorithm("citer", mode="calibrated", rates={"switch": 0.3})
    th = calibrate(alg, presets, WARMUP, SamplingParams(max_tokens=5))
    assert set(th) == {"switch"} and alg.calibrated


# -- synthetic mode -----------------------------------------------------------------------------------------------
def test_synthetic_is_reproducible_and_seeded():
    def run(seed):
        alg = make_algorithm("r2r", mode="synthetic", seed=seed, rates={"switch": 0.3})
        return run_sequential(alg, [FakeRunner(0), FakeRunner(1)], [[1, 2, 3], [4, 5]],
                              SamplingParams(max_tokens=30))
    a, b, c = run(1), run(1), run(2)
    assert [o.token_models for o in a] == [o.token_models for o in b]
    assert [o.stats.to_dict() for o in a] == [o.stats.to_dict() for o in b]
    assert [o.token_models for o in a] != [o.token_models for o in c]


def test_synthetic_bernoulli_statistics():
    p = 0.2
    alg = make_algorithm("co_llm", mode="synthetic", seed=5, rates={"switch": p})
    outs = run_sequential(alg, [FakeRunner(0), FakeRunner(1)], [[i + 1, i + 2] for i in range(6)],
                          SamplingParams(max_tokens=400))
    n = sum(o.stats.num_tokens for o in outs)
    large = sum(o.stats.to_dict()["tokens_per_model"][1] for o in outs)
    assert abs(large / n - p) < 0.03                       # each routed position is one large-model token
    for o in outs:
        away = sum(1 for s, _ in o.stats.switches if s == 0)
        back = sum(1 for s, _ in o.stats.switches if s == 1)
        assert away == back == o.stats.to_dict()["tokens_per_model"][1]   # exactly 1 token per visit


def test_synthetic_markov_statistics():
    a, b = 0.2, 0.5
    alg = make_algorithm("r_stitch", mode="synthetic", seed=11, rates={"switch": a, "return": b})
    outs = run_sequential(alg, [FakeRunner(0), FakeRunner(1)], [[i + 1, 7] for i in range(6)],
                          SamplingParams(max_tokens=400))
    n = sum(o.stats.num_tokens for o in outs)
    large = sum(o.stats.to_dict()["tokens_per_model"][1] for o in outs)
    visits = sum(1 for o in outs for s, _ in o.stats.switches if s == 0)
    small_run, large_run = (1 - a) / a, 1 / b
    assert abs(large / n - large_run / (small_run + large_run)) < 0.05   # 1/3
    assert abs(large / visits - large_run) < 0.3                          # mean large run = 1/b = 2
    assert abs(visits / n - 1 / (small_run + large_run)) < 0.03           # routing rate 1/6


# -- routed generation on the test presets vs an independent implementation -------------------------------------
def naive_route(alg, runners, prompt, max_tokens, rid):
    """Route one request with no KV reuse and no handoffs: every step recomputes the model on prompt + output.
    Independent of the reference's views, suffixes and catch-up (switching algorithms only)."""
    from tokenplane.engine.sequence import Sequence
    out, models, m = [], [], 0
    v = RequestView.new(rid, prompt, alg.num_models, max_tokens=max_tokens)
    while len(out) < max_tokens:
        seq = Sequence("naive", prompt + out)
        bm = runners[m].block_manager
        bm.allocate(seq)
        o = runners[m].run([seq])
        bm.free(seq)
        r = StepResult(rid, m, len(out), int(torch.argmax(o.logits[0])), o.logits[0], o.hidden[0])
        v.output_ids, v.model = list(out), m
        target = alg.route(r, v)
        if target == m or alg.keep_last(r, v, target):
            out.append(r.token)
            models.append(m)
        m = target
    return out, models


@pytest.fixture(scope="module")
def fresh_presets():
    # separate runners without a prefix cache warm from other tests: the naive loop shares them
    return [build_runner(p, dtype=F64, num_blocks=256) for p in ("test-small", "test-large")]


@pytest.mark.parametrize("name,kwargs", [
    ("r2r", {"mode": "synthetic", "rates": {"switch": 0.3}}),
    ("citer", {"mode": "synthetic", "rates": {"switch": 0.5}}),
    ("co_llm", {"mode": "synthetic", "rates": {"switch": 1.0}}),
    ("r_stitch", {"mode": "synthetic", "rates": {"switch": 0.25, "return": 0.3}}),
    ("r_stitch", {"mode": "calibrated", "rates": {"switch": 0.25, "return": 0.4}}),
])
def test_reference_equals_no_kv_routing(fresh_presets, name, kwargs):
    alg = make_algorithm(name, seed=2, **kwargs)
    if kwargs["mode"] == "calibrated":   # real entropy signals (about 0.998 on these random models) vs thresholds
        calibrate(alg, fresh_presets, WARMUP[:2], SamplingParams(max_tokens=8))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [100, 200, 300]]
    outs = run_sequential(alg, fresh_presets, prompts, SamplingParams(max_tokens=16))
    for i, (p, o) in enumerate(zip(prompts, outs)):
        tokens, models = naive_route(alg, fresh_presets, p, 16, f"req-{i}")
        assert o.token_ids == tokens and o.token_models == models
    assert any(1 in o.token_models for o in outs)


def test_all_large_routing_equals_large_model_alone(fresh_presets):
    """Co-LLM deferring every token and R-Stitch never returning both reproduce the large model's greedy output."""
    prompt = [7, 7, 3, 11, 19]
    alone = make_algorithm("r_stitch", mode="synthetic", rates={"switch": 0.0, "return": 0.0})
    large_alone = run_sequential(alone, fresh_presets[::-1], [prompt], SamplingParams(max_tokens=12))[0].token_ids
    for alg in (make_algorithm("co_llm", mode="synthetic", rates={"switch": 1.0}),
                make_algorithm("r_stitch", mode="synthetic", rates={"switch": 1.0, "return": 0.0})):
        out = run_sequential(alg, fresh_presets, [prompt], SamplingParams(max_tokens=12))[0]
        assert out.token_ids == large_alone and set(out.token_models) == {1}


def test_ensemble_weights_select_a_model(fresh_presets):
    """Always-ensemble with all weight on one model reproduces that model alone (score visits + catch-up exact)."""
    prompt = [12, 34, 56]
    sp = SamplingParams(max_tokens=12)
    alone = make_algorithm("r_stitch", mode="synthetic", rates={"switch": 0.0, "return": 0.0})
    small = run_sequential(alone, fresh_presets, [prompt], sp)[0].token_ids
    large = run_sequential(alone, fresh_presets[::-1], [prompt], sp)[0].token_ids
    assert small != large
    for weights, expect in (([1.0, 0.0], small), ([0.0, 1.0], large)):
        alg = make_algorithm("ensemble", always=True, weights=weights, topk=0)
        out = run_sequential(alg, fresh_presets, [prompt], sp)[0]
        assert out.token_ids == expect
        d = out.stats.to_dict()
        assert d["ensembled_positions"] == d["score_visits"] == 12
        assert d["prefill_tokens"][1][0] == len(prompt)   # first score visit: the peer prefills the prompt
    three = make_algorithm("ensemble", num_models=3, always=True, weights=[0.0, 0.0, 1.0], topk=8)
    out = run_sequential(three, fresh_presets + [fresh_presets[1]], [prompt], sp)[0]
    assert out.token_ids == large and out.stats.score_visits == 24
