"""How far the routing runtime's model steps are from one core's memory floor, and the bound that puts on its ratio
to stock vLLM (issue 16).

A decode step reads every weight of the model once (the vocabulary projection most of all: tiny-small's 151936 x 256
float32 matrix is 155 MB of its 168), so on one core a step cannot take less than its weight bytes divided by the
rate at which that core streams memory. In one process pinned to one CPU, one thread:

  read    the core's streaming read rate: a compiled sum over a 256 MB float32 array, reassociated into vector
          accumulators (no dependency chain, no write stream), cold every time; median and best of `--reads`
  weights the bytes a decode step reads: every parameter but the embedding table, of which a step reads B rows
  step    the torch engine's decode step at each batch size (engine_decode.py's set-up and timing: B one-token
          sequences at a 128-token context, sampling excluded), median of `--repeats`
  floor   weights / the fastest stream seen: the best read rate, or the engine's own batch-1 step where it streams
          faster (weights / its shortest step: it prefetches, the plain sum does not); `floor share` = floor / step

With `--record` (a routing_vs_vllm.py JSON), each cell gets the most the runtime could reach if a model's step took
only its floor: model m, busy a share b_m of the run at t_m ms a step, limits the runtime to tok/s x (t_m / floor_m)
/ b_m (the throughput at which it would be busy all the time at its floor, the same work per token and the same
batch shapes assumed), and the smallest of these over the models, divided by the baseline's tok/s, bounds the
ratio. The floor is a lower bound on a step (compute not counted), so the bound is an upper one.

    flock /tmp/bench.lock taskset -c 1 python benchmarks/routing/step_floor.py \\
        --record benchmarks/routing/results/vs_vllm_xeon_rstitch_stop57.json --out benchmarks/routing/results/step_floor
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from engine_decode import measure  # noqa: E402

from tokenplane.engine import load_model  # noqa: E402

READ_MB = 256


def _read_kernel():  # noqa: ANN202
    from numba import njit

    @njit(cache=False, nogil=True, fastmath=True)
    def read_sum(a):  # noqa: ANN001, ANN202
        s = np.float32(0.0)
        for i in range(a.shape[0]):     # fastmath: LLVM splits the sum over vector accumulators (no chain)
            s += a[i]
        return s

    return read_sum


def read_rate(runs: int) -> list[float]:
    """GB/s of `runs` cold passes over a READ_MB array (a 64 MB write between passes evicts it)."""
    a = np.random.default_rng(0).random(READ_MB * (1 << 20) // 4, dtype=np.float32)
    sweep = np.zeros(64 << 20, np.uint8)
    fn = _read_kernel()
    fn(a[:1024])
    out = []
    for _ in range(runs):
        sweep += 1
        t0 = time.perf_counter()
        fn(a)
        out.append(a.nbytes / (time.perf_counter() - t0) / 1e9)
    return out


def step_bytes(model: torch.nn.Module, batch: int) -> int:
    """Bytes of the weights one decode step of `batch` rows reads: every parameter once, the embedding's B rows."""
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            total += batch * p.shape[-1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def bounds(record: dict, floors: dict[str, float]) -> list[dict]:
    """Per cell of a routing_vs_vllm record: the ratio bound of the module docstring."""
    models = record["meta"]["models"]
    out = []
    for cell in record["cells"]:
        ours = cell["summary"]["tokenplane"]
        for base in cell["baselines"]:
            summ = cell["summary"][base]
            per = []
            for m, pm in enumerate(ours["per_model"]):
                t, b = pm["ms_per_step"], pm["busy_share"]
                cap = ours["tok_s_median"] * (t / floors[models[m]]) / max(b, 1e-9)
                per.append({"model": models[m], "ms_per_step": t, "busy_share": b, "mean_batch": pm["mean_batch"],
                            "floor_ms": floors[models[m]], "tok_s_cap": cap})
            cap = min(p["tok_s_cap"] for p in per)
            out.append({"algorithm": cell["algorithm"], "concurrency": cell["concurrency"], "baseline": base,
                        "ratio": ours["tok_s_median"] / summ["tok_s_median"], "tok_s": ours["tok_s_median"],
                        "baseline_tok_s": summ["tok_s_median"], "baseline_per_model": summ["per_model"],
                        "ratio_bound": cap / summ["tok_s_median"], "models": per})
    return out


def markdown(res: dict) -> str:
    m = res["meta"]
    rates = res["read_gbps"]
    lines = ["# Model steps against one core's memory floor", "",
             f"Command: `{m['command']}`  ", f"{m['host']}; {m['when']}; CPU {m['cpu']}, 1 thread; load average "
             f"{m['load_start']} at start, {m['load_end']} at end; {m['elapsed_s']:.0f} s.", "",
             f"Streaming read, one core, {READ_MB} MB cold, {len(rates)} runs: median {statistics.median(rates):.2f}"
             f" GB/s, best {max(rates):.2f}; the engine's batch-{min(r['batch'] for r in res['steps'])} step streamed "
             f"its weights at up to {res['engine_stream_gbps']:.2f} GB/s; floors below at the faster, "
             f"**{res['floor_gbps']:.2f} GB/s**.", "",
             "| model | batch | weights read (MB) | floor ms | step ms (median) | step P90 | floor share |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["steps"]:
        lines.append(f"| {r['model']} | {r['batch']} | {r['bytes'] / 1e6:.1f} | {r['floor_ms']:.2f} | "
                     f"{r['median_ms']:.2f} | {r['p90_ms']:.2f} | {r['floor_ms'] / r['median_ms']:.2f} |")
    if res.get("bounds"):
        lines += ["", f"Bound on the ratio from `{m['record']}` (module docstring: each model's measured step and busy "
                  "share in that run, its floor from this run):", "",
                  "| algorithm | C | baseline | measured ratio | runtime tok/s | per model: ms/step, busy, floor, "
                  "tok/s cap | ratio bound |", "|---|---:|---|---:|---:|---|---:|"]
        for b in res["bounds"]:
            per = "; ".join(f"{p['model']} {p['ms_per_step']:.1f} ms, {p['busy_share']:.0%}, floor "
                            f"{p['floor_ms']:.1f}, cap {p['tok_s_cap']:.0f}" for p in b["models"])
            lines.append(f"| {b['algorithm']} | {b['concurrency']} | {b['baseline']} | {b['ratio']:.2f} | "
                         f"{b['tok_s']:.1f} | {per} | **{b['ratio_bound']:.2f}** |")
    return "\n".join(lines) + "\n"


def png(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name in sorted({r["model"] for r in res["steps"]}):
        rows = [r for r in res["steps"] if r["model"] == name]
        xs = [r["batch"] for r in rows]
        ax.plot(xs, [r["median_ms"] for r in rows], "o-", label=f"{name} step")
        ax.plot(xs, [r["floor_ms"] for r in rows], "--", label=f"{name} floor")
    ax.set_xlabel("batch (rows)")
    ax.set_ylabel("ms")
    ax.set_title(f"decode step vs memory floor ({res['floor_gbps']:.1f} GB/s, 1 core)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-small", "tiny-large"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 12])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reads", type=int, default=9)
    ap.add_argument("--cpu", type=int, default=1)
    ap.add_argument("--record", type=Path, default=None, help="a routing_vs_vllm.py JSON to bound")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "routing" / "results" / "step_floor")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    t0, load0 = time.time(), os.getloadavg()
    rates = read_rate(args.reads)
    print(f"read: median {statistics.median(rates):.2f} GB/s, best {max(rates):.2f}", flush=True)
    steps = []
    for name in args.models:
        cfg, model = load_model(name, dtype=torch.float32, seed=0)
        for batch in args.batches:
            r = measure(model, cfg, batch, 128, args)
            row = {"model": name, "batch": batch, "bytes": step_bytes(model, batch), "median_ms": r["median_ms"],
                   "p90_ms": r["p90_ms"], "min_ms": r["min_ms"], "kernel": r["kernel"]}
            steps.append(row)
            print(f"{name} batch {batch}: {r['median_ms']:.2f} ms", flush=True)
        del model
    engine_rate = max(r["bytes"] / r["min_ms"] / 1e6 for r in steps if r["batch"] == min(args.batches))
    best = max(max(rates), engine_rate)
    for r in steps:
        r["floor_ms"] = r["bytes"] / best / 1e6
    floors = {r["model"]: r["floor_ms"] for r in steps if r["batch"] == min(args.batches)}
    res: dict = {"meta": {"command": "python " + " ".join(sys.argv), "host": f"{platform.machine()}, "
                          f"{os.cpu_count()} CPUs", "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
                          "cpu": args.cpu, "load_start": [round(x, 2) for x in load0],
                          "load_end": [round(x, 2) for x in os.getloadavg()], "elapsed_s": time.time() - t0,
                          "record": str(args.record) if args.record else None, "torch": torch.__version__},
                 "read_gbps": rates, "engine_stream_gbps": engine_rate, "floor_gbps": best, "steps": steps,
                 "floors_ms": floors}
    if args.record:
        # the record's models are paths or names; map them to this run's names by their last path part
        rec = json.loads(args.record.read_text())
        rec["meta"]["models"] = [Path(m).name for m in rec["meta"]["models"]]
        res["bounds"] = bounds(rec, floors)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    args.out.with_suffix(".md").write_text(markdown(res))
    png(res, args.out.with_suffix(".png"))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
