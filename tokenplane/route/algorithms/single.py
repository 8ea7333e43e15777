"""One model, no routing: `route` always stays. Serves a single model through the routing runtime, so it gets the
runtime's process isolation, heartbeat, chunked prefill, preemption and crash recovery with nothing else changed.

No gates (nothing to calibrate), no handoffs, no algorithm state: a request lives on model 0, its home, from
admission to finish.
"""

from __future__ import annotations

from typing import Any

from ..api import Algorithm, StepResult


class Single(Algorithm):
    name = "single"
    num_models = 1

    def __init__(self, *, seed: int = 0, num_models: int | None = None, mode: str | None = None, **kwargs: Any):
        # `mode` is accepted and ignored (every mode stays): ServeConfig's default parameters carry one.
        if num_models not in (None, 1):
            raise ValueError(f"single serves exactly 1 model, got num_models={num_models}")
        if kwargs:
            raise ValueError(f"single takes no routing parameters, got {sorted(kwargs)}")
        super().__init__(seed=seed, num_models=1)

    def uses_logits(self, model: int) -> bool:
        """Nothing to route on: greedy steps take the engine's greedy screen (logprobs still read the logits)."""
        return False

    def route(self, result: StepResult, req: Any) -> int:
        return result.model
