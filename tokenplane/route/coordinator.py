"""Sync-mode step coordinator (stepwise_sync / model_sync), run by the runtime's I/O thread.

stepwise_sync grants a step to every model per round and waits for all StepDones; model_sync grants one model at a
time (round-robin over models with work). A grant carries, per peer, how many handoffs the coordinator knows that
peer has sent to this model, and the sub-server drains its peer socket until it has received that many before
stepping (ZeroMQ orders messages per sender only), so the barrier is exact.
"""

from __future__ import annotations

from typing import Callable

from .messages import StepDone, StepGrant


class Coordinator:
    def __init__(self, num_models: int):
        self.num_models = num_models
        self.reset()

    def reset(self) -> None:
        n = self.num_models
        self.round = 0
        self.outstanding: set[int] = set()
        self.sent_table = [[0] * n for _ in range(n)]   # sent_table[k][m]: handoffs k -> m, per StepDone
        self.dirty = [True] * n                          # may have work: worth a grant
        self.rr = 0
        self.idle_round_at = 0.0

    def mark(self, m: int) -> None:
        """A request was submitted to model m."""
        self.dirty[m] = True

    def on_step_done(self, msg: StepDone) -> None:
        for k, n in enumerate(msg.sent):
            if n > self.sent_table[msg.model][k]:
                self.dirty[k] = True
        self.sent_table[msg.model] = list(msg.sent)
        self.dirty[msg.model] = msg.num_ready > 0
        self.outstanding.discard(msg.model)
        if msg.ran:
            self.idle_round_at = 0.0

    def on_model_reset(self, m: int) -> None:
        """Model m died: the barrier restarts from scratch (the new process counts from zero)."""
        self.outstanding.clear()
        for k in range(self.num_models):
            self.sent_table[k][m] = 0
        self.sent_table[m] = [0] * self.num_models

    def tick(self, now: float, mode: str, has_live: bool, all_ready: bool,
             grant: Callable[[int, StepGrant], None]) -> None:
        """Grant the next round if the previous one is over and there is work."""
        if self.outstanding or not has_live or not all_ready:
            return
        if not any(self.dirty):
            # Nothing reported ready; still poke everyone now and then so nothing can be missed.
            if self.idle_round_at and now - self.idle_round_at < 0.01:
                return
            self.dirty = [True] * self.num_models
        self.idle_round_at = now
        self.round += 1
        if mode == "stepwise_sync":
            targets = list(range(self.num_models))
        else:
            order = [(self.rr + i) % self.num_models for i in range(self.num_models)]
            pick = next((m for m in order if self.dirty[m]), order[0])
            self.rr = (pick + 1) % self.num_models
            targets = [pick]
        for m in targets:
            expected = [self.sent_table[k][m] for k in range(self.num_models)]
            self.dirty[m] = False
            self.outstanding.add(m)
            grant(m, StepGrant(self.round, expected))


__all__ = ["Coordinator"]
