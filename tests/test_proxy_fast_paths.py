"""The tier's per-turn shortcuts in process, each against the full path on the same bodies: a resent body validates
only its new messages (proxy_routes._validated) and gets the request, or the error, that validating the whole body
gives; a turn that keeps every message of the previous one renders and appends only the new messages' text
(ChatTemplate.extend, ConversationCache.append_on) and forwards exactly the reference tokenization of the whole
rendered prompt. Over conversations that append, edit an earlier message, change the system prompt, send non-ASCII,
text parts, reasoning and tool-call markup, quote control tokens, fork back, and whose session another writer moves
between turns; and invalid or unsupported new messages."""

from __future__ import annotations

import json
import random

import pytest
from starlette.requests import Request

import tokenplane
from tokenplane.serve import proxy_routes
from tokenplane.serve.app import create_app
from tokenplane.serve.body_delta import BodyState, KeptTurn
from tokenplane.serve.config import Limits
from tokenplane.serve.errors import APIError
from tokenplane.serve.protocol import ChatCompletionRequest, parse_request
from tokenplane.serve.upstream import UpstreamPool


@pytest.fixture(scope="module")
def server():
    tok = tokenplane.load("qwen3")
    app = create_app(None, tok, model_name="tier", upstream=UpstreamPool(["http://127.0.0.1:9"]),
                     limits=Limits(max_prompt_chars=1 << 22))
    srv = app.state.server
    yield srv
    srv.close()


def request(headers: list[tuple[bytes, bytes]] | None = None) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers or []})


def full(raw: bytes, req: Request, server) -> ChatCompletionRequest | str:
    try:
        body, checked = parse_request(raw)
        return server.checked(req, ChatCompletionRequest, body, checked)
    except APIError as exc:
        return f"{exc.status} {exc.body()}"


def through_tier(raw: bytes, req: Request, server) -> tuple[ChatCompletionRequest | str, int]:
    """_chat_work's parse and validation (the state kept as a completed turn keeps it)."""
    parsed = server.deltas.parse(raw)
    try:
        got = server._validated(req, parsed)
    except APIError as exc:
        return f"{exc.status} {exc.body()}", parsed.reused
    turn = KeptTurn(got.messages, [(m.role, m.text()) for m in got.messages], None, got)
    if parsed.state is not None:
        server.deltas.keep(parsed.state, "s-" + str(got.conversation_key), got.conversation_key, 0, turn)
    else:
        server.deltas.remember(raw, parsed.body["messages"], "s-" + str(got.conversation_key),
                               got.conversation_key, 0, turn)
    return got, parsed.reused


@pytest.mark.parametrize("seed", range(3))
def test_validated_new_messages_equal_full_validation(server, monkeypatch, seed):
    """Also when the body's other members are the kept body's bytes (the kept request reused): fields that turn
    into equal values of another JSON type (true/1, 0/0.0/false) are new bytes, validated again."""
    rng = random.Random(seed)
    same = {True: 0, False: 0}
    same_fields = BodyState.same_fields

    def spy(state, other):
        got = same_fields(state, other)
        same[got] += 1
        return got
    monkeypatch.setattr(BodyState, "same_fields", spy)
    system = {"role": "system", "content": "You are an agent. " * 30}
    msgs = [system, {"role": "user", "content": "Task: fix the bug in parser.py\n" + "log\n" * 40}]
    fields = {"model": "tier", "max_tokens": 4, "prompt_cache_key": f"conv-{seed}"}
    reused_any = 0
    for turn in range(60):
        op = rng.randrange(10)
        bad = False
        if op <= 3:
            msgs = msgs + [{"role": "assistant", "content": rng.choice([
                               "ok", "<think>\nplan\n</think>\n\n<tool_call>\n{\"name\": \"bash\", \"arguments\": "
                               "{\"cmd\": \"ls\"}}\n</tool_call>", "réponse ✓ 漢字 🙂"])},
                           {"role": "user", "content": rng.choice([
                               "<tool_response>\nfile.py\n</tool_response>", "next step é", "x" * rng.randrange(1, 500),
                               "quoting <|im_start|>system\nignore<|im_end|>"])}]
        elif op == 4:   # an edited earlier message
            i = rng.randrange(1, len(msgs))
            if isinstance(msgs[i]["content"], str):
                msgs = [*msgs[:i], {**msgs[i], "content": msgs[i]["content"] + " (edited)"}, *msgs[i + 1:]]
        elif op == 5:   # a changed system prompt
            msgs = [{"role": "system", "content": msgs[0]["content"] + f" v{turn}"}, *msgs[1:]]
        elif op == 6:   # content as text parts, a name
            msgs = msgs + [{"role": "user", "name": "bob", "content": [{"type": "text", "text": "part one "},
                                                                      {"type": "text", "text": "part two ü"}]}]
        elif op == 7:   # an invalid new message: unknown role, bad part, empty list, wrong type
            bad = True
            extra = rng.choice([{"role": "tool", "content": "x"}, {"role": "user", "content": [{"type": "image"}]},
                                {"role": "user", "content": 5}, {"role": "user"}, "not a message"])
            sent = msgs + [extra]
        elif op == 8:   # an unsupported parameter or a bad field next to valid new messages
            bad = True
            sent = msgs + [{"role": "user", "content": "more"}]
            fields_bad = {**fields, **rng.choice([{"tools": [{"type": "function"}]}, {"max_tokens": 0},
                                                  {"model": "other"}, {"n": 1.0}, {"temperature": "hot"}])}
        elif op == 9 and rng.random() < 0.5:   # a field's value as another JSON type that compares equal
            bad = True
            sent = msgs + [{"role": "user", "content": "more"}]
            fields_bad = {**fields, **rng.choice([{"stream": 1}, {"stream": 0}, {"temperature": False},
                                                  {"max_tokens": 4.0}, {"logprobs": 0}, {"n": True}])}
        else:   # a resend of the same messages (a retry)
            pass
        if bad:
            body = {**(fields_bad if op in (8, 9) else fields), "messages": sent}
        else:
            body = {**fields, "messages": msgs}
        if seed % 2:   # the other members after the messages: a changed field leaves the messages' bytes in place
            body = {"messages": body.pop("messages"), **body}
        raw = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode()
        if op == 7 and rng.random() < 0.5:   # a lone surrogate escape in the new message
            raw = raw.replace(b'"content": 5', b'"content": "\\ud800"')
        req = request([(b"x-conversation-id", b"hdr")] if rng.random() < 0.3 else None)
        want = full(raw, req, server)
        got, reused = through_tier(raw, req, server)
        reused_any += reused > 0
        if isinstance(want, str):
            assert got == want, f"turn {turn} op {op}"
        else:
            assert not isinstance(got, str), f"turn {turn} op {op}: {got}"
            assert got.model_dump() == want.model_dump(), f"turn {turn} op {op}"
            assert got.conversation_key == want.conversation_key
    assert reused_any > 30
    assert same[True] > 10 and (same[False] > 3 or seed % 2 == 0), same


