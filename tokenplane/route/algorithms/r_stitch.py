"""R-Stitch (arXiv 2507.17307): entropy-based switching in both directions with multi-token large-model runs.

Signal: normalized entropy H / log V of the model currently decoding. On the small model, H > tau hands the request
to the large model and drops the small token (the large model regenerates that position). The large model keeps
decoding while its own H > tau; the first token with H <= tau is committed and the request returns to the small
model. Both models keep independent KV caches; on each switch the receiver prefills the tokens it missed.

There is no official code; tau's value is not public (default 0.3 here is a placeholder, set it). Calibrated mode
uses one threshold per direction (warm-up: small-model switch rate `rates["switch"]`, large-model return rate
`rates["return"]`), because two random-weight models have disjoint entropy ranges and one shared tau would leave the
large model never or always returning. Synthetic mode is the two-state Markov chain P(small->large) = a =
rates["switch"], P(large->small) = b = rates["return"]: mean small run (1-a)/a, mean large run 1/b.
"""

from __future__ import annotations

from typing import Any

from ..api import RequestView, StepResult
from .base import Gate, ThresholdAlgorithm


class RStitch(ThresholdAlgorithm):
    name = "r_stitch"
    gates = (Gate("switch", 0, "above"), Gate("return", 1, "at_most"))
    default_thresholds = {"switch": 0.3, "return": 0.3}
    default_rates = {"switch": 0.1, "return": 0.5}

    def __init__(self, *, tau: float | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        if tau is not None:   # the paper's single tau, both directions
            self.thresholds.update(switch=float(tau), **{"return": float(tau)})

    def signal(self, gate: Gate, result: StepResult) -> float:
        return result.normalized_entropy()

    def route(self, result: StepResult, req: RequestView) -> int:
        if result.model == 0:
            return 1 if self.decide(self.gates[0], result, req) else 0
        return 0 if self.decide(self.gates[1], result, req) else 1

    def keep_last(self, result: StepResult, req: RequestView, target: int) -> bool:
        return result.model != 0   # uncertain small token dropped; the large model's confident token kept
