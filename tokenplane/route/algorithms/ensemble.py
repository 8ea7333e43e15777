"""ME: token-level ensemble in the GaC style ("Generation as Classification"), with 2 or 3 models.

The primary (model 0) decodes alone while its max probability is above the gate threshold t. At a gated position
its sampled token is dropped; every peer catches up on its unseen suffix and returns its next-token distribution at
that position (a score visit: no token); the primary commits argmax(sum_i w_i p_i) for all models. `always=True`
ensembles every position. Peers' distributions travel as their top-k (ids, probs) (`topk`, default 128; 0 = the
full vocabulary), so the combination is exact on each peer's top-k and identical in every runtime.
Committed tokens are the ensemble argmax (greedy); sampling from the mixture is not implemented.
"""

from __future__ import annotations

from typing import Any

import torch

from ..api import Handoff, RequestView, StepResult
from .base import Gate, ThresholdAlgorithm


class Ensemble(ThresholdAlgorithm):
    name = "ensemble"
    gates = (Gate("gate", 0, "at_most"),)
    default_thresholds = {"gate": 0.5}
    default_rates = {"gate": 0.2}

    def __init__(self, *, num_models: int = 2, weights: list[float] | None = None, always: bool = False,
                 topk: int = 128, **kwargs: Any):
        if num_models not in (2, 3):
            raise ValueError(f"ensemble: num_models must be 2 or 3, got {num_models}")
        super().__init__(num_models=num_models, **kwargs)
        weights = [1.0] * num_models if weights is None else [float(w) for w in weights]
        if len(weights) != num_models or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"ensemble: need {num_models} non-negative weights with a positive sum, got {weights}")
        total = sum(weights)
        self.weights = [w / total for w in weights]
        self.always = bool(always)
        if topk < 0:
            raise ValueError(f"ensemble: topk must be >= 0, got {topk}")
        self.topk = int(topk)

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg.update(weights=list(self.weights), always=self.always, topk=self.topk)
        return cfg

    def calibration_gates(self) -> list[Gate]:
        return [] if self.always else super().calibration_gates()

    def signal(self, gate: Gate, result: StepResult) -> float:
        return result.max_prob()

    def ensemble_peers(self, result: StepResult, req: RequestView) -> list[int]:
        if result.model != self.primary:
            return []
        if self.always or self.decide(self.gates[0], result, req):
            return list(range(1, self.num_models))
        return []

    def route(self, result: StepResult, req: RequestView) -> int:
        return result.model   # ME never switches: peers only score

    def keep_last(self, result: StepResult, req: RequestView, target: int) -> bool:
        return False          # the primary's token at a gated position is replaced by the ensemble's

    def send(self, req: RequestView, result: StepResult, target: int) -> Handoff:
        h = super().send(req, result, target)
        h.metadata["score"] = True
        return h

    def score(self, result: StepResult) -> dict[str, Any]:
        if self.topk == 0:
            return {"probs": [float(x) for x in result.probs()]}
        ids, probs = result.topk(self.topk)
        return {"ids": ids, "probs": probs}

    def combine(self, req: RequestView, result: StepResult, scores: dict[int, dict[str, Any]]) -> int:
        missing = set(range(1, self.num_models)) - set(scores)
        if missing:
            raise ValueError(f"ensemble: missing peer distributions from models {sorted(missing)}")
        mix = self.weights[0] * result.probs().to(torch.float64).cpu()
        for peer in sorted(scores):   # fixed order: float sums are order-sensitive
            s = scores[peer]
            probs = torch.tensor(s["probs"], dtype=torch.float64)
            if "ids" in s:
                mix.index_add_(0, torch.tensor(s["ids"], dtype=torch.long), self.weights[peer] * probs)
            else:
                mix += self.weights[peer] * probs
        return int(torch.argmax(mix))   # first maximal index: ties go to the lowest token id
