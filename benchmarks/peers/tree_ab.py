"""Engine speed of two source trees (before / after a change) on one model: prefill and decode, each tree in its own
process per run, the trees alternated (rotating order) over the repeats, so the shared machine's load drifts over both
alike. Times are process CPU seconds (1 thread), reported as medians and P90 over the runs, with the ratio after /
before of the medians.

A run (one process, `--worker`): the engine built as decode_breakdown.py builds it (LLMEngine, fp32, 1 thread,
enforce_eager, 2,048 tokens a step); prefill: --prefill-trials fresh random prompts of P tokens (distinct in every run:
no prefix-cache hit) prefilled to their first token, CPU seconds per prompt (median of the trials); decode: N requests
of a P-token prompt, then --steps greedy steps, CPU ms per step (median of the steps).

    flock /tmp/bench.lock python benchmarks/peers/tree_ab.py --before /work/main --after . \\
        --model /tmp/tokenplane-peer-models/smollm2-135m --out benchmarks/results/tree_ab_x
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]


def worker(args: argparse.Namespace) -> None:
    import torch

    from tokenplane.engine import LLMEngine, SamplingParams

    rng = random.Random(args.seed)
    out: dict[str, float] = {}
    P, N = args.prompt_len, args.batch
    eng = LLMEngine(args.model, dtype=torch.float32,
                    num_blocks=max(N, 2) * (-(-(P + 4 * args.steps + 64) // 16) + 1) + 8,
                    block_size=16, max_num_seqs=max(N, 2), max_num_batched_tokens=2048, enforce_eager=True,
                    num_threads=1)

    def prompt(n: int) -> list[int]:
        return [rng.randint(10, 29999) for _ in range(n)]

    def drain() -> None:
        while eng.scheduler.running or eng.scheduler.waiting:
            eng.step()

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for _ in range(2):   # warm-up: numba compile / load, allocator
        eng.add_request(prompt(P), one)
        drain()
    if args.prefill_trials:
        cpu = []
        for _ in range(args.prefill_trials):
            eng.add_request(prompt(args.prefill_len), one)
            c0 = time.process_time()
            drain()
            cpu.append(time.process_time() - c0)
        out["prefill_cpu_s"] = statistics.median(cpu)
    params = SamplingParams(temperature=0.0, max_tokens=4 * args.steps + 8, ignore_eos=True)
    for _ in range(N):
        eng.add_request(prompt(P), params)
    while any(s.num_output_tokens < 4 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    steps = []
    for _ in range(args.steps):
        c0 = time.process_time()
        eng.step()
        steps.append((time.process_time() - c0) * 1e3)
    out["decode_cpu_ms"] = statistics.median(steps)
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="/work/main")
    ap.add_argument("--after", default=".")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-len", type=int, default=256, help="decode: prompt tokens")
    ap.add_argument("--batch", type=int, default=1, help="decode: requests decoding together")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prefill-trials", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--core", type=int, default=-1, help="pin the workers to this core (-1: no pinning)")
    ap.add_argument("--out", default="")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    trees = {"before": str(Path(args.before).resolve()), "after": str(Path(args.after).resolve())}
    names = list(trees)
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    loads = [os.getloadavg()[0]]
    here = Path(__file__).resolve()
    for r in range(args.repeats):
        for n in names[r % 2:] + names[:r % 2]:
            cmd = [sys.executable, str(here), "--worker", "--model", args.model, "--prompt-len", str(args.prompt_len),
                   "--batch", str(args.batch), "--steps", str(args.steps), "--prefill-len", str(args.prefill_len),
                   "--prefill-trials", str(args.prefill_trials), "--seed", str(1000 * r + names.index(n))]
            if args.core >= 0:
                cmd = ["taskset", "-c", str(args.core), *cmd]
            env = dict(os.environ, PYTHONPATH=trees[n])
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=trees[n])
            line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
            if res.returncode or not line:
                raise RuntimeError(f"{n} run failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
            runs[n].append(json.loads(line[-1][7:]))
            loads.append(os.getloadavg()[0])
            print(n, runs[n][-1], f"load {loads[-1]:.2f}", flush=True)
    summary: dict[str, dict[str, float]] = {}
    for key in runs["before"][0]:
        b = [x[key] for x in runs["before"]]
        a = [x[key] for x in runs["after"]]
        summary[key] = {"before_median": statistics.median(b), "before_p90": p90(b), "after_median": statistics.median(a),
                        "after_p90": p90(a), "after_over_before": statistics.median(a) / statistics.median(b)}
    res_all = {"command": "python " + " ".join([str(Path(sys.argv[0])), *sys.argv[1:]]), "trees": trees,
               "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model,
               "prompt_len": args.prompt_len, "batch": args.batch, "steps": args.steps,
               "prefill_len": args.prefill_len, "prefill_trials": args.prefill_trials, "repeats": args.repeats,
               "load_min": min(loads), "load_max": max(loads), "runs": runs, "summary": summary}
    print(json.dumps(summary, indent=1))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(res_all, indent=1))
        lines = [f"# Tree A/B: {args.model}, fp32, 1 thread", "",
                 f"{res_all['host']}; {res_all['when']}; load {min(loads):.2f}-{max(loads):.2f}; {args.repeats} runs "
                 f"per tree, alternated; process CPU time; before = {trees['before']}, after = {trees['after']}.", "",
                 f"Command: `{res_all['command']}`", "",
                 "| metric | before median (P90) | after median (P90) | after / before |", "|---|---:|---:|---:|"]
        for key, s in summary.items():
            label = (f"prefill {args.prefill_len} tokens, CPU s" if key == "prefill_cpu_s"
                     else f"decode step N={args.batch} P={args.prompt_len}, CPU ms")
            lines.append(f"| {label} | {s['before_median']:.4g} ({s['before_p90']:.4g}) | {s['after_median']:.4g} "
                         f"({s['after_p90']:.4g}) | {s['after_over_before']:.3f} |")
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
