"""Co-LLM (clinicalml/co-llm): the base (small) model's deferral head gives P(defer); when it exceeds eta the base
token is discarded and the assistant (large) model generates exactly one token, which is accepted ("defer"
strategy), then generation returns to the base model.

Signals: "head" (official: a linear probe g on the base's last hidden state, P(defer) = sigmoid(g . h + b), the extra
`<|defer|>` row of the LM head; weights `weight` [H] (+ optional `bias`) from a safetensors file, random-init from
`seed` otherwise) or "max_prob" (training-free: P(defer) = 1 - max softmax probability). eta = 0.5 by default;
Co-LLM itself calibrates eta to a target deferral portion, which is this package's calibrated mode.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from ..api import StepResult
from .base import Gate, OneTokenCorrection, seeded


class CoLLM(OneTokenCorrection):
    name = "co_llm"
    gates = (Gate("switch", 0, "above"),)
    default_thresholds = {"switch": 0.5}

    def __init__(self, *, signal: Literal["head", "max_prob"] = "head", head_weights: str | None = None,
                 **kwargs: Any):
        super().__init__(**kwargs)
        if signal not in ("head", "max_prob"):
            raise ValueError(f"co_llm: signal must be 'head' or 'max_prob', got {signal!r}")
        self.signal_name = signal
        self.head_weights = head_weights
        self.weight: torch.Tensor | None = None
        self.bias = 0.0

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg.update(signal=self.signal_name, head_weights=self.head_weights)
        return cfg

    def _build(self, hidden_size: int) -> None:
        if self.head_weights is not None:
            from safetensors.torch import load_file
            t = load_file(str(self.head_weights))
            if "weight" not in t:
                raise ValueError(f"{self.head_weights}: deferral head needs a 'weight' tensor of shape [{hidden_size}]")
            w = t["weight"].reshape(-1)
            if w.numel() != hidden_size:
                raise ValueError(f"{self.head_weights}: weight has {w.numel()} values, hidden size is {hidden_size}")
            self.weight = w
            self.bias = float(t["bias"].reshape(-1)[0]) if "bias" in t else 0.0
        else:
            with seeded(self.seed):
                self.weight = torch.randn(hidden_size) / hidden_size ** 0.5

    def defer_prob(self, result: StepResult) -> float:
        if self.signal_name == "max_prob":
            return 1.0 - result.max_prob()
        if result.hidden is None:
            raise ValueError("co_llm deferral head needs the base model's hidden state in StepResult.hidden")
        if self.weight is None:
            self._build(int(result.hidden.shape[-1]))
        h = result.hidden
        assert self.weight is not None   # _build sets it
        logit = torch.dot(self.weight.to(device=h.device, dtype=h.dtype), h) + self.bias
        return float(torch.sigmoid(logit))

    def uses_logits(self, model: int) -> bool:
        """Only the max_prob signal (on model 0) reads logits; the router signal reads the hidden state."""
        return model == 0 and self.signal_name == "max_prob"

    def signal(self, gate: Gate, result: StepResult) -> float:
        return self.defer_prob(result)