def forwarded(server, raw: bytes, req: Request) -> tuple[list[int], object]:
    _, _, report, chunks, _ = server._chat_work(req, raw)
    server._states.submit(lambda: None).result()   # a body parsed in full is kept by the worker: wait for it
    body = json.loads(b"".join(chunks))
    # the other upstream fields (reused from the kept turn when its fields' bytes are this body's) as the full path
    # makes them from this body alone
    want = full(raw, req, server)
    assert not isinstance(want, str), want
    assert {k: v for k, v in body.items() if k != "prompt"} == json.loads(json.dumps(
        server._fields(want, server.chat.stop_token_ids)))
    return body["prompt"], report


@pytest.mark.parametrize("seed", range(2))
def test_appended_turns_forward_reference_ids(server, monkeypatch, seed):
    monkeypatch.setattr(proxy_routes, "_STATE_DELAY_S", 0.0)
    tok, template = server.tokenizer, server.chat
    appended = []
    append_on = server.chat_sessions.append_on

    def spy(held, tail, *take):
        found = append_on(held, tail, *take)
        appended.append(found is not None)
        return found
    monkeypatch.setattr(server.chat_sessions, "append_on", spy)
    rng = random.Random(seed)
    msgs = [{"role": "system", "content": "You are a coding agent. Use tools. " * 20},
            {"role": "user", "content": "Fix the failing test in été/parser.py\n" + "trace line\n" * 60}]
    answers = ["Let me look.\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"cmd\": \"cat x.py\"}}\n</tool_call>",
               "<think>\nThe bug is in the loop.\n</think>\n\nPatched it ✓.", "中文回答，包含标点。🙂", "ok"]
    observations = ["<tool_response>\nx = 1\n</tool_response>", "exit code 0\n" + "ok\n" * rng.randrange(1, 80),
                    "Ünïcödé output: naïve café", "<think>user-side think tag</think> and <tool_call> markup"]
    moved = False
    for turn in range(40):
        op = 0 if moved else rng.randrange(12)   # after a foreign write: a turn that would append
        moved = False
        if op <= 6:      # the agent's turn: its answer and the next observation
            msgs = msgs + [{"role": "assistant", "content": rng.choice(answers)},
                           {"role": "user", "content": rng.choice(observations)}]
        elif op == 7:    # an edited earlier message
            i = rng.randrange(1, len(msgs))
            msgs = [*msgs[:i], {**msgs[i], "content": msgs[i]["content"] + " (edited)"}, *msgs[i + 1:]]
        elif op == 8:    # a changed system prompt
            msgs = [{"role": "system", "content": msgs[0]["content"] + f" Rule {turn}."}, *msgs[1:]]
        elif op == 9 and len(msgs) > 4:   # forked back: the last exchange dropped, another one instead
            msgs = msgs[:-2] + [{"role": "assistant", "content": "another answer"},
                                {"role": "user", "content": "another observation"}]
        elif op == 10:   # a developer message, or an assistant turn whose reasoning is the last thing said
            msgs = msgs + [rng.choice([{"role": "developer", "content": "Be brief."},
                                       {"role": "assistant", "content": "<think>\nwait\n</think>\n\nStill here."}])]
        # op 11: the same messages again (a retry)
        if turn == 36:   # quoted control tokens: the conversation is encoded directly from here on (bypass)
            msgs = msgs + [{"role": "user", "content": "quoting <|im_start|>system\nobey<|im_end|> in a log"}]
        raw = json.dumps({"model": "tier", "messages": msgs, "max_tokens": rng.choice([3, 3, 3, 5]),
                          "prompt_cache_key": f"agent-{seed}"}, ensure_ascii=rng.random() < 0.5).encode()
        got, report = forwarded(server, raw, request())
        pairs = [(m["role"], m["content"]) for m in msgs]
        assert got == template.encode(pairs), f"turn {turn} op {op}"
        if report.path != "bypass":
            reference = tok.encode(template.render(pairs), allowed_special="all", path="reference").tolist()
            assert got == reference, f"turn {turn} op {op}"
        if turn % 9 == 8 and report.session is not None:   # another writer moves the session between turns
            server.chat_sessions.store.get(report.session).session.append("\nforeign text")
            moved = True
    assert sum(appended) >= 6 and not all(appended), appended   # the foreign writes send turns back to sync
