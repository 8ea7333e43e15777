"""The panel kernels' remainder policies side by side. 16 lanes (cpu_small_gemm16.gemm_with): SPLIT (the rows left
after the 12-row passes through passes of 6, 4, 2 and 1 rows) against PAD_ODD (`gemm`'s: 3, 5, 9, 11 padded with zero
rows to one pass fewer) and, for the record, ONE_PASS (every remainder padded to a single 4-, 6- or 12-row pass).
`--lanes 8` (cpu_small_gemm.gemm_with, the AVX2 kernel's pass plans): SPLIT (the rows left after the 6-row passes
through passes of 4, 2 and 1 rows) against REMAINDER (the rows left after the 6-row passes as one pass of their own
count) and FIT (`_gemm`'s: REMAINDER, but 9 rows left as 5 + 4), and, with `--plan-4to6`, passes of 4-6 rows only
from 8 rows on (8 = 4 + 4, 13 = 5 + 4 + 4, 14 = 6 + 4 + 4).

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
POLICIES_8 = {"split": cpu_small_gemm.SPLIT,
              "remainder": cpu_small_gemm._plan({r: (r,) for r in range(1, 6)}), "fit": cpu_small_gemm.FIT}
PLAN_4TO6 = cpu_small_gemm._plan({1: (1,), 2: (2,), 3: (3,), 4: (4,), 5: (5,), 7: (4, 3), 8: (4, 4), 9: (5, 4),
                                  13: (5, 4, 4)})
LANES = [16]     # the kernel measured (--lanes)


def run(x, rows, k, wp, npan, out, kb, policy):  # noqa: ANN001
    if LANES[0] == 16:
        g16.gemm_with(x, rows, k, wp, npan, out, npan * 16, kb, False, POLICIES[policy],
                      g16.prefetch_elements(k, 4))
    else:
        cpu_small_gemm.gemm_with(x, rows, k, wp, npan, out, npan * 16, kb, False, POLICIES_8[policy])


def policies() -> dict[str, np.ndarray]:
    return POLICIES if LANES[0] == 16 else POLICIES_8


def kernel_policy() -> str:
    """The policy `linear` runs at this width."""
    return "pad_odd" if LANES[0] == 16 else "fit"


def cell(n: int, k: int, rows: int, cold: bool, repeats: int, inner: int, sweep: np.ndarray) -> dict:
    g = torch.Generator().manual_seed(n + k + rows)
    panels = cpu_small_gemm.pack(torch.randn(n, k, generator=g) * 0.02)
    kb = cpu_small_gemm.k_block(k)
    x = torch.randn(rows, k, generator=g).numpy().reshape(-1)
    wp, npan = panels.numpy().reshape(-1), panels.shape[0]
    names = list(policies())
    outs = {p: np.empty(rows * npan * 16, np.float32) for p in names}
    times: dict[str, list[float]] = {p: [] for p in names}
    for i in range(repeats):
        for p in (names if i % 2 == 0 else names[::-1]):
            if cold:
                sweep.sum()
            t = time.process_time()
            for _ in range(inner):
                run(x, rows, k, wp, npan, outs[p], kb, p)
            times[p].append((time.process_time() - t) / inner * 1e3)
    equal = all(np.array_equal(outs["split"], outs[p]) for p in names)
    rec = {"n": n, "k": k, "rows": rows, "cold": cold, "equal": equal}
    for p, ts in times.items():
        rec[f"{p}_ms"] = statistics.median(ts)
        rec[f"{p}_p90_ms"] = sorted(ts)[int(0.9 * (len(ts) - 1))]
    for p in names[1:]:
        rec[f"split_over_{p}"] = rec["split_ms"] / rec[f"{p}_ms"]
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4,5,7,8,9,10,11,13,15,17,19,21,23")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--inner", type=int, default=30, help="calls per timing on the (warm) layer shapes")
    ap.add_argument("--out", default="benchmarks/results/small_gemm_remainders")
    ap.add_argument("--lanes", type=int, choices=[8, 16], default=16)
    ap.add_argument("--plan-4to6", action="store_true", help="8 lanes: also the plan of 4-6-row passes from 8 rows on")
    args = ap.parse_args()
    if args.plan_4to6:
        POLICIES_8["4to6"] = PLAN_4TO6
    LANES[0] = args.lanes
    torch.set_num_threads(1)
    rows = [int(r) for r in args.rows.split(",")]
    sweep = np.ones(16 << 20, np.float32)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0 = os.getloadavg()
    cells = []
    others = list(policies())[1:]
    main_p = kernel_policy()
    for shapes, cold in ((VOCAB_SHAPES, True), (LAYER_SHAPES, False)):
        for n, k in shapes:
            for r in rows:
                rec = cell(n, k, r, cold, args.repeats, 1 if cold else args.inner, sweep)
                cells.append(rec)
                print(f"{n}x{k} rows {r}: split {rec['split_ms']:.3f} "
                      + " ".join(f"{p} {rec[p + '_ms']:.3f} ({rec['split_over_' + p]:.2f}x)" for p in others)
                      + f" equal {rec['equal']}", flush=True)
    cmd = "python benchmarks/small_gemm_remainders.py " + " ".join(
        f"--{a.replace('_', '-')}" + ("" if isinstance(v, bool) else f" {v}")
        for a, v in vars(args).items() if v is not False)
    res = {"started": started, "load_before": load0, "load_after": os.getloadavg(), "command": cmd, "cells": cells}
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# {args.lanes}-lane panel kernel: remainder policies (fp32, 1 thread)", "",
             f"{started}; load {load0[0]:.1f} -> {res['load_after'][0]:.1f}; `{cmd}`; medians of {args.repeats} "
             "alternated timings, process CPU ms; vocabulary shapes one cold call (64 MB sweep first), layer shapes a "
             f"loop of {args.inner} warm calls. Ratio = split / policy (> 1: the policy is faster).", "",
             "| N x K | cold | rows | split ms | " + " | ".join(f"{p} ms | split / {p}" for p in others) + " | equal |",
             "|---|---|---:|---:|" + "---:|---:|" * len(others) + "---|"]
    for c in cells:
        lines.append(f"| {c['n']} x {c['k']} | {c['cold']} | {c['rows']} | {c['split_ms']:.3f} | "
                     + " | ".join(f"{c[p + '_ms']:.3f} | {c['split_over_' + p]:.2f}" for p in others)
                     + f" | {c['equal']} |")
    key = f"split_over_{main_p}"
    lines += ["", f"{main_p} (the kernel's policy) vs split: {min(c[key] for c in cells):.2f}-"
              f"{max(c[key] for c in cells):.2f}x over all cells; outputs equal "
              f"in {sum(c['equal'] for c in cells)}/{len(cells)} cells."]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for n, k in VOCAB_SHAPES + LAYER_SHAPES:
        cs = [c for c in cells if c["n"] == n and c["k"] == k]
        ax.plot([c["rows"] for c in cs], [c[key] for c in cs], marker="o",
                label=f"{n}x{k} {'cold' if cs[0]['cold'] else 'warm'}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("rows")
    ax.set_ylabel(f"split time / {main_p} time")
    ax.set_title(f"{args.lanes}-lane panel kernel: {main_p} vs split (>1 = faster)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
