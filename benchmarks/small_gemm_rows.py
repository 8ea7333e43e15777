"""cpu_small_gemm against oneDNN's packed linear and F.linear (the engine's fp32 fallback past the limits: fp32 keeps no
oneDNN copy) by row count: where each is faster, which sets cpu_small_gemm.MAX_ROWS (layers) and VOCAB_MAX_ROWS
(vocabulary projections). On an AVX-512 host `small_gemm` is the 16-lane kernel (cpu_small_gemm16.py) and the
8-lane one is timed beside it as `small_gemm_8lane` (same sums bit for bit: checked in every cell).

All three run on the same weights in one process, 1 thread, alternating call by call; each cell is the median (and P90)
of `--repeats` timings of one call (vocabulary shapes: cold, the matrix is far larger than the caches, as in a decode
step) or of a loop of `--inner` calls (layer shapes: warm). Process CPU time is the figure (steadier on a shared
machine); wall time is recorded beside it. Every cell also checks both outputs against float64.

    taskset -c 1 python benchmarks/small_gemm_rows.py --out benchmarks/results/small_gemm_rows
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenplane.engine import cpu_small_gemm
from tokenplane.engine.layers import cpu_pack, cpu_packed_linear

VOCAB_SHAPES = [(151936, 256), (151936, 512), (49152, 576)]
LAYER_SHAPES = [(3072, 576), (576, 1536), (960, 576), (1536, 256), (512, 256), (3072, 512), (512, 1536), (1024, 512)]


def timed(fn: Callable[[], object], inner: int) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.process_time() - c0) / inner, (time.perf_counter() - t0) / inner


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def cell(n: int, k: int, rows: int, repeats: int, inner: int, w: torch.Tensor, panels: torch.Tensor,
         packed: torch.Tensor) -> dict:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    ways = {"onednn": lambda: cpu_packed_linear(x, packed, None), "small_gemm": lambda: cpu_small_gemm.linear(
        x, panels, n), "f_linear": lambda: F.linear(x, w)}
    if cpu_small_gemm.HOST_AVX512:
        ways["small_gemm_8lane"] = lambda: _eight_lane(x, panels, n)
    ref = x.double() @ w.double().t()
    rec: dict = {"n": n, "k": k, "rows": rows, "inner": inner}
    if cpu_small_gemm.HOST_AVX512:
        rec["lanes_equal"] = bool(torch.equal(_eight_lane(x, panels, n), cpu_small_gemm.linear(x, panels, n)))
    for name, fn in ways.items():
        rec[f"{name}_err_vs_f64"] = (fn().double() - ref).abs().max().item()   # type: ignore[union-attr]
        fn()
    cpu: dict[str, list[float]] = {name: [] for name in ways}
    wall: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(repeats):
        order = list(ways)[r % len(ways):] + list(ways)[:r % len(ways)]
        for name in order:
            c, t = timed(ways[name], inner)
            cpu[name].append(c)
            wall[name].append(t)
    for name in ways:
        rec[f"{name}_cpu_ms"] = statistics.median(cpu[name]) * 1e3
        rec[f"{name}_cpu_p90_ms"] = p90(cpu[name]) * 1e3
        rec[f"{name}_wall_ms"] = statistics.median(wall[name]) * 1e3
    rec["ratio_onednn_over_small_gemm"] = rec["onednn_cpu_ms"] / rec["small_gemm_cpu_ms"]
    rec["ratio_f_linear_over_small_gemm"] = rec["f_linear_cpu_ms"] / rec["small_gemm_cpu_ms"]
    if "small_gemm_8lane" in ways:
        rec["ratio_8lane_over_small_gemm"] = rec["small_gemm_8lane_cpu_ms"] / rec["small_gemm_cpu_ms"]
    return rec


def _eight_lane(x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    kernel = cpu_small_gemm._KERNEL[0]
    cpu_small_gemm._KERNEL[0] = cpu_small_gemm._gemm
    try:
        return cpu_small_gemm.linear(x, panels, n)
    finally:
        cpu_small_gemm._KERNEL[0] = kernel


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,8,12,16,24,32,48,64")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=20, help="calls per timing on the (warm) layer shapes")
    ap.add_argument("--out", default="benchmarks/results/small_gemm_rows")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [int(r) for r in args.rows.split(",")]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0 = os.getloadavg()[0]
    cells = []
    for kind, shapes, inner in (("vocab (cold)", VOCAB_SHAPES, 1), ("layer (warm)", LAYER_SHAPES, args.inner)):
        for n, k in shapes:
            w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.02
            panels, packed = cpu_small_gemm.pack(w), cpu_pack(w)
            for m in rows:
                rec = cell(n, k, m, args.repeats, inner, w, panels, packed)
                rec["kind"] = kind
                cells.append(rec)
                print(f"{kind} {n}x{k} rows {m}: oneDNN {rec['onednn_cpu_ms']:.3f} ms, F.linear "
                      f"{rec['f_linear_cpu_ms']:.3f} ms, small_gemm {rec['small_gemm_cpu_ms']:.3f} ms "
                      f"({rec['ratio_onednn_over_small_gemm']:.2f}x, {rec['ratio_f_linear_over_small_gemm']:.2f}x)",
                      flush=True)
            del w, panels, packed
    res = {"started": started, "load_before": load0, "load_after": os.getloadavg()[0], "repeats": args.repeats,
           "max_rows": cpu_small_gemm.MAX_ROWS, "vocab_max_rows": cpu_small_gemm.VOCAB_MAX_ROWS, "cells": cells,
           "command": "python benchmarks/small_gemm_rows.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())}
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    lanes = "16-lane (AVX-512 host; the 8-lane kernel timed beside it)" if cpu_small_gemm.HOST_AVX512 else "8-lane"
    lines = ["# cpu_small_gemm vs oneDNN's packed linear and F.linear by row count (fp32, 1 thread)", "",
             f"small_gemm here: the {lanes} kernel; host CPU: {_cpu_name()}.", "",
             f"{started}; load {load0:.1f} -> {res['load_after']:.1f}; `{res['command']}`; median of "
             f"{args.repeats} alternating timings, process CPU ms (P90 in brackets); vocabulary shapes one cold call, "
             f"layer shapes a loop of {args.inner} warm calls. Limits in use: MAX_ROWS {cpu_small_gemm.MAX_ROWS} "
             f"(layers), VOCAB_MAX_ROWS {cpu_small_gemm.VOCAB_MAX_ROWS} (vocabulary).", "",
             "| kind | N x K | rows | oneDNN ms | F.linear ms | small_gemm ms | oneDNN / small_gemm | F.linear / small_gemm "
             "| max err vs f64 (oneDNN / F.linear / ours) | 8-lane ms | 8-lane / small_gemm | lanes equal |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for c in cells:
        lines.append(f"| {c['kind']} | {c['n']} x {c['k']} | {c['rows']} | {c['onednn_cpu_ms']:.3f} "
                     f"({c['onednn_cpu_p90_ms']:.3f}) | {c['f_linear_cpu_ms']:.3f} ({c['f_linear_cpu_p90_ms']:.3f}) "
                     f"| {c['small_gemm_cpu_ms']:.3f} ({c['small_gemm_cpu_p90_ms']:.3f}) "
                     f"| {c['ratio_onednn_over_small_gemm']:.2f} | {c['ratio_f_linear_over_small_gemm']:.2f} "
                     f"| {c['onednn_err_vs_f64']:.1e} / {c['f_linear_err_vs_f64']:.1e} / {c['small_gemm_err_vs_f64']:.1e} | "
                     + (f"{c['small_gemm_8lane_cpu_ms']:.3f} | {c['ratio_8lane_over_small_gemm']:.2f} | "
                        f"{c['lanes_equal']} |" if "lanes_equal" in c else "- | - | - |"))
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for n, k in VOCAB_SHAPES + LAYER_SHAPES:
        cs = [c for c in cells if c["n"] == n and c["k"] == k]
        line, = ax.plot([c["rows"] for c in cs], [c["ratio_onednn_over_small_gemm"] for c in cs], marker="o",
                        label=f"{n}x{k} ({cs[0]['kind']}) vs oneDNN")
        ax.plot([c["rows"] for c in cs], [c["ratio_f_linear_over_small_gemm"] for c in cs], marker="x", ls="--",
                color=line.get_color(), label=f"{n}x{k} vs F.linear")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("rows")
    ax.set_ylabel("other time / small_gemm time (>1: small_gemm faster)")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
