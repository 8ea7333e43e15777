"""CITER (aiming-lab/CITER): route a token to the large model when the small model's confidence is below tau.
Commit pattern: the small token is replaced by the large model's token (exactly 1), then back to the small model.

Signals: "max_prob" (training-free: the small model's max softmax probability) or "router" (the official
`ConfidenceModel`: torchvision MLP(H, [2H, H], BatchNorm1d, ReLU) -> Linear(H, 1) -> sigmoid on the small model's
last hidden state; weights from a safetensors file, random-init from `seed` otherwise). Threshold 0.9 (README
example; the argparse default is 0.95).
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch
from torch import nn

from ..api import StepResult
from .base import Gate, OneTokenCorrection, load_weights, seeded


class ConfidenceModel(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        h = hidden_size
        # Same layout as torchvision.ops.MLP(h, [2h, h], norm_layer=BatchNorm1d) followed by the head.
        self.mlp = nn.Sequential(nn.Linear(h, 2 * h), nn.BatchNorm1d(2 * h), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(2 * h, h), nn.Dropout(0.1))
        self.head = nn.Linear(h, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.head(self.mlp(hidden))).squeeze(-1)


class CITER(OneTokenCorrection):
    name = "citer"
    gates = (Gate("switch", 0, "below"),)
    default_thresholds = {"switch": 0.9}

    def __init__(self, *, signal: Literal["max_prob", "router"] = "max_prob", router_weights: str | None = None,
                 **kwargs: Any):
        super().__init__(**kwargs)
        if signal not in ("max_prob", "router"):
            raise ValueError(f"citer: signal must be 'max_prob' or 'router', got {signal!r}")
        self.signal_name = signal
        self.router_weights = router_weights
        self.router: ConfidenceModel | None = None
        self._cast: dict[tuple, ConfidenceModel] = {}

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg.update(signal=self.signal_name, router_weights=self.router_weights)
        return cfg

    def confidence(self, result: StepResult) -> float:
        if self.signal_name == "max_prob":
            return result.max_prob()
        if result.hidden is None:
            raise ValueError("citer router needs the small model's hidden state in StepResult.hidden")
        if self.router is None:
            with seeded(self.seed):
                self.router = ConfidenceModel(int(result.hidden.shape[-1])).eval()
            if self.router_weights is not None:
                load_weights(self.router, self.router_weights)
        key = (result.hidden.dtype, result.hidden.device)
        if key not in self._cast:
            self._cast[key] = copy.deepcopy(self.router).to(device=result.hidden.device, dtype=result.hidden.dtype)
        with torch.no_grad():
            return float(self._cast[key](result.hidden[None])[0])

    def uses_logits(self, model: int) -> bool:
        """Only the max_prob signal (on model 0) reads logits; the router signal reads the hidden state."""
        return model == 0 and self.signal_name == "max_prob"

    def signal(self, gate: Gate, result: StepResult) -> float:
        return self.confidence(result)
