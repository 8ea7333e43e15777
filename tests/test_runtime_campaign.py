"""Longer runtime checks (run with -m campaign): 3-model ensemble, explicit restart_model, the latency-model runner,
and a wider equivalence sweep (all algorithms x all mode flags, longer outputs)."""

from __future__ import annotations

import pytest
import torch

from tokenplane.engine.sampler import SamplingParams
from tokenplane.route.algorithms import make_algorithm
from tokenplane.route.reference import SequentialRouter, build_runner
from tokenplane.route.runtime import Runtime, RuntimeConfig

pytestmark = [pytest.mark.campaign, pytest.mark.usefixtures("one_thread")]

PROMPTS = [[(11 * i + 5 * j) % 500 + 1 for j in range(3 + 5 * i)] for i in range(12)]
RIDS = [f"camp-{i}" for i in range(len(PROMPTS))]


def ref_outputs(alg_name, kwargs, runners, params):
    router = SequentialRouter(make_algorithm(alg_name, **kwargs), runners)
    return [router.generate(p, params, rid) for p, rid in zip(PROMPTS, RIDS)]


def assert_same(ref, outs):
    for r, o in zip(ref, outs):
        assert (o.token_ids, o.token_models, o.finish_reason) == (r.token_ids, r.token_models, r.finish_reason)


def test_three_model_ensemble_all_modes():
    models = ["test-small", "test-large", "test-llama"]
    kwargs = {"mode": "synthetic", "seed": 2, "rates": {"gate": 0.3}, "num_models": 3}
    params = SamplingParams(max_tokens=32)
    runners = [build_runner(m, dtype=torch.float64, num_blocks=256) for m in models]
    ref = ref_outputs("ensemble", kwargs, runners, params)
    with Runtime(RuntimeConfig(models=models, algorithm="ensemble", algorithm_kwargs=kwargs, dtype="float64",
                               num_blocks=256)) as rt:
        for mode in ("stepwise_sync", "model_sync", "immediate_async", "delayed_async"):
            rt.configure(mode=mode, thresholds=[1, 2, 2] if mode == "delayed_async" else None)
            assert_same(ref, rt.run_batch(PROMPTS, params, request_ids=RIDS, concurrency=12))


def test_wide_sweep_and_restart_model():
    models = ["test-small", "test-large"]
    params = SamplingParams(max_tokens=64)
    runners = [build_runner(m, dtype=torch.float64, num_blocks=512) for m in models]
    algs = {"r2r": {"mode": "synthetic", "seed": 1, "rates": {"switch": 0.2}, "router_dim": 32, "router_blocks": 1},
            "citer": {"mode": "synthetic", "seed": 1, "rates": {"switch": 0.2}},
            "co_llm": {"mode": "synthetic", "seed": 1, "rates": {"switch": 0.2}},
            "r_stitch": {"mode": "synthetic", "seed": 1, "rates": {"switch": 0.15, "return": 0.3}},
            "ensemble": {"mode": "synthetic", "seed": 1, "rates": {"gate": 0.2}}}
    flags = [{"mode": m} for m in ("stepwise_sync", "model_sync", "immediate_async")] + [
        {"mode": "delayed_async", "thresholds": [1, 4]}, {"pending_return": False}, {"standard_serving": True}]
    with Runtime(RuntimeConfig(models=models, algorithm="r2r", algorithm_kwargs=algs["r2r"], dtype="float64",
                               num_blocks=512, concurrency=12)) as rt:
        for name, kw in algs.items():
            ref = ref_outputs(name, kw, runners, params)
            for f in flags:
                if name == "ensemble" and f.get("standard_serving"):
                    continue   # score visits need retained state
                full = {"mode": "immediate_async", "thresholds": None, "pending_return": True,
                        "standard_serving": False, **f}
                rt.configure(algorithm=name, algorithm_kwargs=kw, **full)
                assert_same(ref, rt.run_batch(PROMPTS, params, request_ids=RIDS, concurrency=12))
        old = rt.pids[0]
        rt.restart_model(0)
        assert rt.pids[0] != old
        rt.configure(algorithm="r2r", algorithm_kwargs=algs["r2r"], mode="delayed_async", thresholds=None,
                     pending_return=True, standard_serving=False)
        assert_same(ref_outputs("r2r", algs["r2r"], runners, params),
                    rt.run_batch(PROMPTS, params, request_ids=RIDS, concurrency=12))


def test_latency_model_runner_matches_reference():
    from tokenplane.engine.latency_runner import LatencyModelRunner, preset
    sources = [{"latency": "seed-r2r:0", "seed": 0}, {"latency": "seed-r2r:1", "seed": 1}]
    runners = [LatencyModelRunner(preset("seed-r2r")[i], seed=i, num_blocks=512) for i in range(2)]
    kw = {"mode": "synthetic", "seed": 9, "rates": {"switch": 0.2, "return": 0.4}}
    params = SamplingParams(max_tokens=48)
    ref = ref_outputs("r_stitch", kw, runners, params)
    with Runtime(RuntimeConfig(models=sources, runner="latency-model", algorithm="r_stitch", algorithm_kwargs=kw,
                               num_blocks=512, mode="delayed_async", thresholds=[1, 3], concurrency=12)) as rt:
        outs = rt.run_batch(PROMPTS, params, request_ids=RIDS, concurrency=12)
        assert_same(ref, outs)
        st = rt.stats()
        assert st[1]["counters"]["policy"]["launches"][1] > 0
