"""Delayed batching: a model launches a step only once its queue holds T_m ready requests.

Launching every time one request is ready fragments batches (a large model that just started a batch of one makes
the next three arrivals wait a whole step); waiting for T_m requests amortizes a step over more tokens. Waiting must
never deadlock: if every model waits for its threshold while no model executes, every live request sits in some
queue with fewer than T_m entries, so the number of live requests is at most sum_m (T_m - 1). Requiring

    sum_m (T_m - 1) < concurrency

therefore guarantees (pigeonhole) that when all `concurrency` requests are queued and nothing executes, at least one
queue has reached its threshold. The guarantee covers a full system; when fewer requests are live (the tail of a
workload, or a model process that cannot see the whole system) the runtime passes `nothing_else_can_run` or
`num_live` so a queue that can never fill still launches.

Thresholds all 1 is plain immediate execution (the "immediate async" mode): a flag value, not another code path.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

__all__ = ["BatchPolicy", "feasible_thresholds", "is_feasible"]


def is_feasible(thresholds: list[int] | tuple[int, ...], concurrency: int) -> bool:
    """True when no combination of full-but-below-threshold queues can hold all `concurrency` requests."""
    return all(int(t) >= 1 for t in thresholds) and sum(int(t) - 1 for t in thresholds) < concurrency


def feasible_thresholds(num_models: int, concurrency: int, max_t: int | None = None) -> list[tuple[int, ...]]:
    """Every threshold tuple (T_0..T_{M-1}) with 1 <= T_m <= max_t and sum(T_m - 1) < concurrency.

    `max_t` defaults to `concurrency` (a threshold above the concurrency can never be reached by a full system).
    Ordered lexicographically, so (1, ..., 1) comes first.
    """
    if num_models < 1:
        raise ValueError(f"num_models must be >= 1, got {num_models}")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    top = concurrency if max_t is None else min(int(max_t), concurrency)
    if top < 1:
        raise ValueError(f"max_t must be >= 1, got {max_t}")
    return [ts for ts in itertools.product(range(1, top + 1), repeat=num_models) if is_feasible(ts, concurrency)]


@dataclass
class BatchPolicy:
    """Per-model launch thresholds T_m for a runtime serving `concurrency` requests at once.

    `should_launch(model, num_ready, nothing_else_can_run, num_live=None)` is the only question the scheduler asks
    before each step of `model`. Construction validates, so a policy object in hand is always deadlock-free.
    """

    thresholds: list[int]
    concurrency: int
    launches: list[int] = field(default_factory=list, repr=False)  # per-model counters, for benchmarks
    forced_launches: list[int] = field(default_factory=list, repr=False)  # launches below threshold (fallback)

    def __post_init__(self) -> None:
        self.thresholds = [_as_int(t, "threshold") for t in self.thresholds]
        self.concurrency = _as_int(self.concurrency, "concurrency")
        self.validate()
        self.launches = [0] * len(self.thresholds)
        self.forced_launches = [0] * len(self.thresholds)

    @classmethod
    def immediate(cls, num_models: int, concurrency: int) -> BatchPolicy:
        """Thresholds all 1: launch whenever anything is ready (no delayed batching)."""
        return cls([1] * num_models, concurrency)

    @property
    def num_models(self) -> int:
        return len(self.thresholds)

    def validate(self) -> None:
        """Raise ValueError naming the violated condition; the feasibility one is sum_m (T_m - 1) < concurrency."""
        if not self.thresholds:
            raise ValueError("BatchPolicy needs one threshold per model, got an empty list")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        low = [(m, t) for m, t in enumerate(self.thresholds) if t < 1]
        if low:
            m, t = low[0]
            raise ValueError(f"threshold T_{m} = {t} violates T_m >= 1 (a model must be able to launch a batch)")
        slack = sum(t - 1 for t in self.thresholds)
        if slack >= self.concurrency:
            terms = " + ".join(f"({t} - 1)" for t in self.thresholds)
            raise ValueError(
                f"thresholds {self.thresholds} can deadlock: they violate sum_m (T_m - 1) < concurrency, since "
                f"{terms} = {slack} >= {self.concurrency}; with every request queued below its model's threshold "
                f"no model would ever launch. Lower some threshold so the sum is at most {self.concurrency - 1}.")

    def should_launch(self, model: int, num_ready: int, nothing_else_can_run: bool,
                      num_live: int | None = None) -> bool:
        """Whether `model` (idle, with `num_ready` requests queued) should start a step now.

        nothing_else_can_run: the caller knows no other model is executing or able to launch, so waiting can only
            deadlock (e.g. fewer live requests than the thresholds assume); launch whatever is ready.
        num_live: optional upper bound on requests that could ever be ready at this model (live requests it can
            see); the effective threshold is min(T_m, num_live) so a drained workload does not wait forever.
        """
        if not 0 <= model < len(self.thresholds):
            raise ValueError(f"model index {model} out of range for {len(self.thresholds)} thresholds")
        if num_ready <= 0:
            return False
        target = self.thresholds[model]
        if num_live is not None:
            target = max(1, min(target, int(num_live)))
        if num_ready >= target:
            self.launches[model] += 1
            return True
        if nothing_else_can_run:
            self.launches[model] += 1
            self.forced_launches[model] += 1
            return True
        return False

    def to_dict(self) -> dict:
        return {"thresholds": list(self.thresholds), "concurrency": self.concurrency,
                "launches": list(self.launches), "forced_launches": list(self.forced_launches)}


def _as_int(value, what: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):  # numpy ints have __index__, floats do not
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return int(value)
