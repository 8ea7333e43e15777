"""Prefill A/B of two engine options on one model in one process: the residual add fused into the next RMSNorm
(`DecoderModel.fused_norm`, cpu_fused_norm.py) and the last layer's o_proj/MLP/final norm computed for the sampled rows
only (`DecoderModel.prune_rows`). Four variants (both off = the previous engine, each alone, both on), run in a
rotating order within each repeat, so the shared machine's load drifts over all of them alike.

A run: N fresh random prompts of P tokens, distinct for every run (no prefix-cache hits), prefilled through ModelRunner.run in steps of at
most --budget tokens (whole prompts per step, as the scheduler's chunked prefill does for P <= budget; a longer prompt
takes ceil(P / budget) chunks), timed around the steps. Reported: medians and P90 of prefill tok/s per variant, the
ratio to the baseline's median, and max |logit diff| of each variant's last-position logits vs the baseline's (one
untimed run per variant on the same prompts, each on a fresh runner so no prefix-cache hit shortens it).

    PYTHONPATH=. flock /tmp/bench.lock python benchmarks/peers/prefill_ab.py --cells 256x1 256x8 2048x1
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from tokenplane.engine import ModelRunner, Sequence, load_model

RESULTS = Path(__file__).resolve().parents[1] / "results"
# (fused_norm, prune_rows, ModelRunner.prefill_kernel): "both_sdpa_prefill" is "both" with multi-token rows on SDPA's
# flash kernel instead of the compiled prefill kernels (cpu_prefill_attention, its AMX form for bf16)
VARIANTS = {"baseline": (False, False, "auto"), "fused_norm": (True, False, "auto"), "prune_rows": (False, True, "auto"),
            "both": (True, True, "auto"), "both_sdpa_prefill": (True, True, "varlen")}


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]


def run_once(runner: ModelRunner, model: torch.nn.Module, variant: str, P: int, N: int, budget: int,
             seed: int, vocab: int) -> tuple[float, float, torch.Tensor]:
    fused, prune, kernel = VARIANTS[variant]
    model.model.fused_norm, model.model.prune_rows = fused, prune
    if not hasattr(runner, "ab_built_kernel"):     # what the runner chose where it could ("varlen" if nothing else)
        runner.ab_built_kernel = runner.prefill_kernel  # type: ignore[attr-defined]
    runner.prefill_kernel = "varlen" if kernel == "varlen" else runner.ab_built_kernel  # type: ignore[attr-defined]
    rng = random.Random(seed)
    seqs = [Sequence(f"{variant}-{seed}-{i}", [rng.randint(10, min(vocab, 32000) - 1) for _ in range(P)])
            for i in range(N)]
    for s in seqs:
        if not runner.prepare(s):
            raise RuntimeError("KV pool too small")
    per_step = max(1, budget // P)
    chunk = min(P, budget)
    logits = []
    t0, c0 = time.perf_counter(), time.process_time()
    for g in range(0, N, per_step):
        group = seqs[g:g + per_step]
        while group[0].num_computed_tokens < P:
            out = runner.run(group, [chunk] * len(group))
        logits.append(out.logits)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    for s in seqs:
        runner.free(s)
    return dt, dc, torch.cat(logits)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--cells", nargs="+", default=["256x1", "256x8", "2048x1"], help="PxN")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--baseline", default="baseline", choices=list(VARIANTS), help="the variant ratios are taken to")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--core", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "prefill_ab"))
    args = ap.parse_args(argv)
    if args.core >= 0:
        os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(args.threads)
    cfg, model = load_model(args.model, dtype=getattr(torch, args.dtype), seed=0)
    cells = [tuple(int(v) for v in c.split("x")) for c in args.cells]
    # A ModelRunner binds the model's attention layers to its own KV cache, so each phase builds its runner last.
    warm = ModelRunner(model, cfg, num_blocks=64, block_size=16)
    run_once(warm, model, "both", 64, 2, args.budget, 0, cfg.vocab_size)   # warm-up: numba compile, oneDNN
    run_once(warm, model, "baseline", 64, 2, args.budget, 0, cfg.vocab_size)
    run_once(warm, model, "both", 512, 1, args.budget, 0, cfg.vocab_size)   # a row long enough for every kernel
    del warm
    base = args.baseline
    names = [base] + [v for v in args.variants if v != base]
    res: dict = {"command": "python " + " ".join(["benchmarks/peers/prefill_ab.py", *(argv or sys.argv[1:])]),
                 "host": f"{platform.machine()}, {os.cpu_count()} CPUs", "model": args.model,
                 "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": args.threads,
                 "core": args.core, "budget": args.budget, "repeats": args.repeats, "dtype": args.dtype,
                 "baseline": base, "cells": []}
    for P, N in cells:
        secs: dict[str, list[float]] = {v: [] for v in names}
        cpu: dict[str, list[float]] = {v: [] for v in names}
        diff: dict[str, float] = {v: 0.0 for v in names}
        load0 = os.getloadavg()[0]
        logits = {}
        for v in names:   # same prompts for every variant: a fresh runner each, so no prefix-cache hit
            fresh = ModelRunner(model, cfg, num_blocks=P * N // 16 + 64, block_size=16)
            logits[v] = run_once(fresh, model, v, P, N, args.budget, 7, cfg.vocab_size)[2]
            del fresh
        for v in names:
            diff[v] = (logits[v] - logits[base]).abs().max().item()
        runner = ModelRunner(model, cfg, num_blocks=P * N // 16 + 64, block_size=16)
        for r in range(args.repeats):
            order = names[r % len(names):] + names[:r % len(names)]
            for v in order:   # distinct prompts for every run
                seed = 1000 * (r + 1) + names.index(v)
                dt, dc, _ = run_once(runner, model, v, P, N, args.budget, seed, cfg.vocab_size)
                secs[v].append(dt)
                cpu[v].append(dc)
        del runner
        tok = {v: [P * N / s for s in secs[v]] for v in names}
        med = {v: statistics.median(tok[v]) for v in names}
        cpu_med = {v: statistics.median(P * N / c for c in cpu[v]) for v in names}
        cell = {"P": P, "N": N, "tok_s": tok, "median_tok_s": med, "p90_seconds": {v: p90(secs[v]) for v in names},
                "ratio_vs_baseline": {v: med[v] / med[base] for v in names}, "cpu_seconds": cpu,
                "cpu_ratio_vs_baseline": {v: cpu_med[v] / cpu_med[base] for v in names},
                "max_abs_logit_diff_vs_baseline": diff, "load_before": load0, "load_after": os.getloadavg()[0]}
        res["cells"].append(cell)
        print(json.dumps({k: cell[k] for k in ("P", "N", "median_tok_s", "ratio_vs_baseline",
                                               "cpu_ratio_vs_baseline")}), flush=True)
    write(res, Path(args.out))
    return 0


def write(res: dict, prefix: Path) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(res, indent=1))
    names = list(res["cells"][0]["median_tok_s"]) if res["cells"] else list(VARIANTS)
    base = res.get("baseline", "baseline")
    lines = [f"# Prefill A/B, {res['model']} {res.get('dtype', 'float32')}, {res['threads']} thread, core {res['core']}",
             "",
             f"{res['host']}; {res['when']}; medians (P90 of seconds) of {res['repeats']} repeats, variants in "
             f"rotating order; ratios of wall-clock medians (of process CPU time); budget {res['budget']} tokens/step.", "", f"Command: `{res['command']}`", "",
             "| P | N | " + " | ".join(f"{v} tok/s" for v in names) + " | " + " | ".join(f"{v} / {base} (cpu)"
                                                                              for v in names[1:])
             + f" | max logit diff vs {base} | load |",
             "|---:|---:|" + "---:|" * (2 * len(names) - 1) + "---:|---|"]
    for c in res["cells"]:
        lines.append(f"| {c['P']} | {c['N']} | "
                     + " | ".join(f"{c['median_tok_s'][v]:.0f} ({c['p90_seconds'][v]:.2f} s)" for v in names) + " | "
                     + " | ".join(f"{c['ratio_vs_baseline'][v]:.3f} ({c['cpu_ratio_vs_baseline'][v]:.3f})"
                                  for v in names[1:]) + " | "
                     + f"{max(c['max_abs_logit_diff_vs_baseline'].values()):.1e} | "
                     + f"{c['load_before']:.1f}->{c['load_after']:.1f} |")
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / (len(names) - 1)
    for k, v in enumerate(names[1:]):
        ax.bar([i + k * width for i in range(len(res["cells"]))],
               [c["ratio_vs_baseline"][v] for c in res["cells"]], width, label=v)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + width for i in range(len(res["cells"]))], [f"P{c['P']} N{c['N']}" for c in res["cells"]])
    ratios = [c["ratio_vs_baseline"][v] for c in res["cells"] for v in names[1:]]
    ax.set_ylim(min(0.9, min(ratios) - 0.05), max(1.1, max(ratios) + 0.05))
    ax.set_ylabel(f"prefill tok/s vs {base}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(prefix.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
