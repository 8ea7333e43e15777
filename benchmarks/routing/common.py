"""Shared pieces of the routing benchmarks: latency settings, closed-loop load against the runtime, output files.

Closed loop: `concurrency` clients each keep one request in flight (a finished request is replaced at once by a new
one), which is the population the throughput model assumes. Throughput = committed tokens streamed to clients inside
the measurement window / window length; tokens a model generated and the algorithm dropped never reach a client, so
they never count.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tokenplane.engine.latency_runner import LatencyFit, preset  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CPU_LATENCY = RESULTS / "cpu_latency.json"
# the torch engines as the runtime runs them: 1 thread pinned to one core, the other model stepping on the other core
# (cpu_latency.py --threads 1 --core 0 --background)
TORCH_LATENCY = RESULTS / "cpu_latency_torch.json"
# the same engines measured alone (the other core free): what a model costs without its peer, for comparison
TORCH_LATENCY_ISOLATED = RESULTS / "cpu_latency_torch_isolated.json"


def latency_setting(name: str) -> tuple[list[LatencyFit], str]:
    """(fits for [small, large], provenance) for "seed-r2r", "cpu-measured" or "torch-measured"."""
    if name == "seed-r2r":
        return list(preset("seed-r2r")), "seed's R2R GPU figures (6.0 / 27.9 ms at batch 4, context 1024)"
    if name == "cpu-measured":
        if CPU_LATENCY.exists():
            d = json.loads(CPU_LATENCY.read_text())
            fits = [LatencyFit.from_dict(d["fits"][m]) for m in ("tiny-small", "tiny-large")]
            return fits, f"piecewise fit of ModelRunner tiny-small / tiny-large decode steps ({CPU_LATENCY.name})"
        return list(preset("cpu-facts")), "engine-cpu-facts.md figures (no cpu_latency.json measured)"
    if name == "torch-measured":
        if not TORCH_LATENCY.exists():
            raise FileNotFoundError(f"{TORCH_LATENCY} missing: measure it with `python benchmarks/routing/"
                                    "cpu_latency.py --threads 1 --core 0 --out " + str(TORCH_LATENCY) + "`")
        return torch_fits(TORCH_LATENCY)
    raise ValueError(f"unknown latency setting {name!r}")


def torch_fits(path: Path) -> tuple[list[LatencyFit], str]:
    """(fits for [tiny-small, tiny-large], provenance) from a cpu_latency.py --core measurement."""
    d = json.loads(path.read_text())
    fits = [LatencyFit.from_dict(d["fits"][m]) for m in ("tiny-small", "tiny-large")]
    bg = d.get("background")
    side = (f"while the other model stepped (batch {bg['batch']}) on core {bg['core']}, as in the runtime"
            if bg else "alone")
    return fits, (f"piecewise fit of the torch ModelRunner's tiny-small / tiny-large decode steps, 1 thread "
                  f"pinned to core {d.get('core')}, {side}, fitted on the wall-clock {d.get('fit_stat', 'min')} of "
                  f"{(d.get('points') or [{}])[0].get('steps')} steps per point, measured {d.get('measured_at')} "
                  f"(`{d.get('command')}`, load {d.get('loadavg_before')}); d and mixed from "
                  f"{CPU_LATENCY.name}'s --mixed measurement ({path.name}"
                  + (f"; fits: `{d['refit_command']}`" if d.get("refit_command") else "") + ")")


def prompt_for(i: int, length: int, vocab: int = 500) -> list[int]:
    return [(1_000_003 * i + 7919 * j) % (vocab - 2) + 1 for j in range(length)]


async def _closed_loop(rt, concurrency: int, duration_s: float, warmup_s: float, max_tokens: int,
                       prompt_len: int, vocab: int, first_request: int = 0) -> dict[str, Any]:
    from tokenplane.engine.sampler import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t_start = time.monotonic()
    t0, t1 = t_start + warmup_s, t_start + warmup_s + duration_s
    counted = 0
    latencies: list[float] = []
    speeds: list[float] = []  # per request: output tokens / (finish - first token), decode speed one user sees
    ttfts: list[float] = []
    counter = [first_request]   # request numbers (prompts, ids) continue from first_request
    snaps: list = []

    async def snapshot(at: float) -> None:
        # Per-model counters at the window's edges (a stats round trip off the event loop), so utilisation and
        # per-step overhead describe the steady state, not the warm-up or the drain after the window.
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        try:
            snaps.append(await asyncio.get_running_loop().run_in_executor(None, rt.stats))
        except Exception as exc:   # a diagnostic: never lose the measured run over it
            snaps.append(exc)

    async def client(c: int) -> None:
        nonlocal counted
        while time.monotonic() < t1:
            i = counter[0]
            counter[0] += 1
            start = time.monotonic()
            first = None
            n = 0
            async for chunk in rt.generate(prompt_for(i, prompt_len, vocab), params, request_id=f"c{c}-r{i}"):
                now = time.monotonic()
                if chunk.tokens and first is None:
                    first = now
                n += len(chunk.tokens)
                if t0 <= now <= t1:
                    counted += len(chunk.tokens)
            end = time.monotonic()
            # Requests started inside the window, each run to completion (the last ones end a little after t1, when
            # the other clients have stopped: a small bias toward lower latency, the same for every system).
            if t0 <= start <= t1:
                latencies.append(end - start)
                ttfts.append((first or end) - start)
                if first is not None and end > first and n > 1:
                    speeds.append((n - 1) / (end - first))

    await asyncio.gather(*(client(c) for c in range(concurrency)), snapshot(t0), snapshot(t1))
    window = window_counters(snaps[0], snaps[1]) if len(snaps) == 2 and not any(
        isinstance(x, Exception) for x in snaps) else None
    return {"window_counters": window, "throughput": counted / duration_s, "tokens": counted, "window_s": duration_s,
            "requests_in_window": len(latencies),
            "latency_mean_s": statistics.fmean(latencies) if latencies else None,
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
            "user_speed": statistics.fmean(speeds) if speeds else None, "next_request": counter[0]}


def window_counters(before: list[dict], after: list[dict]) -> list[dict]:
    """Per model, what happened between two Runtime.stats() snapshots: steps, mean batch, and the share of wall time
    spent inside the runner (modeled latency), in the rest of a step (schedule, sample, route, send), idle (blocked
    on the sockets with nothing to run) and elsewhere (draining messages, policy waits that spin the loop)."""
    out = []
    for b, a in zip(before, after):
        cb, ca = b["counters"], a["counters"]
        d = {k: ca.get(k, 0) - cb.get(k, 0) for k in ("steps", "batched_seqs", "computed_tokens", "step_time_s",
                                                       "step_wall_s", "idle_s", "wall_s")}
        wall = d["wall_s"] or float("nan")
        steps = max(1, d["steps"])
        out.append({"model": a["model"], "steps": d["steps"], "mean_batch": d["batched_seqs"] / steps,
                    "runner_share": d["step_time_s"] / wall,
                    "step_overhead_share": (d["step_wall_s"] - d["step_time_s"]) / wall,
                    "idle_share": d["idle_s"] / wall,
                    "other_share": 1.0 - (d["step_wall_s"] + d["idle_s"]) / wall,
                    "overhead_ms_per_step": 1e3 * (d["step_wall_s"] - d["step_time_s"]) / steps,
                    # every busy moment that is not the runner, per step: the step's own overhead plus the loop's
                    # message handling between steps (what the throughput model's L_m leaves out)
                    "busy_outside_runner_ms_per_step": 1e3 * (d["wall_s"] - d["idle_s"] - d["step_time_s"]) / steps,
                    "runner_ms_per_step": 1e3 * d["step_time_s"] / steps})
    return out


def runtime_overhead_s(runs: list[dict]) -> list[float] | None:
    """Per model, the median over runs of busy time outside the runner per step (seconds): the runtime's own cost
    of a step, measured, which the throughput model can add to each model's step latency."""
    per_model: dict[int, list[float]] = {}
    for r in runs:
        for w in r.get("window_counters") or []:
            if w["steps"] > 0:
                per_model.setdefault(w["model"], []).append(w["busy_outside_runner_ms_per_step"] / 1e3)
    if not per_model:
        return None
    return [statistics.median(per_model[m]) for m in sorted(per_model)]


