"""The tier in front of vLLM's gRPC engine service (`tokenplane serve --upstream grpc://HOST:PORT`).

The wire format is written and read by hand (serve/grpc_wire.py), so every message is checked against the official
generated classes (smg-grpc-proto, the package vLLM's servicer is built on). The upstream in the end-to-end tests is
a real gRPC server (grpcio) answering with those classes, one token per message as vLLM's servicer streams; the same
conversation through the HTTP tier and the gRPC tier must reach its upstream with the same IDs every turn. The
campaign test against a real vLLM gRPC server is in test_tier_vllm.py."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest
from servers import ThreadServer
from smg_grpc_proto import vllm_engine_pb2 as pb
from test_serve_upstream_ids import ANSWER, IdOnlyEngine, expected_logprobs, reply_ids, vllm_logprobs

import tokenplane
from tokenplane.serve.app import create_app
from tokenplane.serve.config import Limits
from tokenplane.serve.grpc_wire import (
    VARINT_IDS,
    WireError,
    generate_body,
    read_model_info,
    read_output,
    read_varints,
    request_id_field,
    sampling_params,
    varint,
    varint_run,
)
from tokenplane.serve.ids_json import IdsOrigin, RequestBodies
from tokenplane.serve.upstream import UpstreamPool


@pytest.fixture(scope="module")
def tok():
    return tokenplane.load("qwen3")


# ---- the wire format against the official classes ------------------------------------------------------------

def test_varints_match_protobuf():
    rng = np.random.default_rng(0)
    for ids in ([], [0], [127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**28, 2**32 - 1],
                rng.integers(0, 151_936, 5000).tolist()):
        official = pb.TokenizedInput(input_ids=ids).SerializeToString()
        run = varint_run(np.asarray(ids, dtype=np.uint32))
        assert official == (b"\x12" + varint(len(run)) + run if ids else b"")
        assert read_varints(run) == ids
    assert varint(-1) == pb.SamplingParams(seed=-1).SerializeToString()[2:]   # int32 -1: ten bytes
    assert varint_run(np.asarray([5, 300], dtype=np.int64)) == varint_run([5, 300]) == b"\x05\xac\x02"
    for bad in ([-1], [1 << 32]):
        with pytest.raises(WireError):
            varint_run(np.asarray(bad, dtype=np.int64))


def test_generate_request_parses_as_the_official_message():
    ids = np.asarray([5, 151_643, 300, 1 << 20], dtype=np.uint32)
    fields = {"model": "m", "max_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "n": 2, "seed": -3,
              "ignore_eos": True, "stop_token_ids": [151_645, 151_643], "stream": True,
              "return_tokens_as_token_ids": True, "min_p": 0.05, "repetition_penalty": 1.1}
    run = varint_run(ids)
    raw = b"".join((request_id_field("req-1"), *generate_body(fields, [run[:3], memoryview(run)[3:]], len(run))))
    req = pb.GenerateRequest.FromString(raw)
    assert req.request_id == "req-1" and req.stream is True and req.WhichOneof("input") == "tokenized"
    assert list(req.tokenized.input_ids) == ids.tolist()
    sp = req.sampling_params
    assert sp.max_tokens == 7 and sp.HasField("max_tokens") and sp.n == 2 and sp.seed == -3 and sp.ignore_eos
    assert sp.temperature == np.float32(0.7) and sp.top_p == np.float32(0.9) and sp.top_k == 20
    assert sp.min_p == np.float32(0.05) and sp.repetition_penalty == np.float32(1.1)
    assert list(sp.stop_token_ids) == [151_645, 151_643]
    assert not sp.HasField("logprobs") and not sp.skip_special_tokens and list(sp.stop) == []
    # left out: temperature unset (vLLM's servicer then samples at 1.0), top_k <= 0 (no limit), no max_tokens
    sp = pb.SamplingParams.FromString(sampling_params({"top_k": -1, "temperature": None}))
    assert not sp.HasField("temperature") and sp.top_k == 0 and not sp.HasField("max_tokens")
    # logprobs: in the fields only when the client asked (0: the sampled token's alone)
    assert [pb.SamplingParams.FromString(sampling_params({"logprobs": k})).logprobs for k in (0, 5)] == [0, 5]
    assert pb.SamplingParams.FromString(sampling_params({"logprobs": 0})).HasField("logprobs")


def test_answers_read_as_the_official_messages_write_them():
    chunk = pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[9, 200_000], prompt_tokens=12,
                                                              completion_tokens=2, cached_tokens=8, index=1))
    out = read_output(chunk.SerializeToString())
    assert not out.complete and out.token_ids == [9, 200_000] and out.index == 1
    assert (out.prompt_tokens, out.completion_tokens, out.cached_tokens) == (12, 2, 8)
    done = pb.GenerateResponse(complete=pb.GenerateComplete(output_ids=[4], finish_reason="stop", prompt_tokens=3,
                                                            completion_tokens=1, index=0, matched_token_id=151_645))
    out = read_output(done.SerializeToString())
    assert out.complete and out.finish_reason == "stop" and out.stop_reason == 151_645 and out.index == 0
    done = pb.GenerateComplete(finish_reason="stop", matched_stop_str="END", output_logprobs=pb.OutputLogProbs(
        token_logprobs=[-0.5], token_ids=[3]))
    out = read_output(pb.GenerateResponse(complete=done).SerializeToString())
    assert out.stop_reason == "END" and out.token_ids == []   # the logprobs' IDs are another message's
    assert out.logprobs is not None and out.logprobs.token_ids == [3] and out.logprobs.values == [-0.5]
    lp = pb.OutputLogProbs(token_logprobs=[-0.25, float("-inf")], token_ids=[7, 151_000], top_logprobs=[
        pb.TopLogProbs(values=[-0.25, -2.0], token_ids=[7, 8]), pb.TopLogProbs(values=[-1e-3], token_ids=[1 << 20])])
    out = read_output(pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[7, 151_000], output_logprobs=lp))
                      .SerializeToString())
    assert out.logprobs is not None and out.logprobs.token_ids == [7, 151_000]
    assert out.logprobs.values == [-0.25, float("-inf")]
    assert out.logprobs.top == [[(7, -0.25), (8, -2.0)], [(1 << 20, np.float32(-1e-3))]]
    info = pb.GetModelInfoResponse(model_path="/m", served_model_name="tiny", max_context_length=4096,
                                   vocab_size=151_936, default_sampling_params_json='{"temperature": 0.6, '
                                   '"top_k": 20, "max_new_tokens": 99, "bogus": 1}')
    got = read_model_info(info.SerializeToString())
    assert got.served_model_name == "tiny" and got.max_context_length == 4096 and got.vocab_size == 151_936
    assert got.default_sampling == {"temperature": 0.6, "top_k": 20, "max_tokens": 99}


def test_malformed_messages_are_wire_errors():
    raw = pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[300, 5])).SerializeToString()
    for bad in (raw[:-1], raw[:3], b"\x0f", b"\x08"):   # cut inside a run, a length, a key's wire type 7, a varint
        with pytest.raises(WireError):
            read_output(bad)
    with pytest.raises(WireError):
        read_varints(b"\x80")
    uneven = pb.OutputLogProbs(token_logprobs=[-0.5], token_ids=[1, 2])
    with pytest.raises(WireError, match="unequal"):
        read_output(pb.GenerateResponse(chunk=pb.GenerateStreamChunk(output_logprobs=uneven)).SerializeToString())


@pytest.mark.parametrize("seed", range(3))
def test_varint_bodies_reuse_the_previous_turn_exactly(seed):
    """Splices of a session's IDs: a body built on the previous one equals one written from scratch."""
    rng = random.Random(seed)
    bodies = RequestBodies(codec=VARINT_IDS)
    ids = np.asarray([rng.randrange(200_000) for _ in range(rng.randrange(1, 50))], dtype=np.uint32)
    rev = 1
    bodies.chunks({}, ids, IdsOrigin("s", 0, rev, 0))
    for _ in range(300):
        keep = rng.randrange(0, len(ids) + 1) if rng.random() < 0.3 else max(0, len(ids) - rng.randrange(0, 5))
        new = np.concatenate([ids[:keep], np.asarray([rng.choice((rng.randrange(128), rng.randrange(200_000)))
                                                       for _ in range(rng.randrange(0, 40))], dtype=np.uint32)])
        if len(new) == 0:
            continue
        fields = {"max_tokens": rng.randrange(1, 9)}
        got = b"".join(bodies.chunks(fields, new, IdsOrigin("s", rev, rev + 1, keep)))
        assert got == b"".join(RequestBodies(codec=VARINT_IDS).chunks(fields, new))
        assert list(pb.GenerateRequest.FromString(got).tokenized.input_ids) == new.tolist()
        ids, rev = new, rev + 1
    assert bodies.reused > 200


