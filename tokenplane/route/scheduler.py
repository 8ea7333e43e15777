"""Per-model scheduler of the routing runtime: one explicit RequestState per request, continuous batching.

Each sub-server owns one Scheduler. A step is three calls, as in nano-vllm:

    batch = scheduler.schedule()                 # admit WAITING (prefix match + allocate), grow RUNNING block tables
    out = runner.run([r.seq for r in batch])     # every uncomputed token of every request, one mixed batch
    sends = scheduler.update_from_output(batch, out)   # sample, route, commit / hand off / finish

The scheduler never talks to sockets: it returns `Outbound(dest, message)` pairs (dest = model index or FRONTEND).

Pending return (the paper's key state). When a request leaves for a peer it moves RUNNING -> PENDING_RETURN and
keeps its Sequence, KV blocks and counters; on return the peer's tokens are appended to the same Sequence, so the
next run computes exactly the unseen suffix (num_tokens - num_computed_tokens: 1 token for a plain decode, k for a
catch-up, one code path) and the request is RUNNING again: no re-admission, no prefix matching, no allocation.
With `pending_return=False` (baseline) the request frees its blocks when it leaves and goes back through WAITING
(prefix match, allocate, prefill) on return. With `standard_serving=True` (baseline) each visit is a call of its own
(standard.py): admitted, run, freed, and the request goes back to the front end (an external scheduler) as a Yield,
after one token (`standard_unit="token"`) or when the router switches models (`"segment"`, streaming meanwhile).

KV memory and chunked prefill (which requests compute which tokens each step, preemption by recompute when the pool
is out) are step_batch.py's; the request record and Outbound are route_request.py's.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict, deque
from typing import Any, Callable

from .api import Algorithm, Handoff, RequestView, StepResult, after_send, apply_handoff, commit
from .ensemble_wait import EnsembleWait, complete_position
from .messages import (
    AddRequest,
    Error,
    Finished,
    HandoffMsg,
    Release,
    TokenChunk,
    params_from_wire,
    params_to_wire,
    stats_from_wire,
    stats_to_wire,
)
from .positions import record, set_received, window
from .route_request import FRONTEND, Outbound, RouteRequest
from .standard import build_yield, validate_unit
from .states import RequestState
from .stats import RouteStats
from .step_batch import form_batch, free_kv

_TOMBSTONES = 65_536

log = logging.getLogger(__name__)


class Scheduler:
    """Request states and batching for model `model` of `num_models` (model `home` admits and streams)."""

    def __init__(self, model: int, num_models: int, block_manager, algorithm: Algorithm, *,
                 pending_return: bool = True, standard_serving: bool = False, standard_unit: str = "token",
                 home: int = 0,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, sample_fn: Callable | None = None,
                 sequence_cls=None):
        if not 0 <= model < num_models:
            raise ValueError(f"model index {model} out of range for {num_models} models")
        self.model, self.num_models, self.home = model, num_models, home
        self.bm = block_manager
        self.alg = algorithm
        self.pending_return = bool(pending_return)
        self.standard_serving = bool(standard_serving)
        self.standard_unit = validate_unit(standard_unit)
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.admission_clock = 0   # admissions so far: RouteRequest.admitted_at (preemption picks the latest)
        from tokenplane.engine.sampler import sample
        from tokenplane.engine.sequence import Sequence
        self.sample_fn: Callable = sample_fn or sample
        self.default_sampler = sample_fn is None
        self.Sequence = sequence_cls or Sequence
        self.requests: dict[str, RouteRequest] = {}
        self.waiting: deque[str] = deque()
        self.running: list[str] = []
        self.tombstones: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.counters = {"steps": 0, "batched_seqs": 0, "computed_tokens": 0, "admissions": 0, "resumes": 0,
                         "readmissions": 0, "handoffs_sent": 0, "handoffs_received": 0, "finished": 0,
                         "aborted": 0, "errors": 0, "preemptions": 0}

    # -- queries -------------------------------------------------------------------------------------------------
    @property
    def is_home(self) -> bool:
        return self.model == self.home

    def num_ready(self) -> int:
        """Requests that would run if a step launched now (RUNNING + admissible WAITING, capped)."""
        return min(len(self.running) + len(self.waiting), self.max_num_seqs)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def count_states(self) -> dict[str, int]:
        out = {s.name: 0 for s in RequestState}
        for r in self.requests.values():
            out[r.state.name] += 1
        return out

    # -- admission -----------------------------------------------------------------------------------------------
    def add_request(self, msg: AddRequest) -> list[Outbound]:
        """Front end admission (home model), or a standard-serving single-token call on any model."""
        rid = msg.request_id
        if rid in self.requests:
            if self.requests[rid].inc == msg.inc:
                return [self._error_out(rid, f"duplicate request id {rid!r}")]
            self._drop(self.requests[rid], RequestState.ABORTED)   # a stale incarnation nobody released yet
        try:
            params = params_from_wire(msg.params)
            prompt = [int(t) for t in msg.prompt]
            if not prompt:
                raise ValueError("empty prompt")
        except (ValueError, TypeError, KeyError) as exc:
            return [self._error_out(rid, f"bad request: {exc}")]
        if (rid, msg.inc) in self.tombstones:
            return []   # aborted before this call arrived
        # The front end folded the home model's EOS into stop_token_ids and capped max_tokens by the context.
        view = RequestView.new(rid, prompt, self.num_models, max_tokens=params.max_tokens,
                               stop_token_ids=params.stop_token_ids, model=self.model)
        view.output_ids = [int(t) for t in msg.output]
        models = [int(m) for m in msg.models]
        rec = RouteRequest(view, params, models, stats_from_wire(self.num_models, msg.stats, models))
        rec.num_handoffs = msg.num_handoffs
        rec.inc = msg.inc
        rec.logprobs = None if params.logprobs is None else list(msg.logprobs or [])
        state = dict(msg.state)
        view.state = state if (msg.output or msg.handoff is not None or state) else self.alg.init_state(view)
        if msg.handoff is not None:   # standard serving: the switch happened through the front end
            h = msg.handoff
            tokens = self.alg.receive(view, h)
            apply_handoff(view, h, tokens)
            # msg.models / msg.logprobs are the sender's full per-position lists; receive() may change the tail
            set_received(rec, h, rec.models, rec.logprobs, start=0)
        # A fresh admission: nobody else holds state for it, this model is given the whole sequence.
        view.seen = [0] * self.num_models
        view.seen[self.model] = len(prompt) + len(view.output_ids)
        view.model = self.model
        rec.streamed = min(len(msg.output), len(view.output_ids))   # the front end streamed the earlier calls
        return self._admit(rec)

    def _admit(self, rec: RouteRequest) -> list[Outbound]:
        """Queue a request; it takes KV only when scheduled. One that could never fit alone is refused."""
        total = len(rec.view.prompt_ids) + rec.view.max_tokens
        if self.bm.blocks_needed(total) > self.bm.num_blocks:
            return [self._error_out(rec.request_id, f"request needs up to {total} tokens of KV on model "
                                    f"{self.model}, the pool holds {self.bm.num_blocks * self.bm.block_size} "
                                    f"({self.bm.num_blocks} blocks of {self.bm.block_size})")]
        rec.state = RequestState.WAITING
        self.requests[rec.request_id] = rec
        self.waiting.append(rec.request_id)
        return []

    # -- handoffs in ---------------------------------------------------------------------------------------------
    def receive_handoff(self, msg: HandoffMsg) -> list[Outbound]:
        h = msg.handoff
        rid = h.request_id
        if (rid, msg.inc) in self.tombstones:
            return []   # finished or aborted while the message was in flight
        self.counters["handoffs_received"] += 1
        rec = self.requests.get(rid)
        if rec is not None and rec.inc != msg.inc:
            self._drop(rec, RequestState.ABORTED)   # a stale incarnation whose release has not arrived yet
            rec = None
        if msg.final:
            if rec is None or not self.is_home:
                return []
            apply_handoff(rec.view, h, list(h.tokens))
            set_received(rec, h, msg.models, msg.logprobs)
            rec.stats = stats_from_wire(self.num_models, msg.handoff.metadata.get("stats"), rec.models)
            rec.view.state.update(h.metadata.get("state", {}))
            return self._finish(rec, str(h.metadata.get("finish_reason", "stop")))
        if rec is None and self.is_home:
            return []   # the home model never learns of a request from a peer: a stale message
        try:
            if rec is None:
                if h.anchor >= 0 or len(h.tokens) < -h.anchor:
                    return [self._error_out(rid, f"model {self.model} holds no state for request {rid} but the "
                                            f"handoff assumes it does (anchor {h.anchor})")]
                params = params_from_wire(msg.params)
                view = RequestView.from_handoff(h, self.num_models)
                rec = RouteRequest(view, params, [], RouteStats(self.num_models))
                rec.inc = msg.inc
                rec.logprobs = None if params.logprobs is None else []
                fresh = True
            else:
                fresh = False
                if rec.state != RequestState.PENDING_RETURN:
                    return [self._error_out(rid, f"handoff for request {rid} on model {self.model} in state "
                                            f"{rec.state.name}")]
            view = rec.view
            rec.num_handoffs = msg.num_handoffs
            rec.stats = stats_from_wire(self.num_models, h.metadata.get("stats"), rec.models)
            if "scores" in h.metadata and rec.ensemble is not None:
                apply_handoff(view, h, self.alg.receive(view, h))
                self._merge_seen(view, msg.seen, h.source)
                return self._on_score(rec, h)
            tokens = self.alg.receive(view, h)
            apply_handoff(view, h, tokens)
            self._merge_seen(view, msg.seen, h.source)
            set_received(rec, h, msg.models, msg.logprobs)
            rec.stats.token_models = list(rec.models)
        except (ValueError, KeyError, TypeError) as exc:
            if rec is not None and rid in self.requests:
                self._drop(rec, RequestState.ABORTED)
            return [self._error_out(rid, f"handoff rejected on model {self.model}: {exc}")]
        view.model = self.model
        rec.score_for = h.source if h.metadata.get("score") else None
        if fresh:
            return self._admit(rec)
        return self._resume(rec)

    def _resume(self, rec: RouteRequest) -> list[Outbound]:
        """PENDING_RETURN -> RUNNING on the same Sequence (append + catch-up), or WAITING when no KV was kept."""
        reason = self._finish_reason(rec)
        if reason is not None and rec.score_for is None:
            return self._finish(rec, reason)
        if rec.seq is None:
            self.counters["readmissions"] += 1
            rec.state = RequestState.WAITING
            self.waiting.append(rec.request_id)
            return self._stream(rec)
        self._sync_seq(rec)
        self.counters["resumes"] += 1
        rec.state = RequestState.RUNNING
        self.running.append(rec.request_id)
        return self._stream(rec)

    def _merge_seen(self, view: RequestView, seen: list[int], source: int) -> None:
        """The sender's own entry is exact (0 when it dropped its state: pending_return off). For third models
        take the max: a view only lags (e.g. model 1's view of model 2 while model 0 ran score visits on both at
        once), and a third model's count only drops when it drops its state as the sender of some handoff."""
        for k, v in enumerate(seen[:self.num_models]):
            if k == source:
                view.seen[k] = int(v)
            elif k != self.model:
                view.seen[k] = max(view.seen[k], int(v))

    def _on_score(self, rec: RouteRequest, h: Handoff) -> list[Outbound]:
        wait = rec.ensemble
        if wait is None:
            raise ValueError(f"request {rec.request_id}: a score reply but no ensemble position is waiting")
        if not wait.add(h.source, h.metadata["scores"]):
            return []
        complete_position(self.alg, rec, self.model, wait)
        return self._resume(rec)

    # -- the step ------------------------------------------------------------------------------------------------
    def schedule(self) -> list[RouteRequest]:
        """This step's batch: RUNNING requests grow, WAITING ones are admitted, within the token budget and the KV
        pool (step_batch.py: decodes first, chunked prefill, preemption by recompute)."""
        return form_batch(self)

    def greedy_step(self, batch: list[RouteRequest]) -> bool:
        """Whether this step may take greedy tokens from the runner (`ModelRunner.run_greedy`: the engine's greedy
        screen, no vocabulary projection) instead of logits: every request greedy without logprobs, the default
        sampler, and an algorithm that does not read this model's logits (`Algorithm.uses_logits`)."""
        return (self.default_sampler and not self.alg.uses_logits(self.model)
                and not any(r.params.needs_logits for r in batch))

    def update_from_output(self, batch: list[RouteRequest], out) -> list[Outbound]:
        """Sample one token per request and act on the routing decision."""
        self.counters["steps"] += 1
        self.counters["batched_seqs"] += len(batch)
        rows = []   # batch rows whose sequence is complete: only these sample
        for i, rec in enumerate(batch):
            if rec.tail is not None:   # a prefill chunk: restore the held-back tokens, sample nothing
                rec.seq.token_ids.extend(rec.tail)
                rec.tail = None
            else:
                rows.append(i)
        if not rows:
            return []
        positions = [len(batch[i].view.output_ids) for i in rows]
        hidden = getattr(out, "hidden", None)
        sends: list[Outbound] = []
        greedy = getattr(out, "tokens", None)
        if greedy is not None:      # run_greedy's tokens (greedy_step): logits only if something reads them
            top = getattr(out, "top", None)
            results = [StepResult.deferred(batch[i].request_id, self.model, positions[j], int(greedy[i]),
                                           functools.partial(out.project, i), out.hidden[i],
                                           None if top is None else top[i])
                       for j, i in enumerate(rows)]
        else:
            logits = out.logits if len(rows) == len(batch) else out.logits[rows]
            params = [batch[i].params for i in rows]
            histories = None
            if any(p.needs_history for p in params):
                from tokenplane.engine.sampler import token_set
                for i in rows:
                    if batch[i].params.needs_history and batch[i].prompt_set is None:
                        batch[i].prompt_set = token_set(batch[i].view.prompt_ids)
                histories = [(batch[i].prompt_set, batch[i].view.output_ids, batch[i].view.stop_token_ids)
                             for i in rows]
            tokens = self.sample_fn(logits, params, positions, histories)
            results = [StepResult(batch[i].request_id, self.model, positions[j], int(tokens[j]), out.logits[i],
                                  None if hidden is None else hidden[i]) for j, i in enumerate(rows)]
        try:
            self.alg.prepare_step(results)
        except Exception:  # noqa: BLE001 - the per-row calls below recompute, and fail their own request if broken
            log.exception("prepare_step failed on model %d; routing row by row", self.model)
        for i, result in zip(rows, results):
            rec = batch[i]
            try:
                sends += self._route_one(rec, result)
            except Exception as exc:  # an algorithm bug must fail its request, not the sub-server
                if rec.request_id in self.requests:
                    self._drop(rec, RequestState.ABORTED)
                sends.append(self._error_out(rec.request_id, f"routing failed on model {self.model}: "
                                             f"{type(exc).__name__}: {exc}"))
        self.running = [rid for rid in self.running
                        if rid in self.requests and self.requests[rid].state == RequestState.RUNNING]
        return sends

    def _route_one(self, rec: RouteRequest, result: StepResult) -> list[Outbound]:
        view = rec.view
        if rec.score_for is not None:   # ensemble score visit: answer with a distribution, no token
            reply = self.alg.score_reply(view, result, rec.score_for)
            reply.metadata["stats"] = stats_to_wire(rec.stats)
            after_send(view, result, reply)
            rec.score_for = None
            return self._leave(rec, reply)
        peers = self.alg.ensemble_peers(result, view)
        if peers:
            if self.standard_serving:
                raise ValueError("ensemble score visits need retained state; standard serving cannot run them")
            sends = []
            for p in peers:
                h = self.alg.send(view, result, p)
                rec.stats.on_handoff(h)
                after_send(view, result, h)
                sends += self._send_handoff(rec, h)
            rec.ensemble = EnsembleWait(result, set(peers))
            rec.state = RequestState.PENDING_RETURN
            return sends
        target = int(self.alg.route(result, view))
        if not 0 <= target < self.num_models:
            raise ValueError(f"route() returned model {target}, valid are 0..{self.num_models - 1}")
        if target == self.model:
            commit(view, self.model, result.token)
            rec.seq.append_token(result.token)
            record(rec, self.model, result, result.token)
            rec.stats.on_commit(self.model)
            reason = self._finish_reason(rec)
            if reason is not None:
                return self._finish(rec, reason)
            if self.standard_serving and self.standard_unit == "token":
                return self._yield(rec, self.model, None)
            return self._stream(rec)
        h = self.alg.send(view, result, target)
        rec.stats.on_handoff(h)
        home_seen = view.seen[self.home]   # after_send may count the target's copy; home may be the target
        after_send(view, result, h)
        if h.keep_last:
            rec.seq.append_token(result.token)
            record(rec, self.model, result, result.token)
            rec.stats.on_commit(self.model)
        rec.num_handoffs += 1
        reason = self._finish_reason(rec)
        if h.done or reason is not None:
            return self._finish(rec, reason or "stop", home_seen)
        if self.standard_serving:
            return self._yield(rec, target, h)
        return self._stream(rec) + self._leave(rec, h)

    def _leave(self, rec: RouteRequest, h: Handoff) -> list[Outbound]:
        """The request goes to a peer: park it (pending return) or drop its KV (baseline), then send."""
        self.counters["handoffs_sent"] += 1
        if self.pending_return:
            rec.state = RequestState.PENDING_RETURN
        else:
            rec.view.seen[self.model] = 0   # the next visit must bring the whole sequence
            free_kv(self.bm, rec)
            if self.is_home:
                rec.state = RequestState.PENDING_RETURN   # keep the bookkeeping (streaming), not the KV
            else:
                del self.requests[rec.request_id]
        return self._send_handoff(rec, h)

    def _send_handoff(self, rec: RouteRequest, h: Handoff) -> list[Outbound]:
        h.metadata["stats"] = stats_to_wire(rec.stats)
        start = max(h.anchor, 0)
        msg = HandoffMsg(h, list(rec.view.seen), rec.models[start:h.position], params_to_wire(rec.params),
                         rec.num_handoffs, inc=rec.inc, logprobs=window(rec.logprobs, start, h.position))
        return [Outbound(h.target, msg)]

    # -- endings -------------------------------------------------------------------------------------------------
    @staticmethod
    def _finish_reason(rec: RouteRequest) -> str | None:
        out = rec.view.output_ids
        if out and out[-1] in rec.view.stop_token_ids:
            return "stop"
        if len(out) >= rec.view.max_tokens:
            return "length"
        return None

    def _finish(self, rec: RouteRequest, reason: str, home_seen: int | None = None) -> list[Outbound]:
        rid = rec.request_id
        rec.stats.token_models = list(rec.models)
        self.counters["finished"] += 1
        if self.standard_serving:
            return self._yield(rec, self.model, None, finish_reason=reason)
        if self.is_home:
            out = [Outbound(FRONTEND, Finished(rid, rec.view.output_ids[rec.streamed:], rec.models[rec.streamed:],
                                               rec.streamed, reason, self._final_stats(rec), inc=rec.inc,
                                               logprobs=window(rec.logprobs, rec.streamed)))]
            out += [Outbound(k, Release(rid, inc=rec.inc)) for k in range(self.num_models) if k != self.model]
            self._drop(rec, RequestState.FINISHED)
            return out
        # Finished on a peer: deliver the committed suffix to the home model, which streams and releases.
        view = rec.view
        p = len(view.prompt_ids)
        start = view.seen[self.home] if home_seen is None else home_seen
        full = view.prompt_ids + view.output_ids
        h = Handoff(rid, full[start:], start - p, done=True, keep_last=True, target=self.home, source=self.model,
                    position=len(view.output_ids),
                    metadata={"state": dict(view.state), "finish_reason": reason, "stats": stats_to_wire(rec.stats)})
        msg = HandoffMsg(h, list(view.seen), rec.models[max(h.anchor, 0):], params_to_wire(rec.params),
                         rec.num_handoffs, final=True, inc=rec.inc, logprobs=window(rec.logprobs, max(h.anchor, 0)))
        self._drop(rec, RequestState.FINISHED)
        return [Outbound(self.home, msg)]

    def _final_stats(self, rec: RouteRequest) -> dict[str, Any]:
        d = rec.stats.to_dict()
        d.update(prompt_tokens=len(rec.view.prompt_ids), output_tokens=len(rec.view.output_ids),
                 handoffs=rec.num_handoffs)
        return d

    def _yield(self, rec: RouteRequest, next_model: int, h: Handoff | None,
               finish_reason: str | None = None) -> list[Outbound]:
        final = None if finish_reason is None else self._final_stats(rec)
        msg = build_yield(rec, self.model, next_model, h, finish_reason, final)
        self._drop(rec, RequestState.FINISHED, tombstone=False)
        return [Outbound(FRONTEND, msg)]

    def _stream(self, rec: RouteRequest) -> list[Outbound]:
        # Routed serving streams from the home model; a standard-serving segment call streams from whichever model
        # serves it (a stock server's stream), a per-token call only through its Yield.
        segment = self.standard_serving and self.standard_unit == "segment"
        if not segment and (not self.is_home or self.standard_serving):
            return []
        n = len(rec.view.output_ids)
        if n < rec.streamed:
            raise ValueError(f"request {rec.request_id}: committed output shrank below what was streamed")
        if n == rec.streamed:
            return []
        chunk = TokenChunk(rec.request_id, rec.view.output_ids[rec.streamed:], rec.models[rec.streamed:n],
                           rec.streamed, inc=rec.inc, logprobs=window(rec.logprobs, rec.streamed, n))
        rec.streamed = n
        return [Outbound(FRONTEND, chunk)]

    def abort(self, request_id: str, reason: str = "abort", inc: int | None = None) -> bool:
        """Drop a request wherever it is and free its blocks. True if it was here. `inc` None = any incarnation."""
        rec = self.requests.get(request_id)
        if rec is None or (inc is not None and rec.inc != inc):
            if inc is not None:
                self._tombstone((request_id, inc))
            return False
        self._drop(rec, RequestState.ABORTED if reason != "finished" else RequestState.FINISHED)
        return True

    def release(self, msg: Release) -> None:
        self.abort(msg.request_id, msg.reason, msg.inc)

    def _drop(self, rec: RouteRequest, state: RequestState, tombstone: bool = True) -> None:
        rec.state = state
        if state == RequestState.ABORTED:
            self.counters["aborted"] += 1
        free_kv(self.bm, rec)
        self.requests.pop(rec.request_id, None)
        if tombstone:
            self._tombstone((rec.request_id, rec.inc))
        # waiting/running lists are filtered lazily (schedule / update_from_output)
        if rec.request_id in self.running and rec.state != RequestState.RUNNING:
            self.running.remove(rec.request_id)

    def _tombstone(self, key: tuple[str, int]) -> None:
        self.tombstones[key] = None
        if len(self.tombstones) > _TOMBSTONES:
            self.tombstones.popitem(last=False)

    def _sync_seq(self, rec: RouteRequest) -> None:
        """Make the Sequence hold prompt + committed output; KV beyond a truncation point is recomputed."""
        seq = rec.seq
        full = rec.view.prompt_ids + rec.view.output_ids
        old = seq.token_ids
        common = min(len(old), len(full))
        # The common case is a pure append (peer tokens after what we had), so compare from the end of `old` back.
        if old[:common] != full[:common]:
            common = next(i for i, (a, b) in enumerate(zip(old, full)) if a != b)
        seq.token_ids = full
        seq.num_computed_tokens = min(seq.num_computed_tokens, common)

    def _error_out(self, rid: str | None, message: str, inc: int | None = None) -> Outbound:
        self.counters["errors"] += 1
        if inc is None and rid in self.requests:
            inc = self.requests[rid].inc
        return Outbound(FRONTEND, Error(rid, message, self.model, inc=inc))


__all__ = ["Scheduler"]
