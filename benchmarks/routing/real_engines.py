"""Threshold configurations measured on the runtime with REAL engines: the torch ModelRunner on model files.

threshold_validation.py --backend torch: the runtime's two sub-servers run the torch runner on the random-weight
tiny-small / tiny-large checkpoints (the pair the other routing benchmarks use, written once by
benchmarks/peers/routing_vs_vllm.py's `model_dirs`), one thread each, model m's process pinned to core m, R2R
synthetic routing at the chain's p, closed loop at concurrency C.

Unlike the latency-model backend (a fresh runtime per run), one runtime serves all configurations of a concurrency:
loading the models per run would cost more than the windows, and alternating the configurations inside one
process (order rotated every repeat) spreads the shared machine's load drift over all of them alike. Every run
gets fresh prompts (request numbers continue across runs), so no run hits another's prefix cache.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import closed_loop, loadavg  # noqa: E402

from tokenplane.route.config import RuntimeConfig, resolve_thresholds  # noqa: E402

PEERS = Path(__file__).resolve().parents[1] / "peers"
MODELS = ["tiny-small", "tiny-large"]


@dataclass(frozen=True)
class EngineRunSpec:
    """What every torch-backend run shares; thresholds and concurrency vary per run (Runtime.configure)."""

    model_dirs: list[str]
    p_switch: float
    concurrency: int
    duration_s: float = 8.0
    warmup_s: float = 0.5
    max_tokens: int = 128
    prompt_len: int = 32
    num_blocks: int = 512
    seed: int = 0
    pin: bool = True                     # model m's sub-server on core m (needs as many cores as models)
    warm_runs_s: float = 2.0             # one discarded run first: numba kernels, allocator, page cache
    extra: dict[str, Any] = field(default_factory=dict)   # RuntimeConfig overrides (tests: tiny windows)


def ensure_model_dirs(root: Path) -> list[str]:
    """tiny-small / tiny-large checkpoint directories under `root`, written (seed 0, fp32) when missing."""
    sys.path.insert(0, str(PEERS))
    from routing_vs_vllm import model_dirs
    return model_dirs(MODELS, root)


def runtime_config(spec: EngineRunSpec, thresholds: tuple[int, int]) -> RuntimeConfig:
    """The runtime the torch backend measures: torch runner, 1 thread per model, delayed_async with pending
    return at `thresholds`, the chain's routing (R2R synthetic, switch p)."""
    kw: dict[str, Any] = dict(models=list(spec.model_dirs), algorithm="r2r",
                              algorithm_kwargs={"mode": "synthetic", "rates": {"switch": spec.p_switch},
                                                "seed": spec.seed},
                              runner="torch", dtype="float32", threads_per_model=1, mode="delayed_async",
                              pending_return=True, thresholds=list(thresholds), concurrency=spec.concurrency,
                              num_blocks=spec.num_blocks)
    kw.update(spec.extra)
    cfg = RuntimeConfig(**kw)
    cfg.validate()
    resolve_thresholds(cfg)   # raises ValueError for thresholds infeasible at this concurrency
    return cfg


def rotation(grid: list[tuple[int, int]], repeat: int) -> list[tuple[int, int]]:
    """The grid's order in repeat `repeat`: rotated by one each repeat, so no configuration always runs first."""
    k = repeat % len(grid) if grid else 0
    return grid[k:] + grid[:k]


def measure_grid(spec: EngineRunSpec, grid: list[tuple[int, int]], repeats: int,
                 log=print) -> dict[tuple[int, int], list[dict]]:
    """Per thresholds tuple, `repeats` closed-loop runs on one runtime (see module docstring)."""
    from tokenplane.route.runtime import Runtime
    runs: dict[tuple[int, int], list[dict]] = {ts: [] for ts in grid}
    rt = Runtime(runtime_config(spec, grid[0]))
    try:
        pinned = _pin(rt) if spec.pin else []
        next_request = 0

        def one(ts: tuple[int, int], duration: float) -> dict:
            nonlocal next_request
            rt.configure(thresholds=list(ts), concurrency=spec.concurrency)
            load = loadavg()
            res = closed_loop(rt, spec.concurrency, duration_s=duration, warmup_s=spec.warmup_s,
                              max_tokens=spec.max_tokens, prompt_len=spec.prompt_len, first_request=next_request)
            next_request = res["next_request"]
            try:
                res["model_stats"] = rt.stats()
            except Exception as exc:  # diagnostics only: a slow reply must not lose the measurement
                res["model_stats"] = f"unavailable: {exc}"
            res["loadavg_before"], res["loadavg_after"], res["pinned_cores"] = load, loadavg(), pinned
            return res

        if spec.warm_runs_s > 0:
            w = one(grid[0], spec.warm_runs_s)
            log(f"   torch warm-up {grid[0]}: {w['throughput']:.1f} tok/s (discarded)")
        for r in range(repeats):
            for ts in rotation(grid, r):
                res = one(ts, spec.duration_s)
                runs[ts].append(res)
                log(f"   torch {ts} #{r + 1}: {res['throughput']:.1f} tok/s (load {res['loadavg_before'][0]})")
    finally:
        rt.shutdown()
    return runs


def _pin(rt) -> list[int]:
    """Model m's sub-server process (all its threads) onto core m; returns the cores used."""
    import os
    sys.path.insert(0, str(PEERS))
    from vllm_http_engine import pin_process
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < len(rt.pids):
        return []
    used = []
    for m, pid in enumerate(rt.pids):
        if pid is not None:
            pin_process(pid, cores[m])
            used.append(cores[m])
    return used


def runner_ms_per_step(runs: list[dict]) -> list[dict[str, float]]:
    """Per model, from the runs' measurement windows: mean batch and the runner's own time per step (ms): what the
    engines cost inside the runtime, next to what the isolated fit says for that batch."""
    out: dict[int, list[tuple[float, float]]] = {}
    for r in runs:
        for w in r.get("window_counters") or []:
            if w["steps"] > 0:
                out.setdefault(w["model"], []).append((w["mean_batch"], w["runner_ms_per_step"]))
    import statistics
    return [{"mean_batch": statistics.median(b for b, _ in v), "runner_ms": statistics.median(t for _, t in v)}
            for _, v in sorted(out.items())]
