"""The tensor names and shapes of an HF checkpoint for a model config (what save_pretrained_like writes, what the
loader and the GGUF converter map onto)."""
from __future__ import annotations

from tokenplane.engine.config import ModelConfig


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF checkpoint tensor names and shapes for this config (what save_pretrained_like writes)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv, ffn = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                       p + "mlp.down_proj.weight": (h, ffn)})
        if cfg.architecture == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,)})
        if cfg.mlp_bias:
            shapes.update({p + "mlp.gate_proj.bias": (ffn,), p + "mlp.up_proj.bias": (ffn,),
                           p + "mlp.down_proj.bias": (h,)})
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


__all__ = ["hf_tensor_shapes"]
