"""A minimal HTTP/1.1 client on asyncio streams, with keep-alive connections per origin: the tier's upstream hop.

The tier makes one upstream request per agent turn and its own added latency is its product (target < 2 ms per
turn). A general client pays per request for what this hop never needs: aiohttp builds a ClientRequest and a
ClientResponse, a timer context, a header multidict, a payload object and a connector lookup per POST, ~0.35-0.5 ms
more to the first byte of a streamed answer than a request written as one buffer on a kept connection (measured
side by side against the tier's benchmark stub, 2 shared CPUs). This client writes the request line, four headers
and the body (large bodies as a second write, not a copy), reads the status line and headers, and reads the body
as it is framed (Content-Length, chunked, or until close).

Connections: kept per origin (LIFO, so the warmest one is reused) when a response was read to its end and neither
side said `Connection: close`; a response closed before its end closes its connection (that is how an upstream
learns the client left: vLLM aborts the request). A kept connection the server closed while idle (uvicorn closes
them after 5 s) fails on its next request before any byte of an answer: that request is retried once on a new
connection (as aiohttp and httpx do), since the server closed it without reading the request.

Errors: ConnectFailed (cannot connect, or the connection dropped before the response's head: the caller may try
another upstream), TimeoutError (connect or read timeout), ProtocolError (an answer that is not HTTP/1.x).
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

_JOIN_BELOW = 64 << 10      # bodies up to this go out in one write with the head (one copy is cheaper than a syscall)
_READ_LIMIT = 1 << 20       # StreamReader buffer limit: a response head or chunk-size line longer than this is refused
_MAX_IDLE = 64              # kept connections per origin
Body = bytes | Sequence[bytes | memoryview]


class HTTPClientError(Exception):
    """Base of this client's errors."""


class ConnectFailed(HTTPClientError):
    """No connection, or the connection dropped before the response's head arrived."""


class ProtocolError(HTTPClientError):
    """The peer's answer is not well-formed HTTP/1.x."""


@dataclass(frozen=True)
class Origin:
    """Where connections go (the pool's key): scheme, host, port."""
    scheme: str
    host: str
    port: int

    @classmethod
    def of(cls, url: str) -> Origin:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        return cls(u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80))

    @property
    def host_header(self) -> bytes:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (host if self.port == default else f"{host}:{self.port}").encode("idna" if host.isascii() else "utf-8")


class _Conn:
    __slots__ = ("reader", "writer", "loop")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.loop = asyncio.get_running_loop()

    def usable(self) -> bool:
        # Not reused: closed or closing, another loop's, stray bytes read past the last response (out of step), or
        # request bytes still unsent (a server that answered before reading the whole body).
        return (not self.writer.is_closing() and not self.reader.at_eof() and self.loop is asyncio.get_running_loop()
                and not self.reader._buffer   # type: ignore[attr-defined]
                and self.writer.transport.get_write_buffer_size() == 0)

    def close(self) -> None:
        try:
            self.writer.close()
        except RuntimeError:   # its loop is closed (a pool outliving a test server's loop)
            pass


class Response:
    """A response opened as a stream: status, headers (lower-cased names), then the body read once, whole (aread)
    or as it arrives (chunks, lines). close() returns the connection to its pool if the body was read to its end."""

    def __init__(self, client: HTTPClient, origin: Origin, conn: _Conn, status: int, headers: dict[str, str],
                 keep: bool, read_timeout: float | None) -> None:
        self._client, self._origin, self._conn = client, origin, conn
        self.status_code = status
        self.headers = headers
        self._keep = keep
        self._timeout = read_timeout
        self._done = False
        self._closed = False
        te = headers.get("transfer-encoding", "").lower()
        self._chunked = "chunked" in te
        length = headers.get("content-length")
        self._left: int | None = None if self._chunked or length is None else int(length)
        if status in (204, 304) or 100 <= status < 200:
            self._left = 0
        if not self._chunked and self._left is None:
            self._keep = False   # read until the server closes
        if self._left == 0:
            self._done = True

    async def _read(self, coro: Awaitable[bytes]) -> bytes:
        async with asyncio.timeout(self._timeout):
            return await coro

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's data as it arrives (chunked transfer decoded)."""
        reader = self._conn.reader
        try:
            while not self._done:
                if self._chunked:
                    line = await self._read(reader.readuntil(b"\n"))
                    size = int(line.split(b";", 1)[0].strip(), 16)
                    if size == 0:
                        while (await self._read(reader.readuntil(b"\n"))).strip():   # trailers, then the blank line
                            pass
                        self._done = True
                        break
                    data = await self._read(reader.readexactly(size + 2))
                    yield data[:-2]
                elif self._left is not None:
                    data = await self._read(reader.read(min(self._left, 1 << 20)))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", self._left)
                    self._left -= len(data)
                    self._done = self._left == 0
                    yield data
                else:
                    data = await self._read(reader.read(1 << 20))
                    if not data:
                        self._done = True
                        break
                    yield data
        except (ValueError, asyncio.LimitOverrunError) as exc:
            self._keep = False
            raise ProtocolError(f"bad chunked framing: {exc}") from None
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self._keep = False
            raise ConnectFailed(f"connection lost in the response body: {type(exc).__name__}") from None

    async def aread(self) -> bytes:
        parts = [data async for data in self.chunks()]
        await self.aclose()
        return b"".join(parts)

    async def lines(self) -> AsyncIterator[bytes]:
        """Lines without their endings, split here (no line-length limit: a chunk with many logprobs is long)."""
        rest = b""
        async for data in self.chunks():
            if rest:
                data = rest + data
            *done, rest = data.split(b"\n")
            for line in done:
                yield line[:-1] if line.endswith(b"\r") else line
        if rest:
            yield rest.rstrip(b"\r")

    async def finish(self, timeout: float) -> None:
        """Read what is left of the body (discarded) for at most `timeout` s, then close: a stream whose server
        ends it right after its last event (an SSE stream's terminating chunk follows `[DONE]`) keeps its
        connection; one that does not end in time is closed."""
        try:
            async with asyncio.timeout(timeout):
                async for _ in self.chunks():
                    pass
        except (TimeoutError, HTTPClientError):
            pass
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._done and self._keep:
            self._client._release(self._origin, self._conn)
        else:
            self._conn.close()


