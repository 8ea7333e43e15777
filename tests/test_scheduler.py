"""Scheduler unit tests, vLLM style: no processes, no model. A fake runner computes every uncomputed token and
returns logits whose argmax is a fixed function of the sequence; a scripted algorithm decides routes by
(request, position). Handoffs are delivered by hand between two Schedulers, so every state transition is visible."""

from __future__ import annotations

import torch

from tokenplane.engine.block_manager import BlockManager
from tokenplane.engine.sampler import SamplingParams
from tokenplane.route.api import Algorithm
from tokenplane.route.messages import AddRequest, Finished, HandoffMsg, Release, TokenChunk, Yield, params_to_wire
from tokenplane.route.route_request import FRONTEND
from tokenplane.route.scheduler import Scheduler
from tokenplane.route.states import RequestState

V = 64


class FakeOut:
    def __init__(self, logits):
        self.logits = logits
        self.hidden = None


class FakeRunner:
    """Consumes every uncomputed token; next token = (sum of tokens + model) % V, as greedy argmax of one-hot."""

    def __init__(self, model: int, bm=None):
        self.model, self.bm = model, bm
        self.batches: list[list[tuple[str, int]]] = []   # (seq_id, tokens computed) per run

    def run(self, seqs):
        self.batches.append([(s.seq_id, s.num_tokens - s.num_computed_tokens) for s in seqs])
        logits = torch.zeros(len(seqs), V, dtype=torch.float64)
        for i, s in enumerate(seqs):
            assert len(s.block_table) * 16 >= s.num_tokens
            logits[i, (sum(s.token_ids) + self.model) % V] = 1.0
            s.num_computed_tokens = s.num_tokens
            if self.bm is not None:
                self.bm.cache_blocks(s)   # as ModelRunner.run does: computed full blocks become prefix-cache hits
        return FakeOut(logits)


class Scripted(Algorithm):
    """route: model 0 hands to model 1 at positions in `away`; model 1 always hands back (1-token peer)."""
    name = "scripted"

    def __init__(self, away=(), keep=True, **kw):
        super().__init__(**kw)
        self.away, self.keep = set(away), keep

    def route(self, result, req):
        if result.model == 0:
            return 1 if (req.request_id, result.position) in self.away else 0
        return 0

    def keep_last(self, result, req, target):
        return self.keep if result.model == 0 else True


def make(away=(), keep=True, pending_return=True, num_blocks=64, standard_serving=False, max_num_batched_tokens=2048,
         standard_unit="token"):
    alg = Scripted(away, keep)
    s = [Scheduler(m, 2, BlockManager(num_blocks, 16), alg, pending_return=pending_return,
                   standard_serving=standard_serving, max_num_batched_tokens=max_num_batched_tokens,
                   standard_unit=standard_unit)
         for m in range(2)]
    return s, [FakeRunner(0, s[0].bm), FakeRunner(1, s[1].bm)]


def add(s0, rid, prompt, max_tokens=8):
    return s0.add_request(AddRequest(rid, prompt, params_to_wire(SamplingParams(max_tokens=max_tokens))))


def step(s, runner):
    batch = s.schedule()
    if not batch:
        return []
    return s.update_from_output(batch, runner.run([r.seq for r in batch]))


def pump(scheds, runners, outs, max_steps=200):
    """Drive both schedulers, delivering handoffs; returns front-end messages."""
    front, queue = [], list(outs)
    for _ in range(max_steps):
        while queue:
            o = queue.pop(0)
            if o.dest == FRONTEND:
                front.append(o.msg)
            elif isinstance(o.msg, HandoffMsg):
                queue += scheds[o.dest].receive_handoff(o.msg)
            elif isinstance(o.msg, Release):
                scheds[o.dest].release(o.msg)
        if not any(s.has_work() for s in scheds):
            break
        for s, r in zip(scheds, runners):
            queue += step(s, r)
    return front


