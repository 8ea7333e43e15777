"""Which operations put fp32 Llama logits away from float64: a float64 reference forward (transformers' op order,
weights from an HF directory) in which chosen op classes run in float32 (inputs rounded to fp32, the op in fp32, the
result widened), everything else in float64. Reported: max |logit - float64 logit| at the last position and over every
position, for each op class alone in fp32, every class but one, all of them, and the linears (qkv, o, gate/up, down,
lm_head) on each fp32 GEMM the engine could run: F.linear (transformers' call), oneDNN's packed linear, cpu_small_gemm.

    PYTHONPATH=. python benchmarks/peers/exactness_attribution.py --model /tmp/tokenplane-peer-models/smollm2-135m \\
        --out benchmarks/results/exactness_attribution
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tokenplane.engine import cpu_small_gemm
from tokenplane.engine.layers import cpu_pack, cpu_packed_linear

OPS = ["norm", "qkv", "rope", "attn", "o", "resid", "gateup", "act", "down", "head"]
LINEARS = {"qkv", "o", "gateup", "down", "head"}


class Reference:
    def __init__(self, directory: str) -> None:
        cfg = json.loads((Path(directory) / "config.json").read_text())
        self.sd = {k: v.double() for k, v in load_file(str(Path(directory) / "model.safetensors")).items()}
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.d = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        self.layers, self.eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
        self.theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
        self.vocab = cfg["vocab_size"]
        self.gemm = "flinear"
        self._packs: dict[tuple[str, str], torch.Tensor] = {}

    def linear32(self, name: str, x: torch.Tensor) -> torch.Tensor:
        w = self.sd[name]
        if self.gemm == "flinear":
            return F.linear(x, w.float())
        key = (self.gemm, name)
        if key not in self._packs:
            wf = w.float().contiguous()
            self._packs[key] = cpu_pack(wf) if self.gemm == "onednn" else cpu_small_gemm.pack(wf)
        p = self._packs[key]
        if self.gemm == "onednn":
            return cpu_packed_linear(x.contiguous(), p, None)
        # small_gemm: the engine's block size (k_block); small_gemm_k64: blocks of 64, the most accurate order
        kb = cpu_small_gemm.k_block(x.shape[1]) if self.gemm == "small_gemm" else 64
        return cpu_small_gemm._linear(x.contiguous(), p, kb, None)[:, :w.shape[0]]

    def op(self, kind: str, f32: set[str], fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
        if kind in f32:
            return fn(*[x.float() for x in xs]).double()
        return fn(*xs)

    def lin(self, kind: str, f32: set[str], name: str, x: torch.Tensor) -> torch.Tensor:
        if kind in f32:
            return self.linear32(name, x.float()).double()
        return F.linear(x, self.sd[name])

    def forward(self, ids: torch.Tensor, f32: set[str]) -> torch.Tensor:
        sd, d, eps, T = self.sd, self.d, self.eps, len(ids)

        def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:   # transformers' LlamaRMSNorm order
            return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

        def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return x * cos + torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1) * sin

        def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d ** -0.5, enable_gqa=True)

        x = sd["model.embed_tokens.weight"][ids]
        inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))   # float32, as HF
        freqs = torch.arange(T).float()[:, None] * inv[None]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos().double(), emb.sin().double()
        for i in range(self.layers):
            p = f"model.layers.{i}."
            h = self.op("norm", f32, norm, x, sd[p + "input_layernorm.weight"])
            q = self.lin("qkv", f32, p + "self_attn.q_proj.weight", h).view(T, self.heads, d).transpose(0, 1)
            k = self.lin("qkv", f32, p + "self_attn.k_proj.weight", h).view(T, self.kv_heads, d).transpose(0, 1)
            v = self.lin("qkv", f32, p + "self_attn.v_proj.weight", h).view(T, self.kv_heads, d).transpose(0, 1)
            q, k = self.op("rope", f32, rope, q, cos, sin), self.op("rope", f32, rope, k, cos, sin)
            o = self.op("attn", f32, attn, q, k, v).transpose(0, 1).reshape(T, self.heads * d)
            x = self.op("resid", f32, torch.add, x, self.lin("o", f32, p + "self_attn.o_proj.weight", o))
            h = self.op("norm", f32, norm, x, sd[p + "post_attention_layernorm.weight"])
            g = self.lin("gateup", f32, p + "mlp.gate_proj.weight", h)
            u = self.lin("gateup", f32, p + "mlp.up_proj.weight", h)
            a = self.op("act", f32, lambda g, u: F.silu(g) * u, g, u)
            x = self.op("resid", f32, torch.add, x, self.lin("down", f32, p + "mlp.down_proj.weight", a))
        h = self.op("norm", f32, norm, x, sd["model.norm.weight"])
        head = "lm_head.weight" if "lm_head.weight" in sd else "model.embed_tokens.weight"
        return self.lin("head", f32, head, h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an HF directory (config.json + model.safetensors)")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    ref = Reference(args.model)
    ids = torch.randint(10, min(ref.vocab, 32000), (args.tokens,), generator=torch.Generator().manual_seed(1))
    rows = []
    with torch.no_grad():
        exact = ref.forward(ids, set())

        def measure(label: str, f32: set[str], gemm: str = "flinear") -> None:
            ref.gemm = gemm
            e = (ref.forward(ids, f32) - exact).abs()
            rows.append({"fp32": label, "gemm": gemm, "last": e[-1].max().item(), "all_positions": e.max().item(),
                         "mean": e.mean().item()})
            print(f"{label:28s} {gemm:8s} last {rows[-1]['last']:.2e}  all positions {rows[-1]['all_positions']:.2e}"
                  f"  mean {rows[-1]['mean']:.2e}", flush=True)

        measure("all", set(OPS))
        for kind in OPS:
            measure(f"{kind} only", {kind})
        for kind in OPS:
            measure(f"all but {kind}", set(OPS) - {kind})
        for gemm in ("flinear", "onednn", "small_gemm", "small_gemm_k64"):
            measure("layer linears only", LINEARS - {"head"}, gemm)
            measure("head only", {"head"}, gemm)
            measure("all", set(OPS), gemm)
    if args.out:
        res = {"command": "PYTHONPATH=. python " + " ".join(["benchmarks/peers/exactness_attribution.py", *sys.argv[1:]]),
               "host": f"{platform.machine()}, {os.cpu_count()} CPUs", "torch": torch.__version__,
               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": load0,
               "load_after": os.getloadavg()[0], "model": args.model, "tokens": args.tokens,
               "k_block": {k: cpu_small_gemm.probe_k_block(k) for k in (576, 1536)}, "rows": rows}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(res, indent=1))
        lines = ["# fp32 error attribution: op classes in fp32 inside a float64 Llama forward", "",
                 f"{res['host']}; {res['when']}; torch {res['torch']}; load {load0:.2f} -> {res['load_after']:.2f}; "
                 f"{args.model}, {args.tokens} random tokens (seed 1, as exactness.py). Max |logit - float64 logit|. "
                 "gemm: the fp32 linear used (flinear = F.linear, transformers' call; onednn = the packed linear the "
                 f"engine's prefill ran before; small_gemm = cpu_small_gemm, k blocks {res['k_block']}; small_gemm_k64: "
                 "its kernel with blocks of 64, its order before).", "",
                 f"Command: `{res['command']}`", "",
                 "| in fp32 | gemm | last position | all positions | mean |", "|---|---|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['fp32']} | {r['gemm']} | {r['last']:.2e} | {r['all_positions']:.2e} | "
                         f"{r['mean']:.2e} |")
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
