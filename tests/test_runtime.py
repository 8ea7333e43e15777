"""Multi-process routing runtime vs the sequential reference, aborts, and sub-server failure.

One Runtime (2 sub-server processes, fp64 "test-small"/"test-large") serves the whole module: processes cost ~20 s
each to start here, and the execution modes / algorithms are flags switched with `Runtime.configure` on the same
processes. fp64 makes batched and unbatched forwards agree far below any argmax or threshold margin, so equality is
exact (token for token, and per-token producing model), with no tolerance.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from tokenplane.engine.sampler import SamplingParams
from tokenplane.route.algorithms import make_algorithm
from tokenplane.route.reference import SequentialRouter, build_runner, calibrate
from tokenplane.route.runtime import ModelUnavailable, RequestRejected, Runtime, RuntimeConfig

MODELS = ["test-small", "test-large"]
PARAMS = SamplingParams(max_tokens=24)
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(4 + 3 * i)] for i in range(8)]
RIDS = [f"eq-{i}" for i in range(len(PROMPTS))]

# Synthetic rates high enough that every request switches several times in 24 tokens.
ALGORITHMS = {
    "r2r": {"mode": "synthetic", "seed": 3, "rates": {"switch": 0.25}, "router_dim": 32, "router_blocks": 1},
    "citer": {"mode": "synthetic", "seed": 4, "rates": {"switch": 0.25}},
    "co_llm": {"mode": "synthetic", "seed": 5, "rates": {"switch": 0.25}},
    "r_stitch": {"mode": "synthetic", "seed": 6, "rates": {"switch": 0.2, "return": 0.4}},
    "ensemble": {"mode": "synthetic", "seed": 7, "rates": {"gate": 0.3}},
}


@pytest.fixture(scope="module")
def runners():
    # The in-process reference runs tiny fp64 models: one thread is ~20x faster than two on a loaded 2-core box.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield [build_runner(m, dtype=torch.float64, num_blocks=256) for m in MODELS]
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runtime():
    cfg = RuntimeConfig(models=MODELS, algorithm="r2r", algorithm_kwargs=ALGORITHMS["r2r"], dtype="float64",
                        num_blocks=128, mode="immediate_async", heartbeat_timeout_s=20.0)
    rt = Runtime(cfg)
    yield rt
    rt.shutdown()


_REF_CACHE: dict = {}


def reference(runners, name, kwargs):
    key = (name, repr(sorted(kwargs.items())))
    if key not in _REF_CACHE:
        router = SequentialRouter(make_algorithm(name, **kwargs), runners)
        _REF_CACHE[key] = [router.generate(p, PARAMS, rid) for p, rid in zip(PROMPTS, RIDS)]
    return _REF_CACHE[key]


def check_equal(rt, runners, name, kwargs, concurrency):
    ref = reference(runners, name, kwargs)
    outs = rt.run_batch(PROMPTS, PARAMS, request_ids=RIDS, concurrency=concurrency)
    switched = 0
    for r, o in zip(ref, outs):
        assert o.token_ids == r.token_ids, (name, o.request_id)
        assert o.token_models == r.token_models, (name, o.request_id)
        assert o.finish_reason == r.finish_reason
        rs = r.stats.to_dict()
        for key in ("num_handoffs", "tokens_per_model", "dropped_tokens", "score_visits", "ensembled_positions"):
            assert o.stats[key] == rs[key], (key, o.stats[key], rs[key])
        switched += len(set(o.token_models)) > 1 or o.stats["score_visits"] > 0
    assert switched >= len(PROMPTS) // 2, "the test must exercise handoffs"
    return outs


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_equivalence_per_algorithm(runtime, runners, name, concurrency):
    runtime.configure(algorithm=name, algorithm_kwargs=ALGORITHMS[name], mode="delayed_async", thresholds=None,
                      pending_return=True, standard_serving=False)
    check_equal(runtime, runners, name, ALGORITHMS[name], concurrency)


FLAGS = [
    {"mode": "stepwise_sync"},
    {"mode": "model_sync"},
    {"mode": "immediate_async"},
    {"mode": "delayed_async", "thresholds": [1, 3], "concurrency": 8},
    {"mode": "immediate_async", "pending_return": False},
    {"mode": "immediate_async", "standard_serving": True},
    {"mode": "immediate_async", "standard_serving": True, "standard_unit": "segment"},
]


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("name", ["r2r", "r_stitch"])
def test_equivalence_per_execution_mode(runtime, runners, name, flags):
    full = {"thresholds": None, "pending_return": True, "standard_serving": False, "standard_unit": "token", **flags}
    runtime.configure(algorithm=name, algorithm_kwargs=ALGORITHMS[name], **full)
    before = runtime.stats()[0]["counters"]
    outs = check_equal(runtime, runners, name, ALGORITHMS[name], 8)
    after = runtime.stats()[0]["counters"]
    delta = {k: after[k] - before[k] for k in ("readmissions", "resumes", "admissions")}
    if flags.get("pending_return") is False:
        assert delta["readmissions"] > 0 and delta["resumes"] == 0, delta
    elif flags.get("standard_unit") == "segment":
        # one call per model-0 segment: as many as the request came back to model 0 (+1 for its first), far
        # fewer than one per token
        segments = sum(1 + sum(1 for a, b in zip(o.token_models, o.token_models[1:]) if a != 0 and b == 0)
                       for o in outs)
        assert delta["resumes"] == 0 and segments <= delta["admissions"] < 8 * PARAMS.max_tokens // 2, \
            (delta, segments)
    elif flags.get("standard_serving"):
        assert delta["resumes"] == 0 and delta["admissions"] >= 8 * PARAMS.max_tokens // 2, delta
    else:
        assert delta["resumes"] > 0 and delta["readmissions"] == 0 and delta["admissions"] == 8, delta


def test_ensemble_modes(runtime, runners):
    """Score visits (the primary waits for peer distributions) under a sync and the delayed mode."""
    for flags in ({"mode": "stepwise_sync"}, {"mode": "delayed_async", "thresholds": [2, 1]}):
        runtime.configure(algorithm="ensemble", algorithm_kwargs=ALGORITHMS["ensemble"], pending_return=True,
                          standard_serving=False, **{"thresholds": None, **flags})
        check_equal(runtime, runners, "ensemble", ALGORITHMS["ensemble"], 8)


def test_calibrated_signal_routing(runtime, runners):
    """Decisions read real model outputs (R2R router on hidden states + logits), thresholds calibrated once here and
    shipped to the sub-servers through algorithm.config()."""
    alg = make_algorithm("r2r", mode="calibrated", rates={"switch": 0.3}, seed=11, router_dim=32, router_blocks=1)
    calibrate(alg, runners, PROMPTS[:4], SamplingParams(max_tokens=8))
    kwargs = alg.config()
    runtime.configure(algorithm="r2r", algorithm_kwargs=kwargs, mode="delayed_async", thresholds=None,
                      pending_return=True, standard_serving=False)
    check_equal(runtime, runners, "r2r", kwargs, 8)


def test_streaming_chunks_are_ordered(runtime, runners):
    runtime.configure(algorithm="r_stitch", algorithm_kwargs=ALGORITHMS["r_stitch"], mode="immediate_async",
                      thresholds=None, pending_return=True, standard_serving=False)
    ref = reference(runners, "r_stitch", ALGORITHMS["r_stitch"])[2]

    async def go():
        chunks = []
        async for c in runtime.generate(PROMPTS[2], PARAMS, request_id=RIDS[2]):
            chunks.append(c)
        return chunks
    chunks = asyncio.run(go())
    pos = 0
    for c in chunks:
        assert c.start == pos
        pos += len(c.tokens)
    assert [t for c in chunks for t in c.tokens] == ref.token_ids
    assert chunks[-1].finish_reason == ref.finish_reason and chunks[-1].stats["latency_s"] > 0
    assert sum(1 for c in chunks if c.tokens) > 1   # streamed, not one final blob


def _settled(rt, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        st = rt.stats()
        busy = [(s["model"], s["num_used_blocks"], s["requests"]) for s in st
                if s["num_used_blocks"] or any(s["requests"].values())]
        if not busy or time.monotonic() > deadline:
            return st, busy
        time.sleep(0.1)


def test_abort_frees_every_block(runtime):
    runtime.configure(algorithm="r_stitch", algorithm_kwargs=ALGORITHMS["r_stitch"], mode="immediate_async",
                      thresholds=None, pending_return=True, standard_serving=False)
    params = SamplingParams(max_tokens=400)

    async def one(i):
        rid = f"abort-{i}"
        got = 0
        async for c in runtime.generate(PROMPTS[i % 8] * 3, params, request_id=rid):
            got += len(c.tokens)
            if got >= i % 5:     # abort at different depths: before admission, mid-prefill, mid-decode, away
                runtime.abort(rid)
            if c.finish_reason is not None:
                return c.finish_reason

    async def go():
        return await asyncio.gather(*(one(i) for i in range(100)))
    reasons = asyncio.run(go())
    assert reasons.count("abort") == 100
    st, busy = _settled(runtime)
    assert not busy, busy
    assert st[0]["counters"]["aborted"] > 0


def test_bad_requests_fail_cleanly(runtime):
    with pytest.raises(ValueError):
        asyncio.run(runtime.complete([], PARAMS))
    with pytest.raises(RequestRejected, match="KV pool of 2048 tokens"):   # 128 blocks x 16; refused up front
        asyncio.run(runtime.complete([1] * 100, SamplingParams(max_tokens=4000)))
    assert not runtime._live
    out = asyncio.run(runtime.complete(PROMPTS[0], SamplingParams(max_tokens=3)))   # still serving
    assert len(out.token_ids) == 3


def test_preemption_and_chunked_prefill_keep_reference_outputs(runners):
    """A small pool (12 blocks = 192 tokens for 8 requests of up to 49 tokens) and a 16-token step budget: requests
    are preempted and recomputed, prompts are prefilled in chunks, and every output still equals the reference."""
    cfg = RuntimeConfig(models=MODELS, algorithm="r2r", algorithm_kwargs=ALGORITHMS["r2r"], dtype="float64",
                        num_blocks=12, max_num_batched_tokens=16, mode="immediate_async")
    with Runtime(cfg) as rt:
        check_equal(rt, runners, "r2r", ALGORITHMS["r2r"], 8)
        st = rt.stats()
        assert sum(s["num_preemptions"] for s in st) > 0, st
        assert rt.max_request_tokens == 192


# Logprobs: half the requests ask for the top 3, one for the token's own only (0), the rest for none, in one batch.
LP_PARAMS = [SamplingParams(max_tokens=24, logprobs=3 if i % 2 else (0 if i == 2 else None)) for i in range(8)]
# The runtime's logits come from batched forwards, the reference's from one request at a time: different GEMM shapes.
# In fp64 they differ by rounding only (~1e-13); 1e-9 absolute leaves margin and still catches a wrong distribution.
LP_TOL = 1e-9


def reference_logprobs(runners, name, kwargs):
    """Per prompt: (tokens, [(logprob, top) or None per token]) from the reference's TokenEvents."""
    router = SequentialRouter(make_algorithm(name, **kwargs), runners)
    out = []
    for p, sp, rid in zip(PROMPTS, LP_PARAMS, RIDS):
        events = list(router.stream(p, sp, rid))
        final, tokens = events[-1], events[:-1]
        assert [e.token for e in tokens] == final.token_ids
        out.append((final.token_ids, [None if e.logprob is None else (e.logprob, e.top_logprobs) for e in tokens]))
    return out