def tokens_of(front, rid):
    return [t for m in front if isinstance(m, (TokenChunk, Finished)) and m.request_id == rid for t in m.tokens]


def test_continuous_batching_admits_and_runs_together():
    (s0, s1), (r0, r1) = make()
    add(s0, "a", [1, 2, 3])
    add(s0, "b", [4, 5])
    assert s0.num_ready() == 2
    step(s0, r0)
    assert [rid for rid, _ in r0.batches[0]] == ["a", "b"] and r0.batches[0] == [("a", 3), ("b", 2)]
    assert all(s0.requests[r].state == RequestState.RUNNING for r in "ab")
    step(s0, r0)
    assert r0.batches[1] == [("a", 1), ("b", 1)]   # decode: one uncomputed token each


def test_pending_return_keeps_blocks_and_resumes_without_readmission():
    (s0, s1), (r0, r1) = make(away={("a", 2)}, keep=False)
    add(s0, "a", list(range(1, 20)))   # 19 tokens: 2 blocks
    add(s0, "b", [7, 8])
    sends = step(s0, r0) + step(s0, r0)
    assert not sends or all(o.dest == FRONTEND for o in sends)
    sends = step(s0, r0)    # position 2 of "a" routes away, token dropped
    handoffs = [o for o in sends if isinstance(o.msg, HandoffMsg)]
    assert len(handoffs) == 1 and handoffs[0].dest == 1
    ra = s0.requests["a"]
    blocks = list(ra.seq.block_table)
    assert ra.state == RequestState.PENDING_RETURN and blocks and s0.bm.num_used_blocks >= len(blocks)
    assert handoffs[0].msg.handoff.anchor == -19 and not handoffs[0].msg.handoff.keep_last
    # other requests keep decoding while "a" is away
    step(s0, r0)
    assert [rid for rid, _ in r0.batches[-1]] == ["b"]
    # the peer: first visit is an admission (prefill of prompt + 2 output tokens), 1 token, hands back
    s1.receive_handoff(handoffs[0].msg)
    assert s1.requests["a"].state == RequestState.WAITING
    back = step(s1, r1)
    assert r1.batches[0] == [("a", 21)]
    ret = [o for o in back if isinstance(o.msg, HandoffMsg)][0]
    assert ret.dest == 0 and ret.msg.handoff.tokens == [ret.msg.handoff.tokens[0]] and ret.msg.handoff.anchor == 2
    admissions = s0.counters["admissions"]
    s0.receive_handoff(ret.msg)
    assert ra.state == RequestState.RUNNING and ra.seq.block_table[:len(blocks)] == blocks
    assert s0.counters["admissions"] == admissions and s0.counters["resumes"] == 1
    step(s0, r0)
    assert ("a", 1) in r0.batches[-1]    # catch-up of the peer's one token: same code path as a decode


def test_multi_token_return_is_a_catch_up_prefill():
    (s0, s1), (r0, r1) = make(away={("a", 0)}, keep=True)
    s1.alg.route = lambda result, req: 0 if result.position >= 3 else result.model   # peer stays for 3 tokens
    front = pump((s0, s1), (r0, r1), add(s0, "a", [3, 1, 4], max_tokens=6))
    # model 0 after return computes the 3 tokens model 1 wrote (+ nothing else) in one run
    assert ("a", 3) in [b[0] for b in r0.batches if b]
    fin = [m for m in front if isinstance(m, Finished)][0]
    assert fin.finish_reason == "length" and len(tokens_of(front, "a")) == 6


def test_pending_return_off_readmits_through_prefix_cache():
    (s0, s1), (r0, r1) = make(away={("a", 20), ("a", 40)}, keep=False, pending_return=False)
    front = pump((s0, s1), (r0, r1), add(s0, "a", list(range(1, 40)), max_tokens=48))
    assert s0.counters["readmissions"] == 2 and s0.counters["resumes"] == 0
    assert s0.bm.num_hit_tokens > 0      # the re-admission matched the cached prefix
    assert len(tokens_of(front, "a")) == 48
    assert s0.bm.num_used_blocks == 0 and s1.bm.num_used_blocks == 0


