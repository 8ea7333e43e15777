"""One layer's prefill attention on CPU (fp32 or bf16, 1 thread): tokenplane's paged kernel vs PyTorch's flash SDPA.

Per case: the compiled kernel (tokenplane/engine/cpu_prefill_attention.py) reading K/V in place from a paged cache
through a block table, and the varlen path it replaces (attention.py: one SDPA call with 4-D inputs, enable_gqa, causal
without a mask for a whole prompt, with a [q_len, context] mask for a chunk after cached context), over the same
values. SDPA gets its K/V as a slice (consecutive blocks, the varlen path's best case, no gather); the kernel reads them
through the block table (here consecutive too). The two alternate call by call; wall and CPU-time (thread) medians and
P90 over `--repeats` calls each after one warm-up call. Shapes: the models' attention (heads / KV heads / head_dim).

    flock /tmp/bench.lock python benchmarks/prefill_attention.py            # ~2 min on this machine
    python benchmarks/prefill_attention.py --tokens 256 --repeats 3          # smoke
    python benchmarks/prefill_attention.py --dtype bfloat16 --name prefill_attention_bf16
                        # bf16 caches: the AMX kernel on an AMX host, else the 16-lane kernel's widening loads

    python benchmarks/prefill_attention.py --baseline-tree /tmp/old --models smollm2-135m --tokens 256 2048
                        # also another tree's kernel (its cpu_prefill_attention.py loaded beside this one's, the
                        # helpers it imports from this tree), alternated in the same loop: a before/after of a kernel
                        # change in one process, with its outputs compared bit for bit

Writes benchmarks/results/prefill_attention.{json,md,png}.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenplane.engine import cpu_prefill_attention  # noqa: E402
from tokenplane.engine.attention import causal_mask  # noqa: E402
from tokenplane.engine.config import PRESETS  # noqa: E402
from tokenplane.engine.cpu_prefill_attention import paged_prefill  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {   # SmolLM2-135M is not a preset here (its config comes from the checkpoint): 9 heads / 3 KV heads / 64
    "smollm2-135m": (9, 3, 64),
    **{name: (PRESETS[name]["num_attention_heads"], PRESETS[name]["num_key_value_heads"], PRESETS[name]["head_dim"])
       for name in ("tiny-large", "tiny-small")},
}


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def baseline_module(tree: Path) -> Any:
    """Another tree's cpu_prefill_attention.py as a module of its own (its imports resolve in this tree)."""
    spec = importlib.util.spec_from_file_location("baseline_prefill_attention",
                                                  tree / "tokenplane" / "engine" / "cpu_prefill_attention.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def case(model: str, q_len: int, context: int, repeats: int, block_size: int = 16,
         dtype: torch.dtype = torch.float32, baseline: Any = None) -> dict:
    heads, kvh, d = SHAPES[model]
    group = heads // kvh
    g = torch.Generator().manual_seed(q_len * 7 + context)
    nblk = -(-context // block_size)
    kc = torch.randn(kvh, nblk * block_size, d, generator=g).to(dtype)
    vc = torch.randn(kvh, nblk * block_size, d, generator=g).to(dtype)
    q = torch.randn(q_len, heads, d, generator=g).to(dtype)
    scale = d ** -0.5
    out = torch.empty(q_len, heads * d, dtype=dtype)
    table = np.arange(nblk, dtype=np.int64)[None]
    starts, lens, ctxs = (np.array([x], dtype=np.int64) for x in (0, q_len, context))
    mask = causal_mask(q_len, context, q.device) if q_len < context else None

    def kernel() -> torch.Tensor:
        paged_prefill(q, kc, vc, starts, lens, ctxs, table, out, block_size, group, scale)
        return out

    def sdpa() -> torch.Tensor:
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc[None, :, :context], vc[None, :, :context],
                                           attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1).reshape(q_len, -1)

    def kernel_with(flag: list[bool]):  # noqa: ANN202 - the kernel with a one-item switch list turned off
        def run() -> torch.Tensor:
            saved = flag[0]
            flag[0] = False
            try:
                return kernel()
            finally:
                flag[0] = saved
        return run

    kernel_8lane = kernel_with(cpu_prefill_attention.WIDE)      # the 8-lane passes where 16 lanes are the default
    kernel_fma = kernel_with(cpu_prefill_attention.PAIRS)       # bf16: the FMA score pass instead of bf16 pairs

    diff = (kernel().float() - sdpa().float()).abs().max().item()   # also the warm-up call of each
    systems = [("kernel", kernel), ("sdpa", sdpa)]
    if baseline is not None:
        out_b = torch.empty_like(out)

        def base() -> torch.Tensor:
            baseline.paged_prefill(q, kc, vc, starts, lens, ctxs, table, out_b, block_size, group, scale)
            return out_b
        baseline_equal = bool(torch.equal(base(), kernel()))
        systems.append(("baseline", base))
    if cpu_prefill_attention.WIDE[0] and d % 32 == 0 and dtype == torch.float32:
        wide_out = kernel().clone()
        systems.append(("kernel_8lane", kernel_8lane))
        lanes_equal = bool(torch.equal(kernel_8lane(), wide_out))
    pairs = (dtype == torch.bfloat16 and cpu_prefill_attention.PAIRS[0]
             and not cpu_prefill_attention.amx.applies(d, group, block_size))
    if pairs:
        pairs_out = kernel().clone()
        systems.append(("kernel_fma", kernel_fma))
        same_as_fma = (kernel_fma() == pairs_out).float().mean().item()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in systems}
    for _ in range(repeats):
        for name, fn in systems:
            w, c = time.perf_counter(), time.thread_time()
            fn()
            times[name].append((time.perf_counter() - w, time.thread_time() - c))
    row: dict = {"model": model, "dtype": str(dtype).removeprefix("torch."), "heads": heads, "kv_heads": kvh,
                 "head_dim": d, "q_len": q_len, "context": context, "max_abs_diff": diff}
    for name, ts in times.items():
        wall = [t[0] * 1e3 for t in ts]
        cpu = [t[1] * 1e3 for t in ts]
        row[name] = {"median_ms": statistics.median(wall), "p90_ms": percentile(wall, 0.9),
                     "cpu_median_ms": statistics.median(cpu), "cpu_p90_ms": percentile(cpu, 0.9)}
    if "kernel_8lane" in row:
        row["lanes_equal"] = lanes_equal
        row["ratio_16_over_8_cpu"] = row["kernel"]["cpu_median_ms"] / row["kernel_8lane"]["cpu_median_ms"]
    if "kernel_fma" in row:
        row["same_as_fma"] = same_as_fma      # fraction of output elements equal to the FMA score pass's
        row["ratio_pairs_over_fma_cpu"] = row["kernel"]["cpu_median_ms"] / row["kernel_fma"]["cpu_median_ms"]
    if "baseline" in row:
        paired = sorted(b[1] / k[1] for b, k in zip(times["baseline"], times["kernel"]))
        row["baseline_equal"] = baseline_equal
        row["baseline_over_kernel_cpu"] = {"median": statistics.median(paired), "min": paired[0], "max": paired[-1]}
    row["ratio_wall"] = row["kernel"]["median_ms"] / row["sdpa"]["median_ms"]
    row["ratio_cpu"] = row["kernel"]["cpu_median_ms"] / row["sdpa"]["cpu_median_ms"]
    flops = 4 * heads * d * sum(context - q_len + i + 1 for i in range(q_len))   # causal: QK^T and PV, 2 flop a FMA
    row["kernel_gflops_cpu"] = flops / row["kernel"]["cpu_median_ms"] / 1e6
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[256, 1024, 2048], help="whole-prompt lengths")
    ap.add_argument("--chunks", nargs="+", default=["2:2048", "16:2048", "256:2048"],
                    help="q_len:context pairs: a chunk (or a peer's k tokens) after cached context")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--name", default="prefill_attention")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--baseline-tree", type=Path, help="another checkout whose kernel runs alongside (before/after)")
    args = ap.parse_args(argv)
    baseline = baseline_module(args.baseline_tree) if args.baseline_tree else None
    torch.set_num_threads(1)
    load_before, t0 = os.getloadavg(), time.time()
    spans = [(n, n) for n in args.tokens] + [tuple(int(x) for x in c.split(":")) for c in args.chunks]
    rows = []
    for model in args.models:
        for q_len, ctx in spans:
            row = case(model, q_len, ctx, args.repeats, dtype=getattr(torch, args.dtype), baseline=baseline)
            rows.append(row)
            print(f"{model:13s} q {q_len:5d} ctx {ctx:5d}: kernel {row['kernel']['median_ms']:8.2f} ms "
                  f"sdpa {row['sdpa']['median_ms']:8.2f} ms  wall x{row['ratio_wall']:.2f} cpu x{row['ratio_cpu']:.2f}"
                  f"  {row['kernel_gflops_cpu']:.0f} GFLOP/s  diff {row['max_abs_diff']:.1e}"
                  + (f"  baseline/kernel CPU x{row['baseline_over_kernel_cpu']['median']:.3f} equal "
                     f"{row['baseline_equal']}" if baseline else ""), flush=True)
    meta = {"command": " ".join(["python", "benchmarks/prefill_attention.py", *(argv or sys.argv[1:])]),
            "torch": torch.__version__, "dtype": args.dtype, "machine": platform.processor() or platform.machine(),
            "threads": 1, "cpus": os.cpu_count(), "repeats": args.repeats, "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(), "wall_s": round(time.time() - t0, 1),
            "baseline_tree": str(args.baseline_tree) if args.baseline_tree else None}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    write_md(args.out / f"{args.name}.md", rows, meta)
    write_png(args.out / f"{args.name}.png", rows, args.dtype)
    print(f"wrote {args.out / args.name}.{{json,md,png}} in {meta['wall_s']} s")
    return 0


