"""A sub-server's outgoing messages, one frame per destination, and its HandoffMsg counts per peer.

Outgoing messages collect here during a loop turn and leave as one frame per destination (a ZeroMQ send wakes the
library's I/O thread, ~0.1 ms here, so one per request per step was a visible share of a 6 ms step). ZeroMQ keeps
per-sender order, so a receiver still sees them in dispatch order.

The HandoffMsg counts live beside the sends because a handoff is counted as sent only once its frame is out: the
sync modes' barrier (StepDone's sent counts vs a grant's expected counts) and delayed batching's consistency check
(launch_gate.py) both compare these counts with the receivers'. Final deliveries (a request finished on a peer, its
committed tokens going to the home model) are counted apart: they can never create work, so delayed batching leaves
them out and nobody waits for a peer to acknowledge one.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from .handoff import connect_push, send, send_many
from .messages import Error, HandoffMsg
from .route_request import FRONTEND, Outbound

__all__ = ["Outbox"]


class Outbox:
    """Messages queued for the front end and for peers (`to`, `dispatch`), sent by `flush`; the peer sockets."""

    def __init__(self, model: int, num_models: int, ctx: zmq.Context, front: Any,
                 trace: list | None = None):
        self.model = model
        self.ctx = ctx
        self.front = front                      # PUSH socket to the front end's inbox
        self.peers: dict[int, Any] = {}         # model -> PUSH socket to its peer inbox
        self.queued: dict[int, list] = {}       # dest -> messages of this loop turn, sent as one frame per dest
        self.trace = trace                      # diagnostics (TOKENPLANE_TRACE_DIR): flush events appended
        self.sent = [0] * num_models            # HandoffMsgs sent to each model (sync barrier counts)
        self.received = [0] * num_models        # HandoffMsgs received from each model
        self.final_sent = [0] * num_models      # of those, final deliveries (never create work)
        self.final_received = [0] * num_models

    # -- peers and counts ------------------------------------------------------------------------------------------
    def connect_peer(self, k: int, addr: str) -> None:
        old = self.peers.pop(k, None)
        if old is not None:
            old.close(0)
        self.peers[k] = connect_push(self.ctx, addr)

    def reset_counts(self, k: int | None = None) -> None:
        """Zero the counts with model k (it restarted: its new process counts from 0), or with every model."""
        ks = range(len(self.sent)) if k is None else [k]
        for i in ks:
            self.sent[i] = self.received[i] = self.final_sent[i] = self.final_received[i] = 0

    def on_received(self, msg: HandoffMsg) -> None:
        self.received[msg.handoff.source] += 1
        self.final_received[msg.handoff.source] += bool(msg.final)

    def work_counts(self, pending: bool = False) -> tuple[list[int], list[int]]:
        """HandoffMsgs sent to / received from each model that can create work (final deliveries left out);
        pending: count the queued handoffs as sent (an idle report travels behind them in the same frame)."""
        sent = [a - b for a, b in zip(self.sent, self.final_sent)]
        received = [a - b for a, b in zip(self.received, self.final_received)]
        if pending:
            for dest, msgs in self.queued.items():
                if dest != FRONTEND:
                    sent[dest] += sum(isinstance(m, HandoffMsg) and not m.final for m in msgs)
        return sent, received

    # -- sending ---------------------------------------------------------------------------------------------------
    def dispatch(self, outs: list[Outbound]) -> None:
        for o in outs:
            self.to(o.dest, o.msg)

    def to(self, dest: int, msg: Any) -> None:
        self.queued.setdefault(dest, []).append(msg)

    def send_now(self, dest: int, msg: Any) -> bool:
        """Send one message to a peer at once, ahead of anything queued (an "active" PeerStatus)."""
        return send(self.peers[dest], msg)

    def flush(self) -> None:
        """Send this turn's messages: one frame per destination, in dispatch order. Called at the end of each
        handler and of each step."""
        if not self.queued:
            return
        box, self.queued = self.queued, {}
        if self.trace is not None:
            t = time.perf_counter()
            self._send_box(box)
            self.trace.append(("flush", t, time.perf_counter(), sum(len(v) for v in box.values())))
            return
        self._send_box(box)

    def _send_box(self, box: dict[int, list]) -> None:
        for dest, msgs in box.items():
            if dest == FRONTEND:
                send_many(self.front, msgs)
                continue
            sock = self.peers.get(dest)
            if sock is None or not send_many(sock, msgs):
                send_many(self.front, [Error(getattr(getattr(m, "handoff", None), "request_id",
                                                     getattr(m, "request_id", None)),
                                             f"model {self.model} cannot reach model {dest}", self.model,
                                             inc=getattr(m, "inc", None)) for m in msgs])
                continue
            self.sent[dest] += sum(isinstance(m, HandoffMsg) for m in msgs)
            self.final_sent[dest] += sum(isinstance(m, HandoffMsg) and m.final for m in msgs)

    def close(self) -> None:
        self.front.close(0)
        for s in self.peers.values():
            s.close(0)
