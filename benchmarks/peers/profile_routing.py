"""Where a routing runtime's sub-server time goes, runtime side alone (diagnostics for routing_vs_vllm.py's cells).

One closed loop of 4*C requests (64 tokens, GSM8K prompts past the ones routing_vs_vllm.py uses first) on the
runtime with routing_vs_vllm.py's settings (torch runner, fp32, 1 thread per sub-server, model m pinned to core m),
the algorithm in calibrated mode at the thresholds given (take them from a results JSON's meta.calibration). Prints
per model: steps, rows per step, time inside runner.run vs the whole step (schedule + forward + sample + route +
sends) vs blocked on sockets. With TOKENPLANE_PROFILE_DIR set, each sub-server runs under cProfile and the top
functions by own time are printed (profiled timings are inflated; use an unprofiled run for the split).

    flock /tmp/bench.lock env PYTHONPATH=. python benchmarks/peers/profile_routing.py r_stitch 4 \\
        '{"switch": 0.9957, "return": 0.9912}' --out benchmarks/routing/results/profile_rstitch_c4

--out PREFIX writes PREFIX.json (the figures, command, load, commit) and PREFIX.md (one table).
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("algorithm")
    ap.add_argument("concurrency", type=int)
    ap.add_argument("thresholds", type=json.loads, help="calibrated thresholds, JSON")
    ap.add_argument("--models-dir", default="/tmp/tokenplane-peer-models")
    ap.add_argument("--out", help="write PREFIX.json and PREFIX.md")
    args = ap.parse_args()
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    from routing_vs_vllm import PAIRS, RATES, load_prompts
    from vllm_http_engine import pin_process

    from tokenplane.engine.sampler import SamplingParams
    from tokenplane.route.runtime import Runtime, RuntimeConfig
    C = args.concurrency
    dirs = [str(Path(args.models_dir) / m) for m in PAIRS["tiny"][0]]
    kw = {"mode": "calibrated", "rates": RATES[args.algorithm][0], "seed": 0, "thresholds": args.thresholds}
    rt = Runtime(RuntimeConfig(models=dirs, algorithm=args.algorithm, algorithm_kwargs=kw, runner="torch",
                               dtype="float32", threads_per_model=1, num_blocks=1024, max_num_batched_tokens=2048,
                               concurrency=C))
    for m, pid in enumerate(rt.pids):
        if pid is not None:
            pin_process(pid, m)
    prompts = load_prompts(600, 256)[500:]

    async def run(ps: list[list[int]], tag: str) -> tuple[float, list[Any]]:
        sem = asyncio.Semaphore(C)

        async def one(p: list[int], i: int) -> Any:
            async with sem:
                return await rt.complete(p, SamplingParams(max_tokens=64, ignore_eos=True), f"{tag}-{i}")
        t = time.perf_counter()
        outs = await asyncio.gather(*(one(p, i) for i, p in enumerate(ps)))
        return time.perf_counter() - t, outs

    try:
        asyncio.run(run(prompts[:4], "warm"))
        before = rt.stats()
        dt, outs = asyncio.run(run(prompts[4:4 + 4 * C], "m"))
        after = rt.stats()
    finally:
        rt.shutdown()
    toks = sum(len(o.token_ids) for o in outs)
    large = sum(sum(o.token_models) for o in outs) / toks
    print(f"{args.algorithm} C={C}: {toks / dt:.1f} tok/s, large share {large:.3f}")
    models = []
    for m, (b, a) in enumerate(zip(before, after)):
        d = {k: a["counters"].get(k, 0) - b["counters"].get(k, 0)
             for k in ("steps", "batched_seqs", "step_time_s", "step_wall_s", "idle_s", "wall_s")}
        n = max(1, d["steps"])
        d.update(rows_per_step=d["batched_seqs"] / n, run_ms_per_step=1e3 * d["step_time_s"] / n,
                 step_ms_per_step=1e3 * d["step_wall_s"] / n,
                 glue_ms_per_step=1e3 * (d["step_wall_s"] - d["step_time_s"]) / n)
        models.append(d)
        print(f"m{m}: steps {d['steps']} rows/step {d['rows_per_step']:.2f} run {d['step_time_s']:.2f}s "
              f"step {d['step_wall_s']:.2f}s idle {d['idle_s']:.2f}s wall {d['wall_s']:.2f}s; ms per step: run "
              f"{d['run_ms_per_step']:.1f}, whole step {d['step_ms_per_step']:.1f}")
    if args.out:
        write(args, C, toks / dt, large, toks, dt, models, load_before, started)
    prof = os.environ.get("TOKENPLANE_PROFILE_DIR")
    if prof:
        time.sleep(2)   # the sub-servers write their profiles as they exit
        for f in sorted(glob.glob(f"{prof}/*.prof")):
            s = io.StringIO()
            pstats.Stats(f, stream=s).sort_stats("tottime").print_stats(25)
            print("==", f)
            print(s.getvalue().split("\n", 6)[-1])


def write(args: argparse.Namespace, C: int, tok_s: float, large: float, toks: int, dt: float,
          models: list[dict[str, Any]], load_before: tuple[float, float, float], started: str) -> None:
    import subprocess
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    cmd = "python " + " ".join(sys.argv)
    res = {"command": cmd, "started": started, "commit": commit, "load_before": load_before,
           "load_after": os.getloadavg(), "algorithm": args.algorithm, "concurrency": C,
           "thresholds": args.thresholds, "requests": 4 * C, "tokens": toks, "seconds": dt, "tok_s": tok_s,
           "large_share": large, "models": models, "profiled": bool(os.environ.get("TOKENPLANE_PROFILE_DIR"))}
    Path(f"{args.out}.json").write_text(json.dumps(res, indent=1))
    lines = [f"# Routing runtime profile: {args.algorithm}, C={C} (runtime side only)", "",
             f"Command: `{cmd}`  ", f"{started}, commit {commit}, load average before {list(load_before)}, after "
             f"{[round(x, 2) for x in res['load_after']]}", "",
             f"{4 * C} requests x 64 tokens: {tok_s:.1f} tok/s, large-model share {large:.3f}.", "",
             "run = inside runner.run (forward + logits); whole step = schedule + run + sample + route + sends; "
             "glue = whole step - run.", "",
             "| model | steps | rows/step | run ms/step | whole step ms/step | glue ms/step | idle s | wall s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m, d in enumerate(models):
        lines.append(f"| m{m} | {d['steps']} | {d['rows_per_step']:.2f} | {d['run_ms_per_step']:.1f} | "
                     f"{d['step_ms_per_step']:.1f} | {d['glue_ms_per_step']:.1f} | {d['idle_s']:.2f} | "
                     f"{d['wall_s']:.2f} |")
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
