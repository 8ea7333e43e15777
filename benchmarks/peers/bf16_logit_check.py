"""bf16 prefill attention's effect on logits: a model's 2,048-token prompt prefilled as 8 sequences of 256 * k tokens
(the last 256 a chunk over the 256 * (k - 1) cached before it), the last row's logits in bf16 with the CPU prefill
kernel ("auto") and with SDPA ("varlen"), against the same weights in float32. 1 thread.

    PYTHONPATH=. taskset -c 1 python benchmarks/peers/bf16_logit_check.py /tmp/tokenplane-peer-models/smollm2-135m
"""
from __future__ import annotations

import random
import sys

import torch

from tokenplane.engine import load_model
from tokenplane.engine.model_runner import ModelRunner
from tokenplane.engine.sequence import Sequence


def last_row_logits(path: str, prompt: list[int], dtype: torch.dtype, kernel: str) -> tuple[torch.Tensor, bool]:
    cfg, model = load_model(path, dtype=torch.float32)
    runner = ModelRunner(model.to(dtype), cfg, num_blocks=300, block_size=16, prefill_kernel=kernel)
    out = []
    for k in range(1, 9):
        s = Sequence(f"a{k}", prompt[:256 * k])
        assert runner.prepare(s)
        if k > 1:
            runner.run([s], num_new_tokens=[256 * (k - 1)])
        out.append(runner.run([s]).logits[0].double())   # the last 256 tokens, over the cached ones
        runner.free(s)
    return torch.stack(out), runner.uses_cpu_prefill()


def main() -> None:
    torch.set_num_threads(1)
    path = sys.argv[1]
    rng = random.Random(0)
    prompt = [rng.randint(10, 31999) for _ in range(2048)]
    ref, _ = last_row_logits(path, prompt, torch.float32, "varlen")
    for kernel in ("auto", "varlen"):
        got, used = last_row_logits(path, prompt, torch.bfloat16, kernel)
        d = (got - ref).abs()
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"bf16 {kernel:6s} (cpu prefill kernel: {used}): max |diff| {d.max():.4f} mean {d.mean():.4f} "
              f"argmax agree {agree:.3f}")


if __name__ == "__main__":
    main()
