"""Qwen3 decoder (Qwen3ForCausalLM): GQA with per-head q_norm/k_norm, no qkv bias, SwiGLU, RMSNorm, RoPE.

Module names follow transformers' except the packed `qkv_proj` / `gate_up_proj` (see `packed_modules`), so the loader
maps HF checkpoints 1:1. `forward` returns final-norm hidden states; `compute_logits` is apart so the runner projects
only the last position of each sequence onto the vocabulary.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenplane.engine import cpu_decode_stack, cpu_qkv_rope, cpu_small_gemm, greedy_screen
from tokenplane.engine.attention import AttentionMetadata, PagedAttention
from tokenplane.engine.config import ModelConfig
from tokenplane.engine.cpu_fused_norm import add_rms_norm_, fused_norm_applies
from tokenplane.engine.layers import (
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    VocabProjection,
    apply_rope,
    cpu_packing_available,
    rms_norm,
)


class DecoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """rows: project only these rows of the attention output (the last layer, when only some positions sample;
        every row's K/V is still written)."""
        qkv = self.qkv_proj(x)
        h, kvh, d, qk_size = self.num_heads, self.num_kv_heads, self.head_dim, self.q_size + self.kv_size
        attn = self.attn
        if cpu_qkv_rope.applies(qkv, attn.k_cache) and attn.v_cache is not None:
            # one compiled pass: norm + rope + KV-cache write (bit-identical rope; see cpu_qkv_rope)
            qw = self.q_norm.weight if self.qk_norm else None
            kw = self.k_norm.weight if self.qk_norm else None
            eps = self.q_norm.eps if self.qk_norm else 0.0
            q = cpu_qkv_rope.qkv_rope_write(qkv, h, kvh, d, qw, kw, eps, cos, sin, attn.k_cache, attn.v_cache,
                                            meta.slot_mapping)
            o = attn.attend(q, meta)
            return self.o_proj(o if rows is None else o[rows])
        # q and k side by side as [T, heads + kv_heads, d]: one norm and one rope for both (same values per head).
        qk = qkv[:, :qk_size].view(-1, h + kvh, d)
        v = qkv[:, qk_size:].view(-1, kvh, d)
        if self.qk_norm:
            w = torch.cat((self.q_norm.weight.expand(h, d), self.k_norm.weight.expand(kvh, d)))
            qk = rms_norm(qk, w, self.q_norm.eps)
        qk = apply_rope(qk, cos, sin)
        o = self.attn(qk[:, :h], qk[:, h:], v, meta)
        return self.o_proj(o if rows is None else o[rows])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(cfg, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        # Unfused residual adds in transformers' order, so float64 runs can match it to ~1e-12.
        # (the sublayer's output is fresh, so the sum goes in place there: a + x == x + a bit for bit)
        a = self.self_attn(self.input_layernorm(x), cos, sin, meta, rows)
        x = a.add_(x if rows is None else x[rows])
        return self.mlp(self.post_attention_layernorm(x)).add_(x)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))  # no init: loader fills
        self.layers = nn.ModuleList(DecoderLayer(cfg, qk_norm) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    # CPU fp32/fp64: residual adds fused into the next RMSNorm (cpu_fused_norm.py); a plain attribute so a benchmark
    # can compare both paths on one model.
    fused_norm = True
    # CPU decode steps of 1-16 rows (bf16: 1-8): the whole stack as compiled kernels over arrays (cpu_decode_stack.py)
    decode_stack = True
    prune_rows = True   # False: compute every row through the last layer, then select (the pre-pruning path)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """rows: return only these rows' hidden states. Every layer still computes all rows up to the last layer's
        attention (their K/V); from there on (o_proj, MLP, final norm: ~84% of a layer's GEMM FLOPs) only these rows,
        so a prefill of n tokens that samples once skips 1/num_layers of the work (the rows computed are the same
        math on a smaller GEMM)."""
        if rows is not None and not self.prune_rows:
            return self.forward(input_ids, positions, meta)[rows]
        if rows is None and self.decode_stack and self.fused_norm and cpu_decode_stack.applies(input_ids, meta):
            stack = cpu_decode_stack.stack_for(self)
            if stack is not None and input_ids.shape[0] <= stack.max_rows:
                return stack.forward(input_ids, positions, meta)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        n = len(self.layers)
        if not (self.fused_norm and fused_norm_applies(x, self.norm.weight)):
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, meta, rows if i + 1 == n else None)
            return self.norm(x)
        # vLLM's layout: each sublayer's fresh output takes the residual add inside the norm that follows it (the
        # next layer's input norm, or the final norm), so x is the residual stream and h the normed input.
        first = self.layers[0].input_layernorm
        h = add_rms_norm_(x, None, first.weight, first.eps)
        for i, layer in enumerate(self.layers):
            last = i + 1 == n
            a = layer.self_attn(h, cos, sin, meta, rows if last else None)
            if last and rows is not None:
                x = x[rows]
            post = layer.post_attention_layernorm
            h = add_rms_norm_(a, x, post.weight, post.eps)
            m = layer.mlp(h)
            nxt = self.norm if last else self.layers[i + 1].input_layernorm
            h = add_rms_norm_(m, a, nxt.weight, nxt.eps)
            x = m
        return h


class Qwen3ForCausalLM(nn.Module):
    qk_norm = True
    # HF tensor name part -> (packed module, shard index); shard sizes come from `packed_sizes`.
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DecoderModel(cfg, self.qk_norm)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.vocab_projection: VocabProjection | None = None   # CPU fast path, set by pack_cpu()
        self.greedy_screen: greedy_screen.GreedyScreen | None = None   # greedy_tokens' bf16 copy, made on first use

    def packed_sizes(self, packed: str) -> list[int]:
        c = self.cfg
        if packed == "qkv_proj":
            return [c.num_attention_heads * c.head_dim] + [c.num_key_value_heads * c.head_dim] * 2
        return [c.intermediate_size] * 2

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Flat token batch [T] -> final-norm hidden states [T, hidden] (or [len(rows), hidden])."""
        return self.model(input_ids, positions, meta, rows)

    def pack_cpu(self) -> bool:
        """oneDNN-packed copies of every linear and of the vocabulary projection, for CPU fp32/bf16 (a snapshot of
        the weights: call again after changing them). Returns False (and packs nothing) elsewhere."""
        weight = self.vocab_weight()
        cpu_decode_stack.invalidate(self.model)
        if not cpu_packing_available(weight):
            self.unpack_cpu()
            return False
        for m in self.modules():
            if isinstance(m, Linear) and m is not self.lm_head:
                m.pack_cpu()
        for m in self.modules():
            if isinstance(m, SwiGLU):
                m.pack_cpu()   # after its gate_up_proj: takes over that oneDNN copy as two halves
        self.vocab_projection = VocabProjection(weight)
        self.greedy_screen = None
        return True

    def unpack_cpu(self) -> None:
        cpu_decode_stack.invalidate(self.model)
        for m in self.modules():
            if isinstance(m, (Linear, SwiGLU)):
                m.unpack_cpu()
        self.vocab_projection = None
        self.greedy_screen = None

    def vocab_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def greedy_tokens(self, hidden: torch.Tensor, top_k: int = 0) -> tuple[list[int], np.ndarray | None] | None:
        """(each row's greedy token, with top_k > 0 each row's top_k largest logits sorted descending) from the
        vocabulary projection's greedy screen (greedy_screen.py), or None where it does not apply (not the fp32
        panel path) or cannot prove the answer: then project in full."""
        vp = self.vocab_projection
        if vp is None or vp.panels is None or not cpu_small_gemm.applies(hidden, greedy_screen.MAX_ROWS):
            return None
        if self.greedy_screen is None or self.greedy_screen.panels is not vp.panels:   # built on first use
            self.greedy_screen = greedy_screen.GreedyScreen(vp.weight, vp.panels)
        return self.greedy_screen.screen(hidden, top_k)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.vocab_weight()
        vp = self.vocab_projection
        if vp is not None and hidden.dtype == weight.dtype and hidden.device.type == "cpu":
            return vp(hidden)
        if hidden.device.type == "cpu":
            # [V, H] @ [H, B] streams the vocabulary matrix once; the default x @ W.T kernel (MKL/oneDNN) costs about
            # 2x from B = 2 on (151936 x 512 fp32: 772 -> 289 ms at B = 2, 1100 -> 463 ms at B = 16, measured here).
            return torch.mm(weight, hidden.t()).t().contiguous()
        return F.linear(hidden, weight)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]