def write_md(path: Path, rows: list[dict], meta: dict) -> None:
    lines = [f"# Prefill attention, one layer: paged CPU kernel vs PyTorch flash SDPA ({meta['dtype']}, 1 thread)",
             "",
             f"`{meta['command']}`; torch {meta['torch']}, {meta['cpus']} CPUs, load average "
             f"{meta['loadavg_before'][0]:.1f} before / {meta['loadavg_after'][0]:.1f} after (shared machine), "
             f"{meta['repeats']} alternated calls per side, {meta['wall_s']} s.", "",
             "ratio = kernel / SDPA (below 1: the kernel is faster). CPU = thread CPU time, less exposed to the other "
             "jobs on the machine than wall time. GFLOP/s: causal QK^T + PV flops over the kernel's CPU-time median. "
             "Other pass, alternated with the kernel in the same loop: fp32, the 8-lane passes (outputs equal bit for "
             "bit); bf16 without AMX, the FMA score pass instead of bf16 pairs (share of equal output elements).",
             "", "| model (heads/kv/d) | q_len | context | kernel ms (P90) | SDPA ms (P90) | ratio wall | ratio CPU "
             "| kernel GFLOP/s | max abs diff | other pass: kernel CPU ms | kernel / other pass CPU | outputs equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        k, s = r["kernel"], r["sdpa"]
        lines.append(f"| {r['model']} ({r['heads']}/{r['kv_heads']}/{r['head_dim']}) | {r['q_len']} | {r['context']} "
                     f"| {k['median_ms']:.2f} ({k['p90_ms']:.2f}) | {s['median_ms']:.2f} ({s['p90_ms']:.2f}) "
                     f"| {r['ratio_wall']:.2f} | {r['ratio_cpu']:.2f} | {r['kernel_gflops_cpu']:.0f} "
                     f"| {r['max_abs_diff']:.1e} | "
                     + (f"8-lane {r['kernel_8lane']['cpu_median_ms']:.2f} | {r['ratio_16_over_8_cpu']:.2f} | "
                        f"{r['lanes_equal']} |" if "kernel_8lane" in r else
                        f"FMA scores {r['kernel_fma']['cpu_median_ms']:.2f} | {r['ratio_pairs_over_fma_cpu']:.2f} | "
                        f"{100 * r['same_as_fma']:.2f}% |" if "kernel_fma" in r else "- | - | - |"))
    if any("baseline" in r for r in rows):
        lines += ["", f"Baseline: the kernel of `{meta['baseline_tree']}`, alternated call by call with this tree's; "
                  "ratio = baseline CPU time / this kernel's, per pair (median [min-max]).", "",
                  "| model | q_len | context | baseline CPU ms | kernel CPU ms | baseline / kernel | outputs equal |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            b = r["baseline_over_kernel_cpu"]
            lines.append(f"| {r['model']} | {r['q_len']} | {r['context']} | {r['baseline']['cpu_median_ms']:.2f} "
                         f"| {r['kernel']['cpu_median_ms']:.2f} | {b['median']:.3f} [{b['min']:.3f}-{b['max']:.3f}] "
                         f"| {r['baseline_equal']} |")
    path.write_text("\n".join(lines) + "\n")


def write_png(path: Path, rows: list[dict], dtype: str = "float32") -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['model']}\n{r['q_len']}/{r['context']}" for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["ratio_wall"] for r in rows], 0.4, label="wall")
    ax.bar(x + 0.2, [r["ratio_cpu"] for r in rows], 0.4, label="CPU time")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, labels, fontsize=6)
    ax.set_ylabel("kernel / SDPA time (median)")
    ax.set_title(f"prefill attention, one layer, {dtype}, 1 thread (q_len/context)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
