"""HTTP front end against a real uvicorn server on 127.0.0.1 with the in-process (sequential reference) backend.

Models: the test presets widened to the Qwen3 vocabulary so real tokenizer ids are valid, random weights, R-Stitch in
calibrated mode (greedy decisions do not depend on the request id, so the server must equal a direct reference run).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from servers import spy_backend_class, wide

import tokenplane
from tokenplane.engine.sampler import SamplingParams
from tokenplane.serve.app import create_app
from tokenplane.serve.backends import InProcessBackend, build_backend, build_router
from tokenplane.serve.chat import ChatTemplate
from tokenplane.serve.config import ServeConfig
from tokenplane.serve.text_stream import TextStream

MODEL = "tokenplane-router"



SpyBackend = spy_backend_class()


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: 1 torch thread for the module


@pytest.fixture(scope="module")
def tokenizer():
    return tokenplane.load("qwen3")


@pytest.fixture(scope="module")
def router(tokenizer):
    cfg = ServeConfig(models=[wide("test-small"), wide("test-large")], algorithm="r_stitch",
                      parameters={"mode": "calibrated", "rates": {"switch": 0.3, "return": 0.5}},
                      calibration={"prompts": ["Hello there", "What is two plus two?"], "max_tokens": 6},
                      num_blocks=512)
    return build_router(cfg, tokenizer, use_cache=False)


@pytest.fixture(scope="module")
def server(router, tokenizer):
    import uvicorn
    backend = SpyBackend(router)
    app = create_app(backend, tokenizer, model_name=MODEL, close_backend=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not srv.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", backend
    srv.should_exit = True
    thread.join(timeout=10)


def post(url: str, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60, **kw)


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def reference_text(router, tokenizer, prompt_ids, max_tokens, stop_ids=()):
    out = router.generate(prompt_ids, SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_ids), "ref")
    return TextStream(tokenizer).push(out.token_ids) + "", out


def test_health_and_models(server):
    url, _ = server
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert [m["state"] for m in health.json()["models"]] == ["ready", "ready"]
    data = httpx.get(url + "/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL]
    assert data[0]["max_model_len"] == 4096


def test_sampling_adjustments_equal_reference(server, router, tokenizer):
    """logit_bias, the penalties, top_k and min_p through the official client (vLLM's extensions in extra_body)
    reach the engine: the text equals the reference router's under the same SamplingParams."""
    import openai

    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = "The quick brown fox"
    ids = tokenizer.encode(prompt).tolist()
    hello = tokenizer.encode(" hello").tolist()
    assert len(hello) == 1
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                  logit_bias={str(hello[0]): 100})
    assert r.choices[0].text == " hello" * 4
    world = tokenizer.encode(" world").tolist()
    both = {str(hello[0]): 100, str(world[0]): 100}
    # both words biased far above the rest, so the penalties decide between them (they visibly act)
    cases = [({"logit_bias": both, "presence_penalty": 0.5, "frequency_penalty": 2.0,
               "extra_body": {"repetition_penalty": 1.4}},
              SamplingParams(max_tokens=12, presence_penalty=0.5, frequency_penalty=2.0, repetition_penalty=1.4,
                             logit_bias=((hello[0], 100.0), (world[0], 100.0)))),
             ({"temperature": 0.9, "seed": 4, "extra_body": {"top_k": 6, "min_p": 0.05}},
              SamplingParams(max_tokens=12, temperature=0.9, seed=4, top_k=6, min_p=0.05))]
    texts = []
    for kw, sp in cases:
        kw = {"temperature": 0, **kw}
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **kw)
        out = router.generate(ids, sp, "ref")
        stream = TextStream(tokenizer)
        assert r.choices[0].text == stream.push(out.token_ids) + stream.flush(), kw
        texts.append(r.choices[0].text)
    assert " hello" in texts[0] and " world" in texts[0], texts[0]
    alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logit_bias=both)
    assert set(alone.choices[0].text.split()) <= {"hello", "world"} and alone.choices[0].text != texts[0]


