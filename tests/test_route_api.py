"""Routing API: counter RNG, StepResult signals, Handoff wire format, view bookkeeping, and the sequential reference's
catch-up mechanics on a deterministic fake runner (every catch-up run computes exactly the handed-off suffix)."""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import msgpack
import pytest
import torch

from tokenplane.engine.block_manager import BlockManager
from tokenplane.engine.sampler import SamplingParams
from tokenplane.route.algorithms import make_algorithm
from tokenplane.route.api import (
    Algorithm,
    Handoff,
    RequestView,
    StepResult,
    after_send,
    apply_handoff,
    commit,
    counter_uniform,
)
from tokenplane.route.reference import SequentialRouter, run_sequential


@dataclass
class FakeOut:
    logits: torch.Tensor
    hidden: torch.Tensor


class FakeRunner:
    """ModelRunner stand-in: logits are a deterministic function of the whole token prefix (like a real LM), and
    every run records how many tokens it had to compute."""

    def __init__(self, seed: int, vocab: int = 64, hidden: int = 16, num_blocks: int = 512, block_size: int = 4):
        self.seed, self.vocab, self.hidden = seed, vocab, hidden
        self.block_manager = BlockManager(num_blocks, block_size)
        self.computed: list[int] = []
        self.model = None

    def run(self, seqs):
        logits, hidden = [], []
        for s in seqs:
            if len(s.block_table) * self.block_manager.block_size < s.num_tokens:
                raise AssertionError("runner called without blocks")
            self.computed.append(s.num_tokens - s.num_computed_tokens)
            s.num_computed_tokens = s.num_tokens
            key = struct.pack(f"<{s.num_tokens + 1}q", self.seed, *s.token_ids)
            g = torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
                                              & ((1 << 62) - 1))
            scale = 0.2 + 3 * float(torch.rand(1, generator=g, dtype=torch.float64))
            logits.append(torch.randn(self.vocab, generator=g, dtype=torch.float64) * scale)
            hidden.append(torch.randn(self.hidden, generator=g, dtype=torch.float64))
        return FakeOut(torch.stack(logits), torch.stack(hidden))


def step(model=0, position=0, token=3, logits=None, hidden=None, rid="r"):
    logits = torch.zeros(8, dtype=torch.float64) if logits is None else logits
    return StepResult(rid, model, position, token, logits, hidden)


# -- counter RNG -------------------------------------------------------------------------------------------------------
def test_counter_uniform_is_keyed_and_uniform():
    a = counter_uniform(1, "req", 5, 0)
    assert a == counter_uniform(1, "req", 5, 0)
    assert len({a, counter_uniform(2, "req", 5, 0), counter_uniform(1, "req2", 5, 0),
                counter_uniform(1, "req", 6, 0), counter_uniform(1, "req", 5, 1),
                counter_uniform(1, "req", 5, 0, stream=1)}) == 6
    xs = [counter_uniform(0, "r", i, 0) for i in range(20000)]
    assert all(0.0 <= x < 1.0 for x in xs)
    assert abs(sum(xs) / len(xs) - 0.5) < 0.01
    assert abs(sum(x < 0.1 for x in xs) / len(xs) - 0.1) < 0.01


# -- StepResult ------------------------------------------------------------------------------------------------------
def test_step_result_signals():
    uniform = step(logits=torch.zeros(16, dtype=torch.float64))
    assert math.isclose(uniform.entropy(), math.log(16))
    assert math.isclose(uniform.normalized_entropy(), 1.0)
    assert math.isclose(uniform.max_prob(), 1 / 16)
    peaked = step(logits=torch.tensor([0.0, 50.0, 0.0, 0.0], dtype=torch.float64))
    assert peaked.normalized_entropy() < 1e-15 and peaked.max_prob() > 0.999
    p = torch.softmax(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), -1)
    r = step(logits=torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    assert math.isclose(r.entropy(), float(-(p * p.log()).sum()), rel_tol=1e-12)


def test_topk_ties_are_deterministic():
    r = step(logits=torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0], dtype=torch.float64))
    ids, probs = r.topk(4)
    assert ids == [1, 2, 4, 0]
    assert probs[0] == probs[1] == probs[2] > probs[3]


