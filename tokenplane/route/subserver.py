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

Outgoing messages collect in an outbox (outbox.py) and leave as one frame per destination. They are sent while the next
launched step runs when the runner can launch (the latency-model runner, like an accelerator), right after the step
otherwise, and always before the loop blocks, before StepDone and before an idle PeerStatus (whose counts must cover
them).

SubServerSpec (the start arguments) and the builders of the runner and algorithm are subserver_spec.py's.

Execution modes are flags of this loop, not separate loops:
    immediate_async  launch whenever >= 1 request is ready (BatchPolicy with thresholds all 1)
    delayed_async    launch when BatchPolicy.should_launch(model, num_ready, nothing_else_can_run, num_live) says so;
                     nothing_else_can_run is count-based (launch_gate.py): every peer reported idle AND every
                     HandoffMsg any model sent has been received (sent/received counts in PeerStatus), so a stale
                     "idle" from a peer that has not yet seen our handoff never forces a launch; max_delay_s stays
                     as the backstop for lost messages / restarted peers
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
from typing import Any

import zmq

from .handoff import Inbox, bind_pull, connect_push, drain, send
from .launch_gate import LaunchGate
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
from .outbox import Outbox
from .params import eos_token_ids
from .route_request import FRONTEND
from .scheduler import Scheduler
from .states import RequestState
from .subserver_spec import MODES, SYNC_MODES, SubServerSpec, build_algorithm, build_runner


