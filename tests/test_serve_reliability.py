"""Regression tests for the serving defects found by driving the server as operators do (issue 11), on a real
uvicorn server on 127.0.0.1 with the in-process backend. The process backend's faults (crash, long prefill, KV
admission) are in test_serve_process.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from servers import ThreadServer, spy_backend_class, wide

import tokenplane
from tokenplane.serve.app import create_app
from tokenplane.serve.backends import Chunk, InProcessBackend, build_router
from tokenplane.serve.config import Limits, ServeConfig

MODEL = "tokenplane-router"



pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: 1 torch thread for the module


@pytest.fixture(scope="module")
def tokenizer():
    return tokenplane.load("qwen3")


@pytest.fixture(scope="module")
def router(tokenizer):
    cfg = ServeConfig(models=[wide("test-small"), wide("test-large")], algorithm="r_stitch",
                      parameters={"mode": "synthetic", "rates": {"switch": 0.3, "return": 0.5}}, num_blocks=256)
    return build_router(cfg, tokenizer, use_cache=False)


SpyBackend = spy_backend_class()


LIMITS = Limits(max_body_bytes=8 << 20, max_prompt_chars=3 << 20, session_bytes=400_000, max_queued=1)


@pytest.fixture(scope="module")
def server(router, tokenizer):
    backend = SpyBackend(router, max_queued=LIMITS.max_queued)
    app = create_app(backend, tokenizer, model_name=MODEL, close_backend=False, limits=LIMITS)
    with ThreadServer(app) as srv:
        yield srv.url, backend


def post(url: str, path: str, body, timeout: float = 60, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=timeout,
                      **kw)


def is_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} or set(err) >= {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


# -- 1. stop strings: limits, linear matching ------------------------------------------------------------------------
def test_huge_stop_string_is_400_and_fast(server):
    url, _ = server
    t0 = time.perf_counter()
    r = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 8, "stop": "ab" * 500_000})
    assert time.perf_counter() - t0 < 5
    assert is_openai_error(r, 400)["param"] == "stop"
    r = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 4, "stop": ["a", "b", "c", "d", "e"]})
    assert is_openai_error(r, 400)["param"] == "stop"


def test_longest_allowed_stop_strings_cost_little(server):
    url, _ = server
    stops = ["ab" * 512, "ba" * 512, "x" * 1024, "y" * 1024]
    # the module's first decode compiles the engine's and router's numba kernels (a fresh clone has no numba cache:
    # 20-30 s on a loaded 2-core machine, over 60 s while the other test worker compiles kernels of its own), which
    # is not what this test times; a timed-out first request would stay live and fail every test after it
    r = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 0}, timeout=300)
    assert r.status_code == 200, r.text
    t0 = time.perf_counter()
    r = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 24, "temperature": 0, "stop": stops})
    assert r.status_code == 200, r.text
    assert time.perf_counter() - t0 < 30


# -- 6. every field validated before anything is registered --------------------------------------------------------
@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "x", "seed": 1180591620717411303424}', "seed"),             # 2**70
    (b'{"prompt": "x", "max_tokens": 18446744073709551616}', "max_tokens"),    # 2**64
    (b'{"prompt": "x", "top_p": NaN}', None),
    (b'{"prompt": "x", "temperature": NaN}', None),
    (b'{"prompt": "x", "temperature": Infinity}', None),
    (b'{"prompt": "x", "temperature": 1e999}', "temperature"),
    (b'{"prompt": "x", "n": 1000}', "n"),
    (b'{"prompt": "x", "echo": true}', "echo"),
    (b'{"prompt": "x", "best_of": 3}', "best_of"),
    (b'{"prompt": "x", "logit_bias": {"a5": 1}}', "logit_bias"),
    (b'{"prompt": "x", "logit_bias": {"5": 101}}', "logit_bias"),
    (b'{"prompt": "x", "logit_bias": {"5": "1"}}', "logit_bias"),
    (b'{"prompt": "x", "logit_bias": {"99999999": 1}}', "logit_bias"),   # beyond the vocabulary
    (b'{"prompt": "x", "presence_penalty": 2.5}', "presence_penalty"),
    (b'{"prompt": "x", "top_k": -2}', "top_k"),
    (b'{"prompt": "x", "min_p": 1.5}', "min_p"),
    (b'{"prompt": "x", "repetition_penalty": 0}', "repetition_penalty"),
    (b'{"prompt": "x", "suffix": "y"}', "suffix"),
    (b'{"prompt": "x", "response_format": {"type": "json_object"}}', "response_format"),
    (b'{"prompt": "x", "stream": "yes"}', "stream"),
    (b'{"prompt": "a\\ud800b"}', "prompt"),
    (b'\xff\xfe{}', None),
])
def test_bad_fields_are_400(server, raw, param):
    url, backend = server
    err = is_openai_error(post(url, "/v1/completions", raw), 400)
    assert err["param"] == param, err
    assert backend.health().live_requests == 0


def test_token_ids_beyond_the_vocabulary_are_400(server):
    url, backend = server
    vocab = backend.vocab_size
    err = is_openai_error(post(url, "/v1/completions", {"prompt": [1, vocab], "max_tokens": 1}), 400)
    assert err["param"] == "prompt" and err["code"] == "token_out_of_vocabulary" and str(vocab) in err["message"]
    for ids in ([1 << 31], [-1]):   # beyond any vocabulary: refused by the schema's bounds
        assert is_openai_error(post(url, "/v1/completions", {"prompt": ids}), 400)["param"] == "prompt"
    assert post(url, "/v1/completions", {"prompt": [1, vocab - 1], "max_tokens": 1}).status_code == 200
    assert backend.health().live_requests == 0


def test_unserved_parameter_values_are_not_in_the_schema(server):
    """The OpenAPI schema offers only the served values of the parameters refused by name (a schema-driven client
    or fuzzer never builds a refused request from it), and the refusal still names the parameter. The sampling
    adjustments are served: the schema states their ranges."""
    url, _ = server
    doc = httpx.get(url + "/openapi.json").json()
    props = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"][
        "properties"]
    assert props["echo"]["const"] is False and props["best_of"]["enum"] == [None, 1]
    assert "enum" not in props["presence_penalty"] and props["logit_bias"]["maxProperties"] == 300
    assert props["logit_bias"]["propertyNames"] == {"pattern": "^[0-9]{1,10}$"}
    err = is_openai_error(post(url, "/v1/completions", {"prompt": "x", "best_of": 0}), 400)
    assert err["param"] == "best_of"


def test_chat_unsupported_parameters_are_named(server):
    url, _ = server
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f"}}]   # served (this template writes Hermes calls)
    for extra, name in (({"tools": tools, "tool_choice": "required"}, "tool_choice"),
                        ({"functions": [{"name": "f"}]}, "functions"),
                        ({"response_format": {"type": "json_object"}}, "response_format")):
        err = is_openai_error(post(url, "/v1/chat/completions", {"messages": msgs, **extra}), 400)
        assert err["param"] == name and name in err["message"]


def test_deeply_nested_json_is_400(server):
    url, _ = server
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/tokenize", "/v1/sessions"):
        raw = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        is_openai_error(post(url, path, raw), 400)


# -- 7. keep-alive connections survive errors ------------------------------------------------------------------------
class Exploding(InProcessBackend):
    async def generate(self, prompt_ids, params, request_id):
        raise RuntimeError("boom")
        yield Chunk([])


def test_errors_keep_connections_usable(router, tokenizer):
    app = create_app(Exploding(router), tokenizer, model_name=MODEL, close_backend=False)
    with ThreadServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert info.value.status_code == 500 and info.value.body["type"] == "server_error"
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=9)
        assert client.models.retrieve(MODEL).id == MODEL   # the pooled connection still works
        with httpx.Client(base_url=srv.url) as c:
            r = c.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 500 and r.headers.get("connection") != "close"
            first = r.extensions["network_stream"]
            r2 = c.get("/v1/models")
            assert r2.status_code == 200 and r2.extensions["network_stream"] is first   # same connection


# -- 8. CPU work off the event loop; sizes checked first -------------------------------------------------------------
def test_big_prompt_does_not_block_health(server):
    url, _ = server
    big = "word " * 500_000   # 2.5M chars: tokenized in a worker thread
    result = {}

    def send():
        result["r"] = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": big}]},
                           timeout=120)
    t = threading.Thread(target=send)
    t.start()
    worst = 0.0
    while t.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.02)
    t.join()
    assert is_openai_error(result["r"], 400)["code"] == "context_length_exceeded"
    assert worst < 2.0, f"/health took {worst:.2f} s while a prompt was tokenized"   # was 8.3 s on the loop
    too_big = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (4 << 20)}]})
    assert is_openai_error(too_big, 413)["code"] == "prompt_too_large"


def test_body_limit_applies_to_chunked_uploads(server):
    url, _ = server

    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * (1 << 20)
        yield b'"}'
    r = httpx.post(url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)
    is_openai_error(r, 413)
    r = httpx.post(url + "/v1/completions", content=b"x" * (9 << 20), headers={"content-type": "application/json"})
    is_openai_error(r, 413)


# -- 9. one error shape on every route ------------------------------------------------------------------------------
def test_one_error_shape_everywhere(server):
    url, _ = server
    is_openai_error(httpx.get(url + "/no/such/route"), 404)
    is_openai_error(httpx.put(url + "/v1/completions"), 405)
    is_openai_error(post(url, "/v1/tokenize", {"text": "a\ud800b".encode("utf-8", "surrogatepass").decode(
        "utf-8", "replace"), "bogus": 1}), 400)
    is_openai_error(post(url, "/v1/tokenize", b"{not json"), 400)
    is_openai_error(post(url, "/v1/tokenize", b'{"text": "a\\ud800b"}'), 400)
    is_openai_error(httpx.get(url + "/v1/sessions/nope"), 404)
    is_openai_error(post(url, "/v1/sessions/nope/edit", {"start": "x", "end": 1, "text": ""}), 400)
    is_openai_error(post(url, "/v1/completions", b'{"prompt": "a\\udc00"}'), 400)
    is_openai_error(httpx.get(url + "/v1/models/gpt-4"), 404)
    schema = httpx.get(url + "/openapi.json").json()
    completions = schema["paths"]["/v1/completions"]["post"]
    assert {"200", "400", "404", "413", "429", "503"} <= set(completions["responses"])
    assert "requestBody" in completions


# -- 5. queue bound, abort on disconnect for non-streaming requests --------------------------------------------------
def test_queue_full_is_429_and_disconnect_aborts(server):
    url, backend = server
    long = {"prompt": "Tell me a long story", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    before = len(backend.aborted)

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            running = asyncio.ensure_future(c.post("/v1/completions", json=long))       # holds the worker
            await asyncio.sleep(0.5)
            queued = asyncio.ensure_future(c.post("/v1/completions", json=long))        # waits (max_queued=1)
            await asyncio.sleep(0.3)
            full = await c.post("/v1/completions", json=long)
            running.cancel()                                                            # client hangs up
            queued.cancel()
            await asyncio.gather(running, queued, return_exceptions=True)
            return full
    full = asyncio.run(go())
    assert is_openai_error(full, 429)["code"] == "queue_full" and int(full.headers["retry-after"]) >= 1
    deadline = time.time() + 20
    while len(backend.aborted) < before + 2 and time.time() < deadline:
        time.sleep(0.05)
    assert len(backend.aborted) >= before + 2   # both non-streaming requests were aborted when their clients left
    t0 = time.time()
    r = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and time.time() - t0 < 20
    used = [rn.block_manager.num_used_blocks for rn in backend.router.runners]
    assert used == [0, 0], (used, backend.aborted[before:])


# -- 4. the advertised limit is the real one ----------------------------------------------------------------------
def test_kv_pool_limit_is_advertised_and_enforced(server):
    url, backend = server
    limit = httpx.get(url + "/v1/models/" + MODEL).json()["max_model_len"]
    assert limit == min(4096, 256 * 16) == backend.max_model_len
    err = is_openai_error(post(url, "/v1/completions", {"prompt": "x", "max_tokens": limit}), 400)
    assert err["code"] == "context_length_exceeded" and str(limit) in err["message"]


# -- OpenAI client: n, models, stream usage ---------------------------------------------------------------------
def test_openai_client_n_and_usage(server):
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, n=2, temperature=0.8, seed=3)
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                            stream=True, stream_options={"include_usage": True}, temperature=0)
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert [m.id for m in client.models.list()] == [MODEL]


# -- 10. API key, metrics, session budget --------------------------------------------------------------------------
def test_api_key(router, tokenizer):
    app = create_app(InProcessBackend(router), tokenizer, model_name=MODEL, close_backend=False,
                     limits=Limits(api_key="s3cret"))
    with ThreadServer(app) as srv:
        assert is_openai_error(httpx.get(srv.url + "/v1/models"), 401)["code"] == "invalid_api_key"
        bad = httpx.get(srv.url + "/v1/models", headers={"authorization": "Bearer nope"})
        assert is_openai_error(bad, 401)
        ok = httpx.get(srv.url + "/v1/models", headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens == 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_metrics(server):
    url, _ = server
    post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0})
    text = httpx.get(url + "/metrics").text
    for name in ("tokenplane_requests_total", "tokenplane_request_latency_seconds_bucket",
                 "tokenplane_time_to_first_token_seconds_count", "tokenplane_generation_tokens_total",
                 "tokenplane_kv_blocks_used", "tokenplane_requests_queued", "tokenplane_sessions",
                 "tokenplane_session_bytes", "tokenplane_routed_tokens_total", "tokenplane_model_up"):
        assert name in text, name
    assert 'route="/v1/completions",status="200"' in text


def test_session_byte_budget_evicts_lru(server):
    url, _ = server
    ids = []
    for i in range(12):
        sid = post(url, "/v1/sessions", {}).json()["id"]
        r = post(url, f"/v1/sessions/{sid}/append", {"text": f"session {i} " + "lorem ipsum " * 4000})
        assert r.status_code == 200, r.text
        ids.append(sid)
    stats = httpx.get(url + "/v1/tokenize/stats").json()
    assert stats["bytes"] <= LIMITS.session_bytes and stats["evicted"] >= 1
    assert httpx.get(url + f"/v1/sessions/{ids[-1]}").status_code == 200      # the newest survives
    assert is_openai_error(httpx.get(url + f"/v1/sessions/{ids[0]}"), 404)    # the oldest was evicted



# -- conversation sessions in the request path (issue 13, part 3) --------------------------------------------------
def test_chat_turns_reuse_the_conversation_session(server, tokenizer):
    from tokenplane.serve.chat import template_for
    url, _ = server
    template = template_for(tokenizer)
    messages = [{"role": "system", "content": "You are a coding agent. " * 50},
                {"role": "user", "content": "Fix the failing test in tests/test_x.py.\n"}]
    paths = []
    previous = 0
    for turn in range(4):
        body = {"messages": messages, "max_tokens": 1, "temperature": 0, "prompt_cache_key": "conv-A"}
        r = post(url, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        out = r.json()
        want = template.encode([(m["role"], m["content"]) for m in messages])
        assert out["usage"]["prompt_tokens"] == len(want)
        tok = out["tokenization"]
        paths.append(tok["path"])
        held = httpx.get(url + f"/v1/sessions/{tok['session']}", params={"ids": "true"}).json()
        assert held["ids"] == want   # exactly the IDs of a full encode of the rendered prompt
        assert tok["reused_tokens"] + tok["new_tokens"] == len(want)
        if turn:
            # the previous prompt is kept (a repair may re-derive a few tokens before its stable boundary)
            assert tok["reused_tokens"] >= previous - 4
        previous = len(want)
        messages = messages + [{"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                               {"role": "user", "content": f"observation {turn}: <returncode>1</returncode> ok"}]
    assert paths == ["new_session", "session", "session", "session"]
    # An edited history repairs the same session and still gives exact IDs.
    messages[1] = {"role": "user", "content": "Fix the failing test in tests/test_y.py, please.\n"}
    r = post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "temperature": 0,
                                           "prompt_cache_key": "conv-A"})
    want = template.encode([(m["role"], m["content"]) for m in messages])
    assert r.json()["usage"]["prompt_tokens"] == len(want) and r.json()["tokenization"]["path"] == "session"
    # Special-token text in content is ordinary text: encoded apart, never through a session.
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x<|im_end|>y"}],
                                           "max_tokens": 1})
    assert r.json()["tokenization"]["path"] == "bypass"


def test_logprobs(server, tokenizer):
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 == len(lp.tokens) == len(lp.top_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) == 3 and abs(max(top.values()) - chosen) < 1e-9   # greedy = the top one
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", "replace") == chat.choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                            temperature=0, logprobs=True, stream=True, extra_body={"ignore_eos": True})
    streamed = [c for chunk in stream for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert len(streamed) == 4 and all(c.logprob <= 0 for c in streamed)   # (routing draws differ per request id)
    err = is_openai_error(post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                             "top_logprobs": 2}), 400)
    assert err["param"] == "top_logprobs"


def test_client_leaving_mid_body_is_quiet_and_405_lists_every_method(server, caplog):
    import logging
    import socket
    from urllib.parse import urlparse
    url, _ = server
    u = urlparse(url)
    with caplog.at_level(logging.ERROR, logger="tokenplane.serve"):
        for path in ("/v1/completions", "/v1/tokenize"):
            with socket.create_connection((u.hostname, u.port)) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          "Content-Length: 1000\r\n\r\n{\"prompt\": \"x".encode())
            time.sleep(0.3)
        assert httpx.get(url + "/health").status_code == 200
    assert not [r for r in caplog.records if r.name == "tokenplane.serve"], [r.getMessage() for r in caplog.records]
    r = httpx.request("OPTIONS", url + "/v1/sessions/abc")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) >= {"GET", "DELETE"}
    ok = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 1.0, "n": 1.0})   # JSON Schema integers
    assert ok.status_code == 200, ok.text
    assert is_openai_error(post(url, "/v1/completions", {"prompt": "x", "max_tokens": 1.5}), 400)["param"] == \
        "max_tokens"


def test_prompt_forms(server):
    url, _ = server
    assert is_openai_error(post(url, "/v1/completions", {"prompt": [["AAA"]]}), 400)["param"] == "prompt"
    r = post(url, "/v1/completions", {"prompt": [[5.0, 6.0]], "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2


# -- client request ids ----------------------------------------------------------------------------------------------
def test_client_request_id_names_the_request_and_repeats_its_routing(server):
    """X-Request-Id (vLLM's request-id header): the response id derives from it, synthetic routing decisions keyed on
    the request id repeat for a repeated id, a malformed one is 400, and one already in flight is 409."""
    url, backend = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 24,
            "temperature": 0}
    outs = [client.chat.completions.create(**body, extra_headers={"X-Request-Id": "fixed-id-1"}) for _ in range(2)]
    assert [o.id for o in outs] == ["chatcmpl-fixed-id-1"] * 2
    routing = [(o.model_extra or {})["routing"] for o in outs]
    assert routing[0]["num_handoffs"] > 0 and routing[0]["tokens_per_model"] == routing[1]["tokens_per_model"]
    assert routing[0]["num_handoffs"] == routing[1]["num_handoffs"]
    other = client.chat.completions.create(**body)
    assert other.id.startswith("chatcmpl-") and other.id != outs[0].id
    for bad in ("", "x" * 129, "caf\u00e9", "a\tb"):
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-request-id": bad.encode("utf-8")},
                       timeout=60)
        assert is_openai_error(r, 400)["code"] == "invalid_request_id", bad
    long = {"prompt": "Tell me a long story", "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=60, headers={"x-request-id": "busy"}) as c:
            async with c.stream("POST", "/v1/completions", json=long) as first:
                assert first.status_code == 200
                again = await c.post("/v1/completions", json={**long, "stream": False})
            return again
    err = is_openai_error(asyncio.run(go()), 409)
    assert err["code"] == "duplicate_request_id" and err["param"] == "X-Request-Id"
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0},
                   headers={"x-request-id": "busy"}, timeout=60)
    assert r.status_code == 200 and r.json()["id"] == "cmpl-busy"     # free again once the first one ended