def test_completion_equals_reference(server, router, tokenizer):
    url, _ = server
    prompt = "The quick brown fox"
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tokenizer.encode(prompt).tolist()
    out = router.generate(ids, SamplingParams(max_tokens=12), "ref")
    stream = TextStream(tokenizer)
    expected = stream.push(out.token_ids) + stream.flush()
    choice = body["choices"][0]
    assert choice["text"] == expected
    assert choice["finish_reason"] == out.finish_reason
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(out.token_ids),
                             "total_tokens": len(ids) + len(out.token_ids),
                             "prompt_tokens_details": {"cached_tokens": out.stats.cached_prompt}}
    routing = body["routing"]
    assert routing["num_tokens"] == len(out.token_ids) == sum(routing["tokens_per_model"])
    assert routing == out.stats.to_dict()


def test_completion_token_prompt(server):
    url, _ = server
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": [9707, 1879, 0], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 3


def test_chat_equals_reference(server, router, tokenizer):
    url, _ = server
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    r = post(url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tokenizer.encode("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay hi.<|im_end|>\n"
                           "<|im_start|>assistant\n", allowed_special={"<|im_start|>", "<|im_end|>"}).tolist()
    template = ChatTemplate(tokenizer)
    assert template.encode([("system", "You are terse."), ("user", "Say hi.")]) == ids
    out = router.generate(ids, SamplingParams(max_tokens=10, stop_token_ids=template.stop_token_ids), "ref")
    stream = TextStream(tokenizer)
    assert body["object"] == "chat.completion"
    content = stream.push(out.token_ids) + stream.flush()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": content}
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["routing"]["num_tokens"] == len(out.token_ids)


def test_chat_template_injection_is_ordinary_text(tokenizer):
    template = ChatTemplate(tokenizer)
    ids = template.encode([("user", "x<|im_end|>y")])
    assert ids.count(tokenizer.specials["<|im_end|>"]) == 1   # only the template's own end marker


def test_streaming_matches_non_streaming(server):
    url, _ = server
    req = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0}
    full = post(url, "/v1/completions", req).json()
    with httpx.stream("POST", url + "/v1/completions", json={**req, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert chunks[-1]["routing"] == full["routing"]
    assert all("usage" not in c for c in chunks)   # usage only when asked for, as OpenAI does
    opts = {**req, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=opts, timeout=60) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"] == full["usage"]
    assert all(e["usage"] is None for e in events[:-2])


def test_chat_streaming(server):
    url, _ = server
    req = {"model": MODEL, "messages": [{"role": "user", "content": "Count to three."}], "max_tokens": 8,
           "temperature": 0}
    full = post(url, "/v1/chat/completions", req).json()
    with httpx.stream("POST", url + "/v1/chat/completions", json={**req, "stream": True}, timeout=60) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == full["choices"][0]["message"]["content"]
    assert events[-2]["routing"]["num_tokens"] == full["usage"]["completion_tokens"]


def test_stop_string(server):
    url, _ = server
    req = {"model": MODEL, "prompt": "Numbers:", "max_tokens": 16, "temperature": 0}
    text = post(url, "/v1/completions", req).json()["choices"][0]["text"]
    cut = next((i for i in range(2, len(text) - 2) if text[i:i + 2].strip()), None)
    if cut is None:
        pytest.skip("greedy text too short to pick a stop string")
    stop = text[cut:cut + 2]
    body = post(url, "/v1/completions", {**req, "stop": [stop]}).json()
    assert body["choices"][0]["text"] == text[:text.find(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"
    kept = post(url, "/v1/completions", {**req, "stop": [stop], "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == text[:text.find(stop) + len(stop)]
    with httpx.stream("POST", url + "/v1/completions", json={**req, "stop": stop, "stream": True}, timeout=60) as r:
        events = sse_events(r)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text[:text.find(stop)]


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": [1] * 4096}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 999999]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 7}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
])
def test_bad_requests(server, path, body, status, param):
    url, _ = server
    r = post(url, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param


def test_context_error_names_the_limit(server):
    url, _ = server
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": [1] * 5000})
    assert r.status_code == 400 and "4096" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_disconnect_aborts_backend(server):
    url, backend = server
    before = len(backend.aborted)
    req = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=req, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break   # one chunk, then hang up
    deadline = time.time() + 20
    while len(backend.aborted) == before and time.time() < deadline:
        time.sleep(0.05)
    assert len(backend.aborted) == before + 1
    assert backend.aborted[-1].startswith("cmpl-")
    # The backend is free again: the next request completes (the aborted one stopped early and released its KV).
    t0 = time.time()
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert time.time() - t0 < 20
    assert all(r.block_manager.num_used_blocks == 0 for r in backend.router.runners)


def test_text_stream_utf8_and_stop(tokenizer):
    inv = {b: i for i, b in enumerate(tokenizer.reference.token_bytes)}
    e1, e2 = inv[b"\xc3"], inv[b"\xa9"]   # "é" split over two byte tokens
    s = TextStream(tokenizer)
    assert s.push([e1]) == "" and s.push([e2]) == "é"
    s = TextStream(tokenizer, stop=["ab"])
    a, b, c = inv[b"a"], inv[b"b"], inv[b"c"]
    assert s.push([c, a]) == "c"          # "a" could start the stop string: held back
    assert s.push([b]) == "" and s.stopped
    s = TextStream(tokenizer, stop=["ab"])
    assert s.push([a]) == "" and s.push([c]) == "ac" and s.flush() == ""
    assert TextStream(tokenizer).push([151900]) == ""   # a padded vocabulary row the tokenizer lacks: no text, as HF/vLLM
    # min_tokens: a stop passed before the stream is armed does not end it; one that ends after does, from where
    # it began (also when it began before)
    s = TextStream(tokenizer, stop=["ab"])
    assert s.push([a, b, c], armed=False) == "abc" and s.push([a], armed=True) == "" and s.push([b]) == ""
    assert s.stopped
    s = TextStream(tokenizer, stop=["ab"])
    assert s.push([c, a], armed=False) == "c" and s.push([b], armed=True) == "" and s.stopped
    s = TextStream(tokenizer, stop=["aa"])   # "aaaa": the stop ending at the armed token is the last two a's
    assert s.push([a, a, a], armed=False) == "a" and s.push([a], armed=True) == "a" and s.stopped
    s = TextStream(tokenizer, stop=["ab"], include_stop=True)   # vLLM's include_stop_str_in_output
    assert s.push([c, a]) == "c" and s.push([b, c]) == "ab" and s.stopped
    end = tokenizer.specials["<|im_end|>"]
    assert TextStream(tokenizer).push([a, end, b]) == "ab"
    assert TextStream(tokenizer, skip_special=False).push([a, end, b]) == "a<|im_end|>b"


def test_min_tokens_through_the_server(server, router, tokenizer):
    url, _ = server
    req = {"model": MODEL, "prompt": "Numbers:", "max_tokens": 12, "temperature": 0}
    ids = tokenizer.encode("Numbers:").tolist()
    ref = router.generate(ids, SamplingParams(max_tokens=12, min_tokens=5), "ref")
    stream = TextStream(tokenizer)
    want = stream.push(ref.token_ids) + stream.flush()
    got = post(url, "/v1/completions", {**req, "min_tokens": 5}).json()["choices"][0]
    assert got["text"] == want
    err = post(url, "/v1/completions", {**req, "min_tokens": 13}).json()["error"]
    assert err["param"] == "min_tokens"


def test_inprocess_backend_abort_before_start(router):
    backend = InProcessBackend(router)

    async def go():
        backend.abort("r1")
        return [c async for c in backend.generate([1, 2, 3], SamplingParams(max_tokens=4), "r1")]
    chunks = asyncio.run(go())
    assert [c.finish_reason for c in chunks] == ["abort"]
    backend.close()


def test_config_validation():
    with pytest.raises(ValueError, match="unknown config keys"):
        ServeConfig.from_dict({"modelz": []})
    with pytest.raises(ValueError, match="devices"):
        ServeConfig.from_dict({"models": ["a", "b"], "devices": ["cpu"]})
    assert ServeConfig.from_dict({}).models == ["smollm2-135m-instruct"] and ServeConfig().algorithm == "single"


@pytest.mark.campaign
def test_process_backend_equals_inprocess(tokenizer):
    """The multi-process Runtime behind the same HTTP layer returns what the in-process reference returns
    (greedy, float64, calibrated thresholds computed once and shipped to every model process)."""
    import uvicorn
    cfg = ServeConfig(models=[wide("test-small"), wide("test-large")], algorithm="r_stitch", dtype="float64",
                      parameters={"mode": "calibrated", "rates": {"switch": 0.3, "return": 0.5}},
                      calibration={"prompts": ["Hello there", "What is two plus two?"], "max_tokens": 6},
                      num_blocks=512)
    results = {}
    for kind in ("inprocess", "process"):
        backend = build_backend(cfg, kind, tokenizer)
        app = create_app(backend, tokenizer, model_name=MODEL)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=srv.run, daemon=True)
        thread.start()
        while not srv.started:
            assert thread.is_alive()
            time.sleep(0.05)
        try:
            url = f"http://127.0.0.1:{port}"
            out = []
            for prompt in ("The quick brown fox", "Once upon a time"):
                body = post(url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 16,
                                                     "temperature": 0}).json()
                out.append((body["choices"][0]["text"], body["usage"], body["routing"]["tokens_per_model"]))
            with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                              json={"model": MODEL, "stream": True, "max_tokens": 12, "temperature": 0,
                                    "messages": [{"role": "user", "content": "hi"}]}) as r:
                events = sse_events(r)
            out.append("".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]))
            results[kind] = out
        finally:
            srv.should_exit = True
            thread.join(timeout=30)
    assert results["process"] == results["inprocess"]


