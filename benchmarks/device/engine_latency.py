"""Decode-step latency of the torch engine on a GPU, with and without CUDA graphs (prepared for an H200).

Random-weight qwen3-0.6b and qwen3-8b shapes (bfloat16), KV cache filled with random values at a fixed context,
decode step = ModelRunner.run() of B one-token sequences, timed with torch.cuda.synchronize() around each step.
Modes: "eager" (padded decode attention, no graphs), "graphs" (the same kernel captured per batch bucket and
block-table width, widths padding by at most 25%) and "graphs-pow2" (widths rounded up to powers of two). For each
(model, batch) the script also checks the benchmarked path against eager per-sequence (varlen) attention on one step
(max |logit difference|, argmax agreement), since CUDA graphs cannot be tested on the CPU machines.

    python benchmarks/device/engine_latency.py            # on the GPU machine; JSON to $OUT (or benchmarks/results)
    python benchmarks/device/engine_latency.py --smoke    # CPU: test presets, eager only, seconds

Budget: about 2-4 minutes on an H200 including model init and graph capture.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tokenplane.engine import ModelRunner, Sequence, load_model  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def add_seqs(runner: ModelRunner, batch: int, context: int, vocab: int) -> list[Sequence]:
    seqs = []
    for i in range(batch):
        s = Sequence(f"s{i}", [(i * 7919 + t) % vocab for t in range(context)])
        runner.block_manager.allocate(s)
        s.num_computed_tokens = context  # KV holds random values: latency does not depend on them
        seqs.append(s)
    return seqs


def step(runner: ModelRunner, seqs: list[Sequence], vocab: int):
    for s in seqs:
        s.append_token((s.token_ids[-1] + 1) % vocab)
        if not runner.prepare(s):
            raise RuntimeError("KV cache too small for the benchmark")
    return runner.run(seqs)


def check_against_varlen(runner: ModelRunner, seqs: list[Sequence], vocab: int) -> dict:
    """One decode step on the benchmarked path (graph or eager, padded attention), rolled back (BlockManager.truncate),
    then the same step eagerly with per-sequence varlen attention, the path the CPU tests check against
    transformers."""
    out_g = step(runner, seqs, vocab).logits.float()
    for s in seqs:
        tok = s.token_ids[-1]
        runner.block_manager.truncate(s, s.num_tokens - 1)
        s.append_token(tok)
        runner.prepare(s)
    saved = runner.use_cuda_graphs, runner.decode_kernel
    runner.use_cuda_graphs, runner.decode_kernel = False, "varlen"
    try:
        out_e = runner.run(seqs).logits.float()
    finally:
        runner.use_cuda_graphs, runner.decode_kernel = saved
    return {"max_abs_logit_diff": float((out_g - out_e).abs().max()),
            "argmax_agree": float((out_g.argmax(-1) == out_e.argmax(-1)).float().mean())}


def bench_mode(model, cfg, mode: str, args, device: torch.device) -> list[dict]:
    rows = []
    max_b = max(args.batches)
    extra = args.warmup + args.repeats + 4
    per_seq = -(-(args.context + extra) // args.block_size) + 1
    for batch in args.batches:
        runner = ModelRunner(model, cfg, num_blocks=batch * per_seq, block_size=args.block_size, device=device,
                             dtype=args.torch_dtype, enforce_eager=(mode == "eager"), max_num_seqs=max_b,
                             decode_kernel="padded")
        if mode == "graphs-pow2":
            runner.graph_width_steps = 1   # the baseline: block-table widths rounded up to powers of two
        runner.kv_cache.normal_(0, 1)
        seqs = add_seqs(runner, batch, args.context, cfg.vocab_size)
        capture_s = None
        if mode != "eager":
            t0 = time.perf_counter()
            runner.capture_graphs([batch], max_context=args.context + extra)
            sync(device)
            capture_s = time.perf_counter() - t0
        times = []
        for i in range(args.warmup + args.repeats):
            sync(device)
            t0 = time.perf_counter()
            step(runner, seqs, cfg.vocab_size)
            sync(device)
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        replay_ms = None
        if mode != "eager" and runner._graphs:
            # the captured graph alone (its GPU time and launch): what the step spends outside it is host work
            graph = runner._graphs[max(runner._graphs)][0]   # the widest: the one these steps replayed
            rt = []
            for _ in range(args.repeats):
                sync(device)
                t0 = time.perf_counter()
                graph.replay()
                sync(device)
                rt.append((time.perf_counter() - t0) * 1e3)
            replay_ms = statistics.median(rt)
        row = {"mode": mode, "batch": batch, "context": args.context, "median_ms": statistics.median(times),
               "graph_replay_ms": replay_ms,
               "p90_ms": sorted(times)[int(0.9 * (len(times) - 1))], "min_ms": min(times),
               "samples_ms": [round(t, 4) for t in times], "graph_capture_s": capture_s,
               "num_graphs": len(runner._graphs)}
        row["check_vs_varlen"] = check_against_varlen(runner, seqs, cfg.vocab_size)
        rows.append(row)
        print(f"  {mode:6s} batch {batch:4d}: median {row['median_ms']:8.3f} ms  p90 {row['p90_ms']:8.3f} ms"
              + (f"  replay alone {replay_ms:.3f} ms" if replay_ms is not None else "")
              + f"  check {row['check_vs_varlen']}", flush=True)
        del runner, seqs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def write(path: Path, meta: dict, results: list[dict], t_start: float) -> None:
    meta["wall_s"] = round(time.time() - t_start, 1)
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run: test presets, small batches, eager only")
    ap.add_argument("--models", nargs="+", default=None)
    ap.add_argument("--batches", nargs="+", type=int, default=None)
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--modes", nargs="+", default=None, choices=["eager", "graphs", "graphs-pow2"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        torch.set_num_threads(1)  # tiny matrices on a shared CPU: a second thread only spins
        defaults = dict(models=["test-small", "test-large"], batches=[1, 2, 4], context=64, repeats=3,
                        dtype="float32", modes=["eager"])
    else:
        if not cuda:
            print("no CUDA device: run with --smoke on CPU", file=sys.stderr)
            return 2
        defaults = dict(models=["qwen3-0.6b", "qwen3-8b"], batches=[1, 2, 4, 8, 16, 32, 64, 128], context=512,
                        repeats=30, dtype="bfloat16", modes=["eager", "graphs", "graphs-pow2"])
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.torch_dtype = getattr(torch, args.dtype)
    out_dir = args.out or Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "dtype": args.dtype, "context": args.context,
            "block_size": args.block_size, "warmup": args.warmup, "repeats": args.repeats, "smoke": args.smoke,
            "note": "random weights; KV filled with random values; step = ModelRunner.run() of B one-token "
                    "sequences incl. host-side batch preparation, sampling excluded; padded decode attention"}
    results: list[dict] = []
    t_start = time.time()
    path = out_dir / ("engine_latency_smoke.json" if args.smoke else "engine_latency.json")
    for name in args.models:
        t0 = time.perf_counter()
        cfg, model = load_model(name, device=device, dtype=args.torch_dtype, seed=0)
        sync(device)
        load_s = time.perf_counter() - t0
        print(f"{name}: {cfg.num_params / 1e9:.2f} B params, init {load_s:.1f} s", flush=True)
        for mode in args.modes:
            if mode != "eager" and not cuda:
                continue
            for row in bench_mode(model, cfg, mode, args, device):
                results.append({"model": name, "num_params": cfg.num_params, **row})
                write(path, meta, results, t_start)  # a run cut short still returns what it measured
        del model
        if cuda:
            torch.cuda.empty_cache()
    write(path, meta, results, t_start)
    print(f"wrote {path} in {meta['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
