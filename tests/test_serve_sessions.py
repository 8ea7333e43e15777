"""Agent conversations through the real HTTP server with the official `openai` client: every turn's prompt IDs equal a
full encode of the rendered prompt, and the conversation's session is reused from the second turn on.

The backend here only records the prompt IDs it is handed and answers one token: what is under test is the path from
the request body to the IDs the engine would decode from."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from realtext import conversations, traces_dir
from servers import ThreadServer

import tokenplane
from tokenplane.serve.app import create_app
from tokenplane.serve.backends import BackendHealth, Chunk, ModelStatus
from tokenplane.serve.chat import template_for
from tokenplane.serve.config import Limits

MODEL = "recorder"


class RecordingBackend:
    max_model_len = 1 << 20
    vocab_size = 151_936

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    async def start(self) -> None:
        return None

    async def generate(self, prompt_ids: Any, params: Any, request_id: str) -> Any:
        self.prompts.append(list(prompt_ids))
        yield Chunk([151645], "stop", {})

    def abort(self, request_id: str) -> None:
        return None

    def health(self) -> BackendHealth:
        return BackendHealth([ModelStatus("recorder", "ready")])

    def close(self) -> None:
        return None


def trajectories(limit: int) -> list[list[dict[str, str]]]:
    convs = conversations(limit)
    if not convs:
        pytest.skip(f"no agent trajectories in {traces_dir()}")
    return convs


@pytest.fixture(scope="module")
def tok():
    return tokenplane.load("qwen3")


def test_real_trajectories_reuse_sessions_with_exact_ids(tok):
    backend = RecordingBackend()
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
