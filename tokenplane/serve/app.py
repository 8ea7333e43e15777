"""The server's FastAPI app: OpenAI-compatible routes, the tokenize service, health, models and metrics on one port,
with one error shape (errors.py) for every route and status.

    create_app(backend, tokenizer, model_name=..., limits=Limits(...))

Routes: POST /v1/completions, /v1/chat/completions (JSON or SSE); GET /v1/models, /v1/models/{id}; GET /health
(200 when every model is ready, 503 with each model's state otherwise); GET /metrics (Prometheus); the tokenize
service's /v1/tokenize and /v1/sessions routes.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from .backends import Backend, BackendHealth
from .config import Limits
from .direct_routes import DirectRoutes
from .errors import APIError, InternalError, InvalidRequest, NotFound, PayloadTooLarge
from .metrics import CONTENT_TYPE, Metrics
from .middleware import GuardMiddleware
from .openai_routes import OpenAIServer
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
)

log = logging.getLogger("tokenplane.serve")


class _GuardedFastAPI(FastAPI):
    """FastAPI whose whole middleware stack (its ServerErrorMiddleware included) runs inside GuardMiddleware; the
    hot routes (`direct_routes`) go from this __call__ through the same guard to their handlers (direct_routes.py)."""

    guard_options: dict[str, Any] = {}
    direct_routes: dict[tuple[str, str], Any] = {}   # hot routes called past FastAPI's layers (direct_routes.py)
    direct: DirectRoutes | None = None
    _direct_guarded: GuardMiddleware | None = None

    def build_middleware_stack(self) -> Any:
        return GuardMiddleware(super().build_middleware_stack(), **self.guard_options)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.direct_routes and scope["type"] == "http":
            if self._direct_guarded is None:   # built at the first request, as Starlette builds its stack
                self.direct = DirectRoutes(self.direct_routes, error_response)
                self._direct_guarded = GuardMiddleware(self.direct, **self.guard_options)
            if self.direct is not None and self.direct.serves(scope):
                scope["app"] = self
                await self._direct_guarded(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def error_response(err: APIError) -> JSONResponse:
    headers = dict(err.headers)
    if isinstance(err, PayloadTooLarge):
        headers["Connection"] = "close"   # the rest of an oversize body is never read
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def guarded_app(title: str, *, metrics: Metrics | None, limits: Limits,
                lifespan: Callable[[FastAPI], Any] | None = None) -> FastAPI:
    """A FastAPI app with the guard, the API key, the body limit and OpenAI-shaped errors for every status."""
    app = _GuardedFastAPI(title=title, lifespan=lifespan)
    app.guard_options = {"metrics": metrics, "max_body_bytes": limits.max_body_bytes, "api_key": limits.api_key}

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        return error_response(InvalidRequest(f"invalid `{'.'.join(loc)}`: {first.get('msg')}",
                                             param=loc[0] if loc else None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:   # Allow lists every route's methods on this path, not only the first route's
            methods = {m for r in app.router.routes if isinstance(r, APIRoute) and r.path_regex.match(request.url.path)
                       for m in (r.methods or ())}
            headers["Allow"] = ", ".join(sorted(methods))
        err = NotFound(f"no route {request.method} {request.url.path}") if exc.status_code == 404 else \
            APIError(str(exc.detail), status=exc.status_code, headers=headers)
        return error_response(err)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, ClientDisconnect):   # the client left mid-body: not a server error, nobody to tell
            return JSONResponse({"error": {"message": "client disconnected", "type": "client_closed_request",
                                           "param": None, "code": None}}, status_code=499)
        log.exception("unhandled error on %s", request.url.path)
        return error_response(InternalError(f"internal error: {type(exc).__name__}"))
    return app


_OPENAI_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": why} for status, why in (
        (400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model"),
        (413, "body or prompt too large"), (429, "queue full"), (500, "internal error"),
        (503, "a model is down or restarting"))}


REF = "#/components/schemas/{model}"


def request_schema(model: type[Any], defs: dict[str, Any]) -> dict[str, Any]:
    """An `openapi_extra` request body for a model parsed by hand; its nested models go into `defs`, which
    `install_schemas` adds to the document's components (OpenAPI has no $defs)."""
    schema = model.model_json_schema(ref_template=REF)
    defs.update(schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_schemas(app: FastAPI, defs: dict[str, Any]) -> None:
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = build()
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs)
            app.openapi_schema = doc
        return app.openapi_schema
    app.openapi = openapi   # type: ignore[method-assign]


def health_body(h: BackendHealth) -> dict[str, Any]:
    return {"status": "ok" if h.ok else "degraded", "live_requests": h.live_requests,
            "queued_requests": h.queued_requests,
            "models": [{"name": m.name, "state": m.state, "pid": m.pid, "restarts": m.restarts,
                        "last_error": m.last_error, "down_for_s": m.down_for_s, "kv_blocks_used": m.kv_blocks_used,
                        "kv_blocks_total": m.kv_blocks_total} for m in h.models]}