# -- Handoff wire ----------------------------------------------------------------------------------------------------
def test_handoff_wire_roundtrip_msgpack():
    h = Handoff("req-1", [5, 6, 7], -2, done=True, keep_last=False, target=1, source=0, position=1,
                metadata={"state": {"run": 3, "x": 0.25}, "request": {"prompt_len": 2, "stop_token_ids": [9]}})
    wire = msgpack.packb(h.to_wire())
    assert Handoff.from_wire(msgpack.unpackb(wire)) == h
    with pytest.raises(ValueError):
        Handoff.from_wire({"v": 99})
    with pytest.raises(ValueError):
        Handoff.from_wire([1, 2])


# -- view bookkeeping -------------------------------------------------------------------------------------------------
class Keep(Algorithm):
    def keep_last(self, result, req, target):
        return True


class Drop(Algorithm):
    def keep_last(self, result, req, target):
        return False


def test_first_visit_drop_and_return_keep():
    alg = Drop()
    sender = RequestView.new("r", [10, 11, 12], 2, max_tokens=8)
    sender.seen[0] = 3
    for t in (20, 21):
        commit(sender, 0, t)
    res = step(model=0, position=2, token=99)
    h = alg.send(sender, res, 1)
    # first visit: the prompt and everything committed, not the dropped token; anchor inside the prompt
    assert h.tokens == [10, 11, 12, 20, 21] and h.anchor == -3 and not h.keep_last and h.position == 2
    assert h.metadata["request"] == {"prompt_len": 3, "max_tokens": 8, "stop_token_ids": []}
    after_send(sender, res, h)
    assert sender.output_ids == [20, 21] and sender.seen == [5, 5] and sender.model == 1

    peer = RequestView.from_handoff(h, 2)
    apply_handoff(peer, h, alg.receive(peer, h))
    assert peer.prompt_ids == [10, 11, 12] and peer.output_ids == [20, 21] and peer.seen == [5, 5]
    # the peer decodes position 2 and 3, then hands back keeping its last token
    commit(peer, 1, 30)
    res = step(model=1, position=3, token=31)
    back = Keep().send(peer, res, 0)
    assert back.tokens == [30, 31] and back.anchor == 2 and back.keep_last and back.position == 4
    after_send(peer, res, back)
    apply_handoff(sender, back, Keep().receive(sender, back))
    assert sender.output_ids == peer.output_ids == [20, 21, 30, 31]
    assert sender.seen == [7, 7] and sender.model == 0
    with pytest.raises(ValueError, match="anchor"):
        apply_handoff(sender, back, back.tokens)   # replaying a handoff is caught


def test_done_flag_on_stop_and_length():
    v = RequestView.new("r", [1], 2, max_tokens=3, stop_token_ids=(7,))
    v.seen[0] = 1
    assert Keep().send(v, step(position=0, token=7), 1).done            # stop token kept
    assert not Drop().send(v, step(position=0, token=7), 1).done        # dropped: not committed, not done
    assert not Keep().send(v, step(position=0, token=5), 1).done
    commit(v, 0, 5)
    commit(v, 0, 5)
    assert Keep().send(v, step(position=2, token=5), 1).done            # third token = max_tokens


def test_state_travels_in_the_handoff():
    v = RequestView.new("r", [1, 2], 2)
    v.seen[0] = 2
    v.state["visits"] = 4
    h = Keep().send(v, step(position=0), 1)
    peer = RequestView.from_handoff(Handoff.from_wire(msgpack.unpackb(msgpack.packb(h.to_wire()))), 2)
    Keep().receive(peer, h)
    assert peer.state == {"visits": 4}


def test_base_algorithm_stays():
    assert Algorithm().route(step(model=1), RequestView.new("r", [1], 2)) == 1


# -- reference mechanics on the fake runner ----------------------------------------------------------------------------
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [11] * 9]


