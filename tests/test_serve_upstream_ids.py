"""The tier in front of upstreams that answer token IDs only (`tokenplane serve --upstream URL --upstream-token-ids`,
for engines started with `--skip-tokenizer-init`): the tier decodes the answer's IDs into text with its own
tokenizer, matches stop strings itself and ends the upstream request on one, and counts usage when it ended the
answer.

The upstream is a small real HTTP server speaking vLLM's ID-only completion stream: text always empty, each chunk's
token written as an ID in its logprobs (`logprobs: 0` + `return_tokens_as_token_ids`: "token_id:N"), or, asked with
`return_token_ids`, carried as `token_ids` with the prompt's IDs echoed in the first chunk. The campaign test against
a real vLLM started with --skip-tokenizer-init is in test_tier_vllm.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from servers import ThreadServer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

import tokenplane
from tokenplane.serve.app import create_app
from tokenplane.serve.config import Limits
from tokenplane.serve.text_stream import TextStream
from tokenplane.serve.upstream import UpstreamPool

ANSWER = "Hi <think>ok</think> \U0001f389 naïve STOP rest of it"


def vllm_logprobs(t: int, k: int) -> dict[int, float]:
    """vLLM's logprob dict for a sampled token t asked with k top logprobs: the sampled token first, then the k most
    likely (here t-1..t-k, or t itself among them when it is even: then the dict holds k entries)."""
    d = {t: -0.5}
    for j in range(k):
        x = t - j if t % 2 == 0 else t - j - 1
        d[x] = -0.5 if x == t else -1.0 - j
    return d


class IdOnlyEngine:
    """vLLM with --skip-tokenizer-init, as seen over HTTP: answers `reply` one token per chunk, text always empty."""

    def __init__(self, reply: list[int], delay_s: float = 0.0, mode: str = "asked") -> None:
        # mode: "asked" answers the way the request asks; "token_ids" always sends `token_ids` (and the prompt
        # echo); "text_tokens" writes text, not IDs, in logprobs (an upstream that has its tokenizer after all)
        self.reply, self.delay_s, self.mode = reply, delay_s, mode
        self.bodies: list[dict[str, Any]] = []
        self.completed: list[bool] = []
        self.app = Starlette(routes=[Route("/v1/models", self.models), Route("/v1/completions", self.completions,
                                                                            methods=["POST"])])

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "ids-engine", "object": "model",
                                                         "max_model_len": 1 << 20}]})

    async def completions(self, request: Request) -> Any:
        body = json.loads(await request.body())
        self.bodies.append(body)
        as_logprobs = body.get("logprobs") is not None and body.get("return_tokens_as_token_ids")
        as_ids = body.get("return_token_ids") or self.mode == "token_ids"
        as_logprobs = as_logprobs and self.mode != "token_ids"
        prefix = "tok" if self.mode == "text_tokens" else "token_id:"
        if not (as_logprobs or as_ids):
            return JSONResponse({"error": {"message": "no tokenizer: ask for IDs"}}, status_code=400)
        reply = self.reply[:body.get("max_tokens") or len(self.reply)]
        stops = set(body.get("stop_token_ids") or ())
        slot = len(self.completed)
        self.completed.append(False)

        def chunk(i: int, t: int, finish: str | None) -> bytes:
            c: dict[str, Any] = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish,
                                 "stop_reason": None}
            if as_logprobs:
                k = body["logprobs"]
                top = dict(list(vllm_logprobs(t, k).items())[:k + 1])   # vLLM's HTTP server: top k + the sampled
                c["logprobs"] = {"text_offset": [0], "token_logprobs": [-0.5], "tokens": [f"{prefix}{t}"],
                                 "top_logprobs": [{f"{prefix}{x}": v for x, v in top.items()}]}
            if as_ids:
                c.update(token_ids=[t], prompt_token_ids=body["prompt"] if i == 0 else None)
            return b"data: " + json.dumps({"id": "cmpl-x", "object": "text_completion", "created": 1,
                                           "model": "ids-engine", "choices": [c]}).encode() + b"\n\n"

        async def events() -> Any:
            n = 0
            for i, t in enumerate(reply):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                n += 1
                end = t in stops or i == len(reply) - 1
                yield chunk(i, t, None if not end else "stop" if t in stops else "length")
                if end:
                    break
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                     "total_tokens": len(body["prompt"]) + n}
            yield b"data: " + json.dumps({"id": "cmpl-x", "object": "text_completion", "created": 1,
                                          "model": "ids-engine", "choices": [], "usage": usage}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
            self.completed[slot] = True
        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def tok():
    return tokenplane.load("qwen3")


def reply_ids(tok) -> list[int]:
    return [int(t) for t in (*tok.encode(ANSWER, allowed_special="all"), tok.specials["<|im_end|>"],
                             *tok.encode(" after"))]


def tier(tok, url: str) -> ThreadServer:
    return ThreadServer(create_app(None, tok, model_name="tier", upstream=UpstreamPool([url], answers_ids=True),
                                   limits=Limits(max_prompt_chars=1 << 20)))


def test_decode_skips_only_the_tokens_marked_special(tok):
    """skip_special_tokens drops the added tokens the file marks special, as HF and vLLM do: qwen3's <think> is
    added but not special, so it stays in the text; <|im_end|> does not."""
    assert tok.specials["<|im_end|>"] in tok.decode_skipped
    assert tok.specials["<think>"] not in tok.decode_skipped
    assert tok.specials["<tool_call>"] not in tok.decode_skipped
    ids = tok.encode("a<think>b</think><|im_end|>", allowed_special="all")
    assert TextStream(tok).push(ids) == "a<think>b</think>"
    cl = tokenplane.load("cl100k_base")   # tiktoken families: every special is skipped
    assert cl.decode_skipped == frozenset(cl.specials.values())


def test_streamed_answer_is_decoded_here_and_the_echo_dropped(tok):
    engine = IdOnlyEngine(reply_ids(tok))
    with ThreadServer(engine.app) as up, tier(tok, up.url) as t:
        client = openai.OpenAI(base_url=t.url + "/v1", api_key="x")
        stream = client.chat.completions.create(model="tier", messages=[{"role": "user", "content": "hello"}],
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ANSWER                                   # <think> kept, <|im_end|> skipped, 🎉 whole
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == ["stop"]                               # the end-of-turn token, as the upstream said
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == len(tok.encode(ANSWER, allowed_special="all")) + 1
        raw = httpx.post(t.url + "/v1/completions", json={"model": "tier", "prompt": "hi", "stream": True},
                         timeout=30).text
        assert "token_id" not in raw and "usage" not in raw   # no IDs; no usage chunk the client did not ask for
        assert all(json.loads(line[6:])["choices"][0]["logprobs"] is None
                   for line in raw.splitlines() if line.startswith("data: {"))
    body = engine.bodies[0]
    assert body["logprobs"] == 0 and body["return_tokens_as_token_ids"] is True   # IDs without the prompt's echo
    assert "return_token_ids" not in body and body["stream"] is True and "stop" not in body
    assert tok.specials["<|im_end|>"] in body["stop_token_ids"]   # the template's end of turn, matched upstream


def test_stop_string_ends_the_answer_and_the_upstream_request(tok):
    engine = IdOnlyEngine(reply_ids(tok), delay_s=0.02)
    cut = ANSWER[:ANSWER.index("STOP")]
    with ThreadServer(engine.app) as up, tier(tok, up.url) as t:
        client = openai.OpenAI(base_url=t.url + "/v1", api_key="x")
        chunks = list(client.completions.create(model="tier", prompt="hello", stop=["STOP", "zzz"], stream=True,
                                                stream_options={"include_usage": True}, max_tokens=64))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == cut
        ends = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(ends) == 1 and ends[0].finish_reason == "stop"
        upto = len(tok.encode(cut + "STOP", allowed_special="all"))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens in (upto - 1, upto, upto + 1)
        assert chunks[-1].usage.prompt_tokens == len(tok.encode("hello"))
        # non-streaming: gathered from the upstream's stream, cut at the same place
        whole = client.completions.create(model="tier", prompt="hello", stop="STOP", max_tokens=64)
        assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
        kept = client.completions.create(model="tier", prompt="hello", stop="STOP", max_tokens=64,
                                         extra_body={"include_stop_str_in_output": True})
        assert kept.choices[0].text == cut + "STOP"          # vLLM's option, applied where the tier cuts
        chat = client.chat.completions.create(model="tier", messages=[{"role": "user", "content": "hello"}])
        assert chat.choices[0].message.content == ANSWER and chat.usage is not None
        import time
        time.sleep(0.5)
    assert engine.completed[0] is False and engine.completed[1] is False   # closed on the stop string
    assert engine.completed[3] is True


def expected_logprobs(tok, ids: list[int], tops: list[dict[int, float]]) -> dict[str, Any]:
    """Completion logprobs as the tier writes them: each token as its bytes decoded alone, offsets summed."""
    def text(t: int) -> str:
        return tok.decode_bytes([t]).decode("utf-8", "replace")
    offsets, n = [], 0
    for t in ids:
        offsets.append(n)
        n += len(text(t))
    return {"tokens": [text(t) for t in ids], "token_logprobs": [-0.5] * len(ids), "text_offset": offsets,
            "top_logprobs": [{text(x): v for x, v in top.items()} for top in tops]}


def test_logprobs_come_back_as_text(tok):
    """Logprobs through an ID-only upstream: asked with the client's count, answered in the token-ID form, written
    here as text (tokens, top-logprob keys, text offsets), streamed and not, completions and chat."""
    reply = reply_ids(tok)
    engine = IdOnlyEngine(reply)
    with ThreadServer(engine.app) as up, tier(tok, up.url) as t:
        client = openai.OpenAI(base_url=t.url + "/v1", api_key="x")
        whole = client.completions.create(model="tier", prompt="hi", logprobs=2, max_tokens=40)
        n = whole.usage.completion_tokens
        want = expected_logprobs(tok, reply[:n], [dict(list(vllm_logprobs(x, 2).items())[:3]) for x in reply[:n]])
        assert whole.choices[0].logprobs.model_dump() == want
        assert engine.bodies[-1]["logprobs"] == 2
        streamed = list(client.completions.create(model="tier", prompt="hi", logprobs=2, max_tokens=40,
                                                  stream=True))
        got: dict[str, list[Any]] = {k: [] for k in want}
        for c in streamed:
            for k, v in (c.choices[0].logprobs.model_dump() if c.choices and c.choices[0].logprobs else {}).items():
                got[k] += v
        assert got == want
        chat = client.chat.completions.create(model="tier", messages=[{"role": "user", "content": "hi"}],
                                              logprobs=True, top_logprobs=1, max_tokens=40)
        assert engine.bodies[-1]["logprobs"] == 1
        m = chat.usage.completion_tokens
        want_chat = expected_logprobs(tok, reply[:m], [dict(list(vllm_logprobs(x, 1).items())[:2])
                                                       for x in reply[:m]])
        content = chat.choices[0].logprobs.content
        assert [e.token for e in content] == want_chat["tokens"]
        assert [e.bytes for e in content] == [list(x.encode()) for x in want_chat["tokens"]]
        assert [{e2.token: e2.logprob for e2 in e.top_logprobs} for e in content] == want_chat["top_logprobs"]
        plain = client.chat.completions.create(model="tier", messages=[{"role": "user", "content": "hi"}])
        assert plain.choices[0].logprobs is None and engine.bodies[-1]["logprobs"] == 0


def test_token_ids_field_is_read_too(tok):
    """An upstream that answers `token_ids` (vLLM's return_token_ids, with the prompt echo) decodes the same."""
    engine = IdOnlyEngine(reply_ids(tok), mode="token_ids")
    with ThreadServer(engine.app) as up, tier(tok, up.url) as t:
        client = openai.OpenAI(base_url=t.url + "/v1", api_key="x")
        chat = client.chat.completions.create(model="tier", messages=[{"role": "user", "content": "hello"}])
        assert chat.choices[0].message.content == ANSWER


def test_upstream_without_ids_is_a_502(tok):
    """An upstream that has its tokenizer after all writes text tokens in logprobs: told as the upstream's fault,
    streamed (an error event, then [DONE]) and not."""
    engine = IdOnlyEngine(reply_ids(tok), mode="text_tokens")
    with ThreadServer(engine.app) as up, tier(tok, up.url) as t:
        r = httpx.post(t.url + "/v1/completions", json={"model": "tier", "prompt": "hi"}, timeout=30)
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
        s = httpx.post(t.url + "/v1/completions", json={"model": "tier", "prompt": "hi", "stream": True}, timeout=30)
        assert '"upstream_error"' in s.text and s.text.rstrip().endswith("data: [DONE]")
