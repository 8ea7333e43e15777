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
(prefix match, allocate, prefill) on return. With `standard_serving=True` (baseline) every step is a single-token
call: admitted, one step, freed, and the request goes back to the front end (an external scheduler) as a Yield.

KV admission reserves the worst case (prompt + max_tokens) per request, as R2R's PrefillAdderSLM does, so a
request parked in PENDING_RETURN can never be stranded by a full pool and no preemption is needed.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from .api import Algorithm, Handoff, RequestView, StepResult, after_send, apply_handoff, commit
from .messages import (AddRequest, Error, Finished, HandoffMsg, Release, TokenChunk, Yield)
from .states import RequestState
from .stats import RouteStats

FRONTEND = -1
_TOMBSTONES = 65_536


@dataclass
class Outbound:
    dest: int          # model index, or FRONTEND
    msg: Any


@dataclass
class EnsembleWait:
    """The primary's side of an ensemble position: its own result, waiting for the peers' score replies."""
    result: StepResult
    awaiting: set[int]
    scores: dict[int, dict[str, Any]] = field(default_factory=dict)


@dataclass
class RouteRequest:
    view: RequestView
    params: Any                         # tokenplane.engine.sampler.SamplingParams
    models: list[int]                   # producing model per output position (parallel to view.output_ids)
    stats: RouteStats
    state: RequestState = RequestState.WAITING
    seq: Any = None                     # tokenplane.engine.sequence.Sequence while this model holds KV
    need_blocks: int = 0                # worst-case blocks reserved at admission
    streamed: int = 0                   # home model: output tokens already sent to the front end
    score_for: int | None = None        # answering an ensemble score visit from that model
    ensemble: EnsembleWait | None = None
    num_handoffs: int = 0
    inc: int = 0                        # incarnation (request ids may be reused once a request ended)
    arrival: float = field(default_factory=time.monotonic)

    @property
    def request_id(self) -> str:
        return self.view.request_id


def params_to_wire(p) -> dict[str, Any]:
    return {"temperature": float(p.temperature), "top_p": float(p.top_p), "max_tokens": int(p.max_tokens),
            "seed": None if p.seed is None else int(p.seed), "stop_token_ids": [int(t) for t in p.stop_token_ids],
            "ignore_eos": bool(getattr(p, "ignore_eos", False))}


def params_from_wire(d: dict[str, Any]):
    from tokenplane.engine.sampler import SamplingParams
    return SamplingParams(temperature=float(d.get("temperature", 0.0)), top_p=float(d.get("top_p", 1.0)),
                          max_tokens=int(d.get("max_tokens", 16)), seed=d.get("seed"),
                          stop_token_ids=tuple(d.get("stop_token_ids", ())),
                          ignore_eos=bool(d.get("ignore_eos", False)))


def stats_to_wire(s: RouteStats) -> dict[str, Any]:
    """Everything but token_models (the runtime carries those as `models`)."""
    return {"switches": [list(x) for x in s.switches], "prefill": [list(x) for x in s.prefill],
            "dropped": s.dropped, "ensembled": s.ensembled, "score_visits": s.score_visits}


def stats_from_wire(num_models: int, d: dict[str, Any] | None, models: list[int]) -> RouteStats:
    d = d or {}
    return RouteStats(num_models, token_models=list(models),
                      switches=[(int(a), int(b)) for a, b in d.get("switches", [])],
                      prefill=[(int(a), int(b)) for a, b in d.get("prefill", [])],
                      dropped=int(d.get("dropped", 0)), ensembled=int(d.get("ensembled", 0)),
                      score_visits=int(d.get("score_visits", 0)))


