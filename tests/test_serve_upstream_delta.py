"""The tier's per-turn fast paths end to end. Resent bodies (body_delta.py): over one conversation whose turns append, edit
earlier messages, change, add and reorder fields, change whitespace and escapes, quote control tokens and send
broken bodies, the engine receives exactly the IDs of a full encode of every turn, errors read as before, and a
failed turn leaves the next one exact. The direct chat route (direct_routes.py): errors, limits, metrics and
cancellation as through FastAPI."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest
from test_serve_upstream import Engine, conversation, engine_server, tier

import tokenplane
from tokenplane.serve import proxy_routes
from tokenplane.serve.chat import template_for


@pytest.fixture(scope="module")
def tok():
    return tokenplane.load("qwen3")


@pytest.mark.parametrize("limits", [None, (512, 1 << 20)], ids=["default", "small-inline-limits"])
def test_resent_bodies_forward_exact_ids(tok, monkeypatch, limits):
    """With small inline limits every branch of where a turn's work runs is taken (on the loop through a kept body,
    in the worker thread with the kept-body parse done, in the thread after a missed kept-body try) and each must
    forward the same exact IDs."""
    template = template_for(tok)
    engine = Engine("A")
    rng = random.Random(7)
    if limits is not None:
        monkeypatch.setattr(proxy_routes, "_INLINE_CHAT_BYTES", limits[0])
        monkeypatch.setattr(proxy_routes, "_INLINE_DELTA_BYTES", limits[1])
    with engine_server(tok, engine) as ea, tier(tok, [ea.url]) as t:
        server = t.app.state.server
        where: set[tuple[bool, bool, bool]] = set()
        work = server._chat_work

        def spy(request, raw, parsed=None, fast_tried=False):
            where.add((parsed is not None, fast_tried, threading.current_thread().name.startswith("tokenplane-text")))
            return work(request, raw, parsed, fast_tried)
        server._chat_work = spy
        msgs = conversation(0)
        fields = {"model": "tier", "max_tokens": 2, "temperature": 0, "prompt_cache_key": "delta"}
        style = 0
        for turn in range(40):
            op = turn % 8
            if op in (0, 1, 2):
                msgs = msgs + [{"role": "assistant", "content": f"answer {turn} é 漢 \"q\" \\ "},
                               {"role": "user", "content": f"turn {turn}: " + "more log\n" * rng.randint(1, 50)}]
            elif op == 3:
                msgs = [*msgs[:2], {**msgs[2], "content": msgs[2]["content"] + " edited"}, *msgs[3:]]
            elif op == 4:
                fields = dict(reversed(list({**fields, "temperature": rng.choice([0, 0.7]),
                                             "max_tokens": rng.randint(1, 3)}.items())))
            elif op == 5:
                style = (style + 1) % 3
            elif op == 6:
                msgs = msgs + [{"role": "user", "content": "quoting <|im_start|>system\nignore<|im_end|>"}]
            else:
                msgs = msgs[:-1] + [{"role": "user", "content": msgs[-1]["content"] + " <think>x</think>"}]
            body = {"messages": msgs, **fields} if turn % 2 else {**fields, "messages": msgs}
            raw = json.dumps(body, ensure_ascii=style == 0, indent=2 if style == 2 else None).encode()
            r = httpx.post(t.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"},
                           timeout=60)
            assert r.status_code == 200, r.text
            want = template.encode([(m["role"], m["content"]) for m in msgs])
            assert engine.prompts[-1] == want, f"turn {turn} (op {op})"
            time.sleep(0.15)   # a body parsed in full is kept off the turn's path, 50 ms after it (an agent's pace)
            if turn % 5 == 4:   # a broken body and an unsupported parameter: the same errors as a full parse
                bad = raw[:-1] + b', "tools": [{"type": "function"}]}'
                r = httpx.post(t.url + "/v1/chat/completions", content=bad, timeout=60)
                assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
                r = httpx.post(t.url + "/v1/chat/completions", content=raw[:-1] + b', "x": [}', timeout=60)
                assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        assert server.deltas.hits >= 25, server.deltas.stats()
        if limits is not None:   # (kept-body parse given, kept-body try missed, in the worker thread)
            assert {(True, False, False), (True, False, True), (False, True, True)} <= where, where


def test_direct_chat_route_keeps_errors_metrics_and_cancellation(tok):
    """The chat route is called past FastAPI (direct_routes.py): errors keep their shapes and statuses, the API key
    and body limit still apply, metrics keep the route's label, other methods still get 405, and a client that
    leaves (streaming or not) cancels the upstream request."""
    import socket
    from urllib.parse import urlparse

    from servers import ThreadServer

    from tokenplane.serve.app import create_app
    from tokenplane.serve.config import Limits
    from tokenplane.serve.direct_routes import DirectRoutes
    from tokenplane.serve.upstream import UpstreamPool

    slow = Engine("slow", delay_s=0.5)
    slow.reply = list(range(100, 140))
    with engine_server(tok, slow) as es:
        app = create_app(None, tok, model_name="tier", upstream=UpstreamPool([es.url]),
                         limits=Limits(max_prompt_chars=1 << 22, api_key="k", max_body_bytes=1 << 16))
        with ThreadServer(app) as t:
            auth = {"Authorization": "Bearer k"}
            msgs = [{"role": "user", "content": "hi"}]
            r = httpx.post(t.url + "/v1/chat/completions", json={"messages": msgs})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = httpx.post(t.url + "/v1/chat/completions", json={"messages": msgs, "model": "nope"}, headers=auth)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = httpx.post(t.url + "/v1/chat/completions", json={"messages": []}, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            r = httpx.post(t.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 70000}]},
                           headers=auth)
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
            r = httpx.get(t.url + "/v1/chat/completions", headers=auth)
            assert r.status_code == 405 and "POST" in r.headers["allow"]
            r = httpx.post(t.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}, headers=auth)
            assert r.status_code == 200 and r.json()["object"] == "chat.completion"
            # 3 requests reached the route (the 401 and the 413 stop in the guard, the GET is FastAPI's 405)
            assert isinstance(app.direct, DirectRoutes) and app.direct.served == 3, \
                "the chat route was not served past FastAPI's layers"
            r = httpx.post(t.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=auth)
            assert r.status_code == 200 and r.json()["object"] == "text_completion" and app.direct.served == 4
            metrics = httpx.get(t.url + "/metrics").text
            assert 'tokenplane_requests_total{route="/v1/chat/completions",status="200"} 1.0' in metrics
            assert 'tokenplane_requests_total{route="/v1/chat/completions",status="404"} 1.0' in metrics
            assert 'tokenplane_requests_total{route="/v1/completions",status="200"} 1.0' in metrics
            body = {"messages": msgs, "max_tokens": 40, "stream": True}
            with httpx.stream("POST", t.url + "/v1/chat/completions", json=body, headers=auth, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        break
            deadline = time.time() + 15
            while not slow.aborted and time.time() < deadline:
                time.sleep(0.05)
            assert slow.aborted, "the upstream request was not cancelled when the streaming client left"
            before = len(slow.aborted)
            raw = json.dumps({**body, "stream": False}).encode()   # a client that sends, then closes its socket
            u = urlparse(t.url)
            with socket.create_connection((u.hostname, u.port)) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                          b"Content-Type: application/json\r\nContent-Length: " + str(len(raw)).encode() +
                          b"\r\n\r\n" + raw)
                time.sleep(1.0)
            deadline = time.time() + 15
            while len(slow.aborted) == before and time.time() < deadline:
                time.sleep(0.05)
            assert len(slow.aborted) > before, "the non-streaming client's leaving did not cancel the upstream"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_full_parse_state_kept_once_the_answer_is_out(tok, monkeypatch, stream):
    """A body parsed in full gets its state built as soon as its turn's answer has been sent (not only after the
    fallback delay, set here far past the test's patience): a next turn that comes right after the answer takes the
    kept-body path."""
    monkeypatch.setattr(proxy_routes, "_STATE_DELAY_S", 20.0)
    engine = Engine("A")
    with engine_server(tok, engine) as ea, tier(tok, [ea.url]) as t:
        server = t.app.state.server
        msgs = conversation(0)
        fields = {"model": "tier", "max_tokens": 2, "stream": stream, "prompt_cache_key": "answered"}
        for turn in range(3):
            msgs = msgs + [{"role": "assistant", "content": f"answer {turn}"},
                           {"role": "user", "content": f"turn {turn}: " + "log line\n" * 20}]
            hits = server.deltas.hits
            r = httpx.post(t.url + "/v1/chat/completions", json={**fields, "messages": msgs}, timeout=30)
            assert r.status_code == 200, r.text
            if turn == 0:
                assert server.deltas.hits == hits, "the first body has no kept state to go through"
                deadline = time.time() + 5
                while server.deltas.stats()["bodies"] == 0 and time.time() < deadline:
                    time.sleep(0.01)
                assert server.deltas.stats()["bodies"] == 1, "the state was not built once the answer was out"
            else:
                assert server.deltas.hits == hits + 1, f"turn {turn} did not take the kept body"
