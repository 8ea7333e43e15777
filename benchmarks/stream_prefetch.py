"""The panel streams' prefetch distance: cpu_small_gemm16's fp32 kernel (`gemm_with`: vocabulary projections and
decode linears) and cpu_bf16_gemv's bf16 stream (`gemv_bf16_with`: the greedy screen's 1-8 row pass over a bf16 copy
of the vocabulary matrix, bf16 decode linears) at the shipped distance (`cpu_small_gemm16.prefetch_elements`:
min(two panels, 24 KiB) ahead where a panel is <= 18 KiB, else 4 KiB) against the fixed 4 KiB they used before and
two other distances. One process, 1 thread, alternated (order flipped every repeat), one cold call each (a 64 MB sweep
first). Wall ms, medians; every variant's output checked equal (a prefetch changes no value).

    flock /tmp/bench.lock taskset -c 1 python benchmarks/stream_prefetch.py --out benchmarks/results/stream_prefetch
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from tokenplane.engine import cpu_bf16_gemv as gv
from tokenplane.engine import cpu_small_gemm
from tokenplane.engine import cpu_small_gemm16 as g16

SHAPES = {"bf16": [(151936, 256), (151936, 512), (49152, 576), (151936, 1024), (151936, 2048), (65536, 4096)],
          "fp32": [(151936, 128), (151936, 256), (151936, 512), (49152, 576), (151936, 1024)]}


def kernel(dtype: str, n: int, k: int):  # noqa: ANN201
    """(packed weight flat, panels, fn(x, rows, out, pf)) for one shape."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.02
    if dtype == "bf16":
        wp = gv.pack_bf16(w)
        npan = wp.shape[0]
        flat = wp.reshape(-1)
        return npan, lambda x, rows, out, pf: gv.gemv_bf16_with(x, rows, k, flat, npan, out, npan * gv.PANEL, pf)
    p = cpu_small_gemm.pack(w)
    npan, kb, flat = p.shape[0], cpu_small_gemm.k_block(k), p.numpy().reshape(-1)
    return npan, lambda x, rows, out, pf: g16.gemm_with(x, rows, k, flat, npan, out, npan * 16, kb, False,
                                                         g16.PAD_ODD, pf)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default="benchmarks/results/stream_prefetch")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sweep = np.ones(16 << 20, np.float32)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0 = os.getloadavg()
    cells = []
    for dtype, n, k in [(d, n, k) for d, shapes in SHAPES.items() for n, k in shapes]:
        size = 2 if dtype == "bf16" else 4
        npan, fn = kernel(dtype, n, k)
        variants = {"shipped": int(g16.prefetch_elements(k, size)), "fixed_4k": 4096 // size,
                    "fixed_24k": 24576 // size, "two_panels": 2 * k * gv.PANEL}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).numpy().reshape(-1)
            outs = {v: np.empty(rows * npan * gv.PANEL, np.float32) for v in variants}
            times: dict[str, list[float]] = {v: [] for v in variants}
            names = list(variants)
            for i in range(args.repeats + 1):
                for v in (names if i % 2 == 0 else names[::-1]):
                    sweep.sum()
                    t = time.perf_counter()
                    fn(x, rows, outs[v], variants[v])
                    if i:   # the first round compiles and warms
                        times[v].append((time.perf_counter() - t) * 1e3)
            rec = {"dtype": dtype, "n": n, "k": k, "rows": rows, "distances": variants, "mb": n * k * size / 1e6,
                   "equal": all(np.array_equal(outs["shipped"], o) for o in outs.values())}
            for v, ts in times.items():
                rec[f"{v}_ms"] = statistics.median(ts)
            rec["fixed_4k_over_shipped"] = rec["fixed_4k_ms"] / rec["shipped_ms"]
            cells.append(rec)
            print(f"{dtype} {n}x{k} rows {rows}: " + "  ".join(f"{v} {rec[f'{v}_ms']:.2f}" for v in variants)
                  + f"  (4k / shipped {rec['fixed_4k_over_shipped']:.2f}x) equal {rec['equal']}", flush=True)
        del fn
    cmd = "python benchmarks/stream_prefetch.py " + " ".join(f"--{a.replace('_', '-')} {v}"
                                                                  for a, v in vars(args).items())
    res = {"started": started, "load_before": load0, "load_after": os.getloadavg(), "command": cmd,
           "short_panel_bytes": g16.SHORT_PANEL_BYTES, "short_prefetch_bytes": g16.SHORT_PREFETCH_BYTES, "cells": cells}
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    lines = ["# Panel streams (fp32 and bf16): prefetch distance (1 thread, cold)", "",
             f"{started}; load {load0[0]:.1f} -> {res['load_after'][0]:.1f}; `{cmd}`; medians of {args.repeats} "
             "alternated cold calls, wall ms (GB/s of the panels in brackets). shipped = prefetch_elements(K, itemsize).",
             "", "| dtype | N x K | rows | shipped (elements) | shipped ms | fixed 4 KiB ms | fixed 24 KiB ms | two panels ms | "
             "4 KiB / shipped | equal |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in cells:
        gbs = c["mb"] / c["shipped_ms"]
        lines.append(f"| {c['dtype']} | {c['n']} x {c['k']} | {c['rows']} | {c['distances']['shipped']} | {c['shipped_ms']:.2f} "
                     f"({gbs:.1f}) | {c['fixed_4k_ms']:.2f} | {c['fixed_24k_ms']:.2f} | {c['two_panels_ms']:.2f} | "
                     f"{c['fixed_4k_over_shipped']:.2f} | {c['equal']} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for dtype in SHAPES:
        for rows in sorted({c["rows"] for c in cells}):
            cs = [c for c in cells if c["rows"] == rows and c["dtype"] == dtype]
            ax.plot([c["k"] for c in cs], [c["fixed_4k_over_shipped"] for c in cs], marker="o",
                    ls="-" if dtype == "fp32" else "--", label=f"{dtype} {rows} rows")
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("K (inner size)")
    ax.set_ylabel("fixed 4 KiB time / shipped time")
    ax.set_title("panel streams: prefetch distance (>1 = shipped faster)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
