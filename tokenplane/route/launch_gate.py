"""Delayed batching in the sub-server loop: whether an idle model with ready requests steps now, and the PeerStatus
reports its peers decide with.

BatchPolicy (batching.py) holds the thresholds and answers should_launch; this module supplies its inputs inside the
multi-process runtime, where no process sees the whole system: `num_live` on the home model, and
`nothing_else_can_run`, read on a consistent cut of the peers' latest reports and every model's HandoffMsg counts
(outbox.py), so a stale "idle" from a peer that has not yet seen our handoff never forces a launch. `max_delay_s`
stays as the backstop for lost messages / restarted peers (counted as `backstop_launches`).

Split out of the sub-server (one mechanism per file): the loop asks `should_step` once per turn and otherwise only
forwards PeerStatus messages here. In the other modes there is no policy and a model steps whenever it has work.
"""

from __future__ import annotations

import time
from typing import Any

from .messages import PeerStatus
from .outbox import Outbox

__all__ = ["LaunchGate", "nothing_else_can_run"]


def nothing_else_can_run(model: int, num_ready: int, sent: list[int], received: list[int],
                         peers: list[PeerStatus | None]) -> bool:
    """Delayed batching: may `model` (idle, `num_ready` queued below its threshold) launch anyway?

    True only on a consistent cut where waiting cannot help: every peer's latest report says idle, no HandoffMsg is
    in flight between any two models (each sender's count equals its receiver's; `model`'s own `sent`/`received`
    are live), and among the models waiting below their thresholds `model` is the leader (most ready, then lowest
    index), so exactly one of them launches. A peer's "idle" sent before our handoff reached it fails the count
    check: that stale report is what used to force large-model launches right after a hand-back. Peers republish
    whenever their idle state or counts change, so a False caused by staleness is followed by a fresher report
    (or, if a message was lost, by the max_delay_s backstop).
    """
    num_models = len(peers)
    sent_by, received_by, ready = {model: sent}, {model: received}, {model: num_ready}
    for k, st in enumerate(peers):
        if k == model:
            continue
        if st is None or st.active or len(st.sent) != num_models or len(st.received) != num_models:
            return False   # executing, or never reported: it may still produce work for us
        sent_by[k], received_by[k], ready[k] = st.sent, st.received, int(st.ready)
    for i in range(num_models):
        for j in range(num_models):
            if i != j and sent_by[i][j] != received_by[j][i]:
                return False   # a handoff i -> j is in flight, or j's report predates it
    return max(range(num_models), key=lambda k: (ready[k], -k)) == model


class LaunchGate:
    """One model's launch decision in delayed_async mode (`policy` None in the other modes: step when ready)."""

    def __init__(self, model: int, num_models: int, outbox: Outbox):
        self.model = model
        self.out = outbox
        self.policy: Any = None   # BatchPolicy in delayed_async mode
        self.peer_status: list[PeerStatus | None] = [None] * num_models   # latest report per peer
        self.published: tuple | None = None
        self.ready_since: float | None = None
        self.forced_lag = 0.0    # forced launches' lag behind the last peer's idle report, summed (diagnostics)

    def configure(self, mode: str, thresholds: list[int], concurrency: int) -> None:
        """(Re)start the gate for `mode`: a fresh policy, and no peer report or own report is current any more."""
        self.policy = None
        if mode == "delayed_async":
            from .batching import BatchPolicy
            self.policy = BatchPolicy(list(thresholds), int(concurrency))
        self.peer_status = [None] * len(self.peer_status)
        self.published = None
        self.ready_since = None

    def on_status(self, msg: PeerStatus) -> None:
        self.peer_status[msg.model] = msg   # per-sender order: the latest one is the newest state

    def forget(self, k: int) -> None:
        """Model k restarted: other peers' counts for it are now inconsistent, so only the backstop can force."""
        self.peer_status[k] = None

    def idle_timeout(self, max_delay_s: float) -> float:
        """How long the loop may block with nothing to run: until the backstop would fire, at most 0.5 s."""
        t = 0.5
        if self.ready_since is not None:
            t = min(t, max(0.0, self.ready_since + max_delay_s - time.monotonic()))
        return min(t, 0.5)

    def should_step(self, n: int, num_live: int | None, counters: dict[str, Any], max_delay_s: float) -> bool:
        """Whether the idle model with `n` ready requests steps now (async modes); publishes its state either way.
        num_live: live requests the model can see (home model), so a drained workload does not wait forever."""
        if n == 0:
            self.ready_since = None
            self.publish(False, 0)
            return False
        now = time.monotonic()
        if self.ready_since is None:
            self.ready_since = now
        launch = True
        if self.policy is not None:
            # The count-based check runs only below threshold (it is the only case that reads it).
            launch = self.policy.should_launch(self.model, n, False, num_live)
            if not launch and self.nothing_else_can_run(n):
                launch = self.policy.should_launch(self.model, n, True, num_live)
                # diagnostics: from the last peer's going idle (its report's time) to this forced launch
                last = max((st.at for st in self.peer_status if st is not None), default=now)
                self.forced_lag += max(0.0, now - last)
            if not launch and now - self.ready_since >= max_delay_s:
                launch = True   # backstop against a lost status message; counted as forced
                counters["backstop_launches"] = counters.get("backstop_launches", 0) + 1
                self.policy.launches[self.model] += 1
                self.policy.forced_launches[self.model] += 1
        if not launch:
            self.publish(False, n)
            return False
        self.publish(True, n)
        self.ready_since = None
        return True

    def nothing_else_can_run(self, n: int) -> bool:
        # Our own handoffs still queued in the outbox count as sent: a step that just handed requests back to a peer
        # has made that peer busy, even though its last report (idle) cannot know it yet. Leaving them out forced a
        # launch right after every hand-back, before the batch it was waiting for could form.
        sent, received = self.out.work_counts(pending=True)
        return nothing_else_can_run(self.model, n, sent, received, self.peer_status)

    def publish(self, active: bool, ready: int) -> None:
        """Delayed batching only: tell peers this model's state when it starts executing, and whenever its idle
        state (ready count, handoff counts) changes, so peers can tell a current "idle" from a stale one."""
        if self.policy is None:
            return
        # an idle report's counts cover every handoff already dispatched: those in the outbox too
        sent, received = self.out.work_counts(pending=not active)
        state = (True,) if active else (False, ready, tuple(sent), tuple(received))
        if state != self.published:
            self.published = state
            ts = self.policy.thresholds
            for k in self.out.peers:
                if ts[k] <= 1:
                    continue   # a peer with threshold 1 launches whenever it has work and never reads our status
                msg = PeerStatus(self.model, active, ready, sent, received, time.monotonic())
                if active:
                    self.out.send_now(k, msg)   # now, ahead of the step's handoffs: peers stop forcing at once
                else:
                    self.out.to(k, msg)   # behind this turn's handoffs to k, in the same frame
        if not active:
            self.out.flush()
