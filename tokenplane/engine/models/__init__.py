"""One file per architecture; `model_class(architecture)` picks it."""
from __future__ import annotations

from torch import nn


def model_class(architecture: str) -> type[nn.Module]:
    if architecture == "qwen3":
        from tokenplane.engine.models.qwen3 import Qwen3ForCausalLM
        return Qwen3ForCausalLM
    if architecture == "llama":
        from tokenplane.engine.models.llama import LlamaForCausalLM
        return LlamaForCausalLM
    raise ValueError(f"unsupported architecture {architecture!r}")
