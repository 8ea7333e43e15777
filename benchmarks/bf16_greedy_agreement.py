"""bf16 greedy continuations of tokenplane's engine against transformers, one flag of the engine at a time.

bf16 inference has no single exact answer (every kernel rounds in its own order), so the measurable criterion is
agreement with the reference engine: for each prompt, how many greedy tokens tokenplane's LLMEngine (bf16) produces
before its first difference from transformers' `generate` in bf16, and in fp32. Run once per setting of a switch
(`--flag module:NAME`, a one-item list such as cpu_prefill_attention.PAIRS), so a fast path is judged by whether it
changes what the engine answers. Prompts: GSM8K questions (real text, the model's own tokenizer family) and
random-token prompts as benchmarks/peers/engine_vs_vllm.py sends them.

    taskset -c 1 python benchmarks/bf16_greedy_agreement.py --flag cpu_prefill_attention:PAIRS \
        --out benchmarks/results/bf16_greedy_agreement_zen4
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tokenplane.engine import LLMEngine, SamplingParams  # noqa: E402

GSM8K = ROOT.parent / "shared" / "data" / "routing" / "gsm8k_test.jsonl"


def prompts(n_real: int, n_random: int, lengths: list[int], vocab: int) -> list[tuple[str, list[int]]]:
    out: list[tuple[str, list[int]]] = []
    if n_real and GSM8K.exists():
        import tokenplane
        tok = tokenplane.load("smollm2")
        with open(GSM8K) as f:
            for i, line in enumerate(f):
                if i >= n_real:
                    break
                q = json.loads(line)["question"]
                out.append((f"gsm8k-{i}", [int(t) for t in tok.encode(f"Question: {q}\nAnswer:")]))
    for length in lengths:
        rng = random.Random(length)
        for i in range(n_random):
            out.append((f"random-{length}-{i}", [rng.randint(10, min(vocab, 32000) - 1) for _ in range(length)]))
    return out


def agree(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default="/tmp/tokenplane-peer-models/smollm2-135m")
    ap.add_argument("--flag", required=True, help="module:NAME of a one-item switch list in tokenplane.engine")
    ap.add_argument("--real", type=int, default=8, help="GSM8K prompts")
    ap.add_argument("--random", type=int, default=3, help="random-token prompts per length")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/bf16_greedy_agreement")
    args = ap.parse_args()
    torch.set_num_threads(1)
    module, name = args.flag.split(":")
    switch = getattr(importlib.import_module(f"tokenplane.engine.{module}"), name)
    cfg = json.loads((Path(args.model_dir) / "config.json").read_text())
    ps = prompts(args.real, args.random, args.lengths, cfg["vocab_size"])
    longest = max(len(p) for _, p in ps) + args.gen + 16
    started, t0, load0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.time(), os.getloadavg()
    outs: dict[str, list[list[int]]] = {}
    for setting in (True, False):
        switch[0] = setting
        eng = LLMEngine(args.model_dir, dtype=torch.bfloat16, num_blocks=longest // 16 * 2 + 32, block_size=16,
                        max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=longest, enforce_eager=True,
                        num_threads=1)
        sp = SamplingParams(temperature=0.0, max_tokens=args.gen, ignore_eos=True)
        outs[f"{name}={setting}"] = [eng.generate([p], sp)[0] for _, p in ps]
    from transformers import AutoModelForCausalLM
    for dtype in (torch.bfloat16, torch.float32):
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).eval()
        rows = []
        with torch.no_grad():
            for _, p in ps:
                o = model.generate(torch.tensor([p]), max_new_tokens=args.gen, min_new_tokens=args.gen,
                                   do_sample=False)
                rows.append(o[0, len(p):].tolist())
        outs[f"transformers-{str(dtype).removeprefix('torch.')}"] = rows
    ref_b, ref_f = outs["transformers-bfloat16"], outs["transformers-float32"]
    table = []
    for i, (label, p) in enumerate(ps):
        row = {"prompt": label, "tokens": len(p)}
        for key in outs:
            if key.startswith(name):
                row[f"{key} vs transformers-bf16"] = agree(outs[key][i], ref_b[i])
                row[f"{key} vs transformers-fp32"] = agree(outs[key][i], ref_f[i])
        row["transformers bf16 vs fp32"] = agree(ref_b[i], ref_f[i])
        row[f"{name}=True vs {name}=False"] = agree(outs[f"{name}=True"][i], outs[f"{name}=False"][i])
        table.append(row)
    cmd = "python benchmarks/bf16_greedy_agreement.py " + " ".join(sys.argv[1:])
    res = {"started": started, "host": f"{platform.machine()}, {os.cpu_count()} CPUs", "load_before": load0,
           "load_after": os.getloadavg(), "wall_s": round(time.time() - t0, 1), "command": cmd, "gen": args.gen,
           "rows": table}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(res, indent=1))
    cols = [k for k in table[0] if k not in ("prompt", "tokens")]
    lines = [f"# bf16 greedy agreement with transformers: {args.flag} on / off (SmolLM2-135M, 1 thread)", "",
             f"{res['host']}; {started}; load {load0[0]:.1f} -> {res['load_after'][0]:.1f}; {res['wall_s']} s; `{cmd}`.",
             "", f"Cells: greedy tokens (of {args.gen}) equal before the first difference.", "",
             "| prompt | tokens | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for r in table:
        lines.append(f"| {r['prompt']} | {r['tokens']} | " + " | ".join(str(r[c]) for c in cols) + " |")
    full = {c: sum(r[c] == args.gen for r in table) for c in cols}
    lines += ["", "Prompts with all tokens equal: " + "; ".join(f"{c} {n}/{len(table)}" for c, n in full.items()) + "."]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(range(len(cols)), [sum(r[c] for r in table) / len(table) for c in cols])
    ax.set_yticks(range(len(cols)), cols, fontsize=7)
    ax.set_xlabel(f"mean greedy tokens equal before the first difference (of {args.gen})")
    ax.set_title(f"bf16 greedy agreement, {len(table)} prompts")
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