class HTTPClient:
    """Keep-alive connections per origin; `request` sends one request and returns its Response once the head is in.

    read_timeout bounds each wait for bytes from the server (not the whole response: a long generation streams)."""

    def __init__(self, *, connect_timeout: float = 5.0, read_timeout: float | None = 600.0,
                 ssl_context: _ssl.SSLContext | None = None) -> None:
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self._ssl = ssl_context
        self._idle: dict[Origin, list[_Conn]] = {}

    async def _connect(self, origin: Origin) -> _Conn:
        ssl: _ssl.SSLContext | None = None
        if origin.scheme == "https":
            ssl = self._ssl or _ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(origin.host, origin.port, ssl=ssl, limit=_READ_LIMIT)
        except TimeoutError:
            raise TimeoutError(f"connect to {origin.host}:{origin.port} timed out") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {origin.host}:{origin.port}: {exc}") from None
        return _Conn(reader, writer)

    def _release(self, origin: Origin, conn: _Conn) -> None:
        idle = self._idle.setdefault(origin, [])
        if len(idle) < _MAX_IDLE and conn.usable():
            idle.append(conn)
        else:
            conn.close()

    def _kept(self, origin: Origin) -> _Conn | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if conn.usable():
                return conn
            conn.close()
        return None

    async def request(self, method: str, url: str, body: Body = b"",
                      content_type: str = "application/json", timeout: float | None = None) -> Response:
        """Send; the head of the answer read. `timeout` (if given) replaces read_timeout for this request. `body`:
        bytes, or a sequence of pieces (bytes or byte memoryviews) written one after the other, never joined when
        large (the tier's bodies are views of earlier turns' bytes: ids_json.py)."""
        origin = Origin.of(url)
        path = _path_of(url)
        if not isinstance(body, bytes):
            body = tuple(body)
            size = sum(len(c) for c in body)   # bytes: the views are 1-D and of bytes
            if size <= _JOIN_BELOW:
                body = b"".join(body)
        else:
            size = len(body)
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (
            method.encode(), path.encode(), origin.host_header, content_type.encode(), size)
        read_timeout = self.read_timeout if timeout is None else timeout
        conn = self._kept(origin)
        if conn is not None:
            try:
                return await self._exchange(origin, conn, head, body, read_timeout)
            except ConnectFailed:
                pass   # closed by the server while idle: once more on a new connection
        return await self._exchange(origin, await self._connect(origin), head, body, read_timeout)

    async def _exchange(self, origin: Origin, conn: _Conn, head: bytes, body: bytes | tuple[bytes | memoryview, ...],
                        read_timeout: float | None) -> Response:
        try:
            if not isinstance(body, bytes):   # large, in pieces
                conn.writer.write(head)
                conn.writer.writelines(body)
            elif len(body) <= _JOIN_BELOW:
                conn.writer.write(head + body)
            else:
                conn.writer.write(head)
                conn.writer.write(body)
            async with asyncio.timeout(read_timeout):
                while True:
                    raw = await conn.reader.readuntil(b"\r\n\r\n")
                    status, headers, keep = _parse_head(raw)
                    if status >= 200 or status == 101:
                        break   # 1xx interim answers (100 Continue) are skipped
            return Response(self, origin, conn, status, headers, keep, read_timeout)
        except BaseException as exc:
            conn.close()   # cancelled, timed out or failed mid-request: the connection's state is unknown
            if isinstance(exc, (asyncio.IncompleteReadError, ConnectionError)):
                raise ConnectFailed(f"connection to {origin.host}:{origin.port} closed before an answer") from None
            if isinstance(exc, asyncio.LimitOverrunError):
                raise ProtocolError("response head too long") from None
            raise

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def _path_of(url: str) -> str:
    u = urlsplit(url)
    return (u.path or "/") + (f"?{u.query}" if u.query else "")


def _parse_head(raw: bytes) -> tuple[int, dict[str, str], bool]:
    """(status, headers with lower-cased names, keep-alive) of a response head."""
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise ProtocolError(f"bad header line: {line[:80]!r}")
        name = name.strip().lower()
        headers[name] = f"{headers[name]}, {value.strip()}" if name in headers else value.strip()
    connection = headers.get("connection", "").lower()
    keep = "close" not in connection and (parts[0] != "HTTP/1.0" or "keep-alive" in connection)
    return int(parts[1]), headers, keep


__all__ = ["ConnectFailed", "HTTPClient", "HTTPClientError", "Origin", "ProtocolError", "Response"]
