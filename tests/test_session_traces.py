"""Replay real agent sessions (mini-swe-agent trajectories, each call's prompt = all earlier messages in a ChatML
template, sent whole) through Session.sync and compare every step with a full reference encode."""

import os

import numpy as np
import pytest
from realtext import traces_dir

import tokenplane
from tokenplane.tokenize.evidence import traces

TRACES = traces_dir()


def load_trajectories(limit=None):
    found = traces.load_trajectories(TRACES, limit=limit)
    if not found:
        pytest.fail(f"no trajectories in {TRACES} (shipped in tests/fixtures/traces, or TOKENPLANE_DATA)")
    return found


render_prompts = traces.render_prompts


def _replay(tok, messages, allowed=()):
    sess = tok.session(allowed_special=allowed)
    prompts = render_prompts(messages)
    for prompt in prompts:
        sess.sync(prompt)
        assert np.array_equal(sess.ids, tok.encode(prompt, allowed_special=allowed)), len(prompt)
    assert sess.text == prompts[-1]
    return sess.stats, len(prompts)


def test_render_prompts_are_extensions():
    messages = load_trajectories(limit=1)[0]
    prompts = render_prompts(messages)
    assert len(prompts) == sum(m["role"] == "assistant" for m in messages)
    assert all(b.startswith(a) for a, b in zip(prompts, prompts[1:]))
    assert prompts[0].startswith("<|im_start|>system\n")


@pytest.mark.parametrize("name", ["o200k_base", "qwen3", "smollm2"])
def test_replay_exact_and_first_window(name):
    tok = tokenplane.load(name)
    repairs = accepted = 0
    for messages in load_trajectories(limit=2):
        stats, steps = _replay(tok, messages[:24])
        repairs += stats.repairs
        accepted += stats.first_window_accepts
        assert stats.full_fallbacks == 0
    assert repairs > 10 and accepted == repairs


@pytest.mark.parametrize("name", ["qwen3", "smollm2"])      # both are ChatML: <|im_start|>, <|im_end|>
def test_replay_with_specials_allowed(name):
    """The chat-template markers become special IDs (hard boundaries) when allowed."""
    tok = tokenplane.load(name)
    messages = load_trajectories(limit=3)[2]
    stats, _ = _replay(tok, messages[:16], allowed="all")
    assert stats.full_fallbacks == 0


@pytest.mark.campaign
@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base", "llama3", "qwen3", "deepseek_v4", "smollm2"])
def test_replay_campaign(name):
    tok = tokenplane.load(name)
    limit = int(os.environ.get("TOKENPLANE_TRACE_LIMIT", "0")) or None
    repairs = accepted = widenings = fallbacks = 0
    for messages in load_trajectories(limit=limit):
        stats, _ = _replay(tok, messages)
        repairs += stats.repairs
        accepted += stats.first_window_accepts
        widenings += stats.widenings
        fallbacks += stats.full_fallbacks
    print(f"{name}: {repairs} repairs, first-window {accepted}, widenings {widenings}, fallbacks {fallbacks}")
    assert fallbacks == 0


def test_replay_with_mid_context_edits():
    """Clients that rewrite history (truncate an old tool output) resend a non-extension: the changed middle is
    repaired on both sides, certified on real text."""
    tok = tokenplane.load("o200k_base")
    messages = load_trajectories(limit=2)[1][:14]
    sess = tok.session()
    for k, prompt in enumerate(render_prompts(messages)):
        sess.sync(prompt)
        if k >= 2:
            edited = [dict(m) for m in messages]
            edited[1]["content"] = edited[1]["content"][: len(edited[1]["content"]) // 2] + "\n[truncated]\n"
            shorter = render_prompts(edited)[k]
            sp = sess.sync(shorter)
            assert sp.path == "window" and sp.keep > 0
            assert np.array_equal(sess.ids, tok.encode(shorter))
            sess.sync(prompt)
            assert np.array_equal(sess.ids, tok.encode(prompt))
