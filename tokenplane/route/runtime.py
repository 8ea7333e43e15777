"""The multi-process token-level routing runtime: a front end plus one sub-server process per model.

    rt = Runtime(RuntimeConfig(models=["test-small", "test-large"], algorithm="r2r",
                               algorithm_kwargs={"mode": "synthetic", "seed": 0}))
    async for chunk in rt.generate(prompt_ids, SamplingParams(max_tokens=64)):
        ...            # TokenChunk: committed tokens in order; the last one has finish_reason and stats
    rt.shutdown()

Model 0 is every request's home: it admits requests and streams committed tokens to the front end; peers send
their tokens back to it (a finished request's tail included). Execution modes and baselines are FLAGS of this one
code path (RuntimeConfig.mode / pending_return / standard_serving), see docs/runtime.md.

Three jobs, three objects: this module is the request front end (validation, admission control, streaming, aborts);
`supervisor.Supervisor` owns the processes (spawn, heartbeats, hung steps, deaths, restarts, health);
`coordinator.Coordinator` grants steps in the sync modes. One I/O thread (frontend_io.FrontEndIO) owns the inbox,
delivers the sub-servers' messages to live requests and drives the other two; user calls send on the per-model
client sockets under a lock shared with it.

Errors (tokenplane.route.errors), all raised by `generate` before anything is registered unless noted:
    RequestRejected   a sampling field out of range / not finite, a bad or too long prompt, prompt + max_tokens over
                      `max_request_tokens` (the smallest KV pool or context), a request id already live
    Overloaded        more than max_num_seqs + max_queued live requests
    ModelUnavailable  a model is restarting or failed (fail fast, with retry_after_s); also mid-stream, for every
                      live request, when a model process dies (any live request may hold state on it)
    RequestFailed     mid-stream: a routing error on a model, the request deadline, shutdown
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
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

import zmq

from .config import RuntimeConfig, resolve_thresholds
from .coordinator import Coordinator
from .errors import ModelUnavailable, Overloaded, RequestFailed, RequestRejected, RouteError
from .frontend_io import FrontEndIO, LiveRequest
from .handoff import bind_pull, new_address_dir, send
from .messages import (
    AddRequest,
    Configure,
    Shutdown,
    StatsQuery,
    StatsReply,
    TokenChunk,
    params_to_wire,
)
from .params import capped_max_tokens, request_params, stop_token_ids, validate_params, validate_prompt
from .subserver_spec import SubServerSpec
from .supervisor import ModelHealth, ModelState, Supervisor

log = logging.getLogger(__name__)


@dataclass
class RuntimeOutput:
    request_id: str
    token_ids: list[int]
    token_models: list[int]
    finish_reason: str
    stats: dict[str, Any]
    logprobs: list | None = None      # per token [logprob, [[id, logprob], ...]] when params.logprobs is set


class Runtime:
    """Front end of the routing runtime (see module docstring)."""

    def __init__(self, config: RuntimeConfig):
        config.validate()
        self.config = config
        self.num_models = len(config.models)
        self.thresholds = resolve_thresholds(config)
        self._dtype = config.dtype if isinstance(config.dtype, str) else str(config.dtype).replace("torch.", "")
        self._ipc_dir = new_address_dir() if config.transport == "ipc" else None
        self._ctx = zmq.Context()
        self._inbox, self._inbox_addr = bind_pull(self._ctx, config.transport, self._ipc_dir, "fe")
        self._lock = threading.RLock()
        self._live: dict[str, LiveRequest] = {}
        self.errors: list[str] = []             # non-request errors reported by sub-servers
        self.events: list[str] = []             # kills, deaths and restarts, for operators and tests
        self._stats_token = itertools.count(1)
        self._inc = itertools.count(1)
        # A death is handled by the I/O side (it fails the live requests), which needs the Supervisor: late-bound.
        self._sup = Supervisor(config, self._ctx, mp.get_context("spawn"), self._spec,
                               lambda m, why: self._io.on_death(m, why), self.events)
        self._coord = Coordinator(self.num_models)
        self._io = FrontEndIO(self._sup, self._coord, self._inbox, self._lock, self._live, self.errors,
                              self.num_models)
        try:
            for m in range(self.num_models):
                self._sup.spawn(m)
            self._io.thread.start()
            # the supervisor's watch fails a silent loader (RuntimeConfig.startup_timeout_s) or one past
            # startup_limit_s; this wait is the backstop
            backstop = config.startup_limit_s + config.startup_timeout_s
            if not self._io.all_ready.wait(backstop):
                raise RuntimeError(self._sup.startup_error or f"sub-servers not ready after {backstop} s")
            if self._sup.startup_error:
                raise RuntimeError(self._sup.startup_error)
        except BaseException:
            self.shutdown()
            raise

    # -- configuration ---------------------------------------------------------------------------------------------
    def _spec(self, m: int, generation: int) -> SubServerSpec:
        cfg = self.config
        nb = cfg.num_blocks[m] if isinstance(cfg.num_blocks, (list, tuple)) else cfg.num_blocks
        return SubServerSpec(
            model=m, num_models=self.num_models, source=cfg.models[m], frontend=self._inbox_addr,
            generation=generation, transport=cfg.transport, ipc_dir=self._ipc_dir,
            seed=0 if cfg.seeds is None else int(cfg.seeds[m]), device=cfg.device, dtype=self._dtype,
            num_blocks=int(nb), block_size=cfg.block_size, runner=cfg.runner, algorithm=cfg.algorithm,
            algorithm_kwargs=dict(cfg.algorithm_kwargs), mode=cfg.mode, pending_return=cfg.pending_return,
            standard_serving=cfg.standard_serving, standard_unit=cfg.standard_unit, thresholds=list(self.thresholds),
            concurrency=cfg.concurrency, max_delay_s=cfg.max_delay_s, grant_timeout_s=cfg.grant_timeout_s,
            heartbeat_s=cfg.heartbeat_s, threads=cfg.threads_per_model, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, enforce_eager=cfg.enforce_eager)

    # -- public API ------------------------------------------------------------------------------------------------
    @property
    def pids(self) -> list[int | None]:
        return [st.pid for st in self._sup.models]

    @property
    def _models(self):
        return self._sup.models

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def health(self) -> list[ModelHealth]:
        """Per model: process state, pid, restarts, last error, KV blocks and queue lengths (from heartbeats)."""
        with self._lock:
            return self._sup.health()

    @property
    def num_live(self) -> int:
        """Registered requests (queued or running anywhere)."""
        return len(self._live)

    @property
    def num_queued(self) -> int:
        """Live requests not yet admitted to a step: the home model's WAITING count (latest heartbeat) plus live
        requests beyond what the home model reported (in flight to it)."""
        st = self._sup.models[0]
        hb = st.heartbeat if st.ready else None
        if hb is None:
            return len(self._live)
        return max(hb.num_waiting, len(self._live) - hb.num_running - hb.num_pending)

    @property
    def max_request_tokens(self) -> int:
        """The largest prompt + max_tokens one request can hold: min over models of min(context, KV pool tokens)."""
        caps = []
        for st in self._sup.models:
            if st.info is not None:
                caps.append(st.info.num_blocks * st.info.block_size)
                if st.info.max_model_len:
                    caps.append(st.info.max_model_len)
        return min(caps)

    def _prepare_params(self, prompt: list[int], params, rid: str) -> dict[str, Any]:
        """Validate and normalise a request exactly as the sequential reference does (same stop rule, same cap by
        the context); RequestRejected when it can never fit. Registers nothing."""
        validate_prompt(prompt)
        validate_params(params)
        params = request_params(params, rid)
        info = self._sup.models[0].info
        stop = stop_token_ids(params, info.eos_token_ids if info is not None else ())
        lens = [st.info.max_model_len for st in self._sup.models if st.info is not None and st.info.max_model_len]
        max_tokens = capped_max_tokens(len(prompt), params.max_tokens, min(lens) if lens else None)
        for m, st in enumerate(self._sup.models):
            if st.info is None:
                continue
            cap = st.info.num_blocks * st.info.block_size
            if len(prompt) + max_tokens > cap:
                raise RequestRejected(
                    f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = {len(prompt) + max_tokens} tokens "
                    f"exceeds model {m}'s KV pool of {cap} tokens ({st.info.num_blocks} blocks of "
                    f"{st.info.block_size}); at most {self.max_request_tokens} tokens per request",
                    param="max_tokens")
        d = params_to_wire(params)
        d.update(max_tokens=max_tokens, stop_token_ids=list(stop))
        return d

    def _check_available(self) -> None:
        for m, st in enumerate(self._sup.models):
            if not st.ready:
                raise ModelUnavailable(f"model {m} ({st.source}) is {st.state.value}"
                                       + (f": {st.last_error}" if st.last_error else ""),
                                       model=m, retry_after_s=self._sup.retry_after_s(m))

    async def generate(self, prompt_ids: Sequence[int], params=None,
                       request_id: str | None = None) -> AsyncIterator[TokenChunk]:
        """Route one request; yields TokenChunks as tokens are committed. RequestRejected / Overloaded /
        ModelUnavailable before anything is registered; RequestFailed (ModelUnavailable on a death) mid-stream."""
        from tokenplane.engine.sampler import SamplingParams
        if self._io.closing:
            raise RequestFailed("runtime is shut down")
        params = params if params is not None else SamplingParams()
        rid = request_id or uuid.uuid4().hex
        try:
            prompt = [int(t) for t in prompt_ids]
        except (TypeError, ValueError, OverflowError) as exc:
            raise RequestRejected(f"prompt must be a sequence of token ids: {exc}", param="prompt") from None
        wire = self._prepare_params(prompt, params, rid)
        deadline = time.monotonic() + self.config.request_timeout_s
        live = LiveRequest(rid, asyncio.get_running_loop(), asyncio.Queue(), prompt, wire, time.monotonic(),
                     inc=next(self._inc))
        with self._lock:
            self._check_available()
            if rid in self._live:
                raise RequestRejected(f"request id {rid!r} is already running", param="request_id")
            limit = self.config.max_num_seqs + self.config.max_queued
            if len(self._live) >= limit:
                raise Overloaded(f"{len(self._live)} requests are live (max_num_seqs {self.config.max_num_seqs} + "
                                 f"max_queued {self.config.max_queued}); retry later", retry_after_s=1.0)
            self._live[rid] = live
            try:
                self._send_client(0, AddRequest(rid, prompt, wire, inc=live.inc))
            except BaseException:
                self._io.unregister(live)
                raise
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                item = await asyncio.wait_for(live.queue.get(), timeout=left)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        except TimeoutError:
            raise RequestFailed(f"request {rid} timed out after {self.config.request_timeout_s} s") from None
        finally:
            if not live.done:   # consumer stopped early, timed out, or was cancelled
                self.abort(rid)

    async def complete(self, prompt_ids: Sequence[int], params=None, request_id: str | None = None) -> RuntimeOutput:
        """Run one request to completion."""
        tokens, models, lps, final = [], [], [], None
        async for chunk in self.generate(prompt_ids, params, request_id):
            tokens += chunk.tokens
            models += chunk.models
            lps += chunk.logprobs or []
            final = chunk
        if final is None or final.finish_reason is None:
            raise RequestFailed(f"request {request_id}: the stream ended without a final chunk")
        return RuntimeOutput(final.request_id, tokens, models, final.finish_reason, final.stats or {},
                             lps if getattr(params, "logprobs", None) is not None else None)

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
            live = self._live.get(request_id)
            if live is None:
                return False
            self._io.unregister(live)
        if not live.done:
            live.done = True
            self._io.deliver(live, TokenChunk(request_id, [], [], live.streamed, "abort", {}))
        return True

    def stats(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Per-model block accounting and counters (a StatsQuery round trip to every sub-server)."""
        token = next(self._stats_token)
        ev, replies = threading.Event(), dict[int, StatsReply]()
        with self._lock:
            self._io.stats_waits[token] = (ev, replies)
            for m in range(self.num_models):
                self._send_client(m, StatsQuery(token))
        ev.wait(timeout)
        with self._lock:
            self._io.stats_waits.pop(token, None)
        if len(replies) < self.num_models:
            raise RequestFailed(f"stats: only models {sorted(replies)} answered within {timeout} s")
        return [dataclasses.asdict(replies[m]) for m in range(self.num_models)]

    _FLAGS = ("mode", "pending_return", "standard_serving", "standard_unit", "thresholds", "concurrency",
              "max_delay_s", "algorithm", "algorithm_kwargs")

    def configure(self, **changes: Any) -> None:
        """Change execution-mode flags (mode, pending_return, standard_serving, standard_unit, thresholds,
        concurrency, max_delay_s) and/or the algorithm (algorithm, algorithm_kwargs) while no request is live. The
        sub-servers keep their models and KV pools; only the flags change."""
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
            self._sup.config = new
            try:
                self.thresholds = resolve_thresholds(new)
            except ValueError:
                self.config = self._sup.config = old_cfg
                raise
            self._coord.reset()
            alg_changed = "algorithm" in changes or "algorithm_kwargs" in changes
            msg = Configure(new.mode, new.pending_return, new.standard_serving, list(self.thresholds),
                            new.concurrency, new.max_delay_s, new.algorithm if alg_changed else None,
                            dict(new.algorithm_kwargs) if alg_changed else None, new.standard_unit)
            for m in range(self.num_models):
                self._send_client(m, msg)
        # Same pipe as Configure: once every model answered, every model has handled it.
        for st in self.stats():
            applied = st["counters"].get("flags", {})
            want = {"mode": new.mode, "pending_return": new.pending_return, "standard_serving": new.standard_serving,
                    "standard_unit": new.standard_unit}
            if any(applied.get(k) != v for k, v in want.items()):
                raise RuntimeError(f"configure: model {st['model']} did not apply {want} (has {applied}); "
                                   f"errors: {self.errors[-1:]}")

    def restart_model(self, m: int, timeout: float | None = None) -> None:
        """Kill (if alive) and restart model m's sub-server; blocks until the new one is Ready. Live requests fail
        with ModelUnavailable (as on any sub-server death). Also revives a FAILED model."""
        st = self._sup.models[m]
        with self._lock:
            old = st.proc
            self._sup.kill(m, "restart_model")
        if old is not None:
            old.join(5)
        with self._lock:
            if st.proc is old and old is not None:   # the I/O thread has not handled the death yet
                self._sup.watch(time.monotonic())
            if st.proc is None:                      # FAILED, or auto_restart off
                st.attempts = 0
                st.restarts += 1
                self._sup.spawn(m)
        deadline = time.monotonic() + (timeout or self.config.startup_limit_s)
        while time.monotonic() < deadline:
            if st.ready and st.proc is not old:
                return
            time.sleep(0.02)
        raise RuntimeError(f"model {m} did not come back within the timeout")

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._io.closing:
            return
        self._io.closing = True
        with self._lock:
            for live in list(self._live.values()):
                self._io.fail(live, RequestFailed("runtime shut down"))
            self._live.clear()
            for st in self._sup.models:
                if st.client is not None:
                    send(st.client, Shutdown())
        deadline = time.monotonic() + timeout
        for st in self._sup.models:
            if st.proc is not None and st.proc.pid is not None:
                st.proc.join(max(0.1, deadline - time.monotonic()))
                if st.proc.exitcode is None:
                    st.proc.kill()
                    st.proc.join(2)
        self._io.stop(5)
        for st in self._sup.models:
            if st.client is not None:
                st.client.close(0)
        self._inbox.close(0)
        self._ctx.term()
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # -- plumbing used by user threads ------------------------------------------------------------------------------
    def _send_client(self, m: int, msg) -> None:
        st = self._sup.models[m]
        if st.client is None or not send(st.client, msg):
            raise ModelUnavailable(f"model {m} is not reachable", model=m, retry_after_s=self._sup.retry_after_s(m))
        if isinstance(msg, AddRequest):
            self._coord.mark(m)


__all__ = ["ModelHealth", "ModelState", "ModelUnavailable", "Overloaded", "RequestFailed", "RequestRejected",
           "RouteError", "Runtime", "RuntimeConfig", "RuntimeOutput"]
