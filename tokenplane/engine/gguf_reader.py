"""Read a GGUF checkpoint (Llama or Qwen3) into HF-named float32 tensors and an HF config.json dict.

Contract. `read_gguf` checks everything that can be checked without dequantizing: the architecture, every tensor's
type (F32, F16, Q8_0, Q4_0, Q4_1), that every tensor name maps to an HF name, and that the names and shapes are
exactly those of the HF checkpoint the config describes (`hf_layout.hf_tensor_shapes`). Anything else fails closed with
a ModelArtifactError naming what is unsupported. `GGUFModel.tensors()` then yields (HF name, float32 array) with the
quantized blocks expanded by `gguf.quants.dequantize` and, for Llama, the Q/K row permutation that llama.cpp's
converter applies for its rope layout undone (per head: n_head for q_proj, n_head_kv for k_proj). Qwen3 GGUFs are
not permuted (llama.cpp runs them with NeoX rope, the HF layout). A GGUF without `output.weight` has tied embeddings.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenplane.engine.artifacts import ModelArtifactError
from tokenplane.engine.config import HF_ARCHITECTURE, ModelConfig

SUPPORTED_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
PERMUTED_QK = {"llama"}  # architectures whose q/k rows llama.cpp's converter permutes

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_UNSUPPORTED_NAMES = {"rope_freqs": "rope frequency factors (llama3/longrope rope scaling)"}


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF name; ModelArtifactError for a tensor the engine has no place for."""
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    why = _UNSUPPORTED_NAMES.get(base.split(".")[-1] if m is None else m.group(2), "no HF counterpart")
    raise ModelArtifactError(f"unsupported GGUF tensor {gguf_name!r} ({why})")


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute`: within each head, rows (half, 2) -> (2, half) (the inverse of its swap)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _value(field: Any) -> Any:
    from gguf import GGUFValueType

    v = field.contents()
    if field.types and field.types[0] == GGUFValueType.FLOAT32:
        v = float(str(np.float32(v)))  # the shortest decimal of the stored float32 (1e-05, not 9.9999997e-06)
    return v


@dataclass
class GGUFModel:
    path: Path
    metadata: dict[str, Any]       # scalar key/values (no token lists)
    config: ModelConfig
    hf_config: dict[str, Any]      # config.json
    tensor_types: dict[str, int]   # GGML type name -> tensor count
    _reader: Any

    @property
    def num_tensors(self) -> int:
        return len(self._reader.tensors)

    def field(self, key: str, default: Any = None) -> Any:
        f = self._reader.fields.get(key)
        return default if f is None else _value(f)

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, float32 array in HF layout), in file order; one tensor in memory at a time."""
        from gguf.quants import dequantize

        heads = {"self_attn.q_proj": self.config.num_attention_heads,
                 "self_attn.k_proj": self.config.num_key_value_heads}
        permuted = self.config.architecture in PERMUTED_QK
        for t in self._reader.tensors:
            name = hf_name(t.name)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGML lists dims fastest-first
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            if permuted:
                for part, n in heads.items():
                    if f".{part}." in name:
                        w = unpermute_rows(w, n)
            yield name, np.ascontiguousarray(w)


def _hf_config(reader: Any, path: Path, names: set[str]) -> dict[str, Any]:
    def get(key: str, default: Any = ...) -> Any:
        f = reader.fields.get(key)
        if f is None:
            if default is ...:
                raise ModelArtifactError(f"{path}: GGUF metadata lacks {key!r}")
            return default
        return _value(f)

    arch = get("general.architecture")
    if arch not in HF_ARCHITECTURE:
        raise ModelArtifactError(f"{path}: unsupported GGUF architecture {arch!r}; "
                                 f"supported: {sorted(HF_ARCHITECTURE)}")
    p = arch + "."
    heads, hidden = int(get(p + "attention.head_count")), int(get(p + "embedding_length"))
    head_dim = int(get(p + "attention.key_length", hidden // heads))
    if int(get(p + "attention.value_length", head_dim)) != head_dim:
        raise ModelArtifactError(f"{path}: unsupported: attention.value_length != key_length")
    if int(get(p + "rope.dimension_count", head_dim)) != head_dim:
        raise ModelArtifactError(f"{path}: unsupported: partial rotary embedding (rope.dimension_count != head_dim)")
    scaling = get(p + "rope.scaling.type", "none")
    if scaling != "none":
        raise ModelArtifactError(f"{path}: unsupported rope scaling {scaling!r}")
    if int(get(p + "expert_count", 0)):
        raise ModelArtifactError(f"{path}: unsupported: mixture-of-experts layers ({p}expert_count)")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = get(p + "vocab_size", None) or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab = int(embd.shape[-1])
    hf: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURE[arch]], "model_type": arch, "vocab_size": int(vocab),
        "hidden_size": hidden, "num_hidden_layers": int(get(p + "block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(get(p + "attention.head_count_kv", heads)), "head_dim": head_dim,
        "intermediate_size": int(get(p + "feed_forward_length")), "hidden_act": "silu",
        "rms_norm_eps": float(get(p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get(p + "context_length")),
        "tie_word_embeddings": "lm_head.weight" not in names,
        "attention_bias": any(n.endswith("self_attn.q_proj.bias") for n in names),
        "mlp_bias": any(n.endswith("mlp.up_proj.bias") for n in names),
        "eos_token_id": get("tokenizer.ggml.eos_token_id", None),
    }
    out = ModelConfig.from_hf(hf).to_hf()
    if (bos := get("tokenizer.ggml.bos_token_id", None)) is not None:
        out["bos_token_id"] = int(bos)
    return out


def read_gguf(path: str | Path) -> GGUFModel:
    """Open and validate a GGUF file (memory-mapped; nothing is dequantized yet)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelArtifactError("reading GGUF files needs the `gguf` package (`pip install gguf`, in the engine "
                                 "extra)") from None

    from tokenplane.engine.hf_layout import hf_tensor_shapes

    path = Path(path)
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise ModelArtifactError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    types = Counter(t.tensor_type.name for t in reader.tensors)
    bad = sorted(set(types) - set(SUPPORTED_TYPES))
    if bad:
        which = [t.name for t in reader.tensors if t.tensor_type.name in bad][:3]
        raise ModelArtifactError(f"{path}: unsupported GGUF tensor type(s) {bad} (e.g. {which}); "
                                 f"supported: {list(SUPPORTED_TYPES)}")
    shapes = {hf_name(t.name): tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    hf = _hf_config(reader, path, set(shapes))
    cfg = ModelConfig.from_hf(hf)
    want = hf_tensor_shapes(cfg)
    missing, extra = sorted(set(want) - set(shapes)), sorted(set(shapes) - set(want))
    if missing or extra:
        raise ModelArtifactError(f"{path}: tensors do not match a {cfg.architecture} checkpoint: "
                                 f"missing {missing[:4]}, unexpected {extra[:4]}")
    wrong = [(n, shapes[n], s) for n, s in want.items() if shapes[n] != s]
    if wrong:
        raise ModelArtifactError(f"{path}: tensor shape(s) disagree with the metadata: {wrong[:3]}")
    meta = {k: _value(f) for k, f in reader.fields.items()
            if not k.startswith("tokenizer.ggml.") or k.endswith("_id") or k.endswith(("model", "pre"))}
    return GGUFModel(path, meta, cfg, hf, dict(sorted(types.items())), reader)
