"""threshold_validation.py --backend torch wiring: the runtime config it measures, its grid, its latency setting and
its report (issue 16: delayed batching on real engines). One short real run on the test presets (sub-second windows)
checks that configurations alternate on one runtime with fresh prompts and the thresholds each run asked for."""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "routing"


def load(name: str):
    """The benchmark module as its siblings import it (benchmarks/routing on sys.path: one `common` for all)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve() == (BENCH / f"{name}.py").resolve()
    return module


@pytest.fixture(scope="module")
def re_mod():
    return load("real_engines")


@pytest.fixture(scope="module")
def tv():
    return load("threshold_validation")


def test_runtime_config_is_the_real_engine_runtime(re_mod):
    spec = re_mod.EngineRunSpec(["/m/tiny-small", "/m/tiny-large"], 0.35, 8)
    cfg = re_mod.runtime_config(spec, (1, 3))
    assert cfg.runner == "torch" and cfg.threads_per_model == 1 and cfg.dtype == "float32"
    assert cfg.models == ["/m/tiny-small", "/m/tiny-large"]
    assert cfg.mode == "delayed_async" and cfg.pending_return and not cfg.standard_serving
    assert cfg.thresholds == [1, 3] and cfg.concurrency == 8
    assert cfg.algorithm == "r2r"
    assert cfg.algorithm_kwargs == {"mode": "synthetic", "rates": {"switch": 0.35}, "seed": 0}
    with pytest.raises(ValueError):   # a threshold above the concurrency can never be reached
        re_mod.runtime_config(re_mod.EngineRunSpec(["a", "b"], 0.35, 4), (1, 5))


def test_grid_and_rotation(re_mod, tv):
    from tokenplane.route.batching import feasible_thresholds
    chain = {ts: None for ts in feasible_thresholds(2, 4, 8)}
    assert tv.torch_grid(chain, (1, 1), [2, 4]) == [(1, 1), (1, 2), (2, 1), (1, 4)]
    chain16 = {ts: None for ts in feasible_thresholds(2, 16, 8)}
    assert tv.torch_grid(chain16, (1, 3), [2, 4]) == [(1, 1), (1, 3), (1, 2), (1, 4), (2, 3)]
    grid = [(1, 1), (1, 2), (2, 1)]
    assert [re_mod.rotation(grid, r)[0] for r in range(4)] == [(1, 1), (1, 2), (2, 1), (1, 1)]
    assert all(sorted(re_mod.rotation(grid, r)) == sorted(grid) for r in range(3))


def test_torch_measured_setting(tmp_path, monkeypatch):
    common = load("common")
    fit = {"name": "x", "a": 0.0, "b": 0.0, "c": 1e-6, "d": 2e-4, "knots": [[1, 0.01], [4, 0.02]], "mixed": 1.0}
    path = tmp_path / "cpu_latency_torch.json"
    path.write_text(json.dumps({"fits": {"tiny-small": fit, "tiny-large": fit | {"knots": [[1, 0.03], [4, 0.04]]}},
                                "core": 0, "measured_at": "now", "command": "cmd", "loadavg_before": [0.1]}))
    monkeypatch.setattr(common, "TORCH_LATENCY", path)
    fits, prov = common.latency_setting("torch-measured")
    assert [f(1) for f in fits] == [0.01, 0.03] and fits[0].d == 2e-4
    assert "core 0" in prov and "cmd" in prov
    monkeypatch.setattr(common, "TORCH_LATENCY", tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError, match="cpu_latency.py"):
        common.latency_setting("torch-measured")


def test_render_torch_targets(tv):
    chain = {"1,1": {"throughput": 100.0}, "1,2": {"throughput": 99.0}}
    run = {"throughput": 0.0, "loadavg_before": [1.0]}
    entry = {"chain": chain,
             "torch_raw": {"1,1": [run | {"throughput": 93.0}], "1,2": [run | {"throughput": 97.0}]},
             "torch_runner": {"1,1": [{"mean_batch": 2.0, "runner_ms": 11.0}]},
             "torch": {"chosen_throughput": 93.0, "best": [1, 2], "best_throughput": 97.0, "ratio": 93 / 97,
                       "all_ones": 93.0}}
    fit = {"a": 0.01}
    md = tv.render_torch({"fits": [fit, fit], "by_concurrency": {"4": entry}}, 96.0)
    row = next(line for line in md.splitlines() if line.startswith("| 4 | (1, 1)"))
    assert "-7.0%" in row and "NOT met" in row and "95.9%" in row and row.count("NOT met") == 1
    assert "(1,1) (choice)" in md and "runner 11.0 ms (fit 10.0)" in md


def test_measure_grid_alternates_on_one_runtime(re_mod):
    """Sub-second windows on the test presets: every configuration runs, with its own thresholds and fresh prompts."""
    spec = re_mod.EngineRunSpec(["test-small", "test-large"], 0.35, 2, duration_s=0.4, warmup_s=0.1, max_tokens=8,
                                prompt_len=20, num_blocks=64, pin=False, warm_runs_s=0.3)
    runs = re_mod.measure_grid(spec, [(1, 1), (1, 2)], repeats=1, log=lambda *_: None)
    assert set(runs) == {(1, 1), (1, 2)}
    for ts, (r,) in runs.items():
        assert r["tokens"] > 0
        large = r["model_stats"][1]["counters"]["policy"]
        assert large["thresholds"] == list(ts)
    counters = runs[(1, 2)][0]["model_stats"][0]["counters"]
    assert counters["prefix_hit_tokens"] == 0   # the second run's prompts are new, not the first run's again
    assert re_mod.runner_ms_per_step(runs[(1, 1)])[0]["runner_ms"] > 0


def test_cpu_latency_fit_stat(tmp_path):
    """--fit-stat picks the steps' min or median column; d and mixed come from cpu_latency.json's --mixed summary."""
    mod = load("cpu_latency")
    pts = [{"model": "tiny-large", "batch": b, "context": ctx, "latency_s": 0.010 * b ** 0.5 + 1e-6 * b * ctx,
            "median_s": 0.012 * b ** 0.5 + 1e-6 * b * ctx} for b in (1, 4) for ctx in (48, 160)]
    lo = mod.fit_points(pts, ["tiny-large"], tmp_path / "x.json", "min")["tiny-large"]
    hi = mod.fit_points(pts, ["tiny-large"], tmp_path / "x.json", "median")["tiny-large"]
    assert [k for k, _ in lo["knots"]] == [1, 4]
    assert abs(lo["knots"][0][1] - 0.010) < 1e-6 and abs(hi["knots"][0][1] - 0.012) < 1e-6
    assert abs(lo["c"] - 1e-6) < 1e-8 and lo["max_rel_error"] < 1e-6
    mixed = mod.json.loads((mod.OUT / "cpu_latency.json").read_text())["mixed"]["summary"]["tiny-large"]
    assert lo["d"] == mixed["d_s_per_token"] and lo["mixed"] == mixed["mixed"]


def test_torch_calibrate(tv):
    """kappa = the runner's time per step in the (1, 1) runs / the fit at the same mean batch; the chain again on the
    scaled fits, and on the isolated fits for comparison."""
    from tokenplane.engine.latency_runner import LatencyFit
    from tokenplane.route.batching import feasible_thresholds
    from tokenplane.route.throughput_model import RoutingModel
    fits = [LatencyFit(0.010, 0.001), LatencyFit(0.020, 0.002)]
    win = [{"model": m, "steps": 10, "mean_batch": 2.0, "runner_ms_per_step": 1e3 * f(2) * k}
           for m, (f, k) in enumerate(zip(fits, (1.5, 2.0)))]
    entry = {"torch_raw": {"1,1": [{"window_counters": win}]}, "torch_overhead_s": [0.0, 0.0]}
    tv.torch_calibrate(entry, fits, RoutingModel.r2r(0.35), 96.0, 4, feasible_thresholds(2, 4, 8))
    assert entry["torch_kappa"] == pytest.approx([1.5, 2.0])
    plain = tv.chain_latency_fns(fits, RoutingModel.r2r(0.35), 96.0)
    slow = tv.solve_chain((1, 1), 4, RoutingModel.r2r(0.35), plain).throughput
    assert entry["torch_chain_calibrated"]["1,1"]["throughput"] < slow / 1.4   # every step 1.5-2x as long
    assert tuple(entry["torch_chosen_calibrated"]) in {tuple(map(int, k.split(","))) for k in entry["torch_chain_calibrated"]}