def test_same_tokens_with_and_without_pending_return():
    outs = []
    for pr in (True, False):
        (s0, s1), (r0, r1) = make(away={("x", 1), ("x", 5), ("y", 2)}, keep=False, pending_return=pr)
        front = pump((s0, s1), (r0, r1), add(s0, "x", [9, 9, 9], 10) + add(s0, "y", [1, 2], 10))
        outs.append((tokens_of(front, "x"), tokens_of(front, "y")))
    assert outs[0] == outs[1]


def test_finish_on_peer_is_delivered_home_and_released():
    (s0, s1), (r0, r1) = make(away={("a", 3)}, keep=False)
    front = pump((s0, s1), (r0, r1), add(s0, "a", [5, 6], max_tokens=4))
    fin = [m for m in front if isinstance(m, Finished)]
    assert len(fin) == 1 and fin[0].finish_reason == "length"
    assert fin[0].start + len(fin[0].tokens) == 4 and fin[0].models[-1] == 1
    assert not s0.requests and not s1.requests
    assert s0.bm.num_used_blocks == 0 and s1.bm.num_used_blocks == 0


def test_abort_frees_blocks_and_ignores_late_handoffs():
    (s0, s1), (r0, r1) = make(away={("a", 0)}, keep=False)
    sends = add(s0, "a", list(range(40)), 8) + step(s0, r0)
    h = [o for o in sends if isinstance(o.msg, HandoffMsg)][0]
    assert s0.bm.num_used_blocks > 0
    assert s0.abort("a") and s0.bm.num_used_blocks == 0 and not s0.requests
    s1.abort("a", inc=0)                  # the front end aborts everywhere, possibly before the handoff lands
    assert s1.receive_handoff(h.msg) == [] and not s1.requests and s1.bm.num_used_blocks == 0


def test_admission_takes_what_the_prompt_needs_and_refuses_what_never_fits():
    (s0, s1), (r0, r1) = make(num_blocks=4)
    add(s0, "a", [1] * 20, max_tokens=20)    # 40 tokens at most; 2 blocks now
    add(s0, "b", [2] * 20, max_tokens=20)    # no worst-case reservation: admitted beside it
    step(s0, r0)
    assert all(s0.requests[r].state == RequestState.RUNNING for r in "ab") and s0.bm.num_used_blocks == 4
    out = add(s0, "c", [1], max_tokens=200)   # 201 tokens > 4 x 16: can never fit, refused with the numbers
    assert out and "201 tokens" in out[0].msg.message and "64" in out[0].msg.message and "c" not in s0.requests


def _run_all(prompts, max_tokens, **kw):
    scheds, runners = make(**kw)
    outs = []
    for rid, p in prompts.items():
        outs += add(scheds[0], rid, p, max_tokens=max_tokens)
    front = pump(scheds, runners, outs, max_steps=2000)
    assert not any(s.requests for s in scheds), [s.requests for s in scheds]
    assert all(s.bm.num_used_blocks == 0 for s in scheds)
    return {rid: tokens_of(front, rid) for rid in prompts}, scheds, runners


PROMPTS = {f"r{i}": [(5 * i + j) % 60 + 1 for j in range(10 + 7 * i)] for i in range(6)}
AWAY = {(f"r{i}", p) for i in range(6) for p in (3, 9, 17, 30)}


def test_growth_and_preemption_keep_outputs():
    """Pool far below total demand (6 requests x up to 85 tokens on 8 blocks = 128 tokens): requests are preempted
    (RUNNING ones and PENDING_RETURN ones parked on model 0 while model 1 has them), recomputed, and every output
    equals the run on a pool large enough for all."""
    want, _, _ = _run_all(PROMPTS, 40, away=AWAY, num_blocks=256)
    got, scheds, _ = _run_all(PROMPTS, 40, away=AWAY, num_blocks=8)
    assert got == want and all(len(v) == 40 for v in got.values())
    assert scheds[0].counters["preemptions"] > 0


