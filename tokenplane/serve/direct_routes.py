"""Hot routes called straight from the ASGI layer, past FastAPI's router, dependency solver and exception middleware.

The tier's chat route runs once per agent turn and its own overhead is the tier's product (the target is < 2 ms per
turn): FastAPI's layers (route matching over every route, request_response, solve_dependencies, three exception and
exit-stack middlewares, each wrapping every `send` of a streamed answer) cost a measurable part of that. The handler
is the same method FastAPI calls (it takes a starlette Request and returns a dict or a Response), its errors take the
app's own error shape (app.error_response) and anything else reaches GuardMiddleware, which answers an OpenAI-shaped
500 as FastAPI's handler would. FastAPI keeps the route too (OpenAPI schema, other methods on the same path).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError

Handler = Callable[[Request], Awaitable[Any]]


class DirectRoutes:
    """ASGI middleware: (method, path) -> handler, called directly; every other request goes to `app`."""

    def __init__(self, app: ASGIApp, routes: dict[tuple[str, str], tuple[Handler, Any]],
                 error_response: Callable[[APIError], Response]) -> None:
        self.app, self.routes, self.error_response = app, routes, error_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = self.routes.get((scope.get("method", ""), scope.get("path", ""))) if scope["type"] == "http" \
            else None
        if found is None:
            await self.app(scope, receive, send)
            return
        handler, route = found
        scope["route"] = route     # the metrics label, as FastAPI's router sets it
        request = Request(scope, receive)
        try:
            result = await handler(request)
        except APIError as exc:
            result = self.error_response(exc)
        except ClientDisconnect:   # the client left mid-body: nobody to answer (as app.internal_error says)
            result = JSONResponse({"error": {"message": "client disconnected", "type": "client_closed_request",
                                             "param": None, "code": None}}, status_code=499)
        response = result if isinstance(result, Response) else JSONResponse(result)
        await response(scope, receive, send)


__all__ = ["DirectRoutes"]
