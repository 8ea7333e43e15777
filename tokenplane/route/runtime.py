"""The multi-process token-level routing runtime: a front end plus one sub-server process per model.

    rt = Runtime(RuntimeConfig(models=["test-small", "test-large"], algorithm="r2r",
                               algorithm_kwargs={"mode": "synthetic", "seed": 0}))
    async for chunk in rt.generate(prompt_ids, SamplingParams(max_tokens=64)):
        ...            # TokenChunk: committed tokens in order; the last one has finish_reason and stats
    rt.shutdown()

Model 0 is every request's home: it admits requests and streams committed tokens to the front end; peers send
their tokens back to it (a finished request's tail included). Execution modes and baselines are FLAGS of this one
code path (RuntimeConfig.mode / pending_return / standard_serving), see docs/runtime.md.

The front end runs one I/O thread that owns the inbox, watches the sub-server processes (exit codes and heartbeats)
and, in the sync modes, acts as the step coordinator. User calls send on the per-model client sockets under a lock.

Faults: when a sub-server dies (or stops heart-beating), every live request fails with RequestFailed naming the
model (a live request may hold state on any model or be routed to it next), the survivors drop those requests, and
the model is restarted (auto_restart, or `restart_model(i)`); new requests are served once it is Ready again.
Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing as mp
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

import zmq

from .handoff import bind_pull, connect_push, drain, new_address_dir, send, send_many
from .messages import (Abort, AddRequest, Configure, Error, Finished, Heartbeat, PeerRestarted, Peers, Ready, Shutdown,
                       StatsQuery, StatsReply, StepDone, StepGrant, TokenChunk, Yield)
from .scheduler import params_to_wire
from .subserver import MODES, SYNC_MODES

log = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    """A request could not complete (sub-server died, routing error, timeout, shutdown)."""


@dataclass
class RuntimeConfig:
    models: list[Any]                                  # model sources: preset name | HF config dict | checkpoint dir
    algorithm: str = "r2r"
    algorithm_kwargs: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    dtype: Any = "float32"                             # torch dtype or its name
    num_blocks: int | list[int] = 512                  # per model (KV pool size in blocks)
    block_size: int = 16
    mode: str = "delayed_async"                        # stepwise_sync | model_sync | immediate_async | delayed_async
    pending_return: bool = True
    standard_serving: bool = False
    thresholds: list[int] | str | None = None          # delayed_async: T_m list, "auto" (no fits: all 1), None = all 1
    concurrency: int = 8                               # what thresholds are validated / chosen for
    routing_probs: Any = None                          # thresholds="auto": routing model (see throughput_model)
    latency_fits: list[dict] | None = None             # thresholds="auto": LatencyFit dicts, one per model
    runner: str = "torch"                              # "torch" | "latency-model"
    seeds: list[int] | None = None                     # weight seeds per model (default 0, as the reference)
    transport: str = "ipc"                             # "ipc" | "tcp" (127.0.0.1)
    threads_per_model: int = 1
    max_num_seqs: int = 256
    enforce_eager: bool = False
    heartbeat_s: float = 0.5
    heartbeat_timeout_s: float = 15.0
    startup_timeout_s: float = 180.0
    request_timeout_s: float = 600.0
    max_delay_s: float = 0.2                           # delayed_async backstop: max wait below threshold
    grant_timeout_s: float = 30.0
    auto_restart: bool = True

    def validate(self) -> None:
        if len(self.models) < 2:
            raise ValueError("the routing runtime needs at least 2 models")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.runner not in ("torch", "latency-model"):
            raise ValueError(f"runner must be 'torch' or 'latency-model', got {self.runner!r}")
        if self.transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {self.transport!r}")
        if self.standard_serving and self.mode in SYNC_MODES:
            pass   # allowed: the external scheduler still obeys the barrier
        if self.seeds is not None and len(self.seeds) != len(self.models):
            raise ValueError("seeds needs one entry per model")


@dataclass
class RuntimeOutput:
    request_id: str
    token_ids: list[int]
    token_models: list[int]
    finish_reason: str
    stats: dict[str, Any]


@dataclass
class _Live:
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


@dataclass
class _Model:
    index: int
    proc: Any = None
    generation: int = 0
    client: Any = None          # PUSH socket to its client inbox
    peer_address: str | None = None
    ready: bool = False
    pid: int | None = None
    last_heartbeat: float = 0.0
    info: Ready | None = None
    restarts: int = 0


class Runtime:
    """Front end of the routing runtime (see module docstring)."""

    def __init__(self, config: RuntimeConfig):
        config.validate()
        self.config = config
        self.num_models = len(config.models)
        self.thresholds = self._resolve_thresholds()
        self._dtype = config.dtype if isinstance(config.dtype, str) else str(config.dtype).replace("torch.", "")
        self._mp = mp.get_context("spawn")
        self._ipc_dir = new_address_dir() if config.transport == "ipc" else None
        self._ctx = zmq.Context()
        self._inbox, self._inbox_addr = bind_pull(self._ctx, config.transport, self._ipc_dir, "fe")
        self._lock = threading.RLock()
        self._live: dict[str, _Live] = {}
        self._models = [_Model(i) for i in range(self.num_models)]
        self._all_ready = threading.Event()
        self._stop = threading.Event()
        self._closed = False
        self.errors: list[str] = []             # non-request errors reported by sub-servers
        self.events: list[str] = []             # deaths and restarts, for operators and tests
        self._stats_waits: dict[int, tuple[threading.Event, dict[int, StatsReply]]] = {}
        self._stats_token = itertools.count(1)
        self._inc = itertools.count(1)
        self._startup_error: str | None = None
        # sync-mode coordinator state (I/O thread only)
        self._round = 0
        self._outstanding: set[int] = set()
        self._sent_table = [[0] * self.num_models for _ in range(self.num_models)]
        self._dirty = [True] * self.num_models
        self._rr = 0
        self._idle_round_at = 0.0
        # I/O thread batching: deliveries to a caller's event loop and standard-serving re-submissions collected
        # while one inbox drain is handled, then handed over once (one loop wake-up, one frame per model).
        self._batching = False
        self._pending_deliveries: list[tuple[_Live, Any]] = []
        self._pending_adds: dict[int, list[tuple[_Live, AddRequest]]] = {}
        self._io = threading.Thread(target=self._io_loop, name="tokenplane-runtime-io", daemon=True)
        try:
            for m in range(self.num_models):
                self._spawn(m)
            self._io.start()
            if not self._all_ready.wait(config.startup_timeout_s):
                raise RuntimeError(self._startup_error or f"sub-servers not ready after {config.startup_timeout_s} s")
            if self._startup_error:
                raise RuntimeError(self._startup_error)
        except BaseException:
            self.shutdown()
            raise

    # -- configuration ---------------------------------------------------------------------------------------------
    def _resolve_thresholds(self) -> list[int]:
        cfg = self.config
        if cfg.mode != "delayed_async" or cfg.thresholds is None:
            return [1] * self.num_models
        if cfg.thresholds == "auto":
            from tokenplane.engine.latency_runner import LatencyFit
            from .throughput_model import choose_thresholds
            fits = cfg.latency_fits
            if fits is None and cfg.runner == "latency-model":
                fits = [m.get("latency") for m in cfg.models]
            if cfg.routing_probs is None or fits is None or not all(isinstance(f, dict) for f in fits):
                # Without a routing model and latency fits there is nothing to choose from; all 1 (launch whenever
                # anything is ready) is always feasible and never slower than immediate_async.
                log.warning("thresholds='auto' without routing_probs and one LatencyFit dict per model (latency_fits, "
                            "or latency-model sources with a 'latency' dict): using thresholds all 1")
                return [1] * self.num_models
            fns = [LatencyFit.from_dict(f).at_context(1024) for f in fits]
            return choose_thresholds(cfg.concurrency, cfg.routing_probs, fns)
        from .batching import BatchPolicy
        ts = [int(t) for t in cfg.thresholds]
        if len(ts) != self.num_models:
            raise ValueError(f"thresholds needs one entry per model, got {ts}")
        BatchPolicy(ts, cfg.concurrency)   # raises ValueError when infeasible
        return ts

    def _spec(self, m: int, generation: int) -> dict[str, Any]:
        cfg = self.config
        nb = cfg.num_blocks[m] if isinstance(cfg.num_blocks, (list, tuple)) else cfg.num_blocks
        return {"model": m, "num_models": self.num_models, "source": cfg.models[m],
                "seed": 0 if cfg.seeds is None else int(cfg.seeds[m]), "device": cfg.device, "dtype": self._dtype,
                "num_blocks": int(nb), "block_size": cfg.block_size, "runner": cfg.runner,
                "algorithm": cfg.algorithm, "algorithm_kwargs": dict(cfg.algorithm_kwargs), "mode": cfg.mode,
                "pending_return": cfg.pending_return, "standard_serving": cfg.standard_serving,
                "thresholds": list(self.thresholds), "concurrency": cfg.concurrency, "max_delay_s": cfg.max_delay_s,
                "grant_timeout_s": cfg.grant_timeout_s, "transport": cfg.transport, "ipc_dir": self._ipc_dir,
                "frontend": self._inbox_addr, "generation": generation, "heartbeat_s": cfg.heartbeat_s,
                "threads": cfg.threads_per_model, "max_num_seqs": cfg.max_num_seqs,
                "enforce_eager": cfg.enforce_eager}

    def _spawn(self, m: int) -> None:
        from . import subserver
        st = self._models[m]
        st.generation += 1
        st.ready = False
        st.proc = self._mp.Process(target=subserver.main, args=(self._spec(m, st.generation),),
                                   name=f"tokenplane-model{m}", daemon=True)
        st.proc.start()
        st.pid = st.proc.pid
        st.last_heartbeat = time.monotonic()

    # -- public API ------------------------------------------------------------------------------------------------
    @property
    def pids(self) -> list[int | None]:
        return [st.pid for st in self._models]

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _prepare_params(self, prompt: list[int], params, rid: str) -> dict[str, Any]:
        """What the sequential reference does to a request's parameters, so both make the same decisions."""
        from .reference import request_params
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        params = request_params(params, rid)
        info = self._models[0].info
        stop = list(params.stop_token_ids)
        if info is not None and not params.ignore_eos:
            stop += [e for e in info.eos_token_ids]
        max_tokens = params.max_tokens
        lens = [st.info.max_model_len for st in self._models if st.info is not None and st.info.max_model_len]
        if lens:
            if len(prompt) >= min(lens):
                raise ValueError(f"prompt has {len(prompt)} tokens; the context is {min(lens)}")
            max_tokens = min(max_tokens, min(lens) - len(prompt))
        d = params_to_wire(params)
        d.update(max_tokens=max_tokens, stop_token_ids=stop)
        return d

    async def generate(self, prompt_ids: Sequence[int], params=None,
                       request_id: str | None = None) -> AsyncIterator[TokenChunk]:
        """Route one request; yields TokenChunks as tokens are committed. Raises RequestFailed on failure."""
        from tokenplane.engine.sampler import SamplingParams
        if self._closed:
            raise RequestFailed("runtime is shut down")
        params = params if params is not None else SamplingParams()
        rid = request_id or uuid.uuid4().hex
        prompt = [int(t) for t in prompt_ids]
        deadline = time.monotonic() + self.config.request_timeout_s
        await self._wait_all_ready(deadline)
        wire = self._prepare_params(prompt, params, rid)
        live = _Live(rid, asyncio.get_running_loop(), asyncio.Queue(), prompt, wire, time.monotonic(),
                     inc=next(self._inc))
        with self._lock:
            if rid in self._live:
                raise ValueError(f"request id {rid!r} is already running")
            self._live[rid] = live
            self._send_client(0, AddRequest(rid, prompt, wire, inc=live.inc))
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise asyncio.TimeoutError
                item = await asyncio.wait_for(live.queue.get(), timeout=left)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        except asyncio.TimeoutError:
            raise RequestFailed(f"request {rid} timed out after {self.config.request_timeout_s} s") from None
        finally:
            if not live.done:   # consumer stopped early, timed out, or was cancelled
                self.abort(rid)

    async def complete(self, prompt_ids: Sequence[int], params=None, request_id: str | None = None) -> RuntimeOutput:
        """Run one request to completion."""
        tokens, models, final = [], [], None
        async for chunk in self.generate(prompt_ids, params, request_id):
            tokens += chunk.tokens
            models += chunk.models
            final = chunk
        return RuntimeOutput(final.request_id, tokens, models, final.finish_reason, final.stats or {})

    def run_batch(self, prompts: Sequence[Sequence[int]], params=None, *, request_ids: Sequence[str] | None = None,
                  concurrency: int | None = None, return_exceptions: bool = False) -> list[Any]:
        """Synchronous helper: route `prompts` with at most `concurrency` in flight; outputs in prompt order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        rids = list(request_ids) if request_ids is not None else [f"req-{i}" for i in range(len(prompts))]

        async def go():
            sem = asyncio.Semaphore(concurrency or len(prompts) or 1)

            async def one(p, sp, rid):
                async with sem:
                    return await self.complete(p, sp, rid)
            return await asyncio.gather(*(one(p, sp, r) for p, sp, r in zip(prompts, plist, rids)),
                                        return_exceptions=return_exceptions)
        return asyncio.run(go())

    def abort(self, request_id: str) -> bool:
        """Abort a request on every model (frees its KV blocks everywhere). True if it was live."""
        with self._lock:
            live = self._live.pop(request_id, None)
            if live is None:
                return False
            for st in self._models:
                if st.ready and st.client is not None:
                    send(st.client, Abort(request_id, inc=live.inc))
        if live is None:
            return False
        if not live.done:
            live.done = True
            self._deliver(live, TokenChunk(request_id, [], [], live.streamed, "abort", {}))
        return True

    def stats(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Per-model block accounting and counters (a StatsQuery round trip to every sub-server)."""
        token = next(self._stats_token)
        ev, replies = threading.Event(), {}
        with self._lock:
            self._stats_waits[token] = (ev, replies)
            for m in range(self.num_models):
                self._send_client(m, StatsQuery(token))
        ev.wait(timeout)
        with self._lock:
            self._stats_waits.pop(token, None)
        if len(replies) < self.num_models:
            raise RequestFailed(f"stats: only models {sorted(replies)} answered within {timeout} s")
        return [dataclasses.asdict(replies[m]) for m in range(self.num_models)]

    _FLAGS = ("mode", "pending_return", "standard_serving", "thresholds", "concurrency", "max_delay_s",
              "algorithm", "algorithm_kwargs")

    def configure(self, **changes: Any) -> None:
        """Change execution-mode flags (mode, pending_return, standard_serving, thresholds, concurrency,
        max_delay_s) and/or the algorithm (algorithm, algorithm_kwargs) while no request is live. The sub-servers
        keep their models and KV pools; only the flags change."""
        bad = sorted(set(changes) - set(self._FLAGS))
        if bad:
            raise ValueError(f"configure: unknown or non-switchable fields {bad}; switchable: {self._FLAGS}")
        # Finished requests may still be parked on peers until the home model's Release reaches them.
        deadline = time.monotonic() + 10.0
        while any(sum(st["requests"].values()) for st in self.stats()):
            if time.monotonic() > deadline:
                raise RuntimeError("configure: sub-servers still hold requests after 10 s")
            time.sleep(0.01)
        with self._lock:
            if self._live:
                raise RuntimeError(f"configure needs an idle runtime; {len(self._live)} requests are live")
            new = dataclasses.replace(self.config, **changes)
            new.validate()
            old_cfg, self.config = self.config, new
            try:
                self.thresholds = self._resolve_thresholds()
            except ValueError:
                self.config = old_cfg
                raise
            self._outstanding.clear()
            self._sent_table = [[0] * self.num_models for _ in range(self.num_models)]
            self._dirty = [True] * self.num_models
            alg_changed = "algorithm" in changes or "algorithm_kwargs" in changes
            msg = Configure(new.mode, new.pending_return, new.standard_serving, list(self.thresholds),
                            new.concurrency, new.max_delay_s, new.algorithm if alg_changed else None,
                            dict(new.algorithm_kwargs) if alg_changed else None)
            for m in range(self.num_models):
                self._send_client(m, msg)
        # Same pipe as Configure: once every model answered, every model has handled it.
        for st in self.stats():
            applied = st["counters"].get("flags", {})
            want = {"mode": new.mode, "pending_return": new.pending_return, "standard_serving": new.standard_serving}
            if any(applied.get(k) != v for k, v in want.items()):
                raise RuntimeError(f"configure: model {st['model']} did not apply {want} (has {applied}); "
                                   f"errors: {self.errors[-1:]}")

    def restart_model(self, m: int, timeout: float | None = None) -> None:
        """Kill (if alive) and restart model m's sub-server; blocks until the new one is Ready. Live requests fail
        (as on any sub-server death)."""
        st = self._models[m]
        with self._lock:
            old = st.proc
            if old is not None and old.exitcode is None:
                old.kill()
        if old is not None:
            old.join(5)
        with self._lock:
            if st.proc is old:   # the I/O thread has not handled the death yet
                if st.ready:
                    self._on_death(m, "was restarted by restart_model")
                self._spawn(m)
        deadline = time.monotonic() + (timeout or self.config.startup_timeout_s)
        while time.monotonic() < deadline:
            if st.ready and st.proc is not old:
                return
            time.sleep(0.02)
        raise RuntimeError(f"model {m} did not come back within the timeout")

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for live in list(self._live.values()):
                self._fail(live, "runtime shut down")
            self._live.clear()
            for st in self._models:
                if st.client is not None:
                    send(st.client, Shutdown())
        deadline = time.monotonic() + timeout
        for st in self._models:
            if st.proc is not None and st.proc.pid is not None:
                st.proc.join(max(0.1, deadline - time.monotonic()))
                if st.proc.exitcode is None:
                    st.proc.kill()
                    st.proc.join(2)
        self._stop.set()
        if self._io.is_alive():
            self._io.join(5)
        for st in self._models:
            if st.client is not None:
                st.client.close(0)
        self._inbox.close(0)
        self._ctx.term()
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # -- plumbing used by user threads and the I/O thread ----------------------------------------------------------
    async def _wait_all_ready(self, deadline: float) -> None:
        while not all(st.ready for st in self._models):
            if self._closed:
                raise RequestFailed("runtime is shut down")
            if time.monotonic() > deadline:
                raise RequestFailed("sub-servers not ready (restarting?) before the request deadline")
            await asyncio.sleep(0.02)

    def _send_client(self, m: int, msg) -> None:
        st = self._models[m]
        if st.client is None or not send(st.client, msg):
            raise RequestFailed(f"model {m} is not reachable")
        if isinstance(msg, AddRequest):
            self._dirty[m] = True

    def _deliver(self, live: _Live, item) -> None:
        if self._batching and threading.current_thread() is self._io:
            self._pending_deliveries.append((live, item))
            return
        try:
            live.loop.call_soon_threadsafe(live.queue.put_nowait, item)
        except RuntimeError:
            pass   # the caller's event loop is gone; nobody is listening

    def _flush_io(self) -> None:
        """I/O thread, after handling one drain: re-submissions (one frame per model), then deliveries (one
        call_soon_threadsafe per caller loop, items in arrival order)."""
        adds, self._pending_adds = self._pending_adds, {}
        for m, items in adds.items():
            st = self._models[m]
            if st.client is None or not send_many(st.client, [a for _, a in items]):
                for live, a in items:
                    if self._live.get(a.request_id) is live:
                        self._live.pop(a.request_id, None)
                    self._fail(live, f"model {m} is not reachable")
            else:
                self._dirty[m] = True
        items, self._pending_deliveries = self._pending_deliveries, []
        by_loop: dict[Any, list] = {}
        for live, item in items:
            by_loop.setdefault(live.loop, []).append((live.queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:
                pass
    def _fail(self, live: _Live, message: str) -> None:
        if not live.done:
            live.done = True
            self._deliver(live, RequestFailed(message))

    # -- I/O thread --------------------------------------------------------------------------------------------------
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        next_check = 0.0
        while not self._stop.is_set():
            poller.poll(5 if self.config.mode in SYNC_MODES else 50)
            msgs = drain(self._inbox)
            if msgs:
                with self._lock:
                    self._batching = True
                    try:
                        for msg in msgs:
                            try:
                                self._on_message(msg)
                            except Exception as exc:   # never let one bad message kill the front end
                                self.errors.append(f"front end: {type(exc).__name__}: {exc}")
                    finally:
                        self._batching = False
                        self._flush_io()
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.1
                with self._lock:
                    self._watch(now)
            if self.config.mode in SYNC_MODES:
                with self._lock:
                    self._coordinate(now)

    def _on_message(self, msg) -> None:
        if isinstance(msg, TokenChunk):
            live = self._live.get(msg.request_id)
            if live is not None and not live.done and live.inc == msg.inc:
                if live.first_token is None:
                    live.first_token = time.monotonic()
                live.streamed = msg.start + len(msg.tokens)
                self._deliver(live, msg)
        elif isinstance(msg, Finished):
            live = self._live.get(msg.request_id)
            if live is not None and live.inc == msg.inc and not live.done:
                del self._live[msg.request_id]
                live.done = True
                self._deliver(live, TokenChunk(msg.request_id, msg.tokens, msg.models, msg.start, msg.finish_reason,
                                               self._final_stats(live, msg.stats)))
        elif isinstance(msg, Yield):
            self._on_yield(msg)
        elif isinstance(msg, Error):
            self._on_error(msg)
        elif isinstance(msg, Heartbeat):
            st = self._models[msg.model]
            if msg.pid == st.pid:
                st.last_heartbeat = time.monotonic()
        elif isinstance(msg, StepDone):
            for k, n in enumerate(msg.sent):
                if n > self._sent_table[msg.model][k]:
                    self._dirty[k] = True
            self._sent_table[msg.model] = list(msg.sent)
            self._dirty[msg.model] = msg.num_ready > 0
            self._outstanding.discard(msg.model)
            if msg.ran:
                self._idle_round_at = 0.0
        elif isinstance(msg, StatsReply):
            w = self._stats_waits.get(msg.token)
            if w is not None:
                w[1][msg.model] = msg
                if len(w[1]) == self.num_models:
                    w[0].set()
        elif isinstance(msg, Ready):
            self._on_ready(msg)

    def _final_stats(self, live: _Live, stats: dict[str, Any]) -> dict[str, Any]:
        now = time.monotonic()
        out = dict(stats)
        out["latency_s"] = now - live.start
        out["ttft_s"] = (live.first_token or now) - live.start
        return out

    def _on_yield(self, y: Yield) -> None:
        """Standard serving: the front end is the external scheduler; one single-token call just ended."""
        live = self._live.get(y.request_id)
        if live is None or live.done or live.inc != y.inc:
            return
        n = len(y.output)
        if n > live.streamed:
            if live.first_token is None:
                live.first_token = time.monotonic()
            self._deliver(live, TokenChunk(y.request_id, y.output[live.streamed:], y.models[live.streamed:n],
                                           live.streamed))
            live.streamed = n
        if y.finish_reason is not None:
            self._live.pop(y.request_id, None)
            live.done = True
            self._deliver(live, TokenChunk(y.request_id, [], [], n, y.finish_reason,
                                           self._final_stats(live, y.state.get("__final_stats__", {}))))
            return
        self._pending_adds.setdefault(y.next_model, []).append(
            (live, AddRequest(y.request_id, y.prompt, y.params, y.output, y.models, y.state, y.num_handoffs,
                              y.handoff, inc=live.inc)))

    def _on_error(self, e: Error) -> None:
        if e.request_id is None:
            self.errors.append(e.message)
            if e.fatal and not self._all_ready.is_set():
                self._startup_error = e.message
                self._all_ready.set()
            return
        live = self._live.get(e.request_id)
        if live is None or (e.inc is not None and e.inc != live.inc):
            return
        del self._live[e.request_id]
        self._fail(live, f"request {e.request_id} failed on model {e.model}: {e.message}")
        for m in range(self.num_models):
            if self._models[m].ready:
                send(self._models[m].client, Abort(e.request_id, "error", live.inc))

    def _on_ready(self, r: Ready) -> None:
        st = self._models[r.model]
        if r.pid != st.pid:
            return   # a previous generation's late message
        st.info = r
        st.peer_address = r.peer_address
        if st.client is not None:
            st.client.close(0)
        st.client = connect_push(self._ctx, r.client_address)
        st.last_heartbeat = time.monotonic()
        st.ready = True
        st.restarts = 0
        restarted = self._all_ready.is_set()
        if restarted:
            # Survivors reconnect to the new peer inbox; the newcomer learns everyone's.
            for k, other in enumerate(self._models):
                if k != r.model and other.ready:
                    send(other.client, PeerRestarted(r.model, r.peer_address))
            self.events.append(f"model {r.model} restarted (pid {r.pid})")
        if all(s.ready for s in self._models):
            addrs = [s.peer_address for s in self._models]
            targets = [r.model] if restarted else range(self.num_models)
            for k in targets:
                send(self._models[k].client, Peers(addrs))
            self._all_ready.set()

    def _watch(self, now: float) -> None:
        """Detect dead or hung sub-servers."""
        if self._closed:
            return
        for m, st in enumerate(self._models):
            if st.proc is None:
                continue
            code = st.proc.exitcode
            if code is not None:
                if not self._all_ready.is_set():
                    self._startup_error = self._startup_error or f"model {m} exited during startup (code {code})"
                    self._all_ready.set()
                    return
                if st.ready:
                    self._on_death(m, f"exited with code {code}")
                    if self.config.auto_restart:
                        self._spawn(m)
                elif self.config.auto_restart and st.restarts < 3:
                    st.restarts += 1   # died again while restarting
                    self.events.append(f"model {m} died while restarting (code {code}); retrying")
                    self._spawn(m)
            elif st.ready and now - st.last_heartbeat > self.config.heartbeat_timeout_s:
                st.proc.kill()   # hung: make it a death, handled on the next check
                self.events.append(f"model {m} missed heartbeats for {self.config.heartbeat_timeout_s} s; killed")

    def _on_death(self, m: int, why: str) -> None:
        st = self._models[m]
        st.ready = False
        if st.client is not None:
            st.client.close(0)
            st.client = None
        msg = f"sub-server for model {m} (pid {st.pid}) {why}"
        self.events.append(msg)
        rids = list(self._live)
        for rid in rids:
            live = self._live.pop(rid)
            self._fail(live, f"{msg}; request {rid} failed")
            for k, other in enumerate(self._models):
                if k != m and other.ready:
                    send(other.client, Abort(rid, "peer failure", live.inc))
        # the barrier restarts from scratch: the new process counts from zero
        self._outstanding.clear()
        for k in range(self.num_models):
            self._sent_table[k][m] = 0
        self._sent_table[m] = [0] * self.num_models

    def _coordinate(self, now: float) -> None:
        """Sync modes: grant steps. stepwise_sync: every model, one round at a time; model_sync: one model at a time."""
        if self._outstanding or not self._live or not all(st.ready for st in self._models):
            return
        if not any(self._dirty):
            # Nothing reported ready; still poke everyone now and then so nothing can be missed.
            if self._idle_round_at and now - self._idle_round_at < 0.01:
                return
            self._dirty = [True] * self.num_models
        self._idle_round_at = now
        self._round += 1
        if self.config.mode == "stepwise_sync":
            targets = list(range(self.num_models))
        else:
            order = [(self._rr + i) % self.num_models for i in range(self.num_models)]
            pick = next((m for m in order if self._dirty[m]), order[0])
            self._rr = (pick + 1) % self.num_models
            targets = [pick]
        for m in targets:
            expected = [self._sent_table[k][m] for k in range(self.num_models)]
            self._dirty[m] = False
            self._outstanding.add(m)
            send(self._models[m].client, StepGrant(self._round, expected))


def _put_all(batch: list) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


__all__ = ["RequestFailed", "Runtime", "RuntimeConfig", "RuntimeOutput"]