def test_cli_defaults_bind_localhost():
    import argparse

    from tokenplane.serve.cli import main_arguments
    p = argparse.ArgumentParser()
    main_arguments(p)
    args = p.parse_args([])
    assert (args.host, args.port, args.config, args.backend) == ("127.0.0.1", 8000, None, None)
    assert p.parse_args(["--backend", "inprocess"]).backend == "inprocess"


def test_vllm_tokenize_and_detokenize_routes(server, tokenizer):
    """vLLM's /tokenize and /detokenize: the IDs the completion and chat routes send to the engine (a chat's count
    equals its completion's usage.prompt_tokens), token strings, and OpenAI-shaped errors."""
    from tokenplane.serve.chat import template_for

    url, _ = server
    prompt = "The quick brown fox, naïve café 你好 <|im_start|>"
    r = post(url, "/tokenize", {"model": MODEL, "prompt": prompt, "add_special_tokens": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(prompt).tolist() and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"]
    assert "token_strs" not in body
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    pairs = [(m["role"], m["content"]) for m in msgs]
    chat = post(url, "/tokenize", {"messages": msgs, "return_token_strs": True}).json()
    template = template_for(tokenizer)
    assert chat["tokens"] == template.encode(pairs)
    assert "".join(chat["token_strs"]) == tokenizer.decode(chat["tokens"]) == template.render(pairs)
    done = post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "temperature": 0}).json()
    assert done["usage"]["prompt_tokens"] == chat["count"]
    bare = post(url, "/tokenize", {"messages": msgs, "add_generation_prompt": False}).json()
    assert bare["tokens"] == template.encode(pairs, add_generation_prompt=False)
    assert bare["count"] < chat["count"] and chat["tokens"][:bare["count"]] == bare["tokens"]
    r = post(url, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode(body["tokens"])}
    r = post(url, "/detokenize", {"tokens": [float(t) for t in body["tokens"]]})   # JSON Schema's integers: 3.0
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode(body["tokens"])}
    schema = httpx.get(url + "/openapi.json").json()["paths"]["/tokenize"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    assert [sorted(b["required"]) for b in schema["oneOf"]] == [["prompt"], ["messages"]]
    for path, bad, param in (("/tokenize", {"prompt": "x", "messages": msgs}, None),
                             ("/tokenize", {}, None),
                             ("/tokenize", b'{"prompt": "a\\udc00"}', "prompt"),
                             ("/tokenize", {"messages": msgs, "tools": [{"type": "function"}]}, "tools"),
                             ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
                             ("/detokenize", {"tokens": [1, tokenizer.n_vocab]}, "tokens"),
                             ("/detokenize", {"tokens": [-1]}, "tokens")):
        r = post(url, path, bad)
        assert r.status_code in (400, 404), (path, bad, r.text)
        err = r.json()["error"]
        assert param is None or err["param"] == param, (bad, err)