class Scheduler:
    """Request states and batching for model `model` of `num_models` (model `home` admits and streams)."""

    def __init__(self, model: int, num_models: int, block_manager, algorithm: Algorithm, *,
                 pending_return: bool = True, standard_serving: bool = False, home: int = 0,
                 max_num_seqs: int = 256, sample_fn: Callable | None = None, sequence_cls=None):
        if not 0 <= model < num_models:
            raise ValueError(f"model index {model} out of range for {num_models} models")
        self.model, self.num_models, self.home = model, num_models, home
        self.bm = block_manager
        self.alg = algorithm
        self.pending_return = bool(pending_return)
        self.standard_serving = bool(standard_serving)
        self.max_num_seqs = int(max_num_seqs)
        if sample_fn is None:
            from tokenplane.engine.sampler import sample as sample_fn
        if sequence_cls is None:
            from tokenplane.engine.sequence import Sequence as sequence_cls
        self.sample_fn = sample_fn
        self.Sequence = sequence_cls
        self.requests: dict[str, RouteRequest] = {}
        self.waiting: deque[str] = deque()
        self.running: list[str] = []
        self.tombstones: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.counters = {"steps": 0, "batched_seqs": 0, "computed_tokens": 0, "admissions": 0, "resumes": 0,
                         "readmissions": 0, "handoffs_sent": 0, "handoffs_received": 0, "finished": 0,
                         "aborted": 0, "errors": 0}

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

    def reserved_blocks(self) -> int:
        """Blocks promised to admitted requests but not yet taken from the pool."""
        return sum(max(0, r.need_blocks - len(r.seq.block_table)) for r in self.requests.values()
                   if r.seq is not None)

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
        rec = RouteRequest(view, params, models, stats_from_wire(self.num_models, msg.state.get("__stats__"), models))
        rec.num_handoffs = msg.num_handoffs
        rec.inc = msg.inc
        state = {k: v for k, v in msg.state.items() if not k.startswith("__")}
        view.state = state if (msg.output or msg.handoff is not None or state) else self.alg.init_state(view)
        if msg.handoff is not None:   # standard serving: the switch happened through the front end
            h = msg.handoff
            tokens = self.alg.receive(view, h)
            apply_handoff(view, h, tokens)
            # msg.models is the sender's full per-position list; receive() may have changed the tail
            n = len(view.output_ids)
            del rec.models[n:]
            rec.models.extend([h.source] * (n - len(rec.models)))
        # A fresh admission: nobody else holds state for it, this model is given the whole sequence.
        view.seen = [0] * self.num_models
        view.seen[self.model] = len(prompt) + len(view.output_ids)
        view.model = self.model
        return self._admit(rec)

    def _admit(self, rec: RouteRequest) -> list[Outbound]:
        need = self.bm.blocks_needed(len(rec.view.prompt_ids) + rec.params.max_tokens)
        if need > self.bm.num_blocks:
            return [self._error_out(rec.request_id, f"request needs {need} KV blocks on model {self.model}, the "
                                    f"pool has {self.bm.num_blocks}")]
        rec.need_blocks = need
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
            self._set_models(rec, h, msg.models)
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
            self._set_models(rec, h, msg.models)
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

    @staticmethod
    def _set_models(rec: RouteRequest, h: Handoff, models: list[int]) -> None:
        start = max(h.anchor, 0)
        del rec.models[start:]
        rec.models.extend(int(m) for m in models)
        # receive() may accept fewer/more tokens than were sent: attribute the difference to the sender
        n = len(rec.view.output_ids)
        del rec.models[n:]
        rec.models.extend([h.source] * (n - len(rec.models)))

    def _on_score(self, rec: RouteRequest, h: Handoff) -> list[Outbound]:
        wait = rec.ensemble
        wait.scores[h.source] = dict(h.metadata["scores"])
        wait.awaiting.discard(h.source)
        if wait.awaiting:
            return []
        token = int(self.alg.combine(rec.view, wait.result, wait.scores))
        rec.ensemble = None
        commit(rec.view, self.model, token)
        rec.models.append(self.model)
        rec.stats.token_models = list(rec.models)
        rec.stats.on_ensemble()
        return self._resume(rec)

    # -- the step ------------------------------------------------------------------------------------------------
    def schedule(self) -> list[RouteRequest]:
        """Admit what fits, then give every RUNNING request the slots its uncomputed tokens need."""
        free = self.bm.num_free_blocks - self.reserved_blocks()
        while self.waiting and len(self.running) < self.max_num_seqs:
            rec = self.requests.get(self.waiting[0])
            if rec is None or rec.state != RequestState.WAITING:
                self.waiting.popleft()
                continue
            seq = self.Sequence(rec.request_id, rec.view.prompt_ids + rec.view.output_ids)
            if rec.need_blocks > free or not self.bm.can_allocate(seq):
                break
            self.waiting.popleft()
            self.bm.allocate(seq)
            free -= rec.need_blocks
            rec.seq = seq
            rec.state = RequestState.RUNNING
            self.running.append(rec.request_id)
            self.counters["admissions"] += 1
        batch = []
        for rid in self.running:
            rec = self.requests[rid]
            seq = rec.seq
            if seq.num_computed_tokens >= seq.num_tokens:
                # Nothing new since the last run (e.g. the peer returned zero tokens): recompute the last position
                # to get its logits again. Same values are rewritten into the same slot.
                seq.num_computed_tokens = seq.num_tokens - 1
            self.bm.append_slots(seq)   # cannot fail: admission reserved the worst case
            batch.append(rec)
        return batch

    def update_from_output(self, batch: list[RouteRequest], out) -> list[Outbound]:
        """Sample one token per request and act on the routing decision."""
        self.counters["steps"] += 1
        self.counters["batched_seqs"] += len(batch)
        if not batch:
            return []
        positions = [len(r.view.output_ids) for r in batch]
        tokens = self.sample_fn(out.logits, [r.params for r in batch], positions)
        hidden = getattr(out, "hidden", None)
        sends: list[Outbound] = []
        for i, rec in enumerate(batch):
            result = StepResult(rec.request_id, self.model, positions[i], int(tokens[i]), out.logits[i],
                                None if hidden is None else hidden[i])
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
            rec.models.append(self.model)
            rec.stats.on_commit(self.model)
            reason = self._finish_reason(rec)
            if reason is not None:
                return self._finish(rec, reason)
            if self.standard_serving:
                return self._yield(rec, self.model, None)
            return self._stream(rec)
        h = self.alg.send(view, result, target)
        rec.stats.on_handoff(h)
        home_seen = view.seen[self.home]   # after_send may count the target's copy; home may be the target
        after_send(view, result, h)
        if h.keep_last:
            rec.seq.append_token(result.token)
            rec.models.append(self.model)
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
            self._free_seq(rec)
            if self.is_home:
                rec.state = RequestState.PENDING_RETURN   # keep the bookkeeping (streaming), not the KV
            else:
                del self.requests[rec.request_id]
        return self._send_handoff(rec, h)

    def _send_handoff(self, rec: RouteRequest, h: Handoff) -> list[Outbound]:
        h.metadata["stats"] = stats_to_wire(rec.stats)
        start = max(h.anchor, 0)
        msg = HandoffMsg(h, list(rec.view.seen), rec.models[start:h.position], params_to_wire(rec.params),
                         rec.num_handoffs, inc=rec.inc)
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
                                               rec.streamed, reason, self._final_stats(rec), inc=rec.inc))]
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
                         rec.num_handoffs, final=True, inc=rec.inc)
        self._drop(rec, RequestState.FINISHED)
        return [Outbound(self.home, msg)]

    def _final_stats(self, rec: RouteRequest) -> dict[str, Any]:
        d = rec.stats.to_dict()
        d.update(prompt_tokens=len(rec.view.prompt_ids), output_tokens=len(rec.view.output_ids),
                 handoffs=rec.num_handoffs)
        return d

    def _yield(self, rec: RouteRequest, next_model: int, h: Handoff | None,
               finish_reason: str | None = None) -> list[Outbound]:
        view = rec.view
        state = dict(view.state)
        state["__stats__"] = stats_to_wire(rec.stats)
        msg = Yield(rec.request_id, self.model, list(view.prompt_ids), list(view.output_ids), list(rec.models),
                    state, params_to_wire(rec.params), rec.num_handoffs, next_model, finish_reason, h, rec.inc)
        if finish_reason is not None:
            msg.state["__final_stats__"] = self._final_stats(rec)
        self._drop(rec, RequestState.FINISHED, tombstone=False)
        return [Outbound(FRONTEND, msg)]

    def _stream(self, rec: RouteRequest) -> list[Outbound]:
        if not self.is_home or self.standard_serving:
            return []
        n = len(rec.view.output_ids)
        if n < rec.streamed:
            raise ValueError(f"request {rec.request_id}: committed output shrank below what was streamed")
        if n == rec.streamed:
            return []
        chunk = TokenChunk(rec.request_id, rec.view.output_ids[rec.streamed:], rec.models[rec.streamed:n],
                           rec.streamed, inc=rec.inc)
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

    def abort_all(self, reason: str = "abort") -> list[str]:
        rids = list(self.requests)
        for rid in rids:
            self.abort(rid, reason)
        return rids

    def _drop(self, rec: RouteRequest, state: RequestState, tombstone: bool = True) -> None:
        rec.state = state
        if state == RequestState.ABORTED:
            self.counters["aborted"] += 1
        self._free_seq(rec)
        self.requests.pop(rec.request_id, None)
        if tombstone:
            self._tombstone((rec.request_id, rec.inc))
        # waiting/running lists are filtered lazily (schedule / update_from_output)
        if rec.request_id in self.running and rec.state != RequestState.RUNNING:
            self.running.remove(rec.request_id)

    def _free_seq(self, rec: RouteRequest) -> None:
        if rec.seq is not None:
            self.bm.free(rec.seq)
            rec.seq = None

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


__all__ = ["EnsembleWait", "FRONTEND", "Outbound", "RouteRequest", "Scheduler", "params_from_wire",
           "params_to_wire"]
