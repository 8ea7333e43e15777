"""What one core of this machine can do, and how close each engine's prefill and decode run to it (issue 14's N = 1
target).

Measures, on one pinned core, one thread, alternating the probes and taking medians of --repeats:
- fma_peak: a loop of 12 independent <8 x float> fused multiply-adds per iteration (llvmlite vector code through the
  same intrinsics as engine/cpu_small_gemm.py), so the loop is bound by the FMA ports alone: the core's fp32 peak;
  on an AVX-512 host also fma_peak16, the same loop on <16 x float> (engine/cpu_simd.py), and the peak is the larger.
- gemm: torch.mm of two 2048 x 2048 fp32 matrices at 1 thread (what a tuned BLAS reaches on a large square GEMM),
  and the oneDNN packed linear the engine runs for prefill (layers.cpu_pack) on a 256 x 512 -> 3072 shape.
- stream: a numpy sum over 512 MB (memory bandwidth, what a vocabulary projection at a few rows is bound by).
- read: the same 512 MB read by a loop of 8 independent <8 x float> loads and adds (the core's read bandwidth with
  nothing else in the loop), and decode_gemv: the engine's one-row kernel (engine/cpu_small_gemm.py, what a decode
  step at N = 1 runs for every projection) over a 151936 x 512 weight, in GB/s of weight read.

Then, for each prefill cell of the engine_vs_vllm result files given (--results), the model FLOPs of the step (linear
layers of every prompt token, causal attention, the vocabulary projection of the sampled rows only: what both engines
compute) over each engine's measured prefill time: achieved GFLOP/s and the fraction of fma_peak. A ratio target above
peak / (vLLM's achieved rate) cannot be met by any engine on this core. For each decode cell at N = 1, the bytes one
step must read (every linear weight and the vocabulary projection once, the KV cache of a P + 32-token context) times
each engine's measured decode rate: achieved GB/s, against the best read sample; the ceiling is the decode rate an
engine reading at that bandwidth would reach, over vLLM's.

    python benchmarks/peers/cpu_roofline.py --results benchmarks/results/engine_vs_vllm_speed6_tinylarge.json \
        --out benchmarks/results/cpu_roofline

Writes OUT.json and OUT.md (no PNG: a table of a few numbers).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from numba import njit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_vs_vllm import MODELS  # noqa: E402   the cell names of its results -> model sources

from tokenplane.engine import cpu_simd as simd  # noqa: E402
from tokenplane.engine import cpu_small_gemm as g  # noqa: E402
from tokenplane.engine.config import ModelConfig  # noqa: E402
from tokenplane.engine.loader import resolve_config  # noqa: E402

ACCUMULATORS = 12     # FMA latency 4-5 cycles x 2 ports: 10+ independent chains keep both ports busy


@njit(cache=True, nogil=True)
def _fma_loop(buf, n):  # noqa: ANN001, ANN202
    a = simd._load8(buf, 0)
    b = simd._load8(buf, 8)
    c0 = simd._load8(buf, 16)
    c1 = c0; c2 = c0; c3 = c0; c4 = c0; c5 = c0; c6 = c0; c7 = c0; c8 = c0; c9 = c0; c10 = c0; c11 = c0  # noqa: E702
    for _ in range(n):
        c0 = simd._fma8(c0, a, b); c1 = simd._fma8(c1, a, b); c2 = simd._fma8(c2, a, b); c3 = simd._fma8(c3, a, b)  # noqa: E702
        c4 = simd._fma8(c4, a, b); c5 = simd._fma8(c5, a, b); c6 = simd._fma8(c6, a, b); c7 = simd._fma8(c7, a, b)  # noqa: E702
        c8 = simd._fma8(c8, a, b); c9 = simd._fma8(c9, a, b); c10 = simd._fma8(c10, a, b); c11 = simd._fma8(c11, a, b)  # noqa: E702
    s = simd._add8(simd._add8(simd._add8(c0, c1), simd._add8(c2, c3)), simd._add8(simd._add8(c4, c5), simd._add8(c6, c7)))
    s = simd._add8(s, simd._add8(simd._add8(c8, c9), simd._add8(c10, c11)))
    simd._store8(buf, 24, s)   # keeps the loop live


@njit(cache=True, nogil=True)
def _fma16_loop(buf, n):  # noqa: ANN001, ANN202
    a = simd._load16(buf, 0)
    b = simd._load16(buf, 16)
    c0 = simd._load16(buf, 32)
    c1 = c0; c2 = c0; c3 = c0; c4 = c0; c5 = c0; c6 = c0; c7 = c0; c8 = c0; c9 = c0; c10 = c0; c11 = c0  # noqa: E702
    for _ in range(n):
        c0 = simd._fma16(c0, a, b); c1 = simd._fma16(c1, a, b); c2 = simd._fma16(c2, a, b); c3 = simd._fma16(c3, a, b)  # noqa: E702
        c4 = simd._fma16(c4, a, b); c5 = simd._fma16(c5, a, b); c6 = simd._fma16(c6, a, b); c7 = simd._fma16(c7, a, b)  # noqa: E702
        c8 = simd._fma16(c8, a, b); c9 = simd._fma16(c9, a, b); c10 = simd._fma16(c10, a, b)  # noqa: E702
        c11 = simd._fma16(c11, a, b)
    s = simd._add16(simd._add16(simd._add16(c0, c1), simd._add16(c2, c3)), simd._add16(simd._add16(c4, c5), simd._add16(c6, c7)))
    s = simd._add16(s, simd._add16(simd._add16(c8, c9), simd._add16(c10, c11)))
    simd._store16(buf, 48, s)   # keeps the loop live


def fma_peak16_gflops(iters: int = 20_000_000) -> float:
    buf = np.full(64, 0.5, dtype=np.float32)
    buf[:16] = 0.999999
    buf[16:32] = 1e-7
    _fma16_loop(buf, 1000)
    t = time.perf_counter()
    _fma16_loop(buf, iters)
    dt = time.perf_counter() - t
    return iters * ACCUMULATORS * 16 * 2 / dt / 1e9


def fma_peak_gflops(iters: int = 20_000_000) -> float:
    buf = np.full(32, 0.5, dtype=np.float32)
    buf[:8] = 0.999999
    buf[8:16] = 1e-7
    _fma_loop(buf, 1000)
    t = time.perf_counter()
    _fma_loop(buf, iters)
    dt = time.perf_counter() - t
    return iters * ACCUMULATORS * 8 * 2 / dt / 1e9


def gemm_gflops(n: int = 2048) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    t = time.perf_counter()
    torch.mm(a, b)
    return 2 * n ** 3 / (time.perf_counter() - t) / 1e9


def packed_linear_gflops(rows: int = 256, k: int = 512, n: int = 3072) -> float:
    from tokenplane.engine.layers import cpu_pack, cpu_packed_linear
    w = torch.randn(n, k)
    packed = cpu_pack(w)
    x = torch.randn(rows, k)
    cpu_packed_linear(x, packed, None)
    reps = 20
    t = time.perf_counter()
    for _ in range(reps):
        cpu_packed_linear(x, packed, None)
    return reps * 2 * rows * k * n / (time.perf_counter() - t) / 1e9


def stream_gbs(mb: int = 512) -> float:
    a = np.ones(mb * 1024 * 1024 // 4, dtype=np.float32)
    a.sum()
    t = time.perf_counter()
    a.sum()
    return a.nbytes / (time.perf_counter() - t) / 1e9


@njit(cache=True, nogil=True)
def _read_loop(buf, n):  # noqa: ANN001, ANN202
    c0 = simd._zero8(); c1 = c0; c2 = c0; c3 = c0; c4 = c0; c5 = c0; c6 = c0; c7 = c0  # noqa: E702
    for i in range(0, n - 63, 64):
        c0 = simd._add8(c0, simd._load8(buf, i)); c1 = simd._add8(c1, simd._load8(buf, i + 8))  # noqa: E702
        c2 = simd._add8(c2, simd._load8(buf, i + 16)); c3 = simd._add8(c3, simd._load8(buf, i + 24))  # noqa: E702
        c4 = simd._add8(c4, simd._load8(buf, i + 32)); c5 = simd._add8(c5, simd._load8(buf, i + 40))  # noqa: E702
        c6 = simd._add8(c6, simd._load8(buf, i + 48)); c7 = simd._add8(c7, simd._load8(buf, i + 56))  # noqa: E702
    s = simd._add8(simd._add8(simd._add8(c0, c1), simd._add8(c2, c3)), simd._add8(simd._add8(c4, c5), simd._add8(c6, c7)))
    simd._store8(buf, 0, s)    # keeps the loop live


def read_gbs(mb: int = 512) -> float:
    a = np.ones(mb * 1024 * 1024 // 4, dtype=np.float32)
    _read_loop(a, a.size)
    a[:] = 1.0
    t = time.perf_counter()
    _read_loop(a, a.size)
    return a.nbytes / (time.perf_counter() - t) / 1e9


def decode_gemv_gbs(n: int = 151936, k: int = 512, reps: int = 5) -> float:
    panels = g.pack(torch.randn(n, k))
    x = torch.randn(1, k)
    g.linear(x, panels, n)
    t = time.perf_counter()
    for _ in range(reps):
        g.linear(x, panels, n)
    return reps * n * k * 4 / (time.perf_counter() - t) / 1e9


def decode_bytes(cfg: ModelConfig, context: int) -> float:
    """Bytes one decode step of one sequence must read: every linear weight and the vocabulary projection once,
    plus the K and V of `context` positions (fp32)."""
    d, heads, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ffn, layers, vocab = cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    linear = d * (heads + 2 * kv) * hd + heads * hd * d + d * 2 * ffn + ffn * d
    return 4.0 * (layers * (linear + 2 * kv * hd * context) + d * vocab)


def model_config(name: str) -> ModelConfig:
    return resolve_config(MODELS.get(name, name))[0]


def prefill_flops(cfg: ModelConfig, prompt: int, n: int) -> float:
    """Model FLOPs of prefilling n prompts of `prompt` tokens and sampling one token each."""
    d, heads, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ffn, layers, vocab = cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    linear_macs = d * (heads + 2 * kv) * hd + heads * hd * d + d * 2 * ffn + ffn * d
    causal_pairs = prompt * (prompt + 1) / 2                       # (query, key) pairs a causal prompt scores
    attention_macs = 2 * heads * hd * causal_pairs                 # QK^T and PV
    per_seq = layers * (prompt * linear_macs + attention_macs) + d * vocab
    return 2.0 * n * per_seq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", nargs="*", default=[], help="engine_vs_vllm JSON files")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--core", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/cpu_roofline")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    probes = {"fma_peak_gflops": fma_peak_gflops, "gemm_2048_gflops": gemm_gflops,
              "onednn_packed_linear_256x512x3072_gflops": packed_linear_gflops, "stream_sum_gbs": stream_gbs,
              "read_gbs": read_gbs, "decode_gemv_gbs": decode_gemv_gbs}
    if simd.HOST_AVX512:
        probes["fma_peak16_gflops"] = fma_peak16_gflops
    samples: dict[str, list[float]] = {k: [] for k in probes}
    for _ in range(args.repeats):
        for k, fn in probes.items():
            samples[k].append(fn())
    med = {k: statistics.median(v) for k, v in samples.items()}
    # the core's capability (other jobs only ever lower a sample): the wider vectors' loop where the host has them
    peak = max(samples["fma_peak_gflops"] + samples.get("fma_peak16_gflops", []))
    bandwidth = max(samples["read_gbs"] + samples["decode_gemv_gbs"])   # the best read any probe reached
    cells, decode_cells = [], []
    for path in args.results:
        data = json.loads(Path(path).read_text())
        for c in data["cells"]:
            if c["N"] == 1 and "decode_tok_s" in c:
                nbytes = decode_bytes(model_config(c["model"]), c["P"] + 32)
                row = {"file": Path(path).name, "model": c["model"], "P": c["P"], "mb_per_token": nbytes / 1e6}
                for side in ("tokenplane", "vllm"):
                    row[f"{side}_tok_s"] = c["decode_tok_s"][side]
                    row[f"{side}_gbs"] = nbytes * c["decode_tok_s"][side] / 1e9
                row["ceiling_tok_s"] = bandwidth * 1e9 / nbytes
                row["ratio"] = c["decode_tok_s"]["tokenplane"] / c["decode_tok_s"]["vllm"]
                row["ratio_ceiling"] = row["ceiling_tok_s"] / c["decode_tok_s"]["vllm"]
                decode_cells.append(row)
            flops = prefill_flops(model_config(c["model"]), c["P"], c["N"])
            row = {"file": Path(path).name, "model": c["model"], "P": c["P"], "N": c["N"], "gflop": flops / 1e9}
            for side in ("tokenplane", "vllm"):
                t = statistics.median(c["prefill_cpu_s"][side])
                row[f"{side}_gflops"] = flops / t / 1e9
                row[f"{side}_of_peak"] = flops / t / 1e9 / peak
            row["ratio_ceiling_at_peak"] = peak / row["vllm_gflops"]
            cells.append(row)
    out = {"command": " ".join(sys.argv), "core": args.core, "load_before": load0, "load_after": os.getloadavg()[0],
           "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "samples": samples, "medians": med,
           "peak_gflops": peak, "prefill_cells": cells, "read_bandwidth_gbs": bandwidth, "decode_cells": decode_cells}
    Path(args.out + ".json").write_text(json.dumps(out, indent=1))
    lines = [f"# One core of this machine vs the engines' prefill ({out['when']})", "",
             f"Command: `python {out['command']}`; core {args.core}, 1 thread; load {load0:.1f} -> "
             f"{out['load_after']:.1f}; medians of {args.repeats} alternating samples.", "",
             "| probe | median | samples |", "|---|---:|---|"]
    for k, v in samples.items():
        lines.append(f"| {k} | {med[k]:.1f} | {', '.join(f'{x:.1f}' for x in v)} |")
    if cells:
        lines += ["", "Prefill cells (model FLOPs / median process CPU time of the max_tokens=1 run; of peak = of the best "
                  f"fma_peak / fma_peak16 sample ({peak:.1f} GFLOP/s); ceiling = the tokenplane / vLLM prefill ratio an engine at that "
                  "peak would reach against vLLM's measured rate in that cell):", "",
                  "| file | model | P | N | GFLOP | tokenplane GFLOP/s (of peak) | vLLM GFLOP/s (of peak) | ceiling |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in cells:
            lines.append(f"| {r['file']} | {r['model']} | {r['P']} | {r['N']} | {r['gflop']:.1f} | "
                         f"{r['tokenplane_gflops']:.1f} ({r['tokenplane_of_peak']:.0%}) | "
                         f"{r['vllm_gflops']:.1f} ({r['vllm_of_peak']:.0%}) | {r['ratio_ceiling_at_peak']:.2f} |")
    if decode_cells:
        lines += ["", f"Decode cells at N = 1 (bytes a step reads x the measured decode tok/s; bandwidth = the best read or "
                  f"decode_gemv sample, {bandwidth:.1f} GB/s; ceiling = the decode tok/s at that bandwidth, and its ratio "
                  "to vLLM's measured rate):", "",
                  "| file | model | P | MB per token | tokenplane tok/s (GB/s) | vLLM tok/s (GB/s) | ratio | ceiling tok/s | "
                  "ceiling ratio |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in decode_cells:
            lines.append(f"| {r['file']} | {r['model']} | {r['P']} | {r['mb_per_token']:.0f} | "
                         f"{r['tokenplane_tok_s']:.1f} ({r['tokenplane_gbs']:.1f}) | {r['vllm_tok_s']:.1f} "
                         f"({r['vllm_gbs']:.1f}) | {r['ratio']:.2f} | {r['ceiling_tok_s']:.1f} | "
                         f"{r['ratio_ceiling']:.2f} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
