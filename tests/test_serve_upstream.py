"""The tokenization tier in front of upstream OpenAI-compatible engines (`tokenplane serve --upstream`): exact token
IDs reach the engine, conversations stick to one upstream (also across tier replicas), a failed upstream's
conversations move, upstream errors are passed on, a client that leaves cancels the upstream request.

The upstreams are this project's own server over a recording backend (it accepts token-ID prompts, as vLLM does)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest
from servers import ThreadServer, post_and_hang_up, streamed_chat

import tokenplane
from tokenplane.serve.app import create_app
from tokenplane.serve.backends import BackendHealth, Chunk, ModelStatus
from tokenplane.serve.chat import template_for
from tokenplane.serve.config import Limits
from tokenplane.serve.upstream import Ring, UpstreamPool

ENGINE = "engine-model"


class Engine:
    """A fake engine: records prompt IDs, answers `reply` token by token (slowly when asked), notes aborts."""
    max_model_len = 1 << 20
    vocab_size = 151_936

    def __init__(self, name: str, delay_s: float = 0.0) -> None:
        self.name, self.delay_s = name, delay_s
        self.prompts: list[list[int]] = []
        self.aborted: list[str] = []
        self.reply = [9707, 11, 1879, 0]   # "Hello, world!" in qwen3

    async def start(self) -> None:
        return None

    async def generate(self, prompt_ids: Any, params: Any, request_id: str) -> Any:
        from tokenplane.serve.errors import InvalidRequest
        if list(prompt_ids) == [5, 5, 5]:
            raise InvalidRequest("the engine refuses this prompt", param="prompt", code="engine_says_no")
        self.prompts.append(list(prompt_ids))
        for i, t in enumerate(self.reply[:params.max_tokens]):
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            last = i == min(len(self.reply), params.max_tokens) - 1
            yield Chunk([t], ("length" if params.max_tokens <= len(self.reply) else "stop") if last else None,
                        {} if last else None)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def health(self) -> BackendHealth:
        return BackendHealth([ModelStatus(self.name, "ready")])

    def close(self) -> None:
        return None


@pytest.fixture(scope="module")
def tok():
    return tokenplane.load("qwen3")


def engine_server(tok, engine: Engine) -> ThreadServer:
    return ThreadServer(create_app(engine, tok, model_name=ENGINE, close_backend=False))


def tier(tok, urls: list[str], **kw) -> ThreadServer:
    pool = UpstreamPool(urls, cooldown_s=kw.pop("cooldown_s", 30.0))
    return ThreadServer(create_app(None, tok, model_name="tier", upstream=pool,
                                   limits=Limits(max_prompt_chars=1 << 22)))


def conversation(turn: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You are a careful coding agent. " * 40}]
    for k in range(turn + 1):
        msgs.append({"role": "user", "content": f"Step {k}: run `pytest -x` and report.\n" + "log line\n" * 30})
        if k < turn:
            msgs.append({"role": "assistant", "content": f"Ran it ({k}); 1 failure in test_{k}."})
    return msgs


def test_ring_is_consistent_and_balanced():
    ring = Ring(["http://a", "http://b", "http://c"])
    homes = [ring.order(f"conv-{i}")[0] for i in range(3000)]
    assert all(ring.order(f"conv-{i}")[0] == h for i, h in enumerate(homes[:50]))
    assert min(homes.count(u) for u in ("http://a", "http://b", "http://c")) > 700
    smaller = Ring(["http://a", "http://b"])   # taking c out moves only c's conversations
    assert all(smaller.order(f"conv-{i}")[0] == h for i, h in enumerate(homes) if h != "http://c")


def test_exact_ids_sticky_upstreams_two_replicas(tok):
    template = template_for(tok)
    engines = [Engine("A"), Engine("B")]
    with engine_server(tok, engines[0]) as ea, engine_server(tok, engines[1]) as eb:
        urls = [ea.url, eb.url]
        with tier(tok, urls) as t1, tier(tok, urls) as t2:
            clients = [openai.OpenAI(base_url=t.url + "/v1", api_key="x", max_retries=0) for t in (t1, t2)]
            homes: dict[str, set[str]] = {}
            # Three conversations homed on each upstream (the ports are random: six arbitrary keys all landed on one
            # upstream in ~1 run of 30, and the spread check below failed).
            ring = Ring(urls)
            keys = [f"c{i}" for i in range(200)]
            on = {u: [k for k in keys if ring.order("key:" + k)[0] == u][:3] for u in urls}
            convs = on[urls[0]] + on[urls[1]]
            for ci, conv in enumerate(convs):
                for turn in range(3):
                    msgs = conversation(turn)
                    client = clients[(ci + turn) % 2]   # turns alternate between the two tier replicas
                    out = client.chat.completions.create(model="tier", messages=msgs, max_tokens=3,
                                                         extra_body={"prompt_cache_key": conv})
                    assert out.choices[0].message.content == "Hello, world" and out.object == "chat.completion"
                    want = template.encode([(m["role"], m["content"]) for m in msgs])
                    got = [e for e in engines if e.prompts and e.prompts[-1] == want]
                    assert len(got) == 1, "the engine received exactly the IDs of a full encode"
                    homes.setdefault(conv, set()).add(got[0].name)
                    got[0].prompts.append([])   # mark consumed
                    tokn = out.model_extra["tokenization"]
                    assert tokn["reused_tokens"] + tokn["new_tokens"] == len(want)
            assert all(len(h) == 1 for h in homes.values()), homes   # sticky, across replicas too
            assert {n for h in homes.values() for n in h} == {"A", "B"}
            stream = clients[0].chat.completions.create(model="tier", messages=conversation(0), max_tokens=3,
                                                        stream=True, stream_options={"include_usage": True})
            chunks = list(stream)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello, world"
            assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == 3
            assert chunks[-1].model_extra["tokenization"]["path"] in ("session", "new_session")
            done = clients[0].completions.create(model="tier", prompt="plain text prompt", max_tokens=2)
            unnamed = create_app(None, tok, model_name="", upstream=UpstreamPool(urls))   # follows the upstream's
            with ThreadServer(unnamed) as t3:
                assert httpx.get(t3.url + "/v1/models").json()["data"][0]["id"] == ENGINE
            assert done.choices[0].text == "Hello," and done.usage.prompt_tokens == len(tok.encode("plain text "
                                                                                                    "prompt"))


def test_failed_upstream_moves_conversations_and_errors_pass_on(tok):
    a, b = Engine("A"), Engine("B")
    sa = engine_server(tok, a).__enter__()
    with engine_server(tok, b) as sb, tier(tok, [sa.url, sb.url]) as t:
        url = t.url
        keys = [f"k{i}" for i in range(12)]
        for k in keys:
            r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "prompt_cache_key": k})
            assert r.status_code == 200, r.text
        on_a = len(a.prompts)
        assert 0 < on_a < 12
        sa.__exit__(None, None, None)   # upstream A goes away
        for k in keys:
            r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "prompt_cache_key": k},
                           timeout=30)
            assert r.status_code == 200, r.text
        assert len(b.prompts) == 24 - on_a   # A's conversations moved to B; B's stayed
        h = httpx.get(url + "/health")
        assert h.status_code == 503 and {m["state"] for m in h.json()["models"]} == {"ready", "failed"}
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "stop_token_ids": [-1]})
        assert r.status_code == 400   # validated here before forwarding
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 5, 5], "max_tokens": 1})
        err = r.json()["error"]   # the engine's own 400, passed on
        assert r.status_code == 400 and err["code"] == "engine_says_no" and "refuses" in err["message"]
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 1, "temperature": 0,
                                                      "stop": ["x"] * 4, "seed": 1})
        assert r.status_code == 200


def test_client_disconnect_cancels_upstream(tok):
    slow = Engine("slow", delay_s=0.5)
    slow.reply = list(range(100, 140))
    with engine_server(tok, slow) as es, tier(tok, [es.url]) as t:
        body = {"prompt": "x" * 10, "max_tokens": 40, "stream": True}
        with httpx.stream("POST", t.url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    json.loads(line[6:])
                    break
        deadline = time.time() + 15
        while not slow.aborted and time.time() < deadline:
            time.sleep(0.05)
        assert slow.aborted, "the upstream request was not cancelled when the client left"
        # A non-streaming client that leaves cancels too.
        before = len(slow.aborted)
        post_and_hang_up(t.url, "/v1/completions", json.dumps({**body, "stream": False}).encode(), 1.0)
        deadline = time.time() + 15
        while len(slow.aborted) == before and time.time() < deadline:
            time.sleep(0.05)
        assert len(slow.aborted) > before


def test_tier_answers_vllm_tokenize_itself(tok):
    """The tier's /tokenize is its own exact encode (the IDs it would forward for that chat), and no upstream
    request is made for it."""
    engine = Engine("A")
    with engine_server(tok, engine) as up, tier(tok, [up.url]) as t:
        msgs = conversation(1)
        r = httpx.post(t.url + "/tokenize", json={"model": "tier", "messages": msgs}, timeout=30)
        assert r.status_code == 200, r.text
        ids = r.json()["tokens"]
        assert ids == template_for(tok).encode([(m["role"], m["content"]) for m in msgs])
        assert not engine.prompts
        done = httpx.post(t.url + "/v1/chat/completions", json={"model": "tier", "messages": msgs, "max_tokens": 2},
                          timeout=30)
        assert done.status_code == 200, done.text
        assert engine.prompts == [ids]       # what /tokenize answered is what the engine received
        d = httpx.post(t.url + "/detokenize", json={"tokens": ids[:20]}, timeout=30).json()
        assert d["prompt"] == tok.decode(ids[:20])


def test_tier_renders_tools_and_parses_calls(tok):
    """Tools through the tier: rendered into the prompt it forwards (== the template's render, as the engine server
    renders them), the upstream's Hermes-style answer parsed into tool_calls, streamed and not."""
    import openai

    from tokenplane.serve.protocol import ChatCompletionRequest
    from tokenplane.serve.tool_calls import chat_extras

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    engine = Engine("A")
    engine.reply = tok.encode("Checking." + call).tolist() + [tok.specials["<|im_end|>"]]
    msgs = conversation(1)
    req = ChatCompletionRequest.model_validate({"messages": msgs, "tools": tools})
    expect = template_for(tok).encode([(m.role, m.text()) for m in req.messages],
                                      extras=chat_extras(req.messages, req.tools))
    with engine_server(tok, engine) as up, tier(tok, [up.url]) as t:
        client = openai.OpenAI(base_url=t.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tier", messages=msgs, tools=tools, max_tokens=100)
        assert engine.prompts[-1] == expect
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content == "Checking."
        assert c.message.tool_calls[0].function.name == "get_weather"
        assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris"}
        text, got, finish = streamed_chat(client, model="tier", messages=msgs, tools=tools, max_tokens=100)
        assert text == "Checking." and finish == "tool_calls" and got[0].function.name == "get_weather"
        plain = client.chat.completions.create(model="tier", messages=msgs, max_tokens=100)   # no tools: text
        assert not plain.choices[0].message.tool_calls and call in plain.choices[0].message.content
