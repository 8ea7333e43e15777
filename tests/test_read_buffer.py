"""uvicorn's body flow-control limit raised for the servers (serve/read_buffer.py): set in every protocol uvicorn has,
never lowered, and with it raised a large body still arrives whole (httptools and h11) while the body limit still
refuses an oversized chunked upload."""

from __future__ import annotations

import importlib

import httpx
import pytest
from servers import ThreadServer

from tokenplane.serve.middleware import GuardMiddleware
from tokenplane.serve.read_buffer import raise_body_high_water


@pytest.fixture
def restored(monkeypatch):
    """The constants put back after the test (they are process-wide)."""
    for name in ("httptools_impl", "h11_impl"):
        try:
            module = importlib.import_module(f"uvicorn.protocols.http.{name}")
        except ImportError:
            continue
        monkeypatch.setattr(module, "HIGH_WATER_LIMIT", module.HIGH_WATER_LIMIT)


async def echo_length(scope, receive, send):
    assert scope["type"] == "http"
    chunks, more = [], True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = b"".join(chunks)
    out = b"%d %d" % (len(body), sum(body[::4096]))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(out))]})
    await send({"type": "http.response.body", "body": out})


def test_limit_set_and_never_lowered(restored):
    h11 = importlib.import_module("uvicorn.protocols.http.h11_impl")
    assert "h11_impl" in raise_body_high_water(3 << 20) and h11.HIGH_WATER_LIMIT == 3 << 20
    assert raise_body_high_water(1 << 10) == [] and h11.HIGH_WATER_LIMIT == 3 << 20


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_large_bodies_whole_and_body_limit_kept(restored, http):
    if http == "httptools":
        pytest.importorskip("httptools")
    raise_body_high_water(1 << 20)
    app = GuardMiddleware(echo_length, metrics=None, max_body_bytes=6 << 20)
    body = bytes(range(251)) * 20_000   # 5 MB, past the limit five times over
    with ThreadServer(app, http=http) as t:
        r = httpx.post(t.url + "/", content=body, timeout=30)
        assert r.status_code == 200 and r.text == f"{len(body)} {sum(body[::4096])}"

        def chunked():
            for _ in range(8):
                yield body[:1 << 20]
        r = httpx.post(t.url + "/", content=chunked(), timeout=30)   # 8 MB without a content-length
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