def test_pending_return_victim_readmits_on_return():
    """"a" needs a second block while "b" is away on model 1 (PENDING_RETURN, the most recently admitted): b's
    blocks are freed, and its return goes through WAITING (prefix match, recompute) with the same outputs."""
    prompts = {"a": list(range(1, 17)), "b": list(range(20, 35))}
    want, _, _ = _run_all(prompts, 16, away={("b", 0)}, num_blocks=64)
    got, scheds, _ = _run_all(prompts, 16, away={("b", 0)}, num_blocks=2)
    assert got == want
    assert scheds[0].counters["preemptions"] >= 1 and scheds[0].counters["readmissions"] == 1


def test_admission_takes_kv_of_parked_requests_not_running_ones():
    """s0's pool is full of "a", parked (PENDING_RETURN) while model 1 has it: "b" is admitted by preempting it (a
    pool full of requests parked on each other's models would otherwise deadlock); all outputs stay the same."""
    prompts = {"a": list(range(1, 21)), "b": [7, 8, 9]}
    want, _, _ = _run_all(prompts, 8, away={("a", 0)}, num_blocks=64)
    (s0, s1), (r0, r1) = make(away={("a", 0)}, num_blocks=2)
    outs = add(s0, "a", prompts["a"], max_tokens=8) + step(s0, r0)
    assert s0.requests["a"].state == RequestState.PENDING_RETURN and s0.bm.num_free_blocks == 0
    outs += add(s0, "b", prompts["b"], max_tokens=8) + step(s0, r0)
    assert s0.requests["b"].state == RequestState.RUNNING and s0.requests["a"].seq is None
    front = pump([s0, s1], [r0, r1], outs)
    assert {rid: tokens_of(front, rid) for rid in prompts} == want and not s0.requests and not s1.requests


def test_chunked_prefill_respects_the_token_budget_and_keeps_outputs():
    want, _, _ = _run_all(PROMPTS, 12, away=AWAY)
    got, scheds, runners = _run_all(PROMPTS, 12, away=AWAY, max_num_batched_tokens=8)
    assert got == want
    for r in runners:
        assert r.batches and all(sum(n for _, n in b) <= 8 for b in r.batches), r.batches
    # the 45-token prompt took several steps, and decodes ran in the same steps as its chunks
    chunks = [b for b in runners[0].batches if any(rid == "r5" and n > 1 for rid, n in b)]
    assert len(chunks) >= 5 and any(any(n == 1 for _, n in b) for b in chunks)


def test_chunk_does_not_sample_until_the_last_chunk():
    (s0, s1), (r0, r1) = make(max_num_batched_tokens=16)
    add(s0, "a", list(range(1, 41)), max_tokens=4)    # 40 tokens: chunks of 16, 16, 8
    outs = step(s0, r0) + step(s0, r0)
    assert outs == [] and s0.requests["a"].view.output_ids == [] and s0.requests["a"].seq.num_tokens == 40
    assert r0.batches == [[("a", 16)], [("a", 16)]] and s0.requests["a"].seq.num_computed_tokens == 32
    outs = step(s0, r0)
    assert r0.batches[-1] == [("a", 8)] and len(s0.requests["a"].view.output_ids) == 1


def test_zero_token_return_recomputes_last_position():
    (s0, s1), (r0, r1) = make(away={("a", 1)}, keep=False)
    sends = add(s0, "a", [1, 2, 3], 6) + step(s0, r0) + step(s0, r0)
    h = [o for o in sends if isinstance(o.msg, HandoffMsg)][0].msg
    # a peer that answers with no tokens (e.g. it dropped its own): model 0 has nothing new to compute
    reply = h.handoff.__class__(h.handoff.request_id, [], 1, keep_last=False, target=0, source=1, position=1,
                                metadata={})
    s0.receive_handoff(HandoffMsg(reply, [4, 0], [], h.params))
    step(s0, r0)
    assert r0.batches[-1] == [("a", 1)]


