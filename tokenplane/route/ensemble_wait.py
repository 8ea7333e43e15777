"""Ensemble positions on the primary model: its own step result waits for the peers' score replies, then the
algorithm combines the distributions into the committed token. Split out of the scheduler (one mechanism per file)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .api import Algorithm, StepResult, commit
from .positions import record

__all__ = ["EnsembleWait", "complete_position"]


@dataclass
class EnsembleWait:
    """The primary's side of an ensemble position: its own result, waiting for the peers' score replies."""
    result: StepResult
    awaiting: set[int]
    scores: dict[int, dict[str, Any]] = field(default_factory=dict)

    def add(self, source: int, scores: dict[str, Any]) -> bool:
        """Record one peer's reply; True once every peer answered."""
        self.scores[source] = dict(scores)
        self.awaiting.discard(source)
        return not self.awaiting


def complete_position(alg: Algorithm, rec: Any, model: int, wait: EnsembleWait) -> None:
    """Commit the combined token on `rec` (a route_request.RouteRequest); the position reports the primary's
    logprob, as the reference does."""
    token = int(alg.combine(rec.view, wait.result, wait.scores))
    rec.ensemble = None
    commit(rec.view, model, token)
    record(rec, model, wait.result, token)
    rec.stats.token_models = list(rec.models)
    rec.stats.on_ensemble()
