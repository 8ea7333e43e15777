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


def latency_setting(name: str) -> tuple[list[LatencyFit], str]:
    """(fits for [small, large], provenance) for "seed-r2r" or "cpu-measured"."""
    if name == "seed-r2r":
        return list(preset("seed-r2r")), "seed's R2R GPU figures (6.0 / 27.9 ms at batch 4, context 1024)"
    if name == "cpu-measured":
        if CPU_LATENCY.exists():
            d = json.loads(CPU_LATENCY.read_text())
            fits = [LatencyFit.from_dict(d["fits"][m]) for m in ("tiny-small", "tiny-large")]
            return fits, f"piecewise fit of ModelRunner tiny-small / tiny-large decode steps ({CPU_LATENCY.name})"
        return list(preset("cpu-facts")), "engine-cpu-facts.md figures (no cpu_latency.json measured)"
    raise ValueError(f"unknown latency setting {name!r}")


def prompt_for(i: int, length: int, vocab: int = 500) -> list[int]:
    return [(1_000_003 * i + 7919 * j) % (vocab - 2) + 1 for j in range(length)]


async def _closed_loop(rt, concurrency: int, duration_s: float, warmup_s: float, max_tokens: int,
                       prompt_len: int, vocab: int) -> dict[str, Any]:
    from tokenplane.engine.sampler import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t_start = time.monotonic()
    t0, t1 = t_start + warmup_s, t_start + warmup_s + duration_s
    counted = 0
    latencies: list[float] = []
    speeds: list[float] = []  # per request: output tokens / (finish - first token), decode speed one user sees
    ttfts: list[float] = []
    counter = [0]

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

    await asyncio.gather(*(client(c) for c in range(concurrency)))
    return {"throughput": counted / duration_s, "tokens": counted, "window_s": duration_s,
            "requests_in_window": len(latencies),
            "latency_mean_s": statistics.fmean(latencies) if latencies else None,
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
            "user_speed": statistics.fmean(speeds) if speeds else None}


def closed_loop(rt, concurrency: int, *, duration_s: float, warmup_s: float = 0.5, max_tokens: int = 128,
                prompt_len: int = 32, vocab: int = 500) -> dict[str, Any]:
    return asyncio.run(_closed_loop(rt, concurrency, duration_s, warmup_s, max_tokens, prompt_len, vocab))


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


def chain_latency_fns(fits: list[LatencyFit], routing, context: float) -> list:
    """Batch-only latency per model for the throughput model, with each model's typical catch-up folded in.

    Star routing (model 0 primary): a peer's first step of a visit computes its own last token plus the primary's
    committed tokens since its last visit (mean 1/p - 1 extra), later steps of the visit compute one; the primary
    catches up on the peer's tokens after each return (mean 1/r - 1 extra). Steps with extra tokens pay the fit's
    `mixed` (eager) factor, so R2R's large model is modeled as eager and the small one as CUDA-graph decode.
    """
    from tokenplane.route.throughput_model import RoutingModel
    rm = RoutingModel.coerce(routing)
    p = 1.0 - rm.P[0][0]
    fns = []
    for m, f in enumerate(fits):
        if m == 0:
            r = min((1.0 - rm.P[k][k] for k in range(1, rm.num_models) if rm.P[0][k] > 0), default=1.0)
            extra = p * (1.0 / r - 1.0) if r > 0 else 0.0
        else:
            pk, r = rm.P[0][m], 1.0 - rm.P[m][m]
            extra = r * (1.0 / p - 1.0) if pk > 0 and p > 0 else 0.0
        fns.append(f.at_context(context, 1.0 + extra))
    return fns
