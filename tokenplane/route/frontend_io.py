"""The front end's I/O thread: it alone reads the front end's inbox and turns the sub-servers' messages into what
each live request's caller receives.

Split out of runtime.py (one mechanism per file): `Runtime` is the public API, called from user threads (validate,
register, send, abort, configure); this module is the other side, one thread that drains every message the
sub-servers push (TokenChunk, Finished, Yield, Error, Heartbeat, StepDone, StatsReply, Ready), routes each to its
live request, drives the Supervisor (watch, readiness, deaths) and, in the sync modes, the Coordinator's step
grants. Both sides share the live table and its lock, which the Runtime creates and passes in.

Deliveries are batched per inbox drain: items for callers' event loops and standard-serving re-submissions collected
while one drain is handled leave once (one loop wake-up per caller loop, one frame per model).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from .coordinator import Coordinator
from .errors import ModelUnavailable, RequestFailed, RouteError
from .handoff import drain, send, send_many
from .messages import (
    Abort,
    AddRequest,
    Error,
    Finished,
    Heartbeat,
    PeerRestarted,
    Peers,
    Ready,
    StatsReply,
    StepDone,
    StepGrant,
    TokenChunk,
    Yield,
)
from .standard import front_end_yield
from .subserver_spec import SYNC_MODES
from .supervisor import Supervisor

__all__ = ["FrontEndIO", "LiveRequest"]


@dataclass
class LiveRequest:
    """A request registered on the front end, from generate() until its last chunk (or failure) is delivered."""
    rid: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    prompt: list[int]
    params: dict[str, Any]
    start: float
    streamed: int = 0
    first_token: float | None = None
    done: bool = False
    inc: int = 0


class FrontEndIO:
    """The inbox thread and the live-request bookkeeping it shares with the Runtime (see module docstring)."""

    def __init__(self, sup: Supervisor, coord: Coordinator, inbox: zmq.Socket, lock: threading.RLock,
                 live: dict[str, LiveRequest], errors: list[str], num_models: int):
        self.sup = sup
        self.coord = coord
        self.inbox = inbox
        self.lock = lock
        self.live = live                       # the Runtime's table, shared
        self.errors = errors                   # the Runtime's list of non-request errors, shared
        self.num_models = num_models
        self.all_ready = threading.Event()     # every model ready, or startup failed (sup.startup_error)
        self.closing = False                   # shutdown began: deaths are expected, stop watching
        self.stats_waits: dict[int, tuple[threading.Event, dict[int, StatsReply]]] = {}
        self._stop = threading.Event()
        self._batching = False
        self._pending_deliveries: list[tuple[LiveRequest, Any]] = []
        self._pending_adds: dict[int, list[tuple[LiveRequest, AddRequest]]] = {}
        self.thread = threading.Thread(target=self._loop, name="tokenplane-runtime-io", daemon=True)

    # -- used by user threads and the I/O thread ---------------------------------------------------------------------
    def deliver(self, live: LiveRequest, item: Any) -> None:
        if self._batching and threading.current_thread() is self.thread:
            self._pending_deliveries.append((live, item))
            return
        try:
            live.loop.call_soon_threadsafe(live.queue.put_nowait, item)
        except RuntimeError:
            pass   # the caller's event loop is gone; nobody is listening

    def fail(self, live: LiveRequest, exc: RouteError) -> None:
        if not live.done:
            live.done = True
            self.deliver(live, exc)

    def unregister(self, live: LiveRequest, reason: str = "abort") -> None:
        """Drop a live entry (if still the same incarnation) and abort it on every reachable model."""
        if self.live.get(live.rid) is live:
            del self.live[live.rid]
        for st in self.sup.models:
            if st.ready and st.client is not None:
                send(st.client, Abort(live.rid, reason, live.inc))

    def stop(self, timeout: float) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    # -- the I/O thread ----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        next_check = 0.0
        while not self._stop.is_set():
            poller.poll(5 if self.sup.config.mode in SYNC_MODES else 50)
            msgs = drain(self.inbox)
            if msgs:
                with self.lock:
                    self._batching = True
                    try:
                        for msg in msgs:
                            try:
                                self._on_message(msg)
                            except Exception as exc:   # never let one bad message kill the front end
                                self.errors.append(f"front end: {type(exc).__name__}: {exc}")
                    finally:
                        self._batching = False
                        self._flush()
            now = time.monotonic()
            if now >= next_check and not self.closing:
                next_check = now + 0.1
                with self.lock:
                    self.sup.watch(now)
                    if self.sup.startup_error and not self.all_ready.is_set():
                        self.all_ready.set()
            if self.sup.config.mode in SYNC_MODES:
                with self.lock:
                    self.coord.tick(now, self.sup.config.mode, bool(self.live),
                                    all(st.ready for st in self.sup.models), self._grant)

    def _flush(self) -> None:
        """After handling one drain: re-submissions (one frame per model), then deliveries (one
        call_soon_threadsafe per caller loop, items in arrival order)."""
        adds, self._pending_adds = self._pending_adds, {}
        for m, items in adds.items():
            st = self.sup.models[m]
            if st.client is None or not send_many(st.client, [a for _, a in items]):
                for live, a in items:
                    if self.live.get(a.request_id) is live:
                        self.live.pop(a.request_id, None)
                    self.fail(live, ModelUnavailable(f"model {m} is not reachable", model=m,
                                                     retry_after_s=self.sup.retry_after_s(m)))
            else:
                self.coord.mark(m)
        items, self._pending_deliveries = self._pending_deliveries, []
        by_loop: dict[Any, list] = {}
        for live, item in items:
            by_loop.setdefault(live.loop, []).append((live.queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:
                pass

    def _grant(self, m: int, grant: StepGrant) -> None:
        send(self.sup.models[m].client, grant)

    def _on_message(self, msg: Any) -> None:
        if isinstance(msg, TokenChunk):
            live = self.live.get(msg.request_id)
            if live is not None and not live.done and live.inc == msg.inc:
                if live.first_token is None:
                    live.first_token = time.monotonic()
                live.streamed = msg.start + len(msg.tokens)
                self.deliver(live, msg)
        elif isinstance(msg, Finished):
            live = self.live.get(msg.request_id)
            if live is not None and live.inc == msg.inc and not live.done:
                del self.live[msg.request_id]
                live.done = True
                self.deliver(live, TokenChunk(msg.request_id, msg.tokens, msg.models, msg.start, msg.finish_reason,
                                              self._final_stats(live, msg.stats), logprobs=msg.logprobs))
        elif isinstance(msg, Yield):
            self._on_yield(msg)
        elif isinstance(msg, Error):
            self._on_error(msg)
        elif isinstance(msg, Heartbeat):
            self.sup.on_heartbeat(msg)
        elif isinstance(msg, StepDone):
            self.coord.on_step_done(msg)
        elif isinstance(msg, StatsReply):
            w = self.stats_waits.get(msg.token)
            if w is not None:
                w[1][msg.model] = msg
                if len(w[1]) == self.num_models:
                    w[0].set()
        elif isinstance(msg, Ready):
            self._on_ready(msg)

    def _final_stats(self, live: LiveRequest, stats: dict[str, Any] | None) -> dict[str, Any]:
        now = time.monotonic()
        out = dict(stats or {})
        out["latency_s"] = now - live.start
        out["ttft_s"] = (live.first_token or now) - live.start
        return out

    def _on_yield(self, y: Yield) -> None:
        """Standard serving: the front end is the external scheduler; one call (a token or a segment) ended."""
        live = self.live.get(y.request_id)
        if live is None or live.done or live.inc != y.inc:
            return
        add = front_end_yield(live, y, self.deliver, self._final_stats, time.monotonic())
        if add is None:
            self.live.pop(y.request_id, None)
        else:
            self._pending_adds.setdefault(y.next_model, []).append((live, add))

    def _on_error(self, e: Error) -> None:
        if e.request_id is None:
            self.errors.append(e.message)
            if e.fatal and not self.all_ready.is_set():
                self.sup.startup_error = e.message
                self.all_ready.set()
            return
        live = self.live.get(e.request_id)
        if live is None or (e.inc is not None and e.inc != live.inc):
            return
        self.unregister(live, "error")
        self.fail(live, RequestFailed(f"request {e.request_id} failed on model {e.model}: {e.message}"))

    def _on_ready(self, r: Ready) -> None:
        st = self.sup.models[r.model]
        if r.pid != st.pid:
            return   # a previous generation's late message
        restarted = self.sup.started
        all_ready = self.sup.on_ready(r)
        if restarted:
            # Survivors reconnect to the new peer inbox; the newcomer learns everyone's.
            for k, other in enumerate(self.sup.models):
                if k != r.model and other.ready:
                    send(other.client, PeerRestarted(r.model, r.peer_address))
        if all_ready:
            addrs = [s.peer_address or "" for s in self.sup.models]   # all ready: every address is set
            targets = [r.model] if restarted else range(self.num_models)
            for k in targets:
                send(self.sup.models[k].client, Peers(addrs))
            self.sup.started = True
            self.all_ready.set()

    def on_death(self, m: int, why: str) -> None:
        """Supervisor callback (under the lock): model m died. Every live request fails with ModelUnavailable (any
        of them may hold state on m or be routed to it next); survivors drop them; the sync barrier resets."""
        st = self.sup.models[m]
        retry = st.start_s if st.start_s is not None else 30.0
        for live in list(self.live.values()):
            self.unregister(live, "peer failure")
            self.fail(live, ModelUnavailable(f"{why}; request {live.rid} failed", model=m, retry_after_s=retry))
        self.coord.on_model_reset(m)


def _put_all(batch: list) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