def check_logprobs(rt, runners, name, kwargs):
    ref = reference_logprobs(runners, name, kwargs)
    outs = rt.run_batch(PROMPTS, LP_PARAMS, request_ids=RIDS, concurrency=8)
    for (tokens, lps), o, sp in zip(ref, outs, LP_PARAMS):
        assert o.token_ids == tokens, (name, o.request_id)
        if sp.logprobs is None:
            assert o.logprobs is None and all(x is None for x in lps)
            continue
        assert len(o.logprobs) == len(tokens), (name, o.request_id)
        for pos, ((lp, top), (rlp, rtop)) in enumerate(zip(o.logprobs, lps)):
            assert abs(lp - rlp) <= LP_TOL, (name, o.request_id, pos, lp, rlp)
            assert [int(i) for i, _ in top] == [i for i, _ in rtop] and len(top) == sp.logprobs
            assert all(abs(v - rv) <= LP_TOL for (_, v), (_, rv) in zip(top, rtop))
    asked = [o for o, sp in zip(outs, LP_PARAMS) if sp.logprobs is not None]
    assert sum(1 in o.token_models or o.stats["score_visits"] > 0 for o in asked) >= 2, "must exercise handoffs"


@pytest.mark.parametrize("flags", [{"pending_return": True}, {"pending_return": False}, {"standard_serving": True},
                                   {"standard_serving": True, "standard_unit": "segment"}],
                         ids=["pending_return", "baseline", "standard_serving", "standard_segment"])
