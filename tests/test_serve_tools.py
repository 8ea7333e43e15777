"""Tool calling in chat: definitions and tool turns rendered by the model's own template exactly as transformers'
apply_chat_template renders them, Hermes-style calls parsed back into message.tool_calls (streaming and not), the
prompt IDs an engine receives, and refusals where a template cannot call tools."""
from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from servers import ReplyBackend, ThreadServer, streamed_chat

import tokenplane
from tokenplane.serve.app import create_app
from tokenplane.serve.chat import ChatTemplate, template_for
from tokenplane.serve.protocol import ChatCompletionRequest
from tokenplane.serve.tool_calls import ToolCallStream, chat_extras, parse_calls

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
HISTORY = [
    {"role": "system", "content": "You are a helpful agent."},
    {"role": "user", "content": "Weather in Paris and in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "4 C, <|im_end|> rain"},   # a control token in tool output
    {"role": "user", "content": "Thanks. And Rome?"}]


@pytest.fixture(scope="module")
def tok():
    return tokenplane.load("qwen3")


def hf_messages(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers' templates take them: tool-call arguments as objects, no null content (the
    server renders a null content as "", as vLLM does)."""
    out = []
    for m in msgs:
        m = {**m, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def render(template: ChatTemplate, msgs: list[dict[str, Any]], tools=TOOLS) -> tuple[str, list[int]]:
    req = ChatCompletionRequest.model_validate({"messages": msgs, "tools": tools})
    pairs = [(m.role, m.text()) for m in req.messages]
    extras = chat_extras(req.messages, req.tools)
    return template.render(pairs, extras=extras), template.encode(pairs, extras=extras)


@pytest.mark.parametrize("msgs", [HISTORY[:2], HISTORY, HISTORY[:4]], ids=["first", "history", "one_answer"])
def test_tool_prompts_equal_transformers(tok, qwen3_hf, msgs):
    template = template_for(tok)
    assert template.calls_tools
    text, ids = render(template, msgs)
    assert text == qwen3_hf.apply_chat_template(hf_messages(msgs), tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "get_weather" in text and "<tools>" in text
    if "<|im_end|> rain" not in text:
        assert ids == tok.encode(text, allowed_special="all").tolist()
    else:   # the tool's quoted control token stays text (as a user's does), the template's own are specials
        end = tok.specials["<|im_end|>"]
        assert ids.count(end) == text.count("<|im_end|>") - 1
        assert tok.decode(ids) == text


def test_stream_parser_splits_content_and_calls():
    answer = "Let me check." + CALL + "\n" + CALL.replace("Paris", "Oslo")
    whole = ToolCallStream()
    content = whole.feed(answer)
    tail, calls = whole.finish()
    assert content + tail == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather"] * 2
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo", "unit": "C"}
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["type"] == "function"
    for cut in range(1, len(answer)):   # any split of the deltas gives the same content and calls
        s = ToolCallStream()
        got = s.feed(answer[:cut]) + s.feed(answer[cut:])
        t, c = s.finish()
        assert got + t == "Let me check." and [x["function"] for x in c] == [x["function"] for x in calls]
    s = ToolCallStream()   # a partial tag is held back, then released when it turns out not to be one
    assert s.feed("a <tool_") == "a " and s.feed("x> b") == "<tool_x> b" and s.finish() == ("", [])


@pytest.mark.parametrize("bad", ["<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}",   # unclosed (length)
                                 "<tool_call>not json</tool_call>",
                                 "<tool_call>{\"arguments\": {}}</tool_call>",
                                 "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
                                 "<tool_call>" + "[" * 100_000 + "</tool_call>"])
def test_unparseable_calls_stay_content(bad):
    assert parse_calls(bad) is None
    s = ToolCallStream()
    assert s.feed("x" + bad) == "x" and s.finish() == (bad, [])
    assert parse_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')[0]["function"] == \
        {"name": "f", "arguments": '{"a": 1}'}


def test_server_tool_calls_through_the_official_client(tok):
    reply = tok.encode("I will look it up.\n" + CALL).tolist()
    engine = ReplyBackend(reply)
    with ThreadServer(create_app(engine, tok, model_name="m", close_backend=False)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="m", messages=HISTORY, tools=TOOLS, max_tokens=200)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "I will look it up.\n"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris",
                                                                                              "unit": "C"}
        assert engine.prompts[-1] == render(template_for(tok), HISTORY)[1]   # the prompt the template renders
        text, calls, finish = streamed_chat(client, model="m", messages=HISTORY, tools=TOOLS, max_tokens=200)
        assert text == "I will look it up.\n" and finish == "tool_calls"
        assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
        short = client.chat.completions.create(model="m", messages=HISTORY, tools=TOOLS, max_tokens=12)
        assert short.choices[0].finish_reason == "length" and not short.choices[0].message.tool_calls
        plain = client.chat.completions.create(model="m", messages=HISTORY[:2], max_tokens=200)   # no tools asked
        assert plain.choices[0].message.content == tok.decode(reply) and not plain.choices[0].message.tool_calls
        none = client.chat.completions.create(model="m", messages=HISTORY[:2], tools=TOOLS, tool_choice="none",
                                              max_tokens=200)
        assert not none.choices[0].message.tool_calls and "<tools>" not in tok.decode(engine.prompts[-1])
        quiet = [m if m.get("role") != "tool" else {**m, "content": m["content"].replace("<|im_end|>", "")}
                 for m in HISTORY]   # no quoted control token: the conversation-session path
        for turn in (quiet[:2], quiet[:4], quiet):
            client.chat.completions.create(model="m", messages=turn, tools=TOOLS, max_tokens=3)
            assert engine.prompts[-1] == render(template_for(tok), turn)[1]
        t = httpx.post(srv.url + "/tokenize", json={"messages": HISTORY, "tools": TOOLS}, timeout=30).json()
        assert t["tokens"] == engine.prompts[0]
        for extra, param in (({"tool_choice": "required"}, "tool_choice"),
                             ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                              "tool_choice")):
            bad = httpx.post(srv.url + "/v1/chat/completions", json={"messages": HISTORY, "tools": TOOLS, **extra},
                             timeout=30)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param
        bad = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={"messages": [
            {"role": "tool", "content": "x"}]})
        assert bad.status_code == 400 and "tool_call_id" in bad.json()["error"]["message"]


def test_message_schema_states_the_tool_fields():
    """What the validator refuses, the schema says (a schema-driven fuzzer found both cases unstated)."""
    from pydantic import ValidationError

    from tokenplane.serve.protocol import ChatMessage

    rules = ChatMessage.model_json_schema()["allOf"]
    assert rules[0]["then"]["required"] == ["tool_call_id"] and rules[1]["then"]["properties"]["role"] == {
        "const": "assistant"}
    for bad in ({"role": "tool", "content": "x"}, {"role": "tool", "tool_call_id": "", "content": "x"},
                {"role": "user", "content": "x", "tool_calls": [{"id": "a", "function": {"name": "f",
                                                                                   "arguments": "{}"}}]}):
        with pytest.raises(ValidationError):
            ChatMessage.model_validate(bad)


def test_templates_without_tool_calls_refuse_tools(tok):
    engine = ReplyBackend([1, 2])
    plain = ChatTemplate(tok)   # ChatML without tools
    assert not plain.calls_tools
    with ThreadServer(create_app(engine, tok, model_name="m", close_backend=False, chat_template=plain)) as srv:
        for body in ({"messages": HISTORY[:2], "tools": TOOLS}, {"messages": HISTORY}):
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        assert not engine.prompts
