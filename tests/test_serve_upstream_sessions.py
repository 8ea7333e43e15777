"""The tier on upstream sessions (`tokenplane serve --upstream URL --upstream-sessions`): each chat turn sends the
upstream only the token IDs its live context lacks, and the context the engine computes on is always the tier's
exact IDs for the rendered chat.

The upstream here is the real middleware (serve/vllm_plugin/tokenplane_vllm_sessions.py) mounted on a small HTTP app,
over a fake engine client that keeps a streaming-input request's context as vLLM's scheduler does
(`_update_request_as_session`: a new chunk extends the prompt so far plus the previous turn's computed output tokens,
every sampled token but the last). Each turn's context is checked against the prompt IDs a plain tier (no sessions)
forwards for the same chat. test_tier_vllm.py runs the middleware inside a real vLLM server (campaign marker)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from servers import ThreadServer
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

import tokenplane
from tokenplane.serve.app import create_app
from tokenplane.serve.config import Limits
from tokenplane.serve.upstream import UpstreamPool
from tokenplane.serve.upstream_sessions import PLUGIN_DIR

sys.path.insert(0, str(PLUGIN_DIR))
import tokenplane_vllm_sessions as plugin  # noqa: E402

WORDS = " alpha beta gamma delta epsilon zeta eta theta iota kappa lambda"
SYSTEM = "You are terse and exact. " * 60   # past conversations.BLOCK_CHARS: shorter prompts skip sessions


class FakeEngine:
    """The parts of vLLM's AsyncLLM the middleware uses, with its streaming-input semantics. Answers are words
    chosen from the context (so a different context gives a different answer) and recorded per turn."""

    def __init__(self, words: list[int], max_num_seqs: int = 8) -> None:
        self.words = words
        self.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))
        self.contexts: list[list[int]] = []      # the context each turn computed its first token on
        self.aborted: list[str] = []
        self.requests = 0

    def generate(self, inputs: Any, sp: Any, request_id: str) -> Any:
        self.requests += 1
        return self._run(inputs, request_id)

    async def _run(self, inputs: Any, request_id: str) -> Any:
        context: list[int] = []
        async for chunk in inputs:
            context += chunk.ids
            self.contexts.append(list(context))
            made = []
            for i in range(chunk.max_tokens):
                t = self.words[(sum(context) + 7 * len(context)) % len(self.words)]
                made.append(t)
                done = i == chunk.max_tokens - 1
                if not done:
                    context.append(t)     # computed: the next token is sampled after it
                await asyncio.sleep(0.002 if chunk.max_tokens > 100 else 0)   # a long answer takes time
                if request_id in self.aborted:   # vLLM ends an aborted request's stream with finish_reason "abort"
                    yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[], finish_reason="abort",
                                                                   stop_reason=None, logprobs=None)])
                    return
                yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[t], finish_reason="length" if done else None,
                                                               stop_reason=None, logprobs=None)])

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@pytest.fixture(autouse=True)
def no_vllm(monkeypatch):
    """The middleware's two calls into vLLM's own classes, without vLLM."""
    monkeypatch.setattr(plugin, "_sampling", lambda app, body, n: SimpleNamespace(max_tokens=body.get("max_tokens")
                                                                                  or 3))
    monkeypatch.setattr(plugin, "_chunk_input", lambda ids, sp: SimpleNamespace(ids=list(ids),
                                                                               max_tokens=sp.max_tokens))


class RecordingEngine:
    """A plain ID-only upstream (the tier without sessions): records each whole prompt, answers one word."""

    def __init__(self, word: int) -> None:
        self.word = word
        self.prompts: list[list[int]] = []
        self.app = Starlette(routes=[Route("/v1/models", self.models), Route("/v1/completions", self.completions,
                                                                            methods=["POST"])])

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "engine", "object": "model", "max_model_len": 1 << 20}]})

    async def completions(self, request: Request) -> Any:
        body = json.loads(await request.body())
        self.prompts.append(body["prompt"])
        chunk = {"id": "c", "object": "text_completion", "created": 1, "model": "engine",
                 "choices": [{"index": 0, "text": "", "token_ids": [self.word], "finish_reason": "length"}]}

        async def events() -> Any:
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")


def session_upstream(engine: FakeEngine, plain: RecordingEngine | None = None) -> Starlette:
    """The middleware in front of `engine`; its plain /v1/completions answered by `plain` (as vLLM's own route)."""
    plain = plain or RecordingEngine(engine.words[0])
    app = Starlette(routes=[Route("/v1/models", plain.models), Route("/v1/completions", plain.completions,
                                                                     methods=["POST"])],
                    middleware=[Middleware(BaseHTTPMiddleware, dispatch=plugin.session_turns)])
    app.state.engine_client = engine
    return app


@pytest.fixture(scope="module")
def tok():
    return tokenplane.load("qwen3")


def words(tok) -> list[int]:
    return [int(t) for t in tok.encode(WORDS)]


def tier(tok, url: str, sessions: bool) -> ThreadServer:
    pool = UpstreamPool([url], answers_ids=True, sessions=sessions)
    return ThreadServer(create_app(None, tok, model_name="tier", upstream=pool, limits=Limits(max_prompt_chars=1 << 20)))


def chat(client: openai.OpenAI, messages: list[dict[str, str]], stream: bool, max_tokens: int = 1) -> str:
    if stream:
        out = client.chat.completions.create(model="tier", messages=messages, stream=True, max_tokens=max_tokens)
        return "".join(c.choices[0].delta.content or "" for c in out if c.choices)
    return client.chat.completions.create(model="tier", messages=messages, max_tokens=max_tokens).choices[0] \
        .message.content or ""


def replay(tok, turns: int, edit_at: int | None = None) -> tuple[list[list[dict[str, str]]], list[list[int]]]:
    """A conversation's requests (the client's own assistant messages, as replayed traces send them) and the prompt
    IDs a plain tier forwards for each."""
    msgs: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    requests = []
    for i in range(turns):
        msgs.append({"role": "user", "content": f"step {i}: " + "naïve text, with 'quotes' and 🎉 " * (i + 1)})
        if edit_at is not None and i == edit_at:
            msgs[1] = {"role": "user", "content": "an edited first question"}
        requests.append([dict(m) for m in msgs])
        msgs.append({"role": "assistant", "content": f"answer {i}."})
    rec = RecordingEngine(words(tok)[0])
    with ThreadServer(rec.app) as up, tier(tok, up.url, False) as t:
        client = openai.OpenAI(base_url=t.url + "/v1", api_key="x")
        for m in requests:
            chat(client, m, stream=True)
    return requests, rec.prompts


@pytest.mark.parametrize("stream", [True, False])
def test_turns_send_only_the_new_ids_and_the_engine_sees_the_exact_prompt(tok, stream):
    requests, expected = replay(tok, 5)
    engine = FakeEngine(words(tok))
    sent: list[int] = []
    with ThreadServer(session_upstream(engine)) as up, tier(tok, up.url, True) as t:
        client = openai.OpenAI(base_url=t.url + "/v1", api_key="x")
        for m in requests:
            chat(client, m, stream)
        turns = t.app.state.server.turns.stats()
    assert engine.contexts == expected          # every turn computed on the tier's exact IDs
    assert engine.requests == 1                 # one live upstream request for the whole conversation
    assert turns == {"sessions": 1, "suffix_turns": 4, "full_turns": 1, "plain_turns": 0}
    for a, b in zip(expected, expected[1:]):
        sent.append(len(b) - len(a))
    assert max(sent) < len(expected[-1]) // 2   # the turns after the first carried their new IDs only


def test_answers_kept_by_the_upstream_are_matched_against_the_rendered_history(tok):
    """An agent loop: the client sends the model's answer back as the assistant message. The upstream keeps every
    answer token but the last; the next turn's IDs must hold those same tokens after the previous prompt, so the
    suffix starts at the answer's last token."""
    engine = FakeEngine(words(tok))
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "count"}]
    with ThreadServer(session_upstream(engine)) as up, tier(tok, up.url, True) as t:
        client = openai.OpenAI(base_url=t.url + "/v1", api_key="x")
        for i in range(4):
            answer = chat(client, msgs, stream=True, max_tokens=4)
            assert len(tok.encode(answer)) == 4
            msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"more {i}"}]
        turns = t.app.state.server.turns.stats()
        rec = RecordingEngine(words(tok)[0])
        with ThreadServer(rec.app) as up2, tier(tok, up2.url, False) as plain:
            pc = openai.OpenAI(base_url=plain.url + "/v1", api_key="x")
            for k in range(2, len(msgs), 2):
                chat(pc, msgs[:k], stream=True)
    assert turns["suffix_turns"] == 3 and turns["full_turns"] == 1
    assert engine.contexts == rec.prompts


