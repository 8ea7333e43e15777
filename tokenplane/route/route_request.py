"""The record a model's scheduler keeps for one request, and the (destination, message) pairs a scheduler emits.

Its own module because several mechanisms read and write the same record: the scheduler (states, routing, endings),
step_batch.py (KV and chunks), standard.py (Yield), ensemble_wait.py and positions.py (per-position records); none of
them needs the scheduler itself to know the record's fields.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .api import RequestView
from .ensemble_wait import EnsembleWait
from .states import RequestState
from .stats import RouteStats

FRONTEND = -1   # Outbound.dest of a message for the front end (model indices are >= 0)

__all__ = ["FRONTEND", "Outbound", "RouteRequest"]


@dataclass
class Outbound:
    """A message the scheduler wants sent; the scheduler never talks to sockets, the sub-server sends these."""
    dest: int          # model index, or FRONTEND
    msg: Any


@dataclass
class RouteRequest:
    view: RequestView
    params: Any                         # tokenplane.engine.sampler.SamplingParams
    models: list[int]                   # producing model per output position (parallel to view.output_ids)
    stats: RouteStats
    state: RequestState = RequestState.WAITING
    seq: Any = None                     # tokenplane.engine.sequence.Sequence while this model holds KV
    admitted_at: int = 0                # admission order (preemption victim: the most recent)
    tail: list[int] | None = None       # chunked prefill: tokens held back from rec.seq during this step
    streamed: int = 0                   # home model: output tokens already sent to the front end
    score_for: int | None = None        # answering an ensemble score visit from that model
    ensemble: EnsembleWait | None = None
    num_handoffs: int = 0
    inc: int = 0                        # incarnation (request ids may be reused once a request ended)
    logprobs: list | None = None        # per output position [lp, top] (positions.py) when params ask, else None
    prompt_set: Any = None              # sampler.token_set of the prompt, made on a penalized request's first sample
    arrival: float = field(default_factory=time.monotonic)

    @property
    def request_id(self) -> str:
        return self.view.request_id
