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
        out = []
        if default_system is not None and messages and messages[0][0] != "system":
            out.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
        out += [f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages]
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


def _key(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


NATIVE: dict[str, Renderer] = {
    _key(SMOLLM2_TEMPLATE): _chatml("You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
    _key(CHATML_TEMPLATE): _chatml(None),
}


def native_renderer(source: str) -> Renderer | None:
    """The native renderer of exactly this template source, if there is one."""
    return NATIVE.get(_key(source))


__all__ = ["CHATML_TEMPLATE", "NATIVE", "SMOLLM2_TEMPLATE", "native_renderer"]