def test_a_resent_turn_goes_plain_and_keeps_the_upstream_session(tok):
    """The same chat sent again (a client's retry) has no new ID for the session: it goes to the plain route (the
    whole prompt, prefix-cached upstream), and the next turn still extends the live session."""
    requests, expected = replay(tok, 3)
    engine = FakeEngine(words(tok))
    plain = RecordingEngine(words(tok)[0])
    with ThreadServer(session_upstream(engine, plain)) as up, tier(tok, up.url, True) as t:
        client = openai.OpenAI(base_url=t.url + "/v1", api_key="x")
        chat(client, requests[0], stream=True)
        chat(client, requests[1], stream=True)
        chat(client, requests[1], stream=False)      # resent
        chat(client, requests[2], stream=True)
        turns = t.app.state.server.turns.stats()
    assert engine.contexts == expected and engine.requests == 1
    assert plain.prompts == [expected[1]]
    assert turns == {"sessions": 1, "suffix_turns": 2, "full_turns": 1, "plain_turns": 1}


def test_answers_the_history_renders_otherwise_open_a_new_session(tok):
    """The client's assistant messages are not the upstream's answers: the tokens the upstream kept after each
    prompt are not the conversation's, so no turn may be sent as a suffix."""
    requests, expected = replay(tok, 3)
    engine = FakeEngine(words(tok))
    with ThreadServer(session_upstream(engine)) as up, tier(tok, up.url, True) as t:
        client = openai.OpenAI(base_url=t.url + "/v1", api_key="x")
        for m in requests:
            chat(client, m, stream=True, max_tokens=3)
        turns = t.app.state.server.turns.stats()
    assert engine.contexts == expected
    assert turns["full_turns"] == 3 and turns["suffix_turns"] == 0


