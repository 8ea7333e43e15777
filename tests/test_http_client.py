"""The tier's upstream HTTP/1.1 client (serve/http_client.py) against a scripted raw server: connections kept and
reused, a kept connection the server closed while idle retried once on a new one, every body framing decoded, a
response abandoned before its end closes its connection, timeouts and refused connections reported as such."""

from __future__ import annotations

import asyncio

import pytest

from tokenplane.serve.http_client import ConnectFailed, HTTPClient, ProtocolError


class Scripted:
    """A raw server: each request on a connection gets the next answer from `answers` (bytes, or a callable that
    takes the writer); counts connections and requests."""

    def __init__(self, answers: list) -> None:
        self.answers = answers
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.base_events.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                answer = self.answers.pop(0)
                if callable(answer):
                    await answer(writer)
                else:
                    writer.write(answer)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


def fixed(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def chunked(*parts: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n")


def run(coro):
    return asyncio.run(coro)


def test_kept_connection_reused_and_bodies_decoded():
    async def go():
        srv = Scripted([fixed(b'{"a": 1}'), chunked(b"data: 1\n\n", b"data: [DONE]\n\n"), fixed(b"")])
        async with srv as url:
            client = HTTPClient()
            r = await client.request("POST", url + "/v1/completions", b'{"prompt": [1, 2]}')
            assert r.status_code == 200 and await r.aread() == b'{"a": 1}'
            r = await client.request("POST", url + "/v1/completions", b"x" * 100_000)   # head and body apart
            assert [line async for line in r.lines()] == [b"data: 1", b"", b"data: [DONE]", b""]
            await r.aclose()
            r = await client.request("GET", url + "/v1/models?x=1")
            assert await r.aread() == b""
            await client.aclose()
        assert srv.connections == 1 and len(srv.requests) == 3
        assert srv.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
        assert srv.requests[0].endswith(b'Content-Length: 18\r\n\r\n{"prompt": [1, 2]}')
        assert srv.requests[1].endswith(b"x" * 100_000) and srv.requests[2].startswith(b"GET /v1/models?x=1 ")
    run(go())


def test_abandoned_or_closing_responses_close_their_connection():
    async def go():
        srv = Scripted([chunked(b"data: 1\n\n", b"data: 2\n\n"), fixed(b"ok", b"Connection: close\r\n"),
                        fixed(b"again")])
        async with srv as url:
            client = HTTPClient()
            r = await client.request("POST", url + "/", b"{}")
            async for _ in r.chunks():
                break   # left before the end: the connection cannot be reused
            await r.aclose()
            r = await client.request("POST", url + "/", b"{}")
            assert await r.aread() == b"ok"   # the server said close
            r = await client.request("POST", url + "/", b"{}")
            assert await r.aread() == b"again"
            await client.aclose()
        assert srv.connections == 3
    run(go())


def test_until_close_body_and_finish_after_done():
    async def go():
        async def until_close(writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.0 200 OK\r\n\r\nall of it")
            await writer.drain()
            writer.close()
        srv = Scripted([until_close, chunked(b"data: [DONE]\n\n"), fixed(b"kept")])
        async with srv as url:
            client = HTTPClient()
            r = await client.request("POST", url + "/", b"{}")
            assert await r.aread() == b"all of it"
            r = await client.request("POST", url + "/", b"{}")
            async for _ in r.lines():
                break
            await r.finish(1.0)   # the rest (the terminating chunk) read: the connection stays
            r = await client.request("POST", url + "/", b"{}")
            assert await r.aread() == b"kept"
            await client.aclose()
        assert srv.connections == 2
    run(go())


def test_kept_connection_dropped_before_an_answer_is_retried_once():
    """A kept connection that the server drops on the next request (its idle timeout racing the request) gets the
    request again on a new connection; one that is seen closed while idle is not used at all."""
    async def drop(writer: asyncio.StreamWriter) -> None:
        writer.close()

    async def answer_then_close(writer: asyncio.StreamWriter) -> None:
        writer.write(fixed(b"three"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()   # an idle keep-alive timeout, seen by the client before its next request

    async def go():
        srv = Scripted([fixed(b"one"), drop, answer_then_close, fixed(b"four")])
        async with srv as url:
            client = HTTPClient()
            assert await (await client.request("POST", url + "/", b"{}")).aread() == b"one"
            r = await client.request("POST", url + "/", b"{}")   # dropped on the kept connection, sent again
            assert await r.aread() == b"three"
            await asyncio.sleep(0.2)
            assert await (await client.request("POST", url + "/", b"{}")).aread() == b"four"
            await client.aclose()
        assert srv.connections == 3 and len(srv.requests) == 4
    run(go())


def test_errors_refused_timeout_bad_answer():
    async def go():
        client = HTTPClient(connect_timeout=2.0, read_timeout=0.2)
        srv = Scripted([])
        async with srv as url:
            pass
        with pytest.raises(ConnectFailed):   # nothing listens there any more
            await client.request("POST", url + "/", b"{}")

        async def silent(writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(1.0)
        srv = Scripted([silent, b"SMTP ready\r\n\r\n"])
        async with srv as url:
            with pytest.raises(TimeoutError):
                await client.request("POST", url + "/", b"{}")
            with pytest.raises(ProtocolError):
                await client.request("POST", url + "/", b"{}")
        await client.aclose()
    run(go())


@pytest.mark.parametrize("use_uvloop", [False, True])
def test_body_in_pieces_arrives_whole(use_uvloop):
    """A body given as pieces (bytes and memoryviews of larger bytes, as ids_json.RequestBodies.chunks makes them)
    arrives as their concatenation with its Content-Length, small (joined) or large (written piece by piece), on
    asyncio's loop and on uvloop's (whose writelines takes the pieces as they are)."""
    if use_uvloop:
        uvloop = pytest.importorskip("uvloop")
    big = bytes(range(256)) * 4096
    small = (b'{"prompt":[', memoryview(b"xx1,2,3yy")[2:7], b"]}")
    large = (b"head", memoryview(big)[5:700_005], b",", memoryview(big)[:3], big[:300_000], b"]}")

    async def go():
        srv = Scripted([fixed(b"a"), fixed(b"b"), fixed(b"c")])
        async with srv as url:
            client = HTTPClient()
            for body in (small, large, [bytes(big[:10])]):
                r = await client.request("POST", url + "/", body)
                await r.aread()
            await client.aclose()
        for got, body in zip(srv.requests, (small, large, [big[:10]])):
            want = b"".join(body)
            assert got.endswith(b"\r\n\r\n" + want) and b"Content-Length: %d\r\n" % len(want) in got
    if use_uvloop:
        uvloop.run(go())
    else:
        run(go())