def test_standard_serving_is_single_token_calls():
    (s0, s1), (r0, r1) = make(away={("a", 1)}, keep=False, standard_serving=True)
    out = add(s0, "a", [1, 2, 3], 4) + step(s0, r0)
    ys = [o.msg for o in out if isinstance(o.msg, Yield)]
    assert len(ys) == 1 and ys[0].next_model == 0 and ys[0].output and not s0.requests
    assert s0.bm.num_used_blocks == 0     # the call ended: everything released


def run_standard(unit: str, away, max_tokens: int = 5):
    """Drive a standard-serving request as the front end does: each Yield is re-submitted as a new AddRequest.
    Returns (final Yield, [(model, calls' admitted output length)], streamed TokenChunks, schedulers)."""
    (s0, s1), (r0, r1) = make(away=away, keep=False, standard_serving=True, standard_unit=unit)
    scheds, runners = (s0, s1), (r0, r1)
    queue = add(s0, "a", [1, 2, 3], max_tokens)
    calls, chunks, final = [(0, 0)], [], None
    client: list[int] = []   # what the front end delivers: chunks, then each Yield's tokens beyond them
    for _ in range(40):
        for s, r in zip(scheds, runners):
            queue += step(s, r)
        for o in queue:
            if isinstance(o.msg, TokenChunk):
                assert o.msg.start == len(client), "streamed out of order or twice"
                chunks.append(o.msg)
                client += o.msg.tokens
            elif isinstance(o.msg, Yield):
                client += o.msg.output[len(client):]
        ys = [o.msg for o in queue if isinstance(o.msg, Yield)]
        queue = []
        if not ys:
            continue
        y = ys[0]
        if y.finish_reason is not None:
            final = y
            break
        calls.append((y.next_model, len(y.output)))
        queue += scheds[y.next_model].add_request(AddRequest(y.request_id, y.prompt, y.params, y.output, y.models,
                                                             y.state, y.num_handoffs, y.handoff))
    assert s0.bm.num_used_blocks == 0 and s1.bm.num_used_blocks == 0   # every call released its KV
    assert final is not None and client == final.output
    return final, calls, chunks, scheds


def test_standard_serving_resubmission_keeps_attribution():
    """The front end re-submits each Yield as a new AddRequest; the producing model of every position survives."""
    final, calls, chunks, _ = run_standard("token", {("a", 2)})
    assert final is not None and len(final.output) == 5
    assert final.models == [0, 0, 1, 0, 0]   # position 2 regenerated by model 1 (the dropped token's redo)
    # one call per generated token (5 committed + the dropped one); tokens reach the client through the Yields
    assert len(calls) == 6 and not chunks


def test_standard_serving_per_segment_calls():
    """standard_unit="segment": a call streams from one model until the router switches (R-Stitch-like stock
    composition): same tokens and attribution as per-token calls, one call per segment, tokens streamed as
    TokenChunks from whichever model serves the segment, each exactly once."""
    ref, _, _, _ = run_standard("token", {("a", 2), ("a", 5)}, max_tokens=8)
    final, calls, chunks, (s0, s1) = run_standard("segment", {("a", 2), ("a", 5)}, max_tokens=8)
    assert final.output == ref.output and final.models == ref.models == [0, 0, 1, 0, 0, 1, 0, 0]
    # segments: model 0 from 0, model 1 for the dropped position 2, model 0 from 3, model 1 at 5, model 0 from 6
    assert calls == [(0, 0), (1, 2), (0, 3), (1, 5), (0, 6)]
    # model 0 streams its tokens; model 1's single token and the last one (the finish) come by Yield
    assert [c.start for c in chunks] == [0, 1, 3, 4, 6]
    assert s0.counters["admissions"] == 3 and s1.counters["admissions"] == 2