def test_an_edited_history_opens_a_new_session_with_the_whole_prompt(tok):
    requests, expected = replay(tok, 4, edit_at=2)
    engine = FakeEngine(words(tok))
    with ThreadServer(session_upstream(engine)) as up, tier(tok, up.url, True) as t:
        client = openai.OpenAI(base_url=t.url + "/v1", api_key="x")
        for m in requests:
            chat(client, m, stream=True)
        turns = t.app.state.server.turns.stats()
        sessions = up.app.state.tokenplane_sessions
        assert len(sessions.open) == 1          # the replaced session was closed upstream
    assert engine.contexts == expected
    assert turns["full_turns"] == 2 and engine.requests == 2


def test_a_lost_upstream_session_is_reopened_with_the_whole_prompt(tok):
    """The upstream restarted (its sessions gone): it answers 409, and the tier sends the whole prompt as a new
    session in the same turn; the client sees a normal answer."""
    requests, expected = replay(tok, 3)
    engine = FakeEngine(words(tok))
    with ThreadServer(session_upstream(engine)) as up, tier(tok, up.url, True) as t:
        client = openai.OpenAI(base_url=t.url + "/v1", api_key="x")
        chat(client, requests[0], stream=True)
        up.app.state.tokenplane_sessions.open.clear()
        assert chat(client, requests[1], stream=False)
        assert chat(client, requests[2], stream=True)
        turns = t.app.state.server.turns.stats()
    assert engine.contexts == expected
    assert turns["full_turns"] == 2 and turns["suffix_turns"] == 2   # the failed suffix try, then the whole


def test_a_client_that_leaves_mid_answer_aborts_the_session(tok):
    requests, expected = replay(tok, 3)
    engine = FakeEngine(words(tok))
    with ThreadServer(session_upstream(engine)) as up, tier(tok, up.url, True) as t:
        client = openai.OpenAI(base_url=t.url + "/v1", api_key="x")
        chat(client, requests[0], stream=True)
        with httpx.stream("POST", t.url + "/v1/chat/completions", timeout=30,
                          json={"model": "tier", "messages": requests[1], "stream": True, "max_tokens": 5000}) as r:
            for _ in r.iter_lines():
                break
        deadline = time.monotonic() + 10
        while not engine.aborted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(engine.aborted) == 1
        chat(client, requests[2], stream=True)
        turns = t.app.state.server.turns.stats()
    assert engine.contexts[0] == expected[0] and engine.contexts[-1] == expected[2]
    assert turns["full_turns"] == 2