@pytest.mark.parametrize("name", ["r2r", "r_stitch", "co_llm"])
def test_logprobs_equal_reference(runtime, runners, name, flags):
    """A committed token's logprob travels with it (peer tokens through HandoffMsg, standard serving through Yield,
    a standard-serving segment through its stream) and equals the reference's TokenEvent: the committing model's raw
    distribution."""
    full = {"pending_return": True, "standard_serving": False, "standard_unit": "token", **flags}
    runtime.configure(algorithm=name, algorithm_kwargs=ALGORITHMS[name], mode="immediate_async", thresholds=None,
                      **full)
    check_logprobs(runtime, runners, name, ALGORITHMS[name])


PEN_PARAMS = [SamplingParams(max_tokens=24, repetition_penalty=1.5, frequency_penalty=0.6, presence_penalty=0.3),
              SamplingParams(max_tokens=24, logit_bias=((5, 2.0),), repetition_penalty=0.9),
              SamplingParams(max_tokens=24, temperature=0.8, top_k=8, min_p=0.02, seed=5, frequency_penalty=1.0),
              SamplingParams(max_tokens=24, min_tokens=20, stop_token_ids=tuple(range(0, 500, 3)))] * 2


@pytest.mark.parametrize("flags", [{"pending_return": True}, {"pending_return": False}, {"standard_serving": True},
                                   {"standard_serving": True, "standard_unit": "segment"}],
                         ids=["pending_return", "baseline", "standard_serving", "standard_segment"])
