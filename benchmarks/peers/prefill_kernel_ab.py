"""Engine prefill step with the CPU prefill-attention kernel on and off (ModelRunner.prefill_kernel "cpu" vs
"varlen", flipped on one runner, the same code path), alternated within each repeat, 1 thread, fp32.

Each run prefills N fresh random prompts of P tokens in one ModelRunner.run (fresh prompts every run: the same ones
twice would hit the prefix cache); medians over the repeats after one untimed round; prints wall and thread-CPU ratios
(kernel / SDPA) and prefill tok/s.

    PYTHONPATH=. flock /tmp/bench.lock python benchmarks/peers/prefill_kernel_ab.py 3
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import time

import torch

from tokenplane.engine import ModelRunner, Sequence, load_model


def main() -> None:
    torch.set_num_threads(1)
    cells = [(2048, 1), (256, 1), (256, 8)]
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    print("load", os.getloadavg())
    for name in ["smollm2-135m-instruct", "tiny-large"]:
        cfg, model = load_model(name, dtype=torch.float32, seed=0)
        runner = ModelRunner(model, cfg, num_blocks=2048 // 16 * 8 + 16, block_size=16)
        vocab = min(cfg.vocab_size, 32000)
        rng = random.Random(0)
        for P, N in cells:
            res = {"cpu": [], "varlen": []}
            for r in range(reps + 1):
                order = ["cpu", "varlen"] if r % 2 == 0 else ["varlen", "cpu"]
                for v in order:
                    # fresh prompts per run: the same ones twice would hit the prefix cache
                    prompts = [[rng.randrange(10, vocab) for _ in range(P)] for _ in range(N)]
                    runner.prefill_kernel = v
                    seqs = [Sequence(f"{v}{r}{i}", list(p)) for i, p in enumerate(prompts)]
                    for s in seqs:
                        assert runner.prepare(s)
                    w, c = time.perf_counter(), time.thread_time()
                    runner.run(seqs)
                    w, c = time.perf_counter() - w, time.thread_time() - c
                    for s in seqs:
                        runner.free(s)
                    if r:
                        res[v].append((w, c))
            mw = {v: statistics.median(x[0] for x in res[v]) for v in res}
            mc = {v: statistics.median(x[1] for x in res[v]) for v in res}
            print(f"{name} P={P} N={N}: cpu-kernel {mw['cpu']*1e3:.0f} ms varlen {mw['varlen']*1e3:.0f} ms  "
                  f"wall x{mw['cpu']/mw['varlen']:.3f} cputime x{mc['cpu']/mc['varlen']:.3f}  "
                  f"tok/s {N*P/mw['cpu']:.0f} vs {N*P/mw['varlen']:.0f}  ", flush=True)
    print("load", os.getloadavg())


if __name__ == "__main__":
    main()