# ---- a real gRPC upstream -------------------------------------------------------------------------------------

class GrpcEngine:
    """vLLM's gRPC servicer as seen on the wire: answers `reply` one token per message, then a completion per
    choice; ends on a stop token ID or max_tokens. A synchronous grpcio server (the tier's client is grpc.aio)."""

    def __init__(self, reply: list[int], delay_s: float = 0.0, fail: str | None = None) -> None:
        self.reply, self.delay_s, self.fail = reply, delay_s, fail
        self.requests: list[Any] = []
        self.completed: list[bool] = []
        self.cancelled: list[bool] = []

    def _generate(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        if self.fail:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.fail)
        slot = len(self.completed)
        self.completed.append(False)
        self.cancelled.append(False)

        def gone() -> None:
            if not self.completed[slot]:
                self.cancelled[slot] = True
        context.add_callback(gone)
        sp, n_prompt = request.sampling_params, len(request.tokenized.input_ids)
        limit = sp.max_tokens if sp.HasField("max_tokens") else len(self.reply)
        stops = set(sp.stop_token_ids)
        for i, t in enumerate(self.reply[:limit]):
            if self.delay_s:
                time.sleep(self.delay_s)
            if not context.is_active():
                return
            lp = {}
            if sp.HasField("logprobs"):   # as vLLM's servicer: the first k entries of vLLM's dict
                top = list(vllm_logprobs(t, sp.logprobs).items())[:sp.logprobs]
                lp["output_logprobs"] = pb.OutputLogProbs(token_logprobs=[-0.5], token_ids=[t], top_logprobs=[
                    pb.TopLogProbs(values=[v for _, v in top], token_ids=[x for x, _ in top])] if top else [])
            yield pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[t], prompt_tokens=n_prompt,
                                                                    completion_tokens=1, index=0, **lp))
            if t in stops or i == min(limit, len(self.reply)) - 1:
                kw = {"matched_token_id": t} if t in stops else {}
                self.completed[slot] = True
                yield pb.GenerateResponse(complete=pb.GenerateComplete(
                    output_ids=[t], finish_reason="stop" if t in stops else "length", prompt_tokens=n_prompt,
                    completion_tokens=1, index=0, **kw))
                return

    def _model_info(self, request: Any, context: Any) -> Any:
        return pb.GetModelInfoResponse(served_model_name="grpc-engine", max_context_length=1 << 20,
                                       vocab_size=151_936)

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def __enter__(self) -> GrpcEngine:
        self.server = grpc.server(ThreadPoolExecutor(max_workers=8))
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._generate, request_deserializer=pb.GenerateRequest.FromString,
                response_serializer=pb.GenerateResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self._model_info, request_deserializer=pb.GetModelInfoRequest.FromString,
                response_serializer=pb.GetModelInfoResponse.SerializeToString)}
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("vllm.grpc.engine.VllmEngine",
                                                                                  handlers)])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0).wait(10)