@pytest.mark.parametrize("name", ["r2r", "r_stitch"])
def test_penalties_and_bias_equal_reference(runtime, runners, name, flags):
    """Penalties read the request's prompt and output tokens on whichever model samples (a peer's view after a
    handoff, a re-admitted standard-serving request): every token equals the sequential reference's."""
    full = {"pending_return": True, "standard_serving": False, "standard_unit": "token", **flags}
    runtime.configure(algorithm=name, algorithm_kwargs=ALGORITHMS[name], mode="immediate_async", thresholds=None,
                      **full)
    router = SequentialRouter(make_algorithm(name, **ALGORITHMS[name]), runners)
    ref = [router.generate(p, sp, rid) for p, sp, rid in zip(PROMPTS, PEN_PARAMS, RIDS)]
    outs = runtime.run_batch(PROMPTS, PEN_PARAMS, request_ids=RIDS, concurrency=8)
    for r, o in zip(ref, outs):
        assert o.token_ids == r.token_ids and o.token_models == r.token_models, (name, o.request_id)
    assert sum(len(set(o.token_models)) > 1 for o in outs) >= 4, "must exercise handoffs"
    plain = [router.generate(p, SamplingParams(max_tokens=24), rid) for p, rid in zip(PROMPTS[:3], RIDS)]
    assert sum(a.token_ids != b.token_ids for a, b in zip(plain, ref)) >= 2   # the adjustments act


