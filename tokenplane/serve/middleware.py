"""The outermost ASGI layer of the server: API key, body-size limit, per-route metrics, and the guarantee that an
error never escapes as a bare 500 or a dropped keep-alive connection.

It wraps the whole FastAPI stack (FastAPI's own ServerErrorMiddleware re-raises after answering, and uvicorn closes a
connection on any exception that reaches it; stopping it here keeps pooled client connections usable).
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, InternalError, PayloadTooLarge, Unauthorized
from .metrics import Metrics

log = logging.getLogger("tokenplane.serve")

OPEN_PATHS = ("/health", "/metrics", "/docs", "/openapi.json", "/redoc")


async def send_error(send: Send, err: APIError, *, close: bool = False) -> None:
    body = err.encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _bearer(scope: Scope) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == b"authorization":
            value = v.decode("latin-1")
            return value[7:].strip() if value[:7].lower() == "bearer " else None
        if k == b"x-api-key":
            return v.decode("latin-1").strip()
    return None


def _content_length(scope: Scope) -> int | None:
    for k, v in scope.get("headers", ()):
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None


class GuardMiddleware:
    def __init__(self, app: ASGIApp, *, metrics: Metrics | None, max_body_bytes: int,
                 api_key: str | None = None) -> None:
        self.app, self.metrics, self.max_body_bytes = app, metrics, max_body_bytes
        self._key = api_key.encode() if api_key else None
        # Each (route, status)'s metric children, looked up once: prometheus_client's labels() takes a lock and
        # builds a key per call (~3 us each, twice a request, on the loop of every turn).
        self._children: dict[tuple[str, int], tuple[Any, Any]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = {"code": 500, "started": False, "done": False}

        async def tracked_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                status["done"] = True
            await send(message)

        try:
            if self._key is not None and not scope["path"].startswith(OPEN_PATHS):
                given = _bearer(scope)
                if given is None or not hmac.compare_digest(given.encode(), self._key):
                    raise Unauthorized("missing or invalid API key (send `Authorization: Bearer <key>`)",
                                       code="invalid_api_key")
            length = _content_length(scope)
            if length is not None and length > self.max_body_bytes:
                raise PayloadTooLarge(f"request body of {length:,} bytes is over the limit of "
                                      f"{self.max_body_bytes:,} bytes", code="body_too_large")
            await self.app(scope, self._limited(receive), tracked_send)
        except ClientDisconnect:
            status["code"] = 499   # the client left while sending its body: nobody to answer, nothing to log
        except Exception as exc:   # noqa: BLE001 - the last line of defence; each kind is answered below
            if status["started"]:
                if not isinstance(exc, APIError):
                    log.exception("error after the response started on %s", scope["path"])
            else:
                err = exc if isinstance(exc, APIError) else InternalError(f"internal error: {type(exc).__name__}")
                if not isinstance(exc, APIError):
                    log.exception("unhandled error on %s", scope["path"])
                # An unread body (413, 401) cannot be skipped on a keep-alive connection: close it.
                await send_error(tracked_send, err, close=isinstance(err, (PayloadTooLarge, Unauthorized)))
        finally:
            if self.metrics is not None:
                route = scope.get("route")
                code = status["code"]
                label = getattr(route, "path", None) or ("unmatched" if code == 404 else "other")
                children = self._children.get((label, code))
                if children is None:
                    children = (self.metrics.requests.labels(label, str(code)), self.metrics.latency.labels(label))
                    self._children[(label, code)] = children
                children[0].inc()
                children[1].observe(time.perf_counter() - t0)

    def _limited(self, receive: Receive) -> Receive:
        limit = self.max_body_bytes
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:   # chunked uploads carry no content-length: counted as they arrive
                    raise PayloadTooLarge(f"request body is over the limit of {limit:,} bytes",
                                          code="body_too_large")
            return message
        return limited


__all__ = ["GuardMiddleware", "send_error"]
