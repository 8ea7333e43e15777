"""Max |logit difference| of the engine (CPU fast paths on: oneDNN-packed linears, vocabulary projection, chunked
prefill) against transformers on the same files, over a prefill and greedy decode steps. Beside it, both against a
float64 run of transformers on the same weights: how far each fp32 implementation sits from the exact logits, which
says whether a difference between the two is more than fp32 summation order (it varies with the CPU's kernels).
And transformers against itself: the same tokens through its KV cache (prefill in the same chunks, then one token
per step, as `generate` runs them) vs a full recompute of the sequence (the reference above). Both are transformers
in fp32 on the same weights; their difference is how far fp32 summation order alone moves its logits, the floor
under any bound between two fp32 implementations.

    PYTHONPATH=. python benchmarks/peers/exactness.py --models tiny-small tiny-large smollm2-135m-instruct

--out PREFIX also writes PREFIX.json and PREFIX.md (the figures, the command, the machine's load before and after).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from tokenplane.engine import ModelRunner, Sequence, load_model, save_pretrained_like


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["tiny-small", "tiny-large", "smollm2-135m-instruct"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=128, help="prefill in chunks of this many tokens (0: whole)")
    ap.add_argument("--batch", type=int, default=2, help="sequences decoding together (prompts of different lengths)")
    ap.add_argument("--out", default="", help="write PREFIX.json and PREFIX.md")
    args = ap.parse_args()
    rows = []
    load0 = os.getloadavg()[0]
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    for name in args.models:
        cfg, model = load_model(name, dtype=dtype, seed=0)
        with tempfile.TemporaryDirectory() as d:
            save_pretrained_like(model, cfg, d)
            hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="sdpa").eval()
            hf64 = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64,
                                                                     attn_implementation="sdpa").eval()
        runner = ModelRunner(model, cfg, num_blocks=args.batch * (-(-(args.prompt + args.steps + 1) // 16) + 1) + 8,
                             block_size=16, max_num_seqs=max(64, args.batch))
        ids = torch.randint(10, min(cfg.vocab_size, 32000), (args.prompt,), generator=torch.Generator().manual_seed(1))
        seqs = [Sequence(f"s{i}", ids.tolist()[: args.prompt - i * args.prompt // (2 * args.batch)])
                for i in range(args.batch)]
        for s in seqs:
            assert runner.prepare(s)
        same = True
        vectors: list[dict] = []
        caches = [transformers.DynamicCache() for _ in seqs]
        # transformers 5.x renames past_key_values to cache (the old name warns)
        cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
        fed = [0] * len(seqs)
        out = None
        while any(s.num_computed_tokens < s.num_tokens for s in seqs):
            out = runner.run(seqs, [args.chunk] * len(seqs)) if args.chunk > 0 else runner.run(seqs)
        for step in range(args.steps + 1):
            if step:
                for s, row in zip(seqs, out.logits):
                    s.append_token(int(row.argmax()))
                    assert runner.prepare(s)
                out = runner.run(seqs)
            for i, (s, row) in enumerate(zip(seqs, out.logits)):
                with torch.no_grad():
                    ref = hf(torch.tensor([s.token_ids])).logits[0, -1].double()
                    exact = hf64(torch.tensor([s.token_ids])).logits[0, -1]
                    step_len = args.chunk if step == 0 and args.chunk > 0 else len(s.token_ids)
                    while fed[i] < len(s.token_ids):     # transformers' own cached path, same chunks as ours
                        end = min(len(s.token_ids), fed[i] + step_len)
                        cached = hf(torch.tensor([s.token_ids[fed[i]:end]]), **{cache_kw: caches[i]},
                                    use_cache=True).logits[0, -1].double()
                        fed[i] = end
                vectors.append({"seq": i, "step": step, "vs_transformers": (row.double() - ref).abs().max().item(),
                                "ours_vs_float64": (row.double() - exact).abs().max().item(),
                                "transformers_vs_float64": (ref - exact).abs().max().item(),
                                "cached_vs_recompute": (cached - ref).abs().max().item(),
                                "cached_vs_float64": (cached - exact).abs().max().item(),
                                "max_abs_logit": exact.abs().max().item()})
                same &= int(row.argmax()) == int(ref.argmax())
        worst, ours64, hf_64, hf_self = (max(v[k] for v in vectors) for k in (
            "vs_transformers", "ours_vs_float64", "transformers_vs_float64", "cached_vs_recompute"))
        diffs = sorted(v["vs_transformers"] for v in vectors)
        print(f"{name} {args.dtype}: max |logit diff| vs transformers {worst:.2e} over a {args.prompt}-token prefill "
              f"(chunks of {args.chunk}) + {args.steps} decode steps, batch {args.batch}; argmax equal: {same}; vs float64 "
              f"transformers: ours {ours64:.2e}, transformers {args.dtype} {hf_64:.2e}; transformers cached vs its "
              f"full recompute {hf_self:.2e}", flush=True)
        rows.append({"model": name, "max_abs_diff_vs_transformers": worst, "argmax_equal": same,
                     "ours_vs_float64": ours64, "transformers_vs_float64": hf_64,
                     "transformers_cached_vs_recompute": hf_self, "diff_p50": diffs[len(diffs) // 2],
                     "vectors": len(diffs), "vectors_over_bound": sum(d > 1e-4 for d in diffs),
                     "worst_vectors": sorted(vectors, key=lambda v: -v["vs_transformers"])[:5]})
    if args.out:
        write(args, rows, load0)


def write(args: argparse.Namespace, rows: list[dict], load0: float) -> None:
    res = {"command": "PYTHONPATH=. python " + " ".join(["benchmarks/peers/exactness.py", *sys.argv[1:]]),
           "host": f"{platform.machine()}, {os.cpu_count()} CPUs", "torch": torch.__version__,
           "transformers": transformers.__version__, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_before": load0, "load_after": os.getloadavg()[0], "dtype": args.dtype, "prompt": args.prompt,
           "steps": args.steps, "chunk": args.chunk, "batch": args.batch, "bound": 1e-4, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines = [f"# Engine logits vs transformers ({args.dtype}, CPU)", "",
             f"{res['host']}; {res['when']}; torch {res['torch']}, transformers {res['transformers']}; load "
             f"{load0:.2f} -> {res['load_after']:.2f}. A {args.prompt}-token prefill (chunks of {args.chunk}) + "
             f"{args.steps} greedy decode steps, batch {args.batch}; max over every step and sequence. Bound: 1e-4.", "",
             f"Command: `{res['command']}`", "",
             "max abs diff: over every logit of every sequence and step (P50: of the per-vector maxima; over 1e-4: "
             "vectors whose max passes the bound). transformers cached vs recompute: transformers against itself "
             "(its KV-cache path vs a full recompute of the same tokens), the fp32 floor.", "",
             "| model | max abs diff vs transformers | P50 | over 1e-4 | argmax equal | ours vs float64 | "
             "transformers vs float64 | transformers cached vs recompute |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['max_abs_diff_vs_transformers']:.2e} | {r['diff_p50']:.2e} | "
                     f"{r['vectors_over_bound']} / {r['vectors']} | {r['argmax_equal']} | "
                     f"{r['ours_vs_float64']:.2e} | {r['transformers_vs_float64']:.2e} | "
                     f"{r['transformers_cached_vs_recompute']:.2e} |")
    lines += ["", "Worst vectors (each logit vector's max |diff|; float64 = transformers in float64 on the same tokens):", "",
              "| model | seq | step | ours vs transformers | ours vs float64 | transformers vs float64 | "
              "transformers cached vs recompute | transformers cached vs float64 | max abs logit |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        for v in r["worst_vectors"]:
            lines.append(f"| {r['model']} | {v['seq']} | {v['step']} | {v['vs_transformers']:.2e} | "
                         f"{v['ours_vs_float64']:.2e} | {v['transformers_vs_float64']:.2e} | "
                         f"{v['cached_vs_recompute']:.2e} | {v['cached_vs_float64']:.2e} | {v['max_abs_logit']:.1f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
