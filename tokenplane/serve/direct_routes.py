"""Hot routes served straight from the app's ASGI entry, past FastAPI's own layers.

The tier's chat and completions routes run once per agent turn and their own overhead is the tier's product (the
target is < 2 ms per turn). Past what FastAPI gives every request (its __call__ checks OpenTelemetry providers and
environment variables per request, Starlette's __call__, route matching over every route, request_response,
solve_dependencies, three exception and exit-stack middlewares, each wrapping every `send` of a streamed answer),
a hot route costs ~5x less Python per request (tests/test_serve_upstream_delta.py counts that it is served here).
The handler is the same method FastAPI's route calls (it takes a starlette Request and returns a dict or a
Response). The app's __call__ (app._GuardedFastAPI) sends a hot route's requests through the same GuardMiddleware
(API key, body limit, metrics, OpenAI-shaped 500s) to `DirectRoutes`; its errors take the app's own error shape
(app.error_response). FastAPI keeps the route too (OpenAPI schema, other methods on the same path: 405 with Allow).
Hot routes are outside FastAPI's native OpenTelemetry hook; the server's Prometheus metrics count them.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from .errors import APIError

Handler = Callable[[Request], Awaitable[Any]]


class BodyRequest(Request):
    """A starlette Request whose body is read with plain receive calls: starlette's `stream()` async generator and
    its per-chunk checks cost a few microseconds a message; large bodies are joined once, as starlette does."""

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            receive = self.receive
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            body: bytes = message.get("body", b"")
            if message.get("more_body", False):
                chunks = [body]
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise ClientDisconnect()
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        break
                body = b"".join(chunks)
            self._body = body
            self._stream_consumed = True
        return self._body


class DirectRoutes:
    """ASGI app for the hot routes: (method, path) -> (handler, the FastAPI route, for its metrics label)."""

    def __init__(self, routes: dict[tuple[str, str], tuple[Handler, Any]],
                 error_response: Callable[[APIError], Response]) -> None:
        self.routes, self.error_response = routes, error_response
        self.served = 0   # requests served here (a test checks that the hot routes take this path)

    def serves(self, scope: Scope) -> bool:
        return (scope.get("method"), scope.get("path")) in self.routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler, route = self.routes[(scope["method"], scope["path"])]
        scope["route"] = route     # the metrics label, as FastAPI's router sets it
        self.served += 1
        request = BodyRequest(scope, receive)
        try:
            result = await handler(request)
        except APIError as exc:
            result = self.error_response(exc)
        except ClientDisconnect:   # the client left mid-body: nobody to answer (as app.internal_error says)
            result = JSONResponse({"error": {"message": "client disconnected", "type": "client_closed_request",
                                             "param": None, "code": None}}, status_code=499)
        response = result if isinstance(result, Response) else JSONResponse(result)
        await response(scope, receive, send)


__all__ = ["BodyRequest", "DirectRoutes"]