def summarize(values: list[float]) -> dict[str, Any]:
    """Median, P90 (nearest rank), min, max and n of repeated measurements."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return {"n": 0, "median": None, "p90": None, "min": None, "max": None}
    return {"n": len(v), "median": statistics.median(v), "p90": v[min(len(v) - 1, int(0.9 * len(v) + 0.5) - 1)],
            "min": v[0], "max": v[-1]}


def loadavg() -> list[float]:
    import os
    return [round(x, 2) for x in os.getloadavg()]


def closed_loop(rt, concurrency: int, *, duration_s: float, warmup_s: float = 0.5, max_tokens: int = 128,
                prompt_len: int = 32, vocab: int = 500, first_request: int = 0) -> dict[str, Any]:
    """first_request: the first request number (prompt and id); a runtime measured again gets fresh prompts by
    passing the previous run's `next_request`, so no run hits another's prefix cache."""
    return asyncio.run(_closed_loop(rt, concurrency, duration_s, warmup_s, max_tokens, prompt_len, vocab,
                                    first_request))


def write_outputs(stem: str, result: dict, markdown: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    (RESULTS / f"{stem}.md").write_text(markdown)


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    def fmt(x):
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
        return str(x)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def chain_latency_fns(fits: list[LatencyFit], routing, context: float, overhead_s: list[float] | None = None) -> list:
    """Batch-only expected step latency per model for the throughput model, with each model's catch-up folded in.

    Star routing (model 0 primary, switch probability p, peer k returns with probability r_k per step): a peer's
    first step of a visit catches up on the primary's tokens committed since its last visit, which exist only when
    the primary committed at least one token before switching again (probability 1 - p; then 1/p of them on
    average); the primary catches up after a return only when the peer ran two steps or more (probability 1 - r;
    then 1/r extra tokens on average). Mean extra tokens per step are as before; what changes is that a step
    where ANY sequence has extra tokens pays the fit's `mixed` (eager, no CUDA graph) factor, so the expected
    latency of a batch of b is  q^b L(b, decode only) + (1 - q^b) L(b, with the batch's extra tokens),  q = the
    per-sequence chance of no catch-up. (R2R at p = 0.35: 35% of the large model's batch-1 steps are decode-only
    graph replays; at batch 4 only 1.5% are. Charging every step as mixed overstated what batching saves.)
    overhead_s: per model, the runtime's measured busy time per step outside the runner (runtime_overhead_s), added
    to every step; None = the chain's idealized zero-overhead runtime.
    """
    from tokenplane.route.throughput_model import RoutingModel
    rm = RoutingModel.coerce(routing)
    p = 1.0 - rm.P[0][0]
    fns = []
    for m, f in enumerate(fits):
        if m == 0:
            r = min((1.0 - rm.P[k][k] for k in range(1, rm.num_models) if rm.P[0][k] > 0), default=1.0)
            # a return with R >= 2 peer tokens (R geometric, mean 1/r) makes the primary compute R - 1 extra
            # tokens, whose mean given R >= 2 is 1/r (memoryless)
            s_m, e_m = (p * (1.0 - r), 1.0 / r) if r > 0 else (0.0, 0.0)
        else:
            pk, r = rm.P[0][m], 1.0 - rm.P[m][m]
            s_m, e_m = (r * (1.0 - p), 1.0 / p) if pk > 0 and p > 0 else (0.0, 0.0)
        fn = _catch_up_mixture(f, context, s_m, e_m)
        if overhead_s:
            fn = _plus(fn, float(overhead_s[m]))
        fns.append(fn)
    return fns


def _catch_up_mixture(f: LatencyFit, context: float, s: float, e: float):
    """E[step latency] for a batch of b when each sequence independently carries e extra tokens with probability s."""
    def fn(batch: int) -> float:
        if batch <= 0:
            return 0.0
        q = (1.0 - s) ** batch
        if q >= 1.0:
            return f(batch, context, 0.0)
        return q * f(batch, context, 0.0) + (1.0 - q) * f(batch, context, batch * s * e / (1.0 - q))
    return fn


def _plus(fn, extra: float):
    return lambda batch: fn(batch) + extra