def create_app(backend: Backend | None, tokenizer: Any, *, model_name: str = "tokenplane-router",
               default_max_tokens: int = 16, close_backend: bool = True, limits: Limits | None = None,
               tokenize_routes: bool = True, chat_template: Any = None, upstream: Any = None) -> FastAPI:
    """The app over a backend, or (`upstream`: an UpstreamPool) the tokenization tier in front of upstream engines.
    The backend's `start()` runs at server startup and `close()` (or `aclose()`) at shutdown."""
    limits = limits or Limits()
    metrics = Metrics()
    server: OpenAIServer
    if upstream is not None:
        from .proxy_routes import ProxyServer
        server = ProxyServer(upstream, tokenizer, model_name=model_name, limits=limits, metrics=metrics,
                             default_max_tokens=default_max_tokens, chat_template=chat_template)
    elif backend is not None:
        server = OpenAIServer(backend, tokenizer, model_name=model_name, limits=limits, metrics=metrics,
                              default_max_tokens=default_max_tokens, chat_template=chat_template)
    else:
        raise ValueError("create_app needs a backend or an upstream pool")
    backend = server.backend
    holder: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        await server.warm_up()
        try:
            yield
        finally:
            server.close()
            if "tokenize" in holder:
                holder["tokenize"].close()
            if close_backend:
                aclose = getattr(backend, "aclose", None)
                if aclose is not None:
                    await aclose()
                else:
                    backend.close()

    app = guarded_app("tokenplane", metrics=metrics, limits=limits, lifespan=lifespan)
    app.state.server = server
    app.state.metrics = metrics

    defs: dict[str, Any] = {}
    app.post("/v1/completions", response_model=None, openapi_extra=request_schema(CompletionRequest, defs),
             responses={200: {"model": CompletionResponse, "content": {"text/event-stream": {}}}, **_OPENAI_ERRORS}
             )(server.completions)
    app.post("/v1/chat/completions", response_model=None, openapi_extra=request_schema(ChatCompletionRequest, defs),
             responses={200: {"model": ChatCompletionResponse, "content": {"text/event-stream": {}}},
                        **_OPENAI_ERRORS})(server.chat_completions)

    # vLLM's tokenizer routes (clients use them to count and to build prompts as the server would)
    app.post("/tokenize", response_model=None, openapi_extra=request_schema(TokenizeRequest, defs),
             responses=_OPENAI_ERRORS)(server.tokenize)
    app.post("/detokenize", response_model=None, openapi_extra=request_schema(DetokenizeRequest, defs),
             responses=_OPENAI_ERRORS)(server.detokenize)

    if upstream is not None:   # the tier's per-turn routes: their own overhead is what the tier adds to each turn
        routes = {r.path: r for r in app.router.routes if isinstance(r, APIRoute)}
        app.direct_routes = {  # type: ignore[attr-defined]
            ("POST", "/v1/chat/completions"): (server.chat_completions, routes["/v1/chat/completions"]),
            ("POST", "/v1/completions"): (server.completions, routes["/v1/completions"])}

    def card() -> dict[str, Any]:
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "tokenplane",
                "max_model_len": backend.max_model_len}

    @app.get("/v1/models", response_model=ModelList, responses={401: _OPENAI_ERRORS[401]})
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id}", response_model=ModelCard,
             responses={401: _OPENAI_ERRORS[401], 404: _OPENAI_ERRORS[404]})
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != server.model_name:
            raise NotFound(f"model {model_id!r} does not exist; available: [{server.model_name!r}]", param="model",
                           code="model_not_found")
        return card()

    @app.get("/health", responses={503: {"description": "a model is down or restarting"}})
    async def health() -> JSONResponse:
        h = backend.health()
        return JSONResponse(health_body(h), status_code=200 if h.ok else 503)

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    sessions = None
    if tokenize_routes:
        from .tokenize_service import add_tokenize_routes
        service = add_tokenize_routes(app, {tokenizer.name: tokenizer}, ttl_s=limits.session_ttl_s,
                                      max_sessions=limits.max_sessions, session_bytes=limits.session_bytes,
                                      max_session_chars=limits.max_session_chars, verify_rate=limits.verify_rate,
                                      max_body_bytes=limits.max_body_bytes)
        holder["tokenize"] = service
        if limits.conversation_sessions:
            server.use_sessions(service.store)

        def sessions() -> dict[str, Any]:
            return {**service.store.snapshot(), "verifier": {n: v.stats() for n, v in service.verifiers.items()}}
    metrics.watch(backend.health, sessions)
    install_schemas(app, defs)
    return app


__all__ = ["create_app", "error_response", "guarded_app", "health_body"]
