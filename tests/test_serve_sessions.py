"""Agent conversations through the real HTTP server with the official `openai` client: every turn's prompt IDs equal a
full encode of the rendered prompt, and the conversation's session is reused from the second turn on.

The backend here only records the prompt IDs it is handed and answers one token: what is under test is the path from
the request body to the IDs the engine would decode from."""

from __future__ import annotations

import openai
import pytest
from realtext import conversations, traces_dir
from servers import ReplyBackend, ThreadServer

import tokenplane
from tokenplane.serve.app import create_app
from tokenplane.serve.chat import template_for
from tokenplane.serve.config import Limits

MODEL = "recorder"


def trajectories(limit: int) -> list[list[dict[str, str]]]:
    convs = conversations(limit)
    if not convs:
        pytest.skip(f"no agent trajectories in {traces_dir()}")
    return convs


@pytest.fixture(scope="module")
def tok():
    return tokenplane.load("qwen3")


def test_real_trajectories_reuse_sessions_with_exact_ids(tok):
    backend = ReplyBackend([151645], "recorder")
    app = create_app(backend, tok, model_name=MODEL, limits=Limits(max_prompt_chars=1 << 22))
    template = template_for(tok)
    convs = trajectories(20)
    with ThreadServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        turns = reused = 0
        for n, messages in enumerate(convs):
            calls = [i for i, m in enumerate(messages) if m["role"] == "assistant"][:6]
            for k, i in enumerate(calls):
                prompt = messages[:i]
                out = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=1,
                                                     extra_body={"prompt_cache_key": f"traj-{n}"})
                want = template.encode([(m["role"], m["content"]) for m in prompt])
                assert backend.prompts[-1] == want, f"trajectory {n} call {k}: prompt IDs differ from a full encode"
                report = out.model_extra["tokenization"]
                assert report["reused_tokens"] + report["new_tokens"] == len(want)
                if k:
                    assert report["path"] == "session", (n, k, report)
                    reused += report["reused_tokens"]
                turns += 1
    assert len(convs) >= 20 and turns >= 60 and reused > 0
