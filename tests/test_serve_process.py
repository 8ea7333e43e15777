"""The HTTP server over the multi-process runtime (one process per model): a model killed under load, the KV pool's
real limit, the bounded queue. Real processes, real sockets, 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from servers import ThreadServer, wide

import tokenplane
from tokenplane.serve.app import create_app
from tokenplane.serve.backends import build_backend
from tokenplane.serve.config import Limits, ServeConfig

MODEL = "tokenplane-router"



@pytest.fixture(scope="module")
def server():
    tok = tokenplane.load("qwen3")
    cfg = ServeConfig(models=[wide("test-small"), wide("test-large")], algorithm="r_stitch",
                      parameters={"mode": "synthetic", "rates": {"switch": 0.2, "return": 0.5}}, num_blocks=64,
                      runtime={"max_num_seqs": 2, "heartbeat_timeout_s": 10.0})
    backend = build_backend(cfg, "process", tok, max_queued=2, use_cache=False)
    app = create_app(backend, tok, model_name=MODEL, limits=Limits(max_queued=2))
    with ThreadServer(app) as srv:
        yield srv.url, backend


def wait_healthy(url: str, timeout: float = 60.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if httpx.get(url + "/health", timeout=5).status_code == 200:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError("server did not become healthy")


def test_health_reports_each_model(server):
    url, _ = server
    h = httpx.get(url + "/health").json()
    assert h["status"] == "ok" and [m["state"] for m in h["models"]] == ["ready", "ready"]
    assert all(isinstance(m["pid"], int) and m["kv_blocks_total"] == 64 for m in h["models"])


def test_completion_logprobs_through_the_runtime(server):
    """Logprobs computed in the model processes (tokens of both models: r_stitch hands off) reach the client. Greedy:
    each token is its model's argmax, so its logprob is the best of its top alternatives."""
    url, _ = server
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 12
    for token_lp, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert token_lp <= 0 and 1 <= len(top) <= 2   # two ids may decode to the same text key
        assert abs(token_lp - max(top.values())) < 1e-6


def test_kv_pool_is_the_advertised_limit(server):
    url, _ = server
    limit = httpx.get(url + f"/v1/models/{MODEL}").json()["max_model_len"]
    assert limit == 64 * 16   # the pool (1,024 tokens) is smaller than the context (4,096)
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": limit})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(url + "/v1/completions", json={"prompt": [1] * 900, "max_tokens": 50, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text


def test_queue_bound_answers_429(server):
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    results: list = []

    def one():
        try:
            results.append(client.completions.create(model=MODEL, prompt="Tell me a story", max_tokens=64,
                                                      temperature=0, extra_body={"ignore_eos": True}))
        except openai.RateLimitError as exc:
            results.append(exc)
    threads = [threading.Thread(target=one) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert limited and all(int(r.response.headers["retry-after"]) >= 1 for r in limited)
    assert len(results) - len(limited) >= 4   # max_num_seqs 2 + max_queued 2 were admitted


def test_killed_model_is_reported_and_recovers(server):
    url, _ = server
    pid = httpx.get(url + "/health").json()["models"][1]["pid"]
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    events: list = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
            if len(events) == 3:
                t_kill = time.monotonic()
                os.kill(pid, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]   # the client is told: an error event, then [DONE]
    assert err["type"] == "service_unavailable" and "model 1" in err["message"]
    h = httpx.get(url + "/health")
    if h.status_code == 503:   # still restarting: degraded, with the model's state
        assert h.json()["models"][1]["state"] in ("restarting", "starting")
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "model_unavailable"
    wait_healthy(url)
    recovery = time.monotonic() - t_kill
    assert recovery < 30, recovery
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    h = httpx.get(url + "/health").json()["models"][1]
    assert h["pid"] != pid and h["restarts"] >= 0
