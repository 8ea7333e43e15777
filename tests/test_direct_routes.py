"""The hot routes' body reader (direct_routes.BodyRequest) and a chunked upload through the tier's hot chat route:
the body arrives whole whatever its framing, a client that leaves mid-body is a ClientDisconnect, and the body limit
counts chunked uploads."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from servers import ThreadServer
from starlette.requests import ClientDisconnect
from test_serve_upstream import Engine, engine_server

import tokenplane
from tokenplane.serve.app import create_app
from tokenplane.serve.chat import template_for
from tokenplane.serve.config import Limits
from tokenplane.serve.direct_routes import BodyRequest
from tokenplane.serve.upstream import UpstreamPool

SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}


def _receiver(messages: list[dict]):
    it = iter(messages)

    async def receive() -> dict:
        return next(it)
    return receive


@pytest.mark.parametrize("pieces", [[b"abc"], [b"a", b"", b"bc", b"d" * 70000], [b""]])
def test_body_joins_every_message_once(pieces):
    messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)]

    async def go() -> tuple[bytes, bytes]:
        request = BodyRequest(SCOPE, _receiver(messages))
        return await request.body(), await request.body()   # the second call reads nothing more
    first, again = asyncio.run(go())
    assert first == again == b"".join(pieces)


def test_body_refuses_a_client_that_left_mid_body():
    messages = [{"type": "http.request", "body": b"{\"mess", "more_body": True}, {"type": "http.disconnect"}]
    with pytest.raises(ClientDisconnect):
        asyncio.run(BodyRequest(SCOPE, _receiver(messages)).body())


@pytest.fixture(scope="module")
def tok():
    return tokenplane.load("qwen3")


def test_chunked_upload_through_the_hot_chat_route(tok):
    """A body sent in chunks (no Content-Length) reaches the engine as the exact IDs; one over the limit is a 413."""
    engine = Engine("A")
    with engine_server(tok, engine) as es:
        app = create_app(None, tok, model_name="tier", upstream=UpstreamPool([es.url]),
                         limits=Limits(max_prompt_chars=1 << 22, max_body_bytes=1 << 16))
        with ThreadServer(app) as t:
            msgs = [{"role": "user", "content": "chunked é 漢 " * 300}]
            raw = json.dumps({"messages": msgs, "max_tokens": 1}).encode()

            def pieces(data: bytes):
                for i in range(0, len(data), 1000):
                    yield data[i:i + 1000]
            r = httpx.post(t.url + "/v1/chat/completions", content=pieces(raw),
                           headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
            assert engine.prompts[-1] == list(template_for(tok).encode([(m["role"], m["content"]) for m in msgs]))
            served = app.direct.served
            big = json.dumps({"messages": [{"role": "user", "content": "x" * 70000}]}).encode()
            r = httpx.post(t.url + "/v1/chat/completions", content=pieces(big),
                           headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
            assert app.direct.served == served + 1   # refused while the hot route read it, not before
