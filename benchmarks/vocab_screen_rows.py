"""The greedy screen's bf16 stream against the full fp32 vocabulary projection, by row count, on a host without
oneDNN's native bf16 (where the stream is the screen's only first pass): the crossover sets
greedy_screen.STREAM_ONLY_MAX_ROWS. Where oneDNN packs bf16 at all, the screen through its bf16 matmul beside it
(`screen_onednn`, every row count through that pass): fast with AVX512-BF16 or AMX, emulated without them, which is
what `greedy_screen.NATIVE_BF16` decides.

Per vocabulary shape and row count, in one process, 1 thread, alternating call by call on the same weights and
inputs: `screen` (GreedyScreen.argmax with its stream pass forced, whatever the limit: the bf16 panel stream, the
bound, the candidates' fp32 columns), `panel_fp32` (cpu_small_gemm.linear: the projection the engine runs past the
screen's limit) and `f_linear` (torch's fp32 F.linear, what a stock engine runs). Each cell is the median and P90 of
`--repeats` single calls (the matrix is far larger than the caches, as in a decode step), in process CPU time (wall
time beside it). Every screen answer is checked against the argmax of the fp32 panel kernel's logits.

    taskset -c 1 python benchmarks/vocab_screen_rows.py --out benchmarks/results/vocab_screen_rows
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenplane.engine import cpu_small_gemm, greedy_screen
from tokenplane.engine.cpu_simd import HOST_AVX512
from tokenplane.engine.greedy_screen import GreedyScreen
from tokenplane.engine.layers import cpu_packing_supported

SHAPES = [(151936, 256), (151936, 512), (49152, 576)]     # tiny-small, tiny-large, SmolLM2-135M


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def measure(n: int, k: int, rows_list: list[int], repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    panels = cpu_small_gemm.pack(w)
    scr = GreedyScreen(w, panels)
    scr.onednn = False                                  # the stream is the first pass (hosts without oneDNN bf16)
    dnn = GreedyScreen(w, panels) if cpu_packing_supported(torch.bfloat16) else None
    if dnn is not None:
        dnn.onednn = True
    out = []
    for rows in rows_list:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        want = cpu_small_gemm.linear(x, panels, n).argmax(dim=1).tolist()
        saved = greedy_screen.STREAM_ONLY_MAX_ROWS, greedy_screen.STREAM_MAX_ROWS
        greedy_screen.STREAM_ONLY_MAX_ROWS = max(rows, saved[0])     # time the stream even past today's limit
        try:
            got = scr.argmax(x)
            ways: dict[str, Callable[[], object]] = {
                "screen": lambda: scr.argmax(x), "panel_fp32": lambda: cpu_small_gemm.linear(x, panels, n),
                "f_linear": lambda: F.linear(x, w)}
            got_dnn = None
            if dnn is not None:
                def onednn() -> object:
                    greedy_screen.STREAM_MAX_ROWS = 0           # every row count through oneDNN's pass
                    try:
                        return dnn.argmax(x)
                    finally:
                        greedy_screen.STREAM_MAX_ROWS = saved[1]
                got_dnn = onednn()
                ways["screen_onednn"] = onednn
            for fn in ways.values():
                fn()
            cpu: dict[str, list[float]] = {name: [] for name in ways}
            wall: dict[str, list[float]] = {name: [] for name in ways}
            for r in range(repeats):
                names = list(ways)
                names = names[r % len(names):] + names[:r % len(names)]
                for name in names:
                    c0, t0 = time.process_time(), time.perf_counter()
                    ways[name]()
                    cpu[name].append(time.process_time() - c0)
                    wall[name].append(time.perf_counter() - t0)
        finally:
            greedy_screen.STREAM_ONLY_MAX_ROWS = saved[0]
        rec: dict = {"n": n, "k": k, "rows": rows, "screen_exact": got == want,
                     "onednn_exact": None if dnn is None else got_dnn in (want, None)}
        for name in ways:
            rec[f"{name}_ms"] = statistics.median(cpu[name]) * 1e3
            rec[f"{name}_p90_ms"] = p90(cpu[name]) * 1e3
            rec[f"{name}_wall_ms"] = statistics.median(wall[name]) * 1e3
        rec["screen_over_panel"] = rec["screen_ms"] / rec["panel_fp32_ms"]
        out.append(rec)
        print(json.dumps(rec), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8,10,12,16")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--out", default="benchmarks/results/vocab_screen_rows")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows_list = [int(r) for r in args.rows.split(",")]
    load0 = os.getloadavg()
    t0 = time.time()
    cells = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        cells += measure(n, k, rows_list, args.repeats)
    meta = {"command": "python benchmarks/vocab_screen_rows.py " + " ".join(
        f"--{key.replace('_', '-')} {val}" for key, val in vars(args).items()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, AVX-512: {HOST_AVX512}, native bf16 (AVX512-BF16 "
                   f"or AMX): {greedy_screen.NATIVE_BF16}, oneDNN packs bf16: {cpu_packing_supported(torch.bfloat16)}",
        "limit_in_code": greedy_screen.STREAM_ONLY_MAX_ROWS, "load_start": load0, "load_end": os.getloadavg(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "seconds": time.time() - t0,
        "cells": cells}
    with open(args.out + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    lines = ["# Greedy screen (bf16 stream) vs the full fp32 vocabulary projection, by rows", "",
             f"Command: `{meta['command']}`  ", f"Machine: {meta['machine']}; load {load0} -> {meta['load_end']}; "
             f"started {meta['started']}; STREAM_ONLY_MAX_ROWS in this tree: {meta['limit_in_code']}.", "",
             "ms of process CPU time per call, median / P90 (1 thread, alternating). screen / panel < 1: the screen "
             "pays.", "",
             "| shape | rows | screen | panel_fp32 | f_linear | screen / panel | screen exact | screen_onednn | "
             "onednn / screen |", "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for c in cells:
        dnn = (f"{c['screen_onednn_ms']:.2f} / {c['screen_onednn_p90_ms']:.2f} | "
               f"{c['screen_onednn_ms'] / c['screen_ms']:.2f}" if "screen_onednn_ms" in c else "- | -")
        lines.append(f"| {c['n']}x{c['k']} | {c['rows']} | {c['screen_ms']:.2f} / {c['screen_p90_ms']:.2f} | "
                     f"{c['panel_fp32_ms']:.2f} / {c['panel_fp32_p90_ms']:.2f} | {c['f_linear_ms']:.2f} / "
                     f"{c['f_linear_p90_ms']:.2f} | {c['screen_over_panel']:.2f} | {c['screen_exact']} | {dnn} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        cs = [c for c in cells if c["n"] == n and c["k"] == k]
        ax.plot([c["rows"] for c in cs], [c["screen_over_panel"] for c in cs], marker="o", label=shape)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("rows")
    ax.set_ylabel("screen / fp32 panel (CPU time)")
    ax.set_title(meta["machine"], fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
