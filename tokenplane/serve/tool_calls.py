"""Tool calls in chat: definitions into the chat template, the model's calls out of its text.

Into the prompt: a request's `tools` and its tool turns (assistant `tool_calls`, `tool` answers) are handed to the
model's own template, which renders them (`ChatExtras`). Only templates that write Hermes-style calls are served
(`template_calls_tools`: Qwen2.5 / Qwen3 and others that show the model `<tool_call>{"name": ..., "arguments": ...}
</tool_call>`), since those are the calls this module can read back; another template refuses `tools` by name.

Out of the answer (`ToolCallStream`, one per choice): text before the first `<tool_call>` is content, streamed as it
comes (a tail that could be the start of the tag is held back until the next delta says); from the tag on, the text
is held, and at the end each `<tool_call>...</tool_call>` block must be a JSON object with a string `name` and
`arguments` (an object, or a string holding one). Then they are the message's tool_calls (arguments as JSON text,
an id each) and finish_reason "tool_calls" where the model stopped by itself; a block that does not parse, or an
unclosed one (max_tokens reached), leaves the whole held text as content, as vLLM's hermes parser does.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Sequence

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def template_calls_tools(source: str) -> bool:
    """Whether a chat template renders `tools` and shows the model Hermes-style calls."""
    return "tools" in source and OPEN in source and CLOSE in source


@dataclass(frozen=True)
class ChatExtras:
    """What a tool conversation adds to its (role, content) pairs for the template: the tool definitions, and per
    message the fields besides role and content (tool_calls with object arguments, as HF templates expect,
    tool_call_id, name)."""
    tools: tuple[dict[str, Any], ...] | None
    fields: tuple[dict[str, Any], ...]


def chat_extras(messages: Sequence[Any], tools: Sequence[Any] | None) -> ChatExtras | None:
    """The template extras of a conversation (protocol.ChatMessage list) and the tools shown to the model (ToolDef
    list, or None), None for a plain conversation."""
    if not tools and not any(m.uses_tools for m in messages):
        return None
    shown = tuple(t.model_dump(exclude_none=True) for t in tools) if tools else None
    fields = []
    for m in messages:
        f: dict[str, Any] = {}
        if m.tool_calls:
            f["tool_calls"] = [{"id": c.id, "type": c.type,
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in m.tool_calls]
        if m.tool_call_id is not None:
            f["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            f["name"] = m.name
        fields.append(f)
    return ChatExtras(shown, tuple(fields))


def _arguments(text: str) -> Any:
    """A call's arguments as the template shows them: the object when the text is one (HF templates `tojson` it),
    else the text itself."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


def _held_back(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of OPEN."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0


def parse_calls(text: str) -> list[dict[str, Any]] | None:
    """OpenAI tool_calls of text that starts with OPEN, or None when any block is unclosed or not a call."""
    calls: list[dict[str, Any]] = []
    pos = 0
    while True:
        at = text.find(OPEN, pos)
        if at < 0:
            break
        end = text.find(CLOSE, at)
        if end < 0:
            return None
        try:
            call = json.loads(text[at + len(OPEN):end])
        except (ValueError, RecursionError):    # the model's text: any JSON, nested as deep as it wrote it
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        args = call.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                return None
        if not isinstance(args, dict):
            return None
        calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
        pos = end + len(CLOSE)
    return calls or None


class ToolCallStream:
    """One choice's answer split into content and tool calls (see the module docstring)."""

    def __init__(self) -> None:
        self._held = ""
        self._calls: str | None = None   # the text from the first OPEN on

    def feed(self, delta: str) -> str:
        """The content this delta releases."""
        if self._calls is not None:
            self._calls += delta
            return ""
        text = self._held + delta
        at = text.find(OPEN)
        if at >= 0:
            self._calls, self._held = text[at:], ""
            return text[:at]
        keep = _held_back(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(the content still held, the tool calls: [] when there are none or they do not parse)."""
        if self._calls is None:
            tail, self._held = self._held, ""
            return tail, []
        calls = parse_calls(self._calls)
        return ("", calls) if calls else (self._calls, [])

    def step(self, delta: str, finish_reason: str | None, last: bool) -> tuple[str, list[dict[str, Any]], str | None]:
        """One piece of a choice's answer: (the content it releases, the tool calls: found at the last piece only,
        the finish_reason to report: "tool_calls" where the model stopped by itself after calls)."""
        content = self.feed(delta)
        if not last:
            return content, [], finish_reason
        tail, calls = self.finish()
        return content + tail, calls, "tool_calls" if calls and finish_reason == "stop" else finish_reason


def calls_delta(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls as a streamed delta carries them (each with its index)."""
    return [{"index": k, **c} for k, c in enumerate(calls)]


class ToolChoices:
    """Wraps a server's chat choice builder (`choice(i, event, stream) -> dict`) for a request that may call
    tools: content and tool_calls per choice, finish_reason "tool_calls" when the model stopped after calls."""

    def __init__(self, choice: Callable[..., dict[str, Any]], event_type: Callable[..., Any]) -> None:
        self.choice, self.event_type = choice, event_type
        self.streams: dict[int, ToolCallStream] = {}

    def __call__(self, i: int, ev: Any, stream: bool = True) -> dict[str, Any]:
        content, calls, reason = self.streams.setdefault(i, ToolCallStream()).step(
            ev.delta, ev.finish_reason, ev.finish_reason is not None or not stream)
        out = self.choice(i, self.event_type(content, ev.finish_reason, ev.stats, ev.completion_tokens,
                                             ev.logprobs), stream)
        if calls:
            if stream:
                out["delta"]["tool_calls"] = calls_delta(calls)
            else:
                out["message"].update(content=content or None, tool_calls=calls)
        out["finish_reason"] = reason
        return out


__all__ = ["ChatExtras", "ToolCallStream", "ToolChoices", "calls_delta", "chat_extras", "parse_calls",
           "template_calls_tools"]
