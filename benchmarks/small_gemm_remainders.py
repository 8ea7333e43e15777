"""The panel kernels' remainder policies side by side. 16 lanes (cpu_small_gemm16.gemm_with): SPLIT (the rows left
after the 12-row passes through passes of 6, 4, 2 and 1 rows) against PAD_ODD (`gemm`'s: 3, 5, 9, 11 padded with zero
rows to one pass fewer) and, for the record, ONE_PASS (every remainder padded to a single 4-, 6- or 12-row pass).
`--lanes 8` (cpu_small_gemm.gemm_with, the AVX2 kernel): SPLIT (the rows left after the 6-row passes through passes of
4, 2 and 1 rows) against PAD_ODD (3 and 5 padded to one 4- or 6-row pass) and ONE_PASS (every remainder of 3 and up
padded to one 6-row pass).

One process, 1 thread, the policies alternated call by call (order flipped every repeat); vocabulary shapes one cold
call each (a 64 MB sweep first, as in a decode step that streams the matrix), layer shapes a loop of warm calls.
Process CPU time, medians (P90 in the JSON). Each cell also checks the policies' outputs are equal bit for bit.

    flock /tmp/bench.lock taskset -c 1 python benchmarks/small_gemm_remainders.py --out benchmarks/results/small_gemm_remainders
    flock /tmp/bench.lock taskset -c 1 python benchmarks/small_gemm_remainders.py --lanes 8 \
        --out benchmarks/results/small_gemm_remainders_8lane
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from tokenplane.engine import cpu_small_gemm
from tokenplane.engine import cpu_small_gemm16 as g16

VOCAB_SHAPES = [(151936, 256), (151936, 512), (49152, 576)]
LAYER_SHAPES = [(1536, 512), (512, 1536), (3072, 576), (1536, 256)]
POLICIES = {"split": g16.SPLIT, "pad_odd": g16.PAD_ODD,
            "one_pass": np.array([0, 1, 2, 4, 4, 6, 6, 12, 12, 12, 12, 12], np.int64)}
POLICIES_8 = {"split": cpu_small_gemm.SPLIT, "pad_odd": cpu_small_gemm.PAD_ODD,
              "one_pass": np.array([0, 1, 2, 6, 6, 6], np.int64)}
LANES = [16]     # the kernel measured (--lanes)


def run(x, rows, k, wp, npan, out, kb, policy):  # noqa: ANN001
    if LANES[0] == 16:
        g16.gemm_with(x, rows, k, wp, npan, out, npan * 16, kb, False, POLICIES[policy])
    else:
        cpu_small_gemm.gemm_with(x, rows, k, wp, npan, out, npan * 16, kb, False, POLICIES_8[policy])


def cell(n: int, k: int, rows: int, cold: bool, repeats: int, inner: int, sweep: np.ndarray) -> dict:
    g = torch.Generator().manual_seed(n + k + rows)
    panels = cpu_small_gemm.pack(torch.randn(n, k, generator=g) * 0.02)
    kb = cpu_small_gemm.k_block(k)
    x = torch.randn(rows, k, generator=g).numpy().reshape(-1)
    wp, npan = panels.numpy().reshape(-1), panels.shape[0]
    outs = {p: np.empty(rows * npan * 16, np.float32) for p in POLICIES}
    times: dict[str, list[float]] = {p: [] for p in POLICIES}
    names = list(POLICIES)
    for i in range(repeats):
        for p in (names if i % 2 == 0 else names[::-1]):
            if cold:
                sweep.sum()
            t = time.process_time()
            for _ in range(inner):
                run(x, rows, k, wp, npan, outs[p], kb, p)
            times[p].append((time.process_time() - t) / inner * 1e3)
    equal = all(np.array_equal(outs["split"], outs[p]) for p in POLICIES)
    rec = {"n": n, "k": k, "rows": rows, "cold": cold, "equal": equal}
    for p, ts in times.items():
        rec[f"{p}_ms"] = statistics.median(ts)
        rec[f"{p}_p90_ms"] = sorted(ts)[int(0.9 * (len(ts) - 1))]
    for p in ("pad_odd", "one_pass"):
        rec[f"split_over_{p}"] = rec["split_ms"] / rec[f"{p}_ms"]
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4,5,7,8,9,10,11,13,15,17,19,21,23")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--inner", type=int, default=30, help="calls per timing on the (warm) layer shapes")
    ap.add_argument("--out", default="benchmarks/results/small_gemm_remainders")
    ap.add_argument("--lanes", type=int, choices=[8, 16], default=16)
    args = ap.parse_args()
    LANES[0] = args.lanes
    torch.set_num_threads(1)
    rows = [int(r) for r in args.rows.split(",")]
    sweep = np.ones(16 << 20, np.float32)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0 = os.getloadavg()
    cells = []
    for shapes, cold in ((VOCAB_SHAPES, True), (LAYER_SHAPES, False)):
        for n, k in shapes:
            for r in rows:
                rec = cell(n, k, r, cold, args.repeats, 1 if cold else args.inner, sweep)
                cells.append(rec)
                print(f"{n}x{k} rows {r}: split {rec['split_ms']:.3f} pad_odd {rec['pad_odd_ms']:.3f} "
                      f"({rec['split_over_pad_odd']:.2f}x) one_pass {rec['one_pass_ms']:.3f} "
                      f"({rec['split_over_one_pass']:.2f}x) equal {rec['equal']}", flush=True)
    cmd = "python benchmarks/small_gemm_remainders.py " + " ".join(f"--{a.replace('_', '-')} {v}"
                                                                   for a, v in vars(args).items())
    res = {"started": started, "load_before": load0, "load_after": os.getloadavg(), "command": cmd, "cells": cells}
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# {args.lanes}-lane panel kernel: remainder policies (fp32, 1 thread)", "",
             f"{started}; load {load0[0]:.1f} -> {res['load_after'][0]:.1f}; `{cmd}`; medians of {args.repeats} "
             "alternated timings, process CPU ms; vocabulary shapes one cold call (64 MB sweep first), layer shapes a "
             f"loop of {args.inner} warm calls. Ratio = split / policy (> 1: the policy is faster).", "",
             "| N x K | cold | rows | split ms | pad_odd ms | split / pad_odd | one_pass ms | split / one_pass | equal |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for c in cells:
        lines.append(f"| {c['n']} x {c['k']} | {c['cold']} | {c['rows']} | {c['split_ms']:.3f} | {c['pad_odd_ms']:.3f} "
                     f"| {c['split_over_pad_odd']:.2f} | {c['one_pass_ms']:.3f} | {c['split_over_one_pass']:.2f} "
                     f"| {c['equal']} |")
    worst = min(c["split_over_pad_odd"] for c in cells)
    lines += ["", f"pad_odd (the kernel's policy) vs split: {min(c['split_over_pad_odd'] for c in cells):.2f}-"
              f"{max(c['split_over_pad_odd'] for c in cells):.2f}x over all cells (lowest {worst:.2f}); outputs equal "
              f"in {sum(c['equal'] for c in cells)}/{len(cells)} cells."]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for n, k in VOCAB_SHAPES + LAYER_SHAPES:
        cs = [c for c in cells if c["n"] == n and c["k"] == k]
        ax.plot([c["rows"] for c in cs], [c["split_over_pad_odd"] for c in cs], marker="o",
                label=f"{n}x{k} {'cold' if cs[0]['cold'] else 'warm'}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("rows")
    ax.set_ylabel("split time / pad_odd time")
    ax.set_title(f"{args.lanes}-lane panel kernel: padding odd remainders (>1 = faster)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