def test_logprobs_ensemble_report_the_primary(runtime, runners):
    runtime.configure(algorithm="ensemble", algorithm_kwargs=ALGORITHMS["ensemble"], mode="immediate_async",
                      thresholds=None, pending_return=True, standard_serving=False)
    check_logprobs(runtime, runners, "ensemble", ALGORITHMS["ensemble"])


@pytest.mark.parametrize("flags", [{"pending_return": True}, {"standard_serving": True}],
                         ids=["pending_return", "standard_serving"])
def test_cached_prompt_tokens(runtime, runners, flags):
    """stats["cached_prompt_tokens"]: the prompt tokens model 0 took from its prefix cache at the request's first
    admission. Rule (the block manager's): whole cached blocks only, never the block holding the last prompt token,
    so an identical repeat reports floor((prompt_len - 1) / block_size) * block_size: 32 for 37 tokens, 16 for 32.
    The count travels with the routing stats (handoffs, standard serving's Yield) and equals the reference's."""
    runtime.configure(algorithm="r2r", algorithm_kwargs=ALGORITHMS["r2r"], mode="immediate_async", thresholds=None,
                      **{"pending_return": True, "standard_serving": False, "standard_unit": "token", **flags})
    tag = 2 if flags.get("standard_serving") else 1
    prompt = [511, 500 + tag] + [(13 * j) % 500 + 1 for j in range(35)]   # a prefix no other test sends
    router = SequentialRouter(make_algorithm("r2r", **ALGORITHMS["r2r"]), runners)
    cases = [(prompt, 0), (prompt, 32), (prompt[:32], 16)]
    for k, (p, want) in enumerate(cases):
        rid = f"cache-{tag}-{k}"
        ref = router.generate(p, PARAMS, rid)
        out = asyncio.run(runtime.complete(p, PARAMS, rid))
        assert out.token_ids == ref.token_ids
        assert out.stats["cached_prompt_tokens"] == ref.stats.to_dict()["cached_prompt_tokens"] == want, k
        assert 1 in out.token_models, "the count must survive handoffs"


def test_killed_subserver_fails_requests_then_serves_again(runtime, runners):
    """Last in the module: kills model 1 mid-flight; in-flight requests fail fast with a clear error, the runtime
    restarts the sub-server by itself and serves (correctly) again."""
    runtime.configure(algorithm="r2r", algorithm_kwargs=ALGORITHMS["r2r"], mode="delayed_async", thresholds=None,
                      pending_return=True, standard_serving=False)
    victim = runtime.pids[1]

    async def doomed(i):
        try:
            async for _ in runtime.generate(PROMPTS[i], SamplingParams(max_tokens=4000 // 16), request_id=f"k{i}"):
                pass
        except ModelUnavailable as exc:
            assert exc.model == 1
            return time.monotonic(), str(exc)
        return time.monotonic(), "finished"

    async def go():
        tasks = [asyncio.create_task(doomed(i)) for i in range(4)]
        await asyncio.sleep(0.3)
        t_kill = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        return t_kill, await asyncio.wait_for(asyncio.gather(*tasks), 30)
    t_kill, results = asyncio.run(go())
    failed = [(t, m) for t, m in results if m != "finished"]
    assert failed, results
    for t, m in failed:
        assert "model 1" in m and "exited" in m, m
        assert t - t_kill < 5.0
    deadline = time.monotonic() + 240
    while not all(st.ready for st in runtime._models):
        assert time.monotonic() < deadline, runtime.events
        time.sleep(0.2)
    assert runtime.pids[1] != victim
    check_equal(runtime, runners, "r2r", ALGORITHMS["r2r"], 8)
    st, busy = _settled(runtime)
    assert not busy, busy
