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


_TEMPLATES: dict[str, object] = {}


def template(name: str):
    """ChatTemplate over the qwen3 tokenizer (its specials) with the named source (built once)."""
    if name not in _TEMPLATES:
        from tokenplane.serve.chat import ChatTemplate
        from tokenplane.tokenize.registry import load
        _TEMPLATES[name] = ChatTemplate(load("qwen3"), SOURCES[name])
    return _TEMPLATES[name]


def _extended(t, old, new) -> str | None:
    """extend's text checked against the full renders (None when extend declines)."""
    from tokenplane.serve.errors import InvalidRequest
    tail = t.extend(old, new)
    try:
        want_old, want_new = t.render(old), t.render(new)
    except InvalidRequest:
        assert tail is None
        return None
    if tail is not None:
        assert want_old + tail == want_new
    return tail


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_extend_real_conversations(name: str) -> None:
    """render(old) + extend(old, new) == render(new) for every prefix pair of real agent conversations, and the
    shortcut is taken for most of them (an agent's next turn appends an assistant answer and a user message)."""
    t = template(name)
    taken = tried = 0
    for conv in conversations(20):
        msgs = [(m["role"], m["content"]) for m in conv]
        for k in range(1, len(msgs)):
            for j in (1, 2, 3):
                if k + j <= len(msgs):
                    tried += 1
                    taken += _extended(t, msgs[:k], msgs[:k + j]) is not None
    assert tried > 100 and taken > tried // 3, (taken, tried)


roles_dev = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
messages_st = st.lists(st.tuples(roles_dev, contents | st.sampled_from([
    "<think>\nplan\n</think>\n\nanswer", "<tool_response>\nx\n</tool_response>", "<think>a</think>b",
    "\n\n<think>\n\n</think>\n\n"])), min_size=1, max_size=7)


@settings(max_examples=600, deadline=None)
@given(messages_st, messages_st, st.sampled_from(sorted(SOURCES)))
def test_extend_adversarial(old: list[tuple[str, str]], added: list[tuple[str, str]], name: str) -> None:
    """Reasoning kept or dropped as the last real query moves, tool-response grouping across the join, system and
    developer turns after the first, control-token text in contents: extend is exact or declines."""
    _extended(template(name), old, old + added)


def test_extend_declines_for_jinja_templates_and_non_extensions() -> None:
    from tokenplane.serve.chat import ChatTemplate
    from tokenplane.tokenize.registry import load
    t = ChatTemplate(load("qwen3"), CHATML_TEMPLATE + " ")   # rendered by the sandbox
    msgs = [("user", "a"), ("assistant", "b"), ("user", "c")]
    assert t.extend(msgs[:1], msgs) is None
    q = template("qwen3")
    assert q.extend([], msgs) is None and q.extend(msgs, msgs) is None
    # the old last turn's reasoning is dropped once a new query follows: not an extension of the old text
    old = [("user", "q"), ("assistant", "<think>r</think>a")]
    new = old + [("user", "q2")]
    assert not q.render(new).startswith(q.render(old)) and q.extend(old, new) is None