class SubServer:
    def __init__(self, spec: SubServerSpec):
        self.spec = spec
        self.model = int(spec.model)
        self.num_models = int(spec.num_models)
        self.mode = spec.mode
        self.ppid = os.getppid()
        self.ctx = zmq.Context()
        # Diagnostics only (TOKENPLANE_TRACE_DIR): timestamped steps and message events, dumped as JSON at exit.
        self.trace: list | None = [] if os.environ.get("TOKENPLANE_TRACE_DIR") else None
        self.out = Outbox(self.model, self.num_models, self.ctx, connect_push(self.ctx, spec.frontend), self.trace)
        self.gate = LaunchGate(self.model, self.num_models, self.out)
        self.grant: StepGrant | None = None
        self.grant_time = 0.0
        self.stopping = False
        self.step_time = 0.0     # inside runner.run (the modeled / real forward)
        self.step_wall = 0.0     # a whole step: schedule + run + sample/route + sends
        self.idle_time = 0.0     # blocked in inbox.wait with nothing to run
        # Liveness is the heartbeat thread's job, so it does not depend on how long a step takes; it reads only
        # these two plain attributes (assignments are atomic), written by the loop. It starts before the model loads:
        # a load slowed by a busy machine (minutes to read weights and compile kernels) is told from a frozen one by
        # its heartbeats (Supervisor.watch), not by a fixed deadline.
        self.step_started: float | None = None   # time.monotonic() when the current step began
        self.load = (0, 0, 0, 0, 0)     # waiting, running, pending, used, total blocks (0 total: loading)
        self._hb_stop = threading.Event()
        self._hb = threading.Thread(target=self._heartbeat_loop, name=f"heartbeat-{self.model}", daemon=True)
        self._hb.start()

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
        self.gate.configure(self.mode, spec.thresholds, spec.concurrency)
        tag = f"{self.model}.{spec.generation}"
        self.client_sock, client_addr = bind_pull(self.ctx, spec.transport, spec.ipc_dir, f"c{tag}")
        self.peer_sock, peer_addr = bind_pull(self.ctx, spec.transport, spec.ipc_dir, f"p{tag}")
        self.inbox = Inbox({"client": self.client_sock, "peer": self.peer_sock})
        cfg = getattr(self.runner, "cfg", None)
        max_len = getattr(cfg, "max_position_embeddings", None)
        self.load = (0, 0, 0, 0, self.runner.block_manager.num_blocks)
        bm = self.runner.block_manager
        send(self.out.front, Ready(self.model, os.getpid(), client_addr, peer_addr, bm.num_blocks, bm.block_size,
                                   eos_token_ids(cfg), None if max_len is None else int(max_len)))

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
                self.out.flush()   # nothing will run: send what the handlers produced before blocking
                t = time.perf_counter()
                self.inbox.wait(self.gate.idle_timeout(float(self.spec.max_delay_s)))
                self.idle_time += time.perf_counter() - t
        self._hb_stop.set()
        self._hb.join(2)
        self.out.flush()
        if self.trace is not None:
            import json
            path = os.path.join(os.environ["TOKENPLANE_TRACE_DIR"], f"model{self.model}.{self.spec.generation}.json")
            with open(path, "w") as f:
                json.dump(self.trace, f)
        self.inbox.close()
        self.out.close()
        self.ctx.term()

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
        self.out.reset_counts()
        self.gate.configure(self.mode, self.spec.thresholds, self.spec.concurrency)

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
            self.out.dispatch(s.add_request(msg))
        elif isinstance(msg, Abort):
            s.abort(msg.request_id, msg.reason, msg.inc)
        elif isinstance(msg, StepGrant):
            self.grant, self.grant_time = msg, time.monotonic()
        elif isinstance(msg, Peers):
            for k, addr in enumerate(msg.addresses):
                if k != self.model:
                    self.out.connect_peer(k, addr)
        elif isinstance(msg, PeerRestarted):
            self.out.connect_peer(msg.model, msg.address)
            self.out.reset_counts(msg.model)
            self.gate.forget(msg.model)
        elif isinstance(msg, StatsQuery):
            bm = self.runner.block_manager
            counters: dict[str, Any] = dict(s.counters)
            counters.update(step_time_s=self.step_time, step_wall_s=self.step_wall, idle_s=self.idle_time,
                            forced_status_lag_s=self.gate.forced_lag,
                            wall_s=time.perf_counter(), prefix_hit_tokens=getattr(bm, "num_hit_tokens", 0),
                            flags={"mode": self.mode, "pending_return": s.pending_return,
                                   "standard_serving": s.standard_serving, "standard_unit": s.standard_unit,
                                   "algorithm": self.spec.algorithm})
            if self.gate.policy is not None:
                counters["policy"] = self.gate.policy.to_dict()
            self.out.to(FRONTEND, StatsReply(self.model, msg.token, bm.num_blocks, bm.num_free_blocks,
                                             bm.num_used_blocks, s.counters["preemptions"], s.count_states(),
                                             counters))
        elif isinstance(msg, Configure):
            self._configure(msg)
        elif isinstance(msg, Shutdown):
            self.stopping = True

    def _handoff_service(self) -> None:
        for msg in drain(self.peer_sock):
            try:
                if isinstance(msg, HandoffMsg):
                    if self.trace is not None:
                        self.trace.append(("recv", time.perf_counter(), msg.handoff.request_id, msg.final))
                    self.out.on_received(msg)
                    self.out.dispatch(self.scheduler.receive_handoff(msg))
                elif isinstance(msg, Release):
                    self.scheduler.release(msg)
                elif isinstance(msg, PeerStatus):
                    self.gate.on_status(msg)
            except Exception as exc:
                self._report(getattr(getattr(msg, "handoff", None), "request_id", None), exc)

    def _decode_service(self) -> bool:
        s = self.scheduler
        if self.mode in SYNC_MODES:
            g = self.grant
            if g is None:
                return False
            if any(self.out.received[k] < g.expected[k] for k in range(self.num_models)):
                if time.monotonic() - self.grant_time < float(self.spec.grant_timeout_s):
                    return False   # a counted handoff is still in flight: drain it before stepping
                send(self.out.front, Error(None, f"model {self.model}: step grant {g.round} waited "
                                           f"{self.spec.grant_timeout_s} s for handoffs {g.expected}, got "
                                           f"{self.out.received}; stepping anyway", self.model))
            ran = self._step() if s.has_work() else False
            self.grant = None
            self.out.flush()   # StepDone's sent counts cover every handoff of this step
            send(self.out.front, StepDone(self.model, g.round, list(self.out.sent), ran, s.num_ready()))
            return ran
        num_live = len(s.requests) if s.is_home and not s.standard_serving else None
        if not self.gate.should_step(s.num_ready(), num_live, s.counters, float(self.spec.max_delay_s)):
            return False
        return self._step()

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
                self.out.flush()
                out = self.runner.wait(pending)
            else:
                self.out.flush()
                run_greedy = getattr(self.runner, "run_greedy", None)
                out = (run_greedy(seqs, top_k=s.alg.top_logits(self.model))
                       if run_greedy is not None and s.greedy_step(batch) else self.runner.run(seqs))
        except Exception as exc:   # a failed forward fails its batch, not the process
            for r in batch:
                s.abort(r.request_id, "error")
                self.out.to(FRONTEND, Error(r.request_id, f"model {self.model} step failed: "
                                            f"{type(exc).__name__}: {exc}", self.model, inc=r.inc))
            self.out.flush()
            return True
        t1 = time.perf_counter()
        self.step_time += t1 - t0
        self.out.dispatch(s.update_from_output(batch, out))
        if launch is None:
            self.out.flush()   # a CPU forward: nothing to overlap with, send now
        t_end = time.perf_counter()
        self.step_wall += t_end - t_step
        if self.trace is not None:
            self.trace.append(("step", t_step, t0, t1, t_end, [r.request_id for r in batch],
                               len(s.requests)))
        return True

    def _report(self, rid: str | None, exc: Exception) -> None:
        tb = traceback.format_exc(limit=4)
        self.out.to(FRONTEND, Error(rid, f"model {self.model}: {type(exc).__name__}: {exc}\n{tb}", self.model))


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


__all__ = ["SubServer", "main"]
