"""Where a ModelRunner step's time goes: torch.profiler over decode steps (B sequences, `--context` cached tokens).
1 thread by default.

The prompt's blocks are allocated at once (consecutive, as admission does) and decode blocks as they are needed,
interleaved across sequences (as in serving). `--random-kv` skips the prefill and fills the KV cache with random
values instead (step time does not depend on the values; a 64 x 256 SmolLM2 prefill would take a minute here).

    PYTHONPATH=. python benchmarks/peers/profile_step.py --model tiny-small --batch 1 16
    PYTHONPATH=. python benchmarks/peers/profile_step.py --model smollm2-135m-instruct --batch 64 --random-kv
"""
from __future__ import annotations

import argparse
import time

import torch

from tokenplane.engine import ModelRunner, Sequence, load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-small")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--rows", type=int, default=14)
    ap.add_argument("--random-kv", action="store_true", help="fill the KV cache randomly instead of prefilling")
    ap.add_argument("--no-profile", action="store_true", help="time only (no profiler overhead)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg, model = load_model(args.model, dtype=getattr(torch, args.dtype))
    for B in args.batch:
        per = -(-(args.context + args.steps + 40) // 16)
        runner = ModelRunner(model, cfg, num_blocks=B * per + 8, block_size=16, decode_kernel=args.kernel)
        seqs = [Sequence(f"s{i}", [(i * 31 + t) % 1000 for t in range(args.context)]) for i in range(B)]
        for s in seqs:
            runner.prepare(s)
        t0 = time.perf_counter()
        if args.random_kv:
            runner.kv_cache.normal_(0, 1, generator=torch.Generator().manual_seed(0))
            for s in seqs:
                s.num_computed_tokens = s.num_tokens - 1
            runner.run(seqs)
        else:
            runner.run(seqs)
        t_prefill = time.perf_counter() - t0

        def decode():
            for s in seqs:
                s.append_token(7)
                runner.prepare(s)
            runner.run(seqs)
        for _ in range(3):
            decode()
        if args.no_profile:
            ts = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                decode()
                ts.append(time.perf_counter() - t0)
            ts.sort()
            print(f"== {args.model} B={B} ctx={args.context}: decode step median {ts[len(ts) // 2]*1e3:.1f} ms "
                  f"min {ts[0]*1e3:.1f} ms ({B/ts[len(ts) // 2]:.1f} tok/s)", flush=True)
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                decode()
            t = (time.perf_counter() - t0) / args.steps
        print(f"== {args.model} B={B} ctx={args.context}: prefill {t_prefill*1e3:.0f} ms "
              f"({B*args.context/t_prefill:.0f} tok/s), decode step {t*1e3:.1f} ms ({B/t:.1f} tok/s)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
