"""Runtime admission control and fault handling (issue 11): request validation before registration, the bounded
queue, liveness independent of step length, hung-step kills, and a SIGKILLed model (ModelUnavailable, health, restart).

One runtime of two latency-model sub-servers serves the module (no weights: a process starts in a few seconds). The
latency model makes a step cost a + d * (extra new tokens), so a long prompt is a long prefill step on demand.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import time
from types import SimpleNamespace

import pytest

from tokenplane.engine.sampler import SamplingParams
from tokenplane.route.errors import ModelUnavailable, Overloaded, RequestFailed, RequestRejected
from tokenplane.route.runtime import ModelState, Runtime, RuntimeConfig

PREFILL_S_PER_TOKEN = 0.01          # d: 250 prompt tokens -> a 2.5 s step
SOURCES = [{"latency": {"a": 0.001, "d": PREFILL_S_PER_TOKEN}, "seed": m} for m in range(2)]
ALG = {"mode": "synthetic", "seed": 9, "rates": {"switch": 0.2, "return": 0.4}}


@pytest.fixture(scope="module")
def rt():
    cfg = RuntimeConfig(models=SOURCES, runner="latency-model", algorithm="r_stitch", algorithm_kwargs=ALG,
                        num_blocks=64, mode="immediate_async", heartbeat_s=0.1, heartbeat_timeout_s=1.0,
                        max_num_batched_tokens=4096, max_num_seqs=4, max_queued=2, step_timeout_s=None)
    runtime = Runtime(cfg)
    yield runtime
    runtime.shutdown()


def _params(**kw):
    """Sampling fields as a client could send them (SamplingParams itself refuses some of these)."""
    d = dict(temperature=0.0, top_p=1.0, max_tokens=8, seed=None, stop_token_ids=(), ignore_eos=False)
    d.update(kw)
    return SimpleNamespace(**d)


@pytest.mark.parametrize("kw,param", [
    ({"seed": 2**70}, "seed"), ({"seed": -1}, "seed"), ({"max_tokens": 2**64}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"), ({"top_p": math.nan}, "top_p"), ({"top_p": 0.0}, "top_p"),
    ({"stop_token_ids": (-5,)}, "stop_token_ids"),
    ({"top_k": -2}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"min_p": math.nan}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"), ({"frequency_penalty": -math.inf}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
    ({"logit_bias": ((3, math.nan),)}, "logit_bias"),
    ({"max_tokens": 1022}, "max_tokens"),          # 3 + 1022 tokens > the 64 x 16 = 1024-token pool
])
def test_bad_fields_are_rejected_before_registration(rt, kw, param):
    with pytest.raises(RequestRejected) as ei:
        asyncio.run(rt.complete([1, 2, 3], _params(**kw)))
    assert ei.value.param == param and isinstance(ei.value, ValueError)
    assert not rt._live
    if kw.get("max_tokens") == 1022:
        assert "1025 tokens" in str(ei.value) and "1024" in str(ei.value) and rt.max_request_tokens == 1024


def test_bad_prompts_and_duplicate_ids(rt):
    for prompt in ([], [1, -2], ["x"]):
        with pytest.raises(RequestRejected) as ei:
            asyncio.run(rt.complete(prompt, SamplingParams(max_tokens=2)))
        assert ei.value.param == "prompt"
    assert not rt._live
    out = asyncio.run(rt.complete([5, 6, 7], SamplingParams(max_tokens=3)))   # still serving
    assert len(out.token_ids) == 3 and not rt._live


def test_registration_is_exception_safe(rt, monkeypatch):
    """A failure between registering and returning (here: the send to the home model) leaves nothing live."""
    def boom(m, msg):
        raise RuntimeError("send failed")
    monkeypatch.setattr(rt, "_send_client", boom)
    with pytest.raises(RuntimeError, match="send failed"):
        asyncio.run(rt.complete([1, 2, 3], SamplingParams(max_tokens=2), request_id="boom"))
    assert not rt._live


def test_overloaded_before_registration(rt):
    """max_num_seqs 4 + max_queued 2: the 7th live request is refused at once, and nothing of it is registered."""
    async def consume(i):
        async for c in rt.generate([9] * 20, SamplingParams(max_tokens=200), request_id=f"ov{i}"):
            if c.finish_reason is not None:
                return c.finish_reason

    async def go():
        tasks = [asyncio.create_task(consume(i)) for i in range(6)]
        await asyncio.sleep(0.05)
        assert rt.num_live == 6
        with pytest.raises(Overloaded) as ei:
            await rt.complete([1, 2], SamplingParams(max_tokens=2), request_id="ov-extra")
        assert ei.value.retry_after_s > 0 and "ov-extra" not in rt._live
        for i in range(6):
            rt.abort(f"ov{i}")
        assert await asyncio.gather(*tasks) == ["abort"] * 6
    asyncio.run(go())
    deadline = time.monotonic() + 5
    while rt.num_live and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rt.num_live == 0


def test_step_longer_than_heartbeat_timeout_is_not_killed(rt):
    """A 2.5 s prefill step with heartbeat_timeout_s 1.0: the heartbeat thread keeps the model alive."""
    pids = rt.pids
    t = time.monotonic()
    out = asyncio.run(rt.complete([3] * 250, SamplingParams(max_tokens=4)))
    assert time.monotonic() - t > 2.0 and len(out.token_ids) == 4
    assert rt.pids == pids and not rt.events, rt.events
    assert all(h.state == ModelState.READY and h.restarts == 0 for h in rt.health())


def _wait_ready(rt, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not all(h.state == ModelState.READY for h in rt.health()):
        assert time.monotonic() < deadline, rt.events
        time.sleep(0.05)


def test_hung_step_is_killed_and_logged(rt, caplog):
    """step_timeout_s 1.0 (set on the live config the supervisor reads) and a 2.5 s step: the model is killed, the
    reason is logged at ERROR on tokenplane.route, the request fails with ModelUnavailable, the model restarts."""
    rt.config.step_timeout_s = 1.0
    try:
        with caplog.at_level(logging.ERROR, logger="tokenplane.route"):
            with pytest.raises(ModelUnavailable) as ei:
                asyncio.run(rt.complete([4] * 250, SamplingParams(max_tokens=4)))
        # The home model's prefill is the long step; a routed peer catching up the same prompt can be as long.
        killed = ei.value.model
        assert killed in (0, 1) and "step_timeout_s" in str(ei.value), str(ei.value)
        assert any("hung step" in r.getMessage() for r in caplog.records if r.name == "tokenplane.route")
        assert not rt._live
    finally:
        rt.config.step_timeout_s = None
    _wait_ready(rt)
    h = rt.health()[killed]
    assert h.restarts == 1 and "hung step" in h.last_error and h.down_since is None


def test_sigkilled_model_fails_fast_reports_health_and_recovers(rt, caplog):
    victim = rt.pids[1]

    async def doomed(i):
        try:
            async for _ in rt.generate([i + 1] * 30, SamplingParams(max_tokens=300), request_id=f"k{i}"):
                pass
        except ModelUnavailable as exc:
            return exc
        return None

    async def go():
        tasks = [asyncio.create_task(doomed(i)) for i in range(3)]
        await asyncio.sleep(0.5)
        t_kill = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        return t_kill, await asyncio.wait_for(asyncio.gather(*tasks), 20)

    with caplog.at_level(logging.ERROR, logger="tokenplane.route"):
        t_kill, results = asyncio.run(go())
    t_failed = time.monotonic()
    assert all(isinstance(e, ModelUnavailable) and e.model == 1 for e in results), results
    assert all("model 1" in str(e) and "code -9" in str(e) for e in results)
    assert t_failed - t_kill < 3.0
    assert any("code -9" in r.getMessage() for r in caplog.records)
    # while restarting: health says so, and new requests fail fast (not at their deadline)
    h = rt.health()[1]
    assert h.state == ModelState.RESTARTING and h.down_since is not None and "code -9" in h.last_error
    t = time.monotonic()
    with pytest.raises(ModelUnavailable) as ei:
        asyncio.run(rt.complete([1, 2, 3], SamplingParams(max_tokens=2)))
    assert time.monotonic() - t < 0.5 and ei.value.model == 1 and ei.value.retry_after_s > 0
    assert isinstance(ei.value, RequestFailed) and not rt._live
    _wait_ready(rt)
    restart_s = rt._models[1].start_s
    print(f"\nrestart of a latency-model sub-server: {restart_s:.2f} s "
          f"(kill -> READY {time.monotonic() - t_kill:.2f} s)")
    h = rt.health()[1]
    assert h.pid != victim and h.restarts >= 1 and h.down_since is None
    outs = rt.run_batch([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=6), request_ids=["after0", "after1"])
    assert [len(o.token_ids) for o in outs] == [6, 6]


def _slow_sources(load_s: float) -> list[dict]:
    return [dict(src, load_s=load_s) for src in SOURCES]


def test_slow_load_that_heartbeats_is_waited_for():
    """A model whose load outlasts every silence limit (a busy machine reading weights and compiling kernels) is
    not failed while its heartbeat thread, started before the load, keeps beating: the runtime starts and serves."""
    cfg = RuntimeConfig(models=_slow_sources(3.0), runner="latency-model", algorithm="r_stitch", algorithm_kwargs=ALG,
                        num_blocks=64, mode="immediate_async", heartbeat_s=0.1, heartbeat_timeout_s=1.0,
                        step_timeout_s=None)
    t0 = time.monotonic()
    runtime = Runtime(cfg)
    try:
        assert time.monotonic() - t0 > 3.0
        assert all(st.start_s > 3.0 for st in runtime._models)
        out = asyncio.run(runtime.complete([1, 2, 3], SamplingParams(max_tokens=4)))
        assert len(out.token_ids) == 4
    finally:
        runtime.shutdown()


def test_frozen_load_is_failed_after_startup_timeout():
    """A model that stops heartbeating while it loads (here: SIGSTOPped) is killed after heartbeat_timeout_s of
    silence (startup_timeout_s when no heartbeat had come yet), and the runtime's start fails with the reason, long
    before the load would have ended."""
    import multiprocessing

    cfg = RuntimeConfig(models=_slow_sources(60.0), runner="latency-model", algorithm="r_stitch",
                        algorithm_kwargs=ALG, num_blocks=64, mode="immediate_async", heartbeat_s=0.1,
                        heartbeat_timeout_s=1.0, startup_timeout_s=10.0, step_timeout_s=None)
    stopped: list[int] = []
    before = {p.pid for p in multiprocessing.active_children()}     # (the module's runtime has models too)

    def freeze() -> None:
        end = time.monotonic() + 30
        while time.monotonic() < end and not stopped:
            kids = [p for p in multiprocessing.active_children()
                    if p.name == "tokenplane-model1" and p.pid not in before]
            if kids and kids[0].pid and time.monotonic() > t0 + 4.0:     # (loading by then: a 60 s load)
                os.kill(kids[0].pid, signal.SIGSTOP)
                stopped.append(kids[0].pid)
            time.sleep(0.05)

    import threading

    t0 = time.monotonic()
    th = threading.Thread(target=freeze, daemon=True)
    th.start()
    with pytest.raises(RuntimeError) as ei:
        Runtime(cfg)
    elapsed = time.monotonic() - t0
    th.join(5)
    assert stopped, "the sub-server was never frozen"
    assert "model 1" in str(ei.value) and "no heartbeat" in str(ei.value), str(ei.value)
    assert elapsed < 30, elapsed


def test_load_that_raises_fails_the_start_with_its_error():
    """A model whose load raises (here: a latency-model source without its latency) fails the runtime's start with
    that error, promptly: the sub-server's heartbeat thread, running since before the load, does not keep the
    failed process alive."""
    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}
    cfg = RuntimeConfig(models=[SOURCES[0], {"seed": 1}], runner="latency-model", algorithm="r_stitch",
                        algorithm_kwargs=ALG, num_blocks=64, mode="immediate_async", heartbeat_s=0.1,
                        heartbeat_timeout_s=1.0, step_timeout_s=None)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as ei:
        Runtime(cfg)
    assert "model 1 failed to start" in str(ei.value) and "latency" in str(ei.value), str(ei.value)
    assert time.monotonic() - t0 < 60
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [p for p in multiprocessing.active_children() if p.pid not in before]:
        time.sleep(0.05)
    assert not [p for p in multiprocessing.active_children() if p.pid not in before]
