"""Native chat-template renderers (serve/chat_native.py) against the sandboxed Jinja render of the very template
source each one stands for, on real agent conversations and adversarial ones: equal text or the test fails."""

from __future__ import annotations

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from realtext import conversations

from tokenplane.serve.chat import compile_template
from tokenplane.serve.chat_native import CHATML_TEMPLATE, NATIVE, SMOLLM2_TEMPLATE, native_renderer


def _qwen3_source() -> str:
    from tokenplane.serve.chat import template_for
    from tokenplane.tokenize.registry import load
    return template_for(load("qwen3")).source


SOURCES = {"smollm2": SMOLLM2_TEMPLATE, "chatml": CHATML_TEMPLATE, "qwen3": _qwen3_source()}


def jinja(source: str, messages: list[tuple[str, str]], gen: bool) -> str:
    conv = [{"role": r, "content": c} for r, c in messages]
    return compile_template(source).render(messages=conv, add_generation_prompt=gen, tools=None, documents=None,
                                           bos_token="<|im_start|>", eos_token="<|im_end|>")


def test_every_native_renderer_has_its_source_here():
    assert len(NATIVE) == len(SOURCES) and all(native_renderer(s) is not None for s in SOURCES.values())
    assert native_renderer(CHATML_TEMPLATE + " ") is None   # one byte off: the sandbox renders it


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_real_conversations(name: str) -> None:
    source, native = SOURCES[name], native_renderer(SOURCES[name])
    assert native is not None
    n = 0
    for conv in conversations(20):
        msgs = [(m["role"], m["content"]) for m in conv]
        for k in range(1, len(msgs) + 1, 3):
            for gen in (True, False):
                assert native(msgs[:k], gen) == jinja(source, msgs[:k], gen)
                n += 1
    assert n > 100


roles = st.sampled_from(["system", "user", "assistant", "tool"])
contents = st.lists(st.sampled_from(["a", "\n", " ", "<|im_start|>", "<|im_end|>", "{{ x }}", "{% if %}", "é",
                                     "<think>", "</think>", "<tool_response>", "</tool_response>", "\n\n",
                                     "\U0001F600", "'", '"', "\\", ""]), max_size=12).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(roles, contents), max_size=6), st.booleans(), st.sampled_from(sorted(SOURCES)))
def test_adversarial_conversations(msgs: list[tuple[str, str]], gen: bool, name: str) -> None:
    native = native_renderer(SOURCES[name])
    assert native is not None
    try:
        expected = jinja(SOURCES[name], msgs, gen)
    except jinja2.exceptions.UndefinedError:   # Qwen3's reads messages[0]: both refuse an empty conversation
        with pytest.raises(ValueError):
            native(msgs, gen)
        return
    assert native(msgs, gen) == expected


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(roles, contents), min_size=1, max_size=8), st.booleans())
def test_adversarial_qwen3(msgs: list[tuple[str, str]], gen: bool) -> None:
    """Qwen3's renderer has the most logic (last real user query, <think> splitting, tool-response grouping)."""
    native = native_renderer(SOURCES["qwen3"])
    assert native is not None
    assert native(msgs, gen) == jinja(SOURCES["qwen3"], msgs, gen)
