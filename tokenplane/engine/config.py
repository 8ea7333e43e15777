"""Model shape and rope settings, read from an HF config.json dict; presets for tests, CPU benchmarks and GPUs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
HF_ARCHITECTURE = {v: k for k, v in ARCHITECTURES.items()}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "qwen3" | "llama"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    rope_scaling: dict[str, Any] | None = None  # HF rope_parameters minus rope_theta; None or rope_type "default"
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_range: float = 0.02
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read an HF config.json dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
        arch = hf.get("architecture")
        if arch is None:
            names = hf.get("architectures") or []
            model_type = hf.get("model_type")
            arch = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
            if arch is None and model_type in HF_ARCHITECTURE:
                arch = model_type
        if arch not in HF_ARCHITECTURE:
            raise ValueError(f"unsupported architecture {hf.get('architectures') or hf.get('model_type')!r}; "
                             f"supported: {sorted(ARCHITECTURES)}")
        heads = int(hf["num_attention_heads"])
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, llama3)")
        if rope_type == "default":
            rope = {}
        head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // heads
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}")
        if hf.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(hf["intermediate_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_scaling=rope or None,
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            eos_token_id=hf.get("eos_token_id"),
        )

    def to_hf(self) -> dict[str, Any]:
        """An HF config.json dict that transformers (4.45+ and 5.x) loads into the same architecture."""
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        out: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURE[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "rope_scaling": None if rope["rope_type"] == "default" else {k: v for k, v in rope.items()
                                                                        if k != "rope_theta"},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "initializer_range": self.initializer_range,
            "torch_dtype": "float32",
        }
        if self.architecture == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.eos_token_id is not None:
            out["eos_token_id"] = self.eos_token_id
        return out

    @property
    def num_params(self) -> int:
        h, L, v = self.hidden_size, self.num_hidden_layers, self.vocab_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size
        return L * per_layer + v * h * (1 if self.tie_word_embeddings else 2)


def _qwen3(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int = 151936, head_dim: int = 64,
           tie: bool = False, max_pos: int = 40960) -> dict[str, Any]:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab, "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "intermediate_size": ffn, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": max_pos, "tie_word_embeddings": tie,
            "attention_bias": False, "eos_token_id": 151645 if vocab > 151645 else None}


# HF-style config dicts. tiny-* keep the real Qwen3 vocabulary, so the vocabulary projection dominates a small-model
# step on CPU (see shared/research/engine-cpu-facts.md); test-* are for unit tests.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-small": _qwen3(256, 4, 4, 2, 768),
    "tiny-large": _qwen3(512, 8, 8, 4, 1536),
    "test-small": _qwen3(64, 2, 4, 2, 128, vocab=512, head_dim=16, max_pos=4096),
    "test-large": _qwen3(96, 3, 6, 2, 192, vocab=512, head_dim=16, max_pos=4096),
    "test-llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                   "intermediate_size": 128, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                   "max_position_embeddings": 16384, "tie_word_embeddings": True,
                   "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}},
    "qwen3-0.6b": _qwen3(1024, 28, 16, 8, 3072, head_dim=128, tie=True),
    "qwen3-8b": _qwen3(4096, 36, 32, 8, 12288, head_dim=128),
}
