"""Measure real ModelRunner decode-step latency on this CPU over batch x context, and fit LatencyFit per model.

The fits feed the latency-model backend ("cpu-measured" latencies in threshold_validation.py / serving.py) and the
throughput model. Each point: `batch` sequences of `context` prompt tokens are prefilled, then `--steps` decode
steps (one new token per sequence) are timed; the MINIMUM is kept: the machine is shared (2 cores, other jobs), and
contention only ever adds time, so the minimum is the best estimate of an uncontended step (the median is recorded).

    python benchmarks/routing/cpu_latency.py [--models tiny-small tiny-large] [--quick]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tokenplane.engine.latency_runner import LatencyFit  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"


def measure(model_name: str, batches: list[int], contexts: list[int], steps: int) -> list[dict]:
    from tokenplane.engine.loader import load_model
    from tokenplane.engine.model_runner import ModelRunner
    from tokenplane.engine.sequence import Sequence

    cfg, model = load_model(model_name, seed=0)
    need = max(batches) * (max(contexts) + steps + 16) // 16 + 8
    runner = ModelRunner(model, cfg, num_blocks=need, block_size=16)
    out = []
    for ctx in contexts:
        for b in batches:
            seqs = [Sequence(f"{model_name}-{ctx}-{b}-{i}", [(31 * i + 7 * j) % 1000 + 1 for j in range(ctx)])
                    for i in range(b)]
            for s in seqs:
                assert runner.prepare(s)
            runner.run(seqs)  # prefill, not timed
            times = []
            for k in range(steps):
                for s in seqs:
                    s.append_token(5 + k)
                    runner.prepare(s)
                t = time.perf_counter()
                runner.run(seqs)
                times.append(time.perf_counter() - t)
            for s in seqs:
                runner.free(s)
            med = statistics.median(times)
            out.append({"model": model_name, "batch": b, "context": ctx, "latency_s": min(times),
                        "median_s": med, "steps": steps})
            print(f"{model_name:>11} ctx {ctx:5d} batch {b:3d}: min {min(times) * 1e3:8.2f} ms, "
                  f"median {med * 1e3:8.2f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny-small", "tiny-large"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT / "cpu_latency.json")
    ap.add_argument("--from-engine", type=Path, default=None,
                    help="fit from the engine helper's engine_decode.json (single-thread CPU-time medians) instead "
                         "of measuring; on a loaded shared machine wall-clock steps are 3-10x inflated")
    args = ap.parse_args(argv)
    if args.from_engine is not None:
        return from_engine(args.from_engine, args.out)
    torch.set_num_threads(args.threads)
    points = []
    for m in args.models:
        points += measure(m, args.batches, args.contexts, args.steps)
    fits = {}
    for m in args.models:
        pts = [p for p in points if p["model"] == m]
        fit = LatencyFit.fit_piecewise(pts, name=f"cpu-{m}")
        worst = max(abs(fit(p["batch"], p["context"]) / p["latency_s"] - 1) for p in pts)
        fits[m] = fit.to_dict() | {"max_rel_error": worst}
        knots = ", ".join(f"{k}:{v * 1e3:.1f}" for k, v in fit.knots)
        print(f"fit {m}: base ms by batch {{{knots}}} c={fit.c * 1e6:.3f} us/(seq*token), max rel err {worst:.1%}")
    res = {"device": "cpu", "threads": args.threads, "dtype": "float32", "points": points, "fits": fits,
           "note": "ModelRunner (varlen SDPA over paged KV) decode steps, random-weight presets, min of steps "
                   "(median kept as median_s); piecewise fit base(batch) + c*batch*context"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    return res


def from_engine(path: Path, out: Path) -> dict:
    """Piecewise fits from engine_decode.json's CPU-time medians; d (per catch-up token) from its catch-up table."""
    import dataclasses

    from tokenplane.engine.latency_runner import fit_from_engine_decode
    data = json.loads(path.read_text())
    fits = fit_from_engine_decode(path, piecewise=True)
    res = {"device": "cpu", "source": str(path), "threads": data.get("meta", {}).get("threads"),
           "note": "piecewise fit base(batch) + c*batch*context of engine_decode.json cpu_median_ms (single-thread "
                   "process CPU time per ModelRunner decode step); d = slope of its catch-up table", "fits": {}}
    for m, fit in fits.items():
        cu = sorted((r["new_tokens"], r["cpu_median_ms"] / 1e3) for r in data.get("catch_up", [])
                    if r.get("model") == m and "cpu_median_ms" in r)
        d = max(0.0, (cu[-1][1] - cu[0][1]) / (cu[-1][0] - cu[0][0])) if len(cu) >= 2 else 0.0
        fit = dataclasses.replace(fit, d=d, name=f"cpu-{m}")
        pts = [r for r in data["results"] if r.get("model") == m]
        worst = max(abs(fit(r["batch"], r["context"]) / (r["cpu_median_ms"] / 1e3) - 1) for r in pts)
        res["fits"][m] = fit.to_dict() | {"max_rel_error": worst}
        knots = ", ".join(f"{k}:{v * 1e3:.1f}" for k, v in fit.knots)
        print(f"fit {m}: base ms by batch {{{knots}}} c={fit.c * 1e6:.3f} us/(seq*token) d={d * 1e3:.3f} ms/token, "
              f"max rel err {worst:.1%}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