@pytest.mark.parametrize("name,kwargs", [
    ("r2r", {"rates": {"switch": 0.3}}),
    ("citer", {"rates": {"switch": 0.5}}),
    ("co_llm", {"rates": {"switch": 0.2}}),
    ("r_stitch", {"rates": {"switch": 0.2, "return": 0.4}}),
    ("ensemble", {"rates": {"gate": 0.3}}),
    ("ensemble", {"rates": {"gate": 0.3}, "num_models": 3}),
])
def test_catch_up_computes_exactly_the_suffix(name, kwargs):
    alg = make_algorithm(name, mode="synthetic", seed=7, **kwargs)
    runners = [FakeRunner(seed=i) for i in range(alg.num_models)]
    outs = run_sequential(alg, runners, PROMPTS, SamplingParams(max_tokens=40))
    for o in outs:
        assert len(o.token_ids) == 40 and o.finish_reason == "length"
        assert o.stats.num_tokens == 40 and o.token_models == o.stats.token_models
    for m, runner in enumerate(runners):
        # a run either continues (1 new token) or catches up on a handoff (its suffix) or prefills the prompt
        catch_up = [k for o in outs for mm, k in o.stats.prefill if mm == m and k != 1]
        first = sorted(len(p) for p in PROMPTS) if m == 0 else []
        assert sorted(c for c in runner.computed if c != 1) == sorted(catch_up + first)
        assert runner.block_manager.num_used_blocks == 0   # every request freed its KV in every model
    assert sum(o.stats.dropped for o in outs) > 0
    for o in outs:
        # each delivered handoff's catch-up is its suffix, plus at most the receiver's own uncomputed kept token
        sent = [x for x in o.stats.sent]
        delivered = sent[:len(o.stats.prefill)]   # a final handoff that ends the request is never delivered
        assert [t for t, _ in delivered] == [t for t, _ in o.stats.prefill]
        assert all(k - n in (0, 1) for (_, n), (_, k) in zip(delivered, o.stats.prefill))


def test_reference_is_deterministic_and_keyed_on_request_id():
    def run(rids):
        alg = make_algorithm("r_stitch", mode="synthetic", seed=3, rates={"switch": 0.3, "return": 0.3})
        return run_sequential(alg, [FakeRunner(0), FakeRunner(1)], PROMPTS[:2], SamplingParams(max_tokens=30),
                              request_ids=rids)
    a, b, c = run(["x", "y"]), run(["x", "y"]), run(["p", "q"])
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_models for o in a] == [o.token_models for o in b]
    assert [o.token_models for o in a] != [o.token_models for o in c]


def test_stream_yields_committed_tokens_then_output():
    alg = make_algorithm("r2r", mode="synthetic", seed=1, rates={"switch": 0.4})
    router = SequentialRouter(alg, [FakeRunner(0), FakeRunner(1)])
    events = list(router.stream([1, 2, 3], SamplingParams(max_tokens=12), "s"))
    out = events[-1]
    assert [e.token for e in events[:-1]] == out.token_ids
    assert [e.model for e in events[:-1]] == out.token_models
    assert [e.position for e in events[:-1]] == list(range(12))


def test_stop_token_ends_the_request():
    alg = make_algorithm("r2r", mode="synthetic", seed=1, rates={"switch": 0.0})
    first = run_sequential(alg, [FakeRunner(0), FakeRunner(1)], [[1, 2]], SamplingParams(max_tokens=10))[0]
    stop = first.token_ids[4]
    out = run_sequential(alg, [FakeRunner(0), FakeRunner(1)], [[1, 2]],
                         SamplingParams(max_tokens=10, stop_token_ids=(stop,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == first.token_ids[:first.token_ids.index(stop) + 1]


def test_route_to_missing_model_is_an_error():
    class Bad(Algorithm):
        def route(self, result, req):
            return 5
    with pytest.raises(ValueError, match="returned model 5"):
        run_sequential(Bad(), [FakeRunner(0), FakeRunner(1)], [[1]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="drives 2 models"):
        run_sequential(Bad(), [FakeRunner(0)], [[1]], SamplingParams(max_tokens=2))


def test_stats_wire_roundtrip_and_summary():
    from tokenplane.route.stats import RouteStats
    alg = make_algorithm("r_stitch", mode="synthetic", seed=4, rates={"switch": 0.3, "return": 0.3})
    out = run_sequential(alg, [FakeRunner(0), FakeRunner(1)], [[1, 2, 3]], SamplingParams(max_tokens=30))[0]
    back = RouteStats.from_wire(msgpack.unpackb(msgpack.packb(out.stats.to_wire())))
    assert back == out.stats and back.to_dict() == out.stats.to_dict()
    d = out.stats.to_dict()
    runs = out.stats.runs()
    assert sum(n for _, n in runs) == 30 and all(a[0] != b[0] for a, b in zip(runs, runs[1:]))
    assert d["num_runs"] == [sum(1 for m, _ in runs if m == k) for k in (0, 1)]
    assert d["num_handoffs"] == len(out.stats.switches) and d["dropped_tokens"] == out.stats.dropped
