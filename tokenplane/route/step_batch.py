"""One step's batch on one model: the token budget, KV growth and preemption by recompute, chunked prefill.

Split out of the scheduler (one mechanism per file): the scheduler decides what a request's state is (admission,
pending return, routing, endings); this module decides which requests compute which tokens in the next step, within
`max_num_batched_tokens` tokens and the model's KV pool. It reads and updates the Scheduler's queues in place, and is
called once per step, as `Scheduler.schedule()`.

KV memory (vLLM v1 style): admission allocates what the prompt (its first chunk) needs and blocks grow as tokens come.
When a RUNNING request cannot grow, the most recently admitted request holding blocks that is not already in this
step is preempted by recompute (an admission that does not fit may preempt PENDING_RETURN requests only, so pools
full of requests parked on each other's models cannot deadlock): its blocks are freed (full blocks stay in the
prefix cache), it keeps its tokens, and its next admission computes them again (mostly prefix-cache hits). A RUNNING
victim goes back to the front of WAITING. A PENDING_RETURN victim stays PENDING_RETURN without KV; when its peer hands
it back it goes through WAITING (prefix match, allocate, recompute), the path pending_return=False takes; its view
(prompt + output) is bookkeeping, not KV, so nothing is lost. If no other victim exists the request preempts itself.
A request that can never fit (prompt + max_tokens over the pool) is refused at admission (Scheduler._admit).

Chunked prefill: a step computes at most `max_num_batched_tokens` tokens. Decodes (1 uncomputed token) are scheduled
first, then longer catch-ups / prefills in admission order, then admissions; a request whose uncomputed tokens do not
fit the rest of the budget computes a chunk (its Sequence is cut at the chunk end for the run and restored in
update_from_output) and samples only when its last chunk completes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .route_request import RouteRequest
from .states import RequestState

if TYPE_CHECKING:
    from .scheduler import Scheduler

__all__ = ["form_batch", "free_kv", "preempt"]


def form_batch(s: Scheduler) -> list[RouteRequest]:
    """This step's batch within max_num_batched_tokens: RUNNING requests grow (decodes first, preempting the
    most recently admitted when the pool is out), then WAITING ones are admitted while blocks and budget last."""
    budget = s.max_num_batched_tokens
    batch: list[RouteRequest] = []
    in_batch: set[str] = set()
    s.running = [rid for rid in s.running
                 if rid in s.requests and s.requests[rid].state == RequestState.RUNNING]
    # decodes first (1 uncomputed token), then catch-ups and prefill chunks, each group in admission order
    order = sorted(s.running, key=lambda rid: _uncomputed(s.requests[rid]) > 1)
    for rid in order:
        rec = s.requests.get(rid)
        if budget <= 0 or len(batch) >= s.max_num_seqs:
            break
        if rec is None or rec.state != RequestState.RUNNING:
            continue   # preempted while an earlier request grew
        n = _grow(s, rec, budget, in_batch)
        if n:
            batch.append(rec)
            in_batch.add(rid)
            budget -= n
    while s.waiting and len(s.running) < s.max_num_seqs and budget > 0:
        rec = s.requests.get(s.waiting[0])
        if rec is None or rec.state != RequestState.WAITING:
            s.waiting.popleft()
            continue
        seq = s.Sequence(rec.request_id, rec.view.prompt_ids + rec.view.output_ids)
        # the chunk's budget starts after the prefix-cache hits `allocate` would give it
        end = min(seq.num_tokens, int(s.bm.num_cached_prefix_tokens(seq)) + budget)
        tail = seq.token_ids[end:]
        del seq.token_ids[end:]
        if not s.bm.can_allocate(seq):
            # Admissions never preempt RUNNING requests, but may take the KV of parked PENDING_RETURN ones:
            # otherwise two models whose pools are full of requests parked on each other would deadlock.
            parked = [r for r in s.requests.values()
                      if r.state == RequestState.PENDING_RETURN and r.seq is not None]
            if not parked:
                break
            preempt(s, max(parked, key=lambda r: r.admitted_at))
            continue
        s.waiting.popleft()
        s.bm.allocate(seq)
        if rec.stats.cached_prompt is None and s.is_home:
            # the request's first admission (a chunk's cut never reaches into the cached blocks it counts)
            rec.stats.cached_prompt = min(seq.num_cached_tokens, len(rec.view.prompt_ids))
        budget -= seq.num_tokens - seq.num_computed_tokens
        s.admission_clock += 1
        rec.seq, rec.tail, rec.admitted_at = seq, tail or None, s.admission_clock
        rec.state = RequestState.RUNNING
        s.running.append(rec.request_id)
        s.counters["admissions"] += 1
        batch.append(rec)
    return batch


def _uncomputed(rec: RouteRequest) -> int:
    return rec.seq.num_tokens - rec.seq.num_computed_tokens


def _grow(s: Scheduler, rec: RouteRequest, budget: int, in_batch: set[str]) -> int:
    """Blocks for a RUNNING request's next chunk (<= budget tokens); preempts others (or itself) when the pool
    is out. Returns the tokens scheduled, 0 when it was preempted."""
    seq = rec.seq
    if seq.num_computed_tokens >= seq.num_tokens:
        # Nothing new since the last run (e.g. the peer returned zero tokens): recompute the last position
        # to get its logits again. Same values are rewritten into the same slot.
        seq.num_computed_tokens = seq.num_tokens - 1
    n = min(seq.num_tokens - seq.num_computed_tokens, budget)
    end = seq.num_computed_tokens + n
    while s.bm.blocks_needed(end) - len(seq.block_table) > s.bm.num_free_blocks:
        victims = [r for r in s.requests.values()
                   if r.seq is not None and r is not rec and r.request_id not in in_batch]
        if not victims:
            preempt(s, rec)
            return 0
        preempt(s, max(victims, key=lambda r: r.admitted_at))
    if end < seq.num_tokens:
        rec.tail = seq.token_ids[end:]
        del seq.token_ids[end:]
    s.bm.append_slots(seq)
    return n


def preempt(s: Scheduler, rec: RouteRequest) -> None:
    """Free a request's blocks (recompute later). RUNNING -> front of WAITING; PENDING_RETURN stays, without KV,
    and re-admits through WAITING when it returns (see the module docstring)."""
    free_kv(s.bm, rec)
    s.counters["preemptions"] += 1
    if rec.state == RequestState.RUNNING:
        rec.state = RequestState.WAITING
        if rec.request_id in s.running:
            s.running.remove(rec.request_id)
        s.waiting.appendleft(rec.request_id)


def free_kv(bm: Any, rec: RouteRequest) -> None:
    """Give a request's KV blocks back to the pool (full blocks stay in the prefix cache); it keeps its tokens."""
    if rec.seq is not None:
        bm.free(rec.seq)
        rec.seq = None