def test_the_session_route_refuses_what_it_cannot_answer():
    engine = FakeEngine([11, 12, 13], max_num_seqs=3)
    with ThreadServer(session_upstream(engine)) as up:
        url = up.url + plugin.PATH

        def post(body: Any) -> httpx.Response:
            return httpx.post(url, content=body if isinstance(body, bytes) else json.dumps(body), timeout=10)
        assert post(b"{not json").status_code == 400
        assert post({"prompt": [], "tokenplane_session": {"id": "a", "context": 0}}).status_code == 400
        assert post({"prompt": [1, True], "tokenplane_session": {"id": "a", "context": 0}}).status_code == 400
        for field, value in (("n", 2), ("stop", ["x"]), ("echo", True), ("use_beam_search", True)):
            r = post({"prompt": [1], field: value, "tokenplane_session": {"id": "a", "context": 0}})
            assert r.status_code == 400 and field in r.json()["error"]["message"]
        assert post({"prompt": [1], "tokenplane_session": {"id": "", "context": 0}}).status_code == 400
        r = post({"prompt": [1], "tokenplane_session": {"id": "ghost", "context": 9}})
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_mismatch"
        ok = post({"prompt": [1, 2, 3], "max_tokens": 2, "tokenplane_session": {"id": "a", "context": 0}})
        report = [json.loads(line[6:]) for line in ok.text.splitlines() if line.startswith("data: {")][-1]
        assert report["tokenplane_session"] == {"id": "a", "context": 4, "kept": report["tokenplane_session"]["kept"]}
        assert len(report["tokenplane_session"]["kept"]) == 1 and report["usage"]["completion_tokens"] == 2
        assert post({"prompt": [1], "tokenplane_session": {"id": "a", "context": 3}}).status_code == 409
        # max_num_seqs 3: at most 1 open session (an idle session counts against the engine's running set)
        post({"prompt": [5], "max_tokens": 1, "tokenplane_session": {"id": "b", "context": 0}})
        assert list(up.app.state.tokenplane_sessions.open) == ["b"]


def test_sessions_are_refused_for_grpc_upstreams():
    with pytest.raises(ValueError, match="http"):
        UpstreamPool(["grpc://127.0.0.1:1"], sessions=True)


def test_a_turn_whose_answer_never_started_is_reclaimed():
    """A client that leaves before the response begins never runs the answer stream: the engine got nothing, and the
    session, still taken, is closed once room is needed and it has waited past plugin._UNSTARTED_S."""
    async def run() -> None:
        engine = FakeEngine([11, 12])
        sessions = plugin.Sessions(engine, max_sessions=1, idle_s=600)
        stuck = sessions.take({"id": "a", "context": 0})
        with pytest.raises(plugin.SessionError) as err:
            sessions.take({"id": "b", "context": 0})
        assert err.value.status == 429
        stuck.last_used -= plugin._UNSTARTED_S + 1
        sessions.take({"id": "b", "context": 0})
        await asyncio.sleep(0)
        assert list(sessions.open) == ["b"] and engine.aborted == [stuck.request_id] and engine.requests == 0
    asyncio.run(run())


def test_a_turn_sent_while_the_previous_one_answers_gets_its_own_session(tok):
    """The next turn arrives while the previous answer still streams (the session is taken): it opens a new upstream
    session with the whole prompt and closes the old one, whose answer still streams to its end."""
    requests, expected = replay(tok, 2)
    engine = FakeEngine(words(tok))
    with ThreadServer(session_upstream(engine)) as up, tier(tok, up.url, True) as t:
        client = openai.OpenAI(base_url=t.url + "/v1", api_key="x")
        with httpx.stream("POST", t.url + "/v1/chat/completions", timeout=60,
                          json={"model": "tier", "messages": requests[0], "stream": True, "max_tokens": 200,
                                "stream_options": {"include_usage": True}}) as r:
            lines = r.iter_lines()
            next(lines)
            assert chat(client, requests[1], stream=False)
            usage = [json.loads(x[6:])["usage"] for x in lines if x.startswith("data: {") and '"usage"' in x]
        turns = t.app.state.server.turns.stats()
        assert list(up.app.state.tokenplane_sessions.open) != [] and len(up.app.state.tokenplane_sessions.open) == 1
    assert usage and usage[-1]["completion_tokens"] == 200          # the first answer was not cut
    assert engine.contexts == expected and engine.requests == 2
    assert turns["full_turns"] == 2
