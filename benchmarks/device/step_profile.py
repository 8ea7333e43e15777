"""Where a CUDA-graph decode step's host time goes: cProfile over decode steps of one model and batch (prepared for
the H200; `--smoke` runs it on the CPU test preset, eager).

    python benchmarks/device/step_profile.py --model qwen3-0.6b --batch 1 --steps 50
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_latency import add_seqs, step, sync  # noqa: E402

from tokenplane.engine import ModelRunner, load_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    name = "test-small" if args.smoke else args.model
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg, model = load_model(name, device=device, dtype=dtype, seed=0)
    per_seq = -(-(args.context + args.steps + 16) // 16) + 1
    runner = ModelRunner(model, cfg, num_blocks=args.batch * per_seq, block_size=16, device=device, dtype=dtype,
                         enforce_eager=not cuda, max_num_seqs=args.batch,
                         decode_kernel="padded" if cuda else "auto")
    seqs = add_seqs(runner, args.batch, args.context, cfg.vocab_size)
    for _ in range(5):
        step(runner, seqs, cfg.vocab_size)
    sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step(runner, seqs, cfg.vocab_size)
        sync(device)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(18)
    print(f"{name} batch {args.batch}, {args.steps} steps, per step ms: "
          f"{stats.total_tt * 1e3 / args.steps:.3f} (profiled)")
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
