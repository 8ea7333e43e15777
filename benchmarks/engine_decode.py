"""Decode-step latency of the torch engine on this CPU: batch size x context length x model.

A decode step = ModelRunner.run() over B sequences that each add one token (one token batch, varlen attention over
the paged cache, logits only at the last positions, sampling excluded). The KV cache is filled with random values
rather than computed by a prefill: step latency does not depend on the values, and prefilling 16 x 512 tokens per
point would dominate the run. Each point: `--warmup` steps, then `--repeats` timed steps; median and P90 reported.
Sequences are rolled back (BlockManager.truncate) after each point, so the context stays within `repeats` tokens
of nominal.

    python benchmarks/engine_decode.py                      # ~3-4 min on 2 vCPUs
    python benchmarks/engine_decode.py --repeats 5 --batches 1 4 --contexts 128 --models test-small  # smoke

Writes benchmarks/results/engine_decode.{json,md,png}.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenplane.engine import ModelRunner, Sequence, load_model  # noqa: E402
from tokenplane.engine.loader import resolve_config  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def make_runner(model, cfg, batch: int, context: int, extra: int, kernel: str, block_size: int = 16):
    per_seq = -(-(context + extra) // block_size) + 1
    runner = ModelRunner(model, cfg, num_blocks=batch * per_seq, block_size=block_size, decode_kernel=kernel)
    runner.kv_cache.normal_(0, 1, generator=torch.Generator().manual_seed(0))
    return runner


def add_seqs(runner: ModelRunner, batch: int, context: int, extra: int, consecutive: bool) -> list[Sequence]:
    """Sequences whose first `context` tokens count as computed. consecutive=True pre-allocates every block a
    sequence will need, so its block table is one run of ids (the attention reads a slice); otherwise blocks are
    allocated as decoding needs them, interleaved across sequences (the attention gathers), as in serving."""
    seqs = []
    for i in range(batch):
        n = context + extra if consecutive else context
        s = Sequence(f"s{i}", [(i * 7919 + t) % 500 for t in range(n)])
        runner.block_manager.allocate(s)
        del s.token_ids[context:]
        s.num_computed_tokens = context
        seqs.append(s)
    return seqs


def time_steps(runner: ModelRunner, seqs: list[Sequence], warmup: int, repeats: int
               ) -> tuple[list[float], list[float]]:
    """-> (wall ms, process CPU ms) per timed step. With one thread, CPU time approximates the wall time of an idle
    machine; on a shared one the wall time includes waiting for a core."""
    times, cpu = [], []
    for step in range(warmup + repeats):
        for s in seqs:
            s.append_token((s.token_ids[-1] + 1) % 500)
            runner.prepare(s)
        t0, c0 = time.perf_counter(), time.process_time()
        runner.run(seqs)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if step >= warmup:
            times.append(dt * 1e3)
            cpu.append(dc * 1e3)
    return times, cpu


def measure(model, cfg, batch: int, context: int, args, kernel: str = "auto", consecutive: bool = False) -> dict:
    extra = args.warmup + args.repeats
    runner = make_runner(model, cfg, batch, context, extra, kernel)
    kernel = runner.decode_kernel   # what "auto" chose
    seqs = add_seqs(runner, batch, context, extra, consecutive)
    times, cpu = time_steps(runner, seqs, args.warmup, args.repeats)
    return {"batch": batch, "context": context, "kernel": kernel, "consecutive_blocks": consecutive,
            "median_ms": statistics.median(times), "p90_ms": percentile(times, 0.9), "min_ms": min(times),
            "cpu_median_ms": statistics.median(cpu), "cpu_p90_ms": percentile(cpu, 0.9),
            "mean_ms": statistics.fmean(times), "repeats": len(times), "samples_ms": [round(t, 3) for t in times]}


def measure_catch_up(model, cfg, context: int, k: int, args) -> dict:
    """One sequence with `context` computed tokens computes k new ones (a peer's tokens or a prompt chunk) and is
    rolled back after each timed run. Keyed "seqs", not "batch", so decode-only fits skip these rows."""
    bs = 16
    context -= context % bs  # block aligned: the rollback keeps num_computed_tokens = context exactly
    runner = make_runner(model, cfg, 1, context, k, args.kernels[0])
    (seq,) = add_seqs(runner, 1, context, 0, False)
    times, cpu = [], []
    for step in range(args.warmup + args.repeats):
        seq.token_ids.extend((seq.token_ids[-1] + 1 + j) % 500 for j in range(k))
        runner.prepare(seq)
        t0, c0 = time.perf_counter(), time.process_time()
        runner.run([seq])
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        runner.block_manager.truncate(seq, context)
        if seq.num_computed_tokens != context:
            raise RuntimeError("rollback lost computed tokens")
        if step >= args.warmup:
            times.append(dt * 1e3)
            cpu.append(dc * 1e3)
    return {"seqs": 1, "context": context, "extra_tokens": k - 1, "new_tokens": k,
            "median_ms": statistics.median(times), "p90_ms": percentile(times, 0.9),
            "cpu_median_ms": statistics.median(cpu), "cpu_p90_ms": percentile(cpu, 0.9), "repeats": len(times)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-small", "tiny-large"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--contexts", nargs="+", type=int, default=[128, 512])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--kernels", nargs="+", default=["auto"], choices=["auto", "cpu", "varlen", "padded"],
                    help="decode attention kernel(s) of the main table, measured back to back at each point "
                         "(auto: cpu for CPU float32)")
    ap.add_argument("--no-kernel-compare", action="store_true",
                    help="skip the cpu / varlen-gather / varlen-slice / padded comparison on the first model")
    ap.add_argument("--catch-up", nargs="*", type=int, default=[1, 4, 16, 64, 256],
                    help="new tokens per run for the one-sequence catch-up/prefill sweep at the largest context")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--name", default="engine_decode")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    load_before = os.getloadavg()
    rows, compare, catch_up = [], [], []
    for name in args.models:
        cfg, model = load_model(name, dtype=torch.float32, seed=0)
        for context in args.contexts:
            for batch in args.batches:
                for kernel in args.kernels:
                    r = {"model": name, **measure(model, cfg, batch, context, args, kernel)}
                    rows.append(r)
                    print(f"{name:11s} ctx {context:4d} batch {batch:3d} {r['kernel']:6s}: median "
                          f"{r['median_ms']:8.2f} ms p90 {r['p90_ms']:8.2f} ms  cpu median {r['cpu_median_ms']:8.2f} ms",
                          flush=True)
        if name == args.models[0] and not args.no_kernel_compare:
            context = max(args.contexts)
            for batch in sorted({args.batches[0], args.batches[-1], args.batches[len(args.batches) // 2]}):
                for kernel, consecutive in (("cpu", False), ("varlen", False), ("varlen", True), ("padded", False)):
                    r = {"model": name, **measure(model, cfg, batch, context, args, kernel, consecutive)}
                    compare.append(r)
                    print(f"  kernel {kernel:6s} consecutive={consecutive!s:5s} ctx {context} batch {batch:3d}: "
                          f"median {r['median_ms']:8.2f} ms cpu {r['cpu_median_ms']:8.2f} ms", flush=True)
        for k in args.catch_up:
            r = {"model": name, **measure_catch_up(model, cfg, max(args.contexts), k, args)}
            catch_up.append(r)
            print(f"  catch-up {k:4d} new tokens at ctx {r['context']}: median {r['median_ms']:8.2f} ms "
                  f"cpu {r['cpu_median_ms']:8.2f} ms", flush=True)
        del model
    meta = {"threads": args.threads, "kernels": args.kernels, "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "processor": platform.processor(), "torch": torch.__version__, "dtype": "float32",
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "wall_s": round(time.time() - t_start, 1),
            "warmup": args.warmup, "block_size": 16,
            "models": {m: dataclasses.asdict(resolve_config(m)[0]) for m in args.models},
            "note": "KV filled with random values; step = runner.run() of B one-token sequences, sampling excluded; "
                    "wall-clock on a shared machine: see loadavg."}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "results": rows, "kernel_compare": compare,
                                                            "catch_up": catch_up},
                                                           indent=1))
    write_markdown(args.out / f"{args.name}.md", meta, rows, compare, catch_up)
    write_png(args.out / f"{args.name}.png", rows, meta, catch_up)
    print(f"wrote {args.out / args.name}.{{json,md,png}} in {meta['wall_s']} s")
    return 0


def write_markdown(path: Path, meta: dict, rows: list[dict], compare: list[dict], catch_up: list[dict] = ()) -> None:
    lines = [f"# Engine decode step latency (CPU, {meta['threads']} thread(s), float32)", "",
             f"torch {meta['torch']}, {meta['cpu_count']} CPUs, load average before/after "
             f"{meta['loadavg_before'][0]:.1f}/{meta['loadavg_after'][0]:.1f} (shared machine), "
             f"{rows[0]['repeats'] if rows else 0} timed steps per point after {meta['warmup']} warm-up steps. "
             "KV cache filled with random values; one step = `ModelRunner.run()` of B one-token sequences "
             "(sampling excluded).", "",
             "CPU ms = process CPU time per step (all threads); with 1 thread it approximates an idle machine's "
             "wall time, which a loaded shared machine's wall time does not.", "",
             "Kernel: decode attention (`cpu` = one compiled call per layer for all rows, K/V read in place by block "
             "table; `varlen` = one SDPA per sequence over its gathered blocks).", "",
             "| model | context | batch | kernel | median ms | P90 ms | min ms | CPU median ms | CPU P90 ms |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['context']} | {r['batch']} | {r['kernel']} | {r['median_ms']:.2f} | "
                     f"{r['p90_ms']:.2f} | "
                     f"{r['min_ms']:.2f} | {r['cpu_median_ms']:.2f} | {r['cpu_p90_ms']:.2f} |")
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    if len(kernels) > 1:
        base = kernels[-1]
        lines += ["", f"Speed-up over `{base}` (its median step time / the other kernel's, same point, measured back to "
                  "back):", "", "| model | context | batch | kernel | speed-up (wall) | speed-up (CPU time) |",
                  "|---|---:|---:|---|---:|---:|"]
        ref = {(r["model"], r["context"], r["batch"]): r for r in rows if r["kernel"] == base}
        for r in rows:
            b = ref.get((r["model"], r["context"], r["batch"]))
            if r["kernel"] != base and b:
                lines.append(f"| {r['model']} | {r['context']} | {r['batch']} | {r['kernel']} | "
                             f"{b['median_ms'] / r['median_ms']:.2f} | {b['cpu_median_ms'] / r['cpu_median_ms']:.2f} |")
    if compare:
        lines += ["", "Attention layout comparison (same model, largest context): `cpu` = one compiled call per layer "
                  "for all rows, K/V read in place by block table; `varlen` = one SDPA per sequence, "
                  "gathering its blocks (or slicing them when consecutive); `padded` = one masked SDPA over the "
                  "padded batch (the CUDA-graph kernel).", "",
                  "| model | context | batch | kernel | consecutive blocks | median ms | P90 ms | CPU median ms |",
                  "|---|---:|---:|---|---|---:|---:|---:|"]
        for r in compare:
            lines.append(f"| {r['model']} | {r['context']} | {r['batch']} | {r['kernel']} | "
                         f"{r['consecutive_blocks']} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | "
                         f"{r['cpu_median_ms']:.2f} |")
    if catch_up:
        lines += ["", "Catch-up / prefill: one sequence with `context` computed tokens computes k new tokens in one run "
                  "(a peer's tokens, or a prompt), logits at the last one only.", "",
                  "| model | context | new tokens k | median ms | P90 ms | CPU median ms |", "|---|---:|---:|---:|---:|---:|"]
        for r in catch_up:
            lines.append(f"| {r['model']} | {r['context']} | {r['new_tokens']} | {r['median_ms']:.2f} | "
                         f"{r['p90_ms']:.2f} | {r['cpu_median_ms']:.2f} |")
    path.write_text("\n".join(lines) + "\n")


def write_png(path: Path, rows: list[dict], meta: dict, catch_up: list[dict] = ()) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    contexts = sorted({r["context"] for r in rows})
    ncols = len(contexts) + (1 if catch_up else 0)
    fig, axes = plt.subplots(1, ncols, figsize=(5 * ncols, 4), squeeze=False)
    if catch_up:
        ax = axes[0][-1]
        for model in dict.fromkeys(r["model"] for r in catch_up):
            pts = [r for r in catch_up if r["model"] == model]
            ax.plot([r["new_tokens"] for r in pts], [r["median_ms"] for r in pts], marker="o", label=f"{model} wall")
            ax.plot([r["new_tokens"] for r in pts], [r["cpu_median_ms"] for r in pts], ls="--", marker=".",
                    label=f"{model} CPU time")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("new tokens in one run (1 sequence)")
        ax.set_ylabel("run latency, ms (median)")
        ax.set_title(f"catch-up at context {catch_up[0]['context']}")
        ax.grid(alpha=0.3)
        ax.legend()
    for ax, ctx in zip(axes[0], contexts):
        for model, kernel in dict.fromkeys((r["model"], r["kernel"]) for r in rows):
            pts = [r for r in rows if r["model"] == model and r["kernel"] == kernel and r["context"] == ctx]
            xs = [r["batch"] for r in pts]
            med = [r["median_ms"] for r in pts]
            p90 = [r["p90_ms"] - r["median_ms"] for r in pts]
            line = ax.errorbar(xs, med, yerr=[[0] * len(pts), p90], marker="o", capsize=3,
                               label=f"{model} {kernel} wall")
            ax.plot(xs, [r["cpu_median_ms"] for r in pts], ls="--", marker=".", color=line[0].get_color(),
                    label=f"{model} {kernel} CPU time")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode step latency, ms (median, bar to P90)")
        ax.set_title(f"context {ctx}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"tokenplane engine decode step, CPU, {meta['threads']} thread(s), fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