def tier(tok, *urls: str, model: str | None = None) -> ThreadServer:
    return ThreadServer(create_app(None, tok, model_name="tier", upstream=UpstreamPool(list(urls), model=model,
                                                                                      answers_ids=True),
                                   limits=Limits(max_prompt_chars=1 << 20)))


def test_answers_decoded_and_every_turn_forwards_the_http_tiers_ids(tok):
    """Streamed and not: text, finish_reason and usage as over HTTP; a multi-turn conversation reaches the gRPC
    upstream with the same IDs as an HTTP ID-only upstream, turn by turn (the varint bodies reuse earlier turns)."""
    reply = reply_ids(tok)
    with GrpcEngine(reply) as g, tier(tok, g.url) as tg:
        cg = openai.OpenAI(base_url=tg.url + "/v1", api_key="x")
        assert [m.id for m in cg.models.list().data] == ["tier"]
        chunks = list(cg.chat.completions.create(model="tier", messages=[{"role": "user", "content": "hello"}],
                                                 stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == len(tok.encode(ANSWER, allowed_special="all")) + 1
        assert usage.prompt_tokens == len(g.requests[0].tokenized.input_ids)
        assert tok.specials["<|im_end|>"] in g.requests[0].sampling_params.stop_token_ids
        # a conversation, through both tiers
        messages: list[dict[str, str]] = [{"role": "system", "content": "be brief"}]
        engine_http = IdOnlyEngine(reply)
        with ThreadServer(engine_http.app) as h2, tier(tok, h2.url) as th2:
            ch = openai.OpenAI(base_url=th2.url + "/v1", api_key="x")
            for turn in range(5):
                messages.append({"role": "user", "content": f"turn {turn}: " + "naïve text 🎉 " * (turn * 40 + 1)})
                a = cg.chat.completions.create(model="tier", messages=messages)
                b = ch.chat.completions.create(model="tier", messages=messages)
                assert a.choices[0].message.content == b.choices[0].message.content == ANSWER
                assert a.usage is not None and b.usage is not None
                assert a.usage.prompt_tokens == b.usage.prompt_tokens
                messages.append({"role": "assistant", "content": a.choices[0].message.content})
            sent_http = [body["prompt"] for body in engine_http.bodies]
        sent_grpc = [list(r.tokenized.input_ids) for r in g.requests[1:]]
        assert sent_grpc == sent_http and len(sent_grpc) == 5
        assert all(len(a) < len(b) for a, b in zip(sent_grpc, sent_grpc[1:]))


def test_stop_string_cancels_the_call(tok):
    cut = ANSWER[:ANSWER.index("STOP")]
    with GrpcEngine(reply_ids(tok), delay_s=0.02) as g, tier(tok, g.url) as t:
        client = openai.OpenAI(base_url=t.url + "/v1", api_key="x")
        chunks = list(client.completions.create(model="tier", prompt="hello", stop=["STOP"], stream=True,
                                                stream_options={"include_usage": True}, max_tokens=64))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == cut
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(tok.encode("hello"))
        whole = client.completions.create(model="tier", prompt="hello", stop="STOP", max_tokens=64)
        assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
        short = client.completions.create(model="tier", prompt="hello", max_tokens=2)
        assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 2
        deadline = time.monotonic() + 5
        while not all(g.cancelled[:2]) and time.monotonic() < deadline:
            time.sleep(0.02)
    assert g.cancelled[:2] == [True, True] and g.completed[:2] == [False, False]
    assert g.completed[2] is True
    assert g.requests[2].sampling_params.max_tokens == 2 and not g.requests[2].sampling_params.stop


def test_upstream_errors_and_failover(tok):
    with GrpcEngine([1], fail="prompt too long for this model") as g, tier(tok, g.url) as t:
        r = httpx.post(t.url + "/v1/completions", json={"model": "tier", "prompt": "hi"}, timeout=30)
        assert r.status_code == 400 and "prompt too long" in r.json()["error"]["message"]
        s = httpx.post(t.url + "/v1/chat/completions", json={"model": "tier", "stream": True, "messages": [
            {"role": "user", "content": "hi"}]}, timeout=30)
        assert s.status_code == 400
    with GrpcEngine(reply_ids(tok)) as g:
        dead = "grpc://127.0.0.1:9"   # nothing listens on the discard port
        pool = UpstreamPool([dead, g.url], answers_ids=True)
        app = create_app(None, tok, model_name="tier", upstream=pool, limits=Limits(max_prompt_chars=1 << 20))
        with ThreadServer(app) as t:
            client = openai.OpenAI(base_url=t.url + "/v1", api_key="x", max_retries=0)
            for i in range(8):   # whichever is a conversation's home, it is answered
                chat = client.chat.completions.create(model="tier", messages=[{"role": "user", "content": f"q{i}"}])
                assert chat.choices[0].message.content == ANSWER
        assert pool.state[dead].failures >= 1 and pool.state[g.url].requests == 8
        with tier(tok, dead, model="m") as t:
            r = httpx.post(t.url + "/v1/completions", json={"model": "tier", "prompt": "hi"}, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable"


def test_vllm_sampling_parameters_reach_either_upstream(tok):
    """top_k, min_p and the penalties, which this project's engine refuses by name, are the upstream's to apply: the
    tier forwards them over HTTP and over gRPC alike."""
    extra = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5,
             "frequency_penalty": -0.25}
    engine = IdOnlyEngine(reply_ids(tok))
    with GrpcEngine(reply_ids(tok)) as g, ThreadServer(engine.app) as h, tier(tok, g.url) as tg, \
            tier(tok, h.url) as th:
        for url in (tg.url, th.url):
            r = httpx.post(url + "/v1/chat/completions", json={"model": "tier", "messages": [
                {"role": "user", "content": "hi"}], **extra}, timeout=30)
            assert r.status_code == 200, r.text
            r = httpx.post(url + "/v1/completions", json={"model": "tier", "prompt": "hi", "top_k": -2}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
    assert all(engine.bodies[0][k] == v for k, v in extra.items())
    sp = g.requests[0].sampling_params
    assert sp.top_k == 20 and sp.min_p == np.float32(0.05) and sp.repetition_penalty == np.float32(1.1)
    assert sp.presence_penalty == np.float32(0.5) and sp.frequency_penalty == np.float32(-0.25)


def test_logprobs_over_grpc(tok):
    """Asked only when the client asks (SamplingParams.logprobs), read from OutputLogProbs and written as text as over
    HTTP; the top entries are the servicer's (the first k of vLLM's dict), the sampled token alone at 0."""
    reply = reply_ids(tok)
    with GrpcEngine(reply) as g, tier(tok, g.url) as t:
        client = openai.OpenAI(base_url=t.url + "/v1", api_key="x")
        plain = client.completions.create(model="tier", prompt="hi", max_tokens=5)
        assert plain.choices[0].logprobs is None and not g.requests[-1].sampling_params.HasField("logprobs")
        for k in (0, 3):
            whole = client.completions.create(model="tier", prompt="hi", logprobs=k, max_tokens=40)
            assert g.requests[-1].sampling_params.logprobs == k
            n = whole.usage.completion_tokens
            tops = [dict(list(vllm_logprobs(x, k).items())[:k]) if k else {x: -0.5} for x in reply[:n]]
            assert whole.choices[0].logprobs.model_dump() == expected_logprobs(tok, reply[:n], tops)
        chunks = list(client.chat.completions.create(model="tier", messages=[{"role": "user", "content": "hi"}],
                                                     logprobs=True, top_logprobs=2, stream=True))
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        want = expected_logprobs(tok, reply[:len(content)], [dict(list(vllm_logprobs(x, 2).items())[:2])
                                                             for x in reply[:len(content)]])
        assert [e.token for e in content] == want["tokens"] and len(content) == len(reply) - 1
        assert [{e2.token: e2.logprob for e2 in e.top_logprobs} for e in content] == want["top_logprobs"]


def test_pools_speak_one_protocol():
    with pytest.raises(ValueError, match="all be grpc"):
        UpstreamPool(["grpc://127.0.0.1:1", "http://127.0.0.1:2"])
    assert UpstreamPool(["grpc://127.0.0.1:1"]).answers_ids is True
