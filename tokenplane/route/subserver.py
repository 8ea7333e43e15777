"""One sub-server process per model: scheduler, model runner, private KV pool, the algorithm's routing functions.

The paper's three loops are three handlers of ONE single-threaded event loop (they share the scheduler, so threads
would only add locks):

    client service  drains the `client` socket: admissions, aborts, step grants, stats queries, shutdown
    handoff         drains the `peer` socket: handoffs from peers (resume or first visit), releases, peer status
    decoding        when requests are ready and the mode allows, schedule -> run -> update_from_output

Each turn of the loop drains both sockets without blocking, runs at most one step, and blocks on the sockets (with
a timeout) only when it did not step. A step never waits for a peer: a request that left is PENDING_RETURN and the
others keep decoding.

Liveness is a separate heartbeat thread with its own zmq context and socket: a Heartbeat every heartbeat_s whatever
the step does, carrying the current step's start (the supervisor kills a step older than step_timeout_s) and the
load the loop last published (KV blocks, waiting / running / pending). The thread reads two attributes the loop
assigns (`step_started`, `load`) and touches nothing else. Steps stay short because the scheduler chunks prefills
to max_num_batched_tokens tokens per step.

Outgoing messages collect in an outbox and leave as one frame per destination (a ZeroMQ send wakes the library's I/O
thread, ~0.1 ms here, so one per request per step was a visible share of a 6 ms step). They are sent while the next
launched step runs when the runner can launch (the latency-model runner, like an accelerator), right after the step
otherwise, and always before the loop blocks, before StepDone and before an idle PeerStatus (whose counts must cover
them).

Execution modes are flags of this loop, not separate loops:
    immediate_async  launch whenever >= 1 request is ready (BatchPolicy with thresholds all 1)
    delayed_async    launch when BatchPolicy.should_launch(model, num_ready, nothing_else_can_run, num_live) says so;
                     nothing_else_can_run is count-based (see _nothing_else_can_run): every peer reported idle AND
                     every HandoffMsg any model sent has been received (sent/received counts in PeerStatus), so a
                     stale "idle" from a peer that has not yet seen our handoff never forces a launch; max_delay_s
                     stays as the backstop for lost messages / restarted peers
    stepwise_sync /  run a step only under a StepGrant from the front-end coordinator, then answer StepDone; the
    model_sync       grant says how many handoffs from each peer must be drained first (cross-sender order is not
                     guaranteed by ZeroMQ, counts make the barrier exact)
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import zmq

from .handoff import Inbox, bind_pull, connect_push, drain, send, send_many
from .messages import (
    Abort,
    AddRequest,
    Configure,
    Error,
    HandoffMsg,
    Heartbeat,
    PeerRestarted,
    Peers,
    PeerStatus,
    Ready,
    Release,
    Shutdown,
    StatsQuery,
    StatsReply,
    StepDone,
    StepGrant,
)
from .params import eos_token_ids
from .scheduler import FRONTEND, Scheduler
from .states import RequestState

SYNC_MODES = ("stepwise_sync", "model_sync")
MODES = ("stepwise_sync", "model_sync", "immediate_async", "delayed_async")


@dataclass
class SubServerSpec:
    """Everything a sub-server process is started with (the spawn argument; never on the wire). Built by the
    runtime's supervisor from RuntimeConfig; defaults are RuntimeConfig's."""
    model: int
    num_models: int
    source: Any                         # preset name | HF config dict | checkpoint dir | latency-model dict
    frontend: str                       # the front end's inbox address
    generation: int                     # restarts of this model so far + 1 (names its sockets)
    transport: str = "ipc"
    ipc_dir: str | None = None
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    num_blocks: int = 512
    block_size: int = 16
    runner: str = "torch"
    algorithm: str = "r2r"
    algorithm_kwargs: dict[str, Any] = field(default_factory=dict)
    mode: str = "delayed_async"
    pending_return: bool = True
    standard_serving: bool = False
    standard_unit: str = "token"
    thresholds: list[int] = field(default_factory=list)
    concurrency: int = 8
    max_delay_s: float = 0.2
    grant_timeout_s: float = 30.0
    heartbeat_s: float = 0.5
    threads: int = 1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enforce_eager: bool = False


def build_runner(spec: SubServerSpec) -> tuple[Any, Any]:
    """(runner, nn.Module or None) for this model, per spec.runner."""
    import torch
    dtype = getattr(torch, spec.dtype)
    if spec.runner == "latency-model":
        from tokenplane.engine.latency_runner import LatencyFit, LatencyModelRunner, preset
        kw = dict(spec.source) if isinstance(spec.source, dict) else {}
        lat = kw.pop("latency", None)
        if isinstance(lat, str):   # "preset:index", e.g. "seed-r2r:1"
            name, _, idx = lat.partition(":")
            lat = preset(name)[int(idx or spec.model)]
        elif isinstance(lat, dict):
            lat = LatencyFit.from_dict(lat)
        else:
            raise ValueError("latency-model runner: each model source must be a dict with a 'latency' entry "
                             "(LatencyFit dict or 'preset:index')")
        kw.setdefault("seed", spec.model)
        runner: Any = LatencyModelRunner(lat, num_blocks=spec.num_blocks, block_size=spec.block_size, dtype=dtype,
                                    **kw)
        return runner, None
    if spec.runner != "torch":
        raise ValueError(f"runner must be 'torch' or 'latency-model', got {spec.runner!r}")
    from tokenplane.engine.loader import load_model
    from tokenplane.engine.model_runner import ModelRunner
    cfg, model = load_model(spec.source, device=spec.device, dtype=dtype, seed=spec.seed)
    runner = ModelRunner(model, cfg, num_blocks=spec.num_blocks, block_size=spec.block_size,
                         device=spec.device, dtype=dtype, enforce_eager=spec.enforce_eager,
                         max_num_seqs=spec.max_num_seqs)
    return runner, model


def build_algorithm(spec: SubServerSpec):
    from tokenplane.route.algorithms import make_algorithm
    return make_algorithm(spec.algorithm, **spec.algorithm_kwargs)


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


class SubServer:
    def __init__(self, spec: SubServerSpec):
        self.spec = spec
        self.model = int(spec.model)
        self.num_models = int(spec.num_models)
        self.mode = spec.mode
        self.ppid = os.getppid()
        self.ctx = zmq.Context()
        self.front = connect_push(self.ctx, spec.frontend)
        self.peers: dict[int, zmq.Socket] = {}
        self.sent = [0] * self.num_models       # HandoffMsgs sent to each model (sync barrier counts)
        self.received = [0] * self.num_models   # HandoffMsgs received from each model
        # Of those, final deliveries (a request finished on a peer, committed tokens to the home model): they can
        # never create work anywhere, so delayed batching's consistency check leaves them out and nobody waits for
        # a peer to acknowledge one (see _work_counts).
        self.final_sent = [0] * self.num_models
        self.final_received = [0] * self.num_models
        self.grant: StepGrant | None = None
        self.grant_time = 0.0
        self.peer_status: list[PeerStatus | None] = [None] * self.num_models   # latest report per peer
        self.published: tuple | None = None
        self.ready_since: float | None = None
        self.stopping = False
        self.outbox: dict[int, list] = {}   # dest -> messages of this loop turn, sent as one frame per dest
        self.step_time = 0.0     # inside runner.run (the modeled / real forward)
        self.step_wall = 0.0     # a whole step: schedule + run + sample/route + sends
        self.idle_time = 0.0     # blocked in inbox.wait with nothing to run
        self.forced_lag = 0.0    # delayed batching: forced launches' lag behind the last peer's idle report, summed
        # Diagnostics only (TOKENPLANE_TRACE_DIR): timestamped steps and message events, dumped as JSON at exit.
        self.trace: list | None = [] if os.environ.get("TOKENPLANE_TRACE_DIR") else None

        import torch
        torch.set_num_threads(int(spec.threads))
        self.runner, module = build_runner(spec)
        self.algorithm = build_algorithm(spec)
        if self.algorithm.num_models != self.num_models:
            raise ValueError(f"algorithm {spec.algorithm} drives {self.algorithm.num_models} models, the runtime "
                             f"has {self.num_models}")
        self.module = module
        self.algorithm.attach(self.model, module)
        self.scheduler = Scheduler(self.model, self.num_models, self.runner.block_manager, self.algorithm,
                                   pending_return=spec.pending_return, standard_serving=spec.standard_serving,
                                   standard_unit=spec.standard_unit, max_num_seqs=spec.max_num_seqs,
                                   max_num_batched_tokens=spec.max_num_batched_tokens)
        self.policy: Any = None   # BatchPolicy in delayed_async mode
        self._set_policy()
        tag = f"{self.model}.{spec.generation}"
        self.client_sock, client_addr = bind_pull(self.ctx, spec.transport, spec.ipc_dir, f"c{tag}")
        self.peer_sock, peer_addr = bind_pull(self.ctx, spec.transport, spec.ipc_dir, f"p{tag}")
        self.inbox = Inbox({"client": self.client_sock, "peer": self.peer_sock})
        cfg = getattr(self.runner, "cfg", None)
        max_len = getattr(cfg, "max_position_embeddings", None)
        # Liveness is the heartbeat thread's job, so it does not depend on how long a step takes; it reads only
        # these two plain attributes (assignments are atomic), written by the loop.
        self.step_started: float | None = None   # time.monotonic() when the current step began
        self.load = (0, 0, 0, 0, self.runner.block_manager.num_blocks)   # waiting, running, pending, used, total
        self._hb_stop = threading.Event()
        self._hb = threading.Thread(target=self._heartbeat_loop, name=f"heartbeat-{self.model}", daemon=True)
        self._hb.start()
        send(self.front, Ready(self.model, os.getpid(), client_addr, peer_addr, self.runner.block_manager.num_blocks,
                               self.runner.block_manager.block_size, eos_token_ids(cfg),
                               None if max_len is None else int(max_len)))

    def _heartbeat_loop(self) -> None:
        """Heartbeat thread: its own context and socket (zmq sockets are not thread-safe), a Heartbeat every
        heartbeat_s whatever the loop is doing, with the loop's latest load and the current step's start."""
        ctx = zmq.Context()
        sock = connect_push(ctx, self.spec.frontend)
        pid = os.getpid()
        try:
            while True:
                w, r, p, used, total = self.load
                send(sock, Heartbeat(self.model, pid, time.time(), w, r, p, self.step_started, used, total))
                if self._hb_stop.wait(self.spec.heartbeat_s):
                    break
        finally:
            sock.close(0)
            ctx.term()

    def _update_load(self) -> None:
        s, bm = self.scheduler, self.runner.block_manager
        pending = sum(r.state == RequestState.PENDING_RETURN for r in s.requests.values())
        self.load = (len(s.waiting), len(s.running), pending, bm.num_used_blocks, bm.num_blocks)

    # -- the event loop ------------------------------------------------------------------------------------------
    def serve(self) -> None:
        load_every = min(0.1, self.spec.heartbeat_s / 2)
        next_load = 0.0
        while not self.stopping:
            if os.getppid() != self.ppid:   # the front end died: nobody can use our results
                break
            self._client_service()
            self._handoff_service()
            if self.stopping:
                break
            ran = self._decode_service()
            now = time.monotonic()
            if not ran or now >= next_load:   # idle: cheap and current; busy: a few times per heartbeat
                self._update_load()
                next_load = now + load_every
            if not ran:
                self._flush()   # nothing will run: send what the handlers produced before blocking
                t = time.perf_counter()
                self.inbox.wait(self._idle_timeout())
                self.idle_time += time.perf_counter() - t
        self._hb_stop.set()
        self._hb.join(2)
        self._flush()
        if self.trace is not None:
            import json
            path = os.path.join(os.environ["TOKENPLANE_TRACE_DIR"], f"model{self.model}.{self.spec.generation}.json")
            with open(path, "w") as f:
                json.dump(self.trace, f)
        self.inbox.close()
        self.front.close(0)
        for s in self.peers.values():
            s.close(0)
        self.ctx.term()

    def _idle_timeout(self) -> float:
        t = 0.5
        if self.ready_since is not None:
            t = min(t, max(0.0, self.ready_since + float(self.spec.max_delay_s) - time.monotonic()))
        return min(t, 0.5)

    def _set_policy(self) -> None:
        self.policy = None
        if self.mode == "delayed_async":
            from tokenplane.route.batching import BatchPolicy
            self.policy = BatchPolicy(list(self.spec.thresholds), int(self.spec.concurrency))
        self.published = None
        self.ready_since = None

    def _configure(self, msg: Configure) -> None:
        s = self.scheduler
        if s.requests:
            raise RuntimeError(f"configure needs an idle model; {len(s.requests)} requests are live")
        if msg.mode not in MODES:
            raise ValueError(f"unknown mode {msg.mode!r}")
        self.spec = dataclasses.replace(self.spec, mode=msg.mode, pending_return=msg.pending_return,
                                        standard_serving=msg.standard_serving, standard_unit=msg.standard_unit,
                                        thresholds=list(msg.thresholds),
                                        concurrency=msg.concurrency, max_delay_s=msg.max_delay_s)
        if msg.algorithm is not None:
            self.spec = dataclasses.replace(self.spec, algorithm=msg.algorithm,
                                            algorithm_kwargs=dict(msg.algorithm_kwargs or {}))
            self.algorithm = build_algorithm(self.spec)
            self.algorithm.attach(self.model, self.module)
            s.alg = self.algorithm
        self.mode = msg.mode
        s.pending_return, s.standard_serving = bool(msg.pending_return), bool(msg.standard_serving)
        s.standard_unit = msg.standard_unit
        self.grant = None
        self.sent = [0] * self.num_models
        self.received = [0] * self.num_models
        self.final_sent = [0] * self.num_models
        self.final_received = [0] * self.num_models
        self.peer_status = [None] * self.num_models
        self._set_policy()

    # -- handlers ------------------------------------------------------------------------------------------------
    def _client_service(self) -> None:
        for msg in drain(self.client_sock):
            try:
                self._on_client(msg)
            except Exception as exc:
                self._report(getattr(msg, "request_id", None), exc)

    def _on_client(self, msg) -> None:
        s = self.scheduler
        if isinstance(msg, AddRequest):
            if self.trace is not None:
                self.trace.append(("add", time.perf_counter(), msg.request_id))
            self._dispatch(s.add_request(msg))
        elif isinstance(msg, Abort):
            s.abort(msg.request_id, msg.reason, msg.inc)
        elif isinstance(msg, StepGrant):
            self.grant, self.grant_time = msg, time.monotonic()
        elif isinstance(msg, Peers):
            for k, addr in enumerate(msg.addresses):
                if k != self.model:
                    self._connect_peer(k, addr)
        elif isinstance(msg, PeerRestarted):
            self._connect_peer(msg.model, msg.address)
            self.sent[msg.model] = self.received[msg.model] = 0
            self.final_sent[msg.model] = self.final_received[msg.model] = 0
            self.peer_status[msg.model] = None   # other peers' counts for it are now inconsistent: backstop only
        elif isinstance(msg, StatsQuery):
            bm = self.runner.block_manager
            counters: dict[str, Any] = dict(s.counters)
            counters.update(step_time_s=self.step_time, step_wall_s=self.step_wall, idle_s=self.idle_time,
                            forced_status_lag_s=self.forced_lag,
                            wall_s=time.perf_counter(), prefix_hit_tokens=getattr(bm, "num_hit_tokens", 0),
                            flags={"mode": self.mode, "pending_return": s.pending_return,
                                   "standard_serving": s.standard_serving, "standard_unit": s.standard_unit,
                                   "algorithm": self.spec.algorithm})
            if self.policy is not None:
                counters["policy"] = self.policy.to_dict()
            self._to(FRONTEND, StatsReply(self.model, msg.token, bm.num_blocks, bm.num_free_blocks,
                                          bm.num_used_blocks, s.counters["preemptions"], s.count_states(), counters))
        elif isinstance(msg, Configure):
            self._configure(msg)
        elif isinstance(msg, Shutdown):
            self.stopping = True

    def _connect_peer(self, k: int, addr: str) -> None:
        old = self.peers.pop(k, None)
        if old is not None:
            old.close(0)
        self.peers[k] = connect_push(self.ctx, addr)

    def _handoff_service(self) -> None:
        for msg in drain(self.peer_sock):
            try:
                if isinstance(msg, HandoffMsg):
                    if self.trace is not None:
                        self.trace.append(("recv", time.perf_counter(), msg.handoff.request_id, msg.final))
                    self.received[msg.handoff.source] += 1
                    self.final_received[msg.handoff.source] += bool(msg.final)
                    self._dispatch(self.scheduler.receive_handoff(msg))
                elif isinstance(msg, Release):
                    self.scheduler.release(msg)
                elif isinstance(msg, PeerStatus):
                    self.peer_status[msg.model] = msg   # per-sender order: the latest one is the newest state
            except Exception as exc:
                self._report(getattr(getattr(msg, "handoff", None), "request_id", None), exc)

    def _decode_service(self) -> bool:
        s = self.scheduler
        if self.mode in SYNC_MODES:
            g = self.grant
            if g is None:
                return False
            if any(self.received[k] < g.expected[k] for k in range(self.num_models)):
                if time.monotonic() - self.grant_time < float(self.spec.grant_timeout_s):
                    return False   # a counted handoff is still in flight: drain it before stepping
                send(self.front, Error(None, f"model {self.model}: step grant {g.round} waited "
                                       f"{self.spec.grant_timeout_s} s for handoffs {g.expected}, got "
                                       f"{self.received}; stepping anyway", self.model))
            ran = self._step() if s.has_work() else False
            self.grant = None
            self._flush()   # StepDone's sent counts cover every handoff of this step
            send(self.front, StepDone(self.model, g.round, list(self.sent), ran, s.num_ready()))
            return ran
        n = s.num_ready()
        if n == 0:
            self.ready_since = None
            self._publish(False, 0)
            return False
        now = time.monotonic()
        if self.ready_since is None:
            self.ready_since = now
        launch = True
        if self.policy is not None:
            num_live = len(s.requests) if s.is_home and not s.standard_serving else None
            # The count-based check runs only below threshold (it is the only case that reads it).
            launch = self.policy.should_launch(self.model, n, False, num_live)
            if not launch and self._nothing_else_can_run(n):
                launch = self.policy.should_launch(self.model, n, True, num_live)
                # diagnostics: from the last peer's going idle (its report's time) to this forced launch
                last = max((st.at for st in self.peer_status if st is not None), default=now)
                self.forced_lag += max(0.0, now - last)
            if not launch and now - self.ready_since >= float(self.spec.max_delay_s):
                launch = True   # backstop against a lost status message; counted as forced
                s.counters["backstop_launches"] = s.counters.get("backstop_launches", 0) + 1
                self.policy.launches[self.model] += 1
                self.policy.forced_launches[self.model] += 1
        if not launch:
            self._publish(False, n)
            return False
        self._publish(True, n)
        self.ready_since = None
        return self._step()

    def _nothing_else_can_run(self, n: int) -> bool:
        # Our own handoffs still in the outbox count as sent: a step that just handed requests back to a peer has
        # made that peer busy, even though its last report (idle) cannot know it yet. Leaving them out forced a
        # launch right after every hand-back, before the batch it was waiting for could form.
        sent, received = self._work_counts(pending=True)
        return nothing_else_can_run(self.model, n, sent, received, self.peer_status)

    def _work_counts(self, pending: bool = False) -> tuple[list[int], list[int]]:
        """HandoffMsgs sent to / received from each model that can create work (final deliveries left out);
        pending: count the outbox's handoffs as sent (an idle report travels behind them in the same frame)."""
        sent = [a - b for a, b in zip(self.sent, self.final_sent)]
        received = [a - b for a, b in zip(self.received, self.final_received)]
        if pending:
            for dest, msgs in self.outbox.items():
                if dest != FRONTEND:
                    sent[dest] += sum(isinstance(m, HandoffMsg) and not m.final for m in msgs)
        return sent, received

    def _publish(self, active: bool, ready: int) -> None:
        """Delayed batching only: tell peers this model's state when it starts executing, and whenever its idle
        state (ready count, handoff counts) changes, so peers can tell a current "idle" from a stale one."""
        if self.policy is None:
            return
        # an idle report's counts cover every handoff already dispatched: those in the outbox too
        sent, received = self._work_counts(pending=not active)
        state = (True,) if active else (False, ready, tuple(sent), tuple(received))
        if state != self.published:
            self.published = state
            ts = self.policy.thresholds
            for k, sock in self.peers.items():
                if ts[k] <= 1:
                    continue   # a peer with threshold 1 launches whenever it has work and never reads our status
                msg = PeerStatus(self.model, active, ready, sent, received, time.monotonic())
                if active:
                    send(sock, msg)   # now, ahead of the step's handoffs: peers stop forcing launches at once
                else:
                    self._to(k, msg)   # behind this turn's handoffs to k, in the same frame
        if not active:
            self._flush()

    def _step(self) -> bool:
        self.step_started = time.monotonic()
        try:
            return self._run_step()
        finally:
            self.step_started = None

    def _run_step(self) -> bool:
        t_step = time.perf_counter()
        s = self.scheduler
        batch = s.schedule()
        if not batch:
            return False
        s.counters["computed_tokens"] += sum(r.seq.num_tokens - r.seq.num_computed_tokens for r in batch)
        t0 = time.perf_counter()
        seqs = [r.seq for r in batch]
        try:
            launch = getattr(self.runner, "launch", None)
            if launch is not None:
                # An accelerator step: launched, the CPU is free until the outputs are needed. The previous step's
                # (and the handlers') messages are sent now, inside the step, as a GPU engine's CPU thread would.
                pending = launch(seqs)
                self._flush()
                out = self.runner.wait(pending)
            else:
                self._flush()
                out = self.runner.run(seqs)
        except Exception as exc:   # a failed forward fails its batch, not the process
            for r in batch:
                s.abort(r.request_id, "error")
                self._to(FRONTEND, Error(r.request_id, f"model {self.model} step failed: {type(exc).__name__}: "
                                         f"{exc}", self.model, inc=r.inc))
            self._flush()
            return True
        t1 = time.perf_counter()
        self.step_time += t1 - t0
        self._dispatch(s.update_from_output(batch, out))
        if launch is None:
            self._flush()   # a CPU forward: nothing to overlap with, send now
        t_end = time.perf_counter()
        self.step_wall += t_end - t_step
        if self.trace is not None:
            self.trace.append(("step", t_step, t0, t1, t_end, [r.request_id for r in batch],
                               len(s.requests)))
        return True

    def _dispatch(self, outs) -> None:
        for o in outs:
            self._to(o.dest, o.msg)

    def _to(self, dest: int, msg) -> None:
        self.outbox.setdefault(dest, []).append(msg)

    def _flush(self) -> None:
        """Send this turn's messages: one frame per destination, in dispatch order (ZeroMQ keeps per-sender
        order, so a receiver still sees them in order). Called at the end of each handler and of each step."""
        if not self.outbox:
            return
        box, self.outbox = self.outbox, {}
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

    def _report(self, rid: str | None, exc: Exception) -> None:
        tb = traceback.format_exc(limit=4)
        self._to(FRONTEND, Error(rid, f"model {self.model}: {type(exc).__name__}: {exc}\n{tb}", self.model))


def main(spec: SubServerSpec) -> None:
    """Process entry point (multiprocessing spawn target)."""
    try:
        server = SubServer(spec)
    except Exception as exc:
        ctx = zmq.Context()
        sock = connect_push(ctx, spec.frontend)
        sock.setsockopt(zmq.LINGER, 2000)
        send(sock, Error(None, f"model {spec.model} failed to start: {type(exc).__name__}: {exc}\n"
                         f"{traceback.format_exc(limit=6)}", int(spec.model), fatal=True))
        sock.close()
        ctx.term()
        raise SystemExit(1) from None
    prof_dir = os.environ.get("TOKENPLANE_PROFILE_DIR")
    if not prof_dir:
        server.serve()
        return
    import cProfile  # diagnostics only: where a sub-server's CPU goes (benchmarks/routing/overhead.py --profile)
    prof = cProfile.Profile()
    try:
        prof.runcall(server.serve)
    finally:
        prof.dump_stats(os.path.join(prof_dir, f"model{server.model}.{spec.generation}.prof"))


__all__ = ["MODES", "SYNC_MODES", "SubServer", "build_algorithm", "build_runner", "main", "nothing_else_can_run"]
