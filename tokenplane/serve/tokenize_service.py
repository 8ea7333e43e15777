"""HTTP tokenize service: stateless encode plus stateful sessions whose IDs always equal a full reference encode.

Routes (JSON; text may be given as `text` or as UTF-8 bytes in `text_b64`):
  POST   /v1/tokenize                    {model?, text|text_b64, allowed_special?}        -> {model, ids, n_tokens}
  POST   /v1/sessions                    {model?, allowed_special?}                       -> {id, model, revision}
  POST   /v1/sessions/{id}/append        {text|text_b64, expect_revision?, return_ids?}   -> patch
  POST   /v1/sessions/{id}/edit          {start, end, text|text_b64, expect_revision?}    -> patch
  POST   /v1/sessions/{id}/sync          {text|text_b64, expect_revision?}                -> patch
  GET    /v1/sessions/{id}?ids=true                                                      -> state (+ ids)
  DELETE /v1/sessions/{id}
  GET    /v1/tokenize/stats
A patch is {revision, n_tokens, keep, ids}: the first `keep` tokens of the previous revision are unchanged and `ids`
are the tokens from `keep` on, so a client holding revision r-1 rebuilds revision r exactly. Edit offsets are
characters of the session text as sent (before normalization; GET reports its length as text_chars).

Errors: 400 invalid text (bad UTF-8, lone surrogates, bad base64, bad offsets), 404 unknown model or session
(including sessions evicted by TTL), 409 stale `expect_revision`, 413 oversize body or text, 422 malformed JSON.
"""

from __future__ import annotations

import base64
import binascii
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from ..tokenize.tokenizer import InvalidTextError, TextTooLargeError, Tokenizer, validate_text
from ..tokenize.session import SessionError, StaleRevisionError
from ..tokenize.verify import ShadowVerifier


class ServiceError(Exception):
    def __init__(self, status: int, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


# -- request bodies ----------------------------------------------------------------------------------------------
class TextBody(BaseModel):
    text: str | None = None
    text_b64: str | None = None


class TokenizeBody(TextBody):
    model: str | None = None
    allowed_special: list[str] | Literal["all"] = []


class CreateSessionBody(BaseModel):
    model: str | None = None
    allowed_special: list[str] | Literal["all"] = []


class AppendBody(TextBody):
    expect_revision: int | None = None
    return_ids: bool = True


class EditBody(AppendBody):
    start: int
    end: int


class SyncBody(AppendBody):
    pass


# -- session store -----------------------------------------------------------------------------------------------
@dataclass
class SessionEntry:
    id: str
    model: str
    session: Any
    created: float
    last_used: float
    lock: threading.Lock = field(default_factory=threading.Lock)


class SessionStore:
    """Sessions by id with idle-TTL eviction (checked on access and swept at most once a second) and a cap."""

    def __init__(self, ttl_s: float, max_sessions: int, clock=time.monotonic):
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.clock = clock
        self._entries: dict[str, SessionEntry] = {}
        self._lock = threading.Lock()
        self._last_sweep = 0.0
        self.evicted = 0
        self.created = 0

    def __len__(self) -> int:
        return len(self._entries)

    def sweep(self, force: bool = False) -> int:
        now = self.clock()
        with self._lock:
            if not force and now - self._last_sweep < 1.0:
                return 0
            self._last_sweep = now
            dead = [k for k, e in self._entries.items() if now - e.last_used > self.ttl_s]
            for k in dead:
                del self._entries[k]
            self.evicted += len(dead)
            return len(dead)

    def create(self, model: str, session: Any) -> SessionEntry:
        self.sweep()
        now = self.clock()
        entry = SessionEntry(id=secrets.token_urlsafe(12), model=model, session=session, created=now, last_used=now)
        with self._lock:
            if len(self._entries) >= self.max_sessions:
                raise ServiceError(429, f"session limit reached ({self.max_sessions}); delete idle sessions")
            self._entries[entry.id] = entry
            self.created += 1
        return entry

    def get(self, session_id: str) -> SessionEntry:
        self.sweep()
        now = self.clock()
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is not None and now - entry.last_used > self.ttl_s:
                del self._entries[session_id]
                self.evicted += 1
                entry = None
            if entry is None:
                raise ServiceError(404, f"unknown session {session_id!r} (never created, deleted, or expired)")
            entry.last_used = now
            return entry

    def delete(self, session_id: str) -> None:
        with self._lock:
            if self._entries.pop(session_id, None) is None:
                raise ServiceError(404, f"unknown session {session_id!r}")


# -- the service -------------------------------------------------------------------------------------------------
class TokenizeService:
    def __init__(self, tokenizers: Mapping[str, Tokenizer], *, ttl_s: float = 3600.0, max_sessions: int = 10_000,
                 verify_rate: float = 0.0, verify_queue: int = 256, max_body_bytes: int | None = None,
                 default_model: str | None = None):
        if not tokenizers:
            raise ValueError("the tokenize service needs at least one tokenizer")
        self.tokenizers = dict(tokenizers)
        self.default_model = default_model or next(iter(self.tokenizers))
        self.store = SessionStore(ttl_s, max_sessions)
        max_chars = max(t.max_chars for t in self.tokenizers.values())
        # JSON escapes can take 12 bytes per character (\ud83d\ude00 for one astral char); base64 4/3 of UTF-8.
        self.max_body_bytes = max_body_bytes if max_body_bytes is not None else 12 * max_chars + 4096
        self.verifiers: dict[str, ShadowVerifier] = {}
        if verify_rate > 0:
            for name, tok in self.tokenizers.items():
                self.verifiers[name] = ShadowVerifier(tok, rate=verify_rate, max_queue=verify_queue)

    def close(self) -> None:
        for v in self.verifiers.values():
            v.close()

    def tokenizer(self, model: str | None) -> tuple[str, Tokenizer]:
        name = model or self.default_model
        tok = self.tokenizers.get(name)
        if tok is None:
            raise ServiceError(404, f"unknown model {name!r}; available: {sorted(self.tokenizers)}")
        return name, tok

    @staticmethod
    def text_of(body: TextBody, tok: Tokenizer) -> str:
        if (body.text is None) == (body.text_b64 is None):
            raise ServiceError(400, "give exactly one of `text` or `text_b64`")
        if body.text_b64 is not None:
            if len(body.text_b64) > 4 * ((4 * tok.max_chars + 2) // 3):   # base64 of the largest UTF-8
                raise ServiceError(413, "text_b64 is larger than the tokenizer's size limit")
            try:
                raw = base64.b64decode(body.text_b64, validate=True)
            except (binascii.Error, ValueError):
                raise ServiceError(400, "text_b64 is not valid base64") from None
            return validate_text(raw, tok.max_chars)
        return validate_text(body.text, tok.max_chars)

    def verify(self, model: str, text: str, ids, allowed=(), context=None) -> None:
        v = self.verifiers.get(model)
        if v is not None:
            v.submit(text, ids, allowed_special=allowed, context=context)

    # -- handlers (plain functions of validated bodies; FastAPI runs them in its thread pool) ------------------
    def tokenize(self, body: TokenizeBody) -> dict:
        name, tok = self.tokenizer(body.model)
        text = self.text_of(body, tok)
        try:
            ids = tok.encode(text, allowed_special=body.allowed_special)
        except ValueError as exc:   # unknown special-token names
            raise ServiceError(400, str(exc)) from None
        allowed = tok.specials.keys() if body.allowed_special == "all" else body.allowed_special
        self.verify(name, text, ids, tuple(allowed))
        return {"model": name, "n_tokens": int(len(ids)), "ids": ids.tolist()}

    def create_session(self, body: CreateSessionBody) -> dict:
        name, tok = self.tokenizer(body.model)
        try:
            session = tok.session(allowed_special=body.allowed_special)
        except ValueError as exc:   # unknown special-token names
            raise ServiceError(400, str(exc)) from None
        entry = self.store.create(name, session)
        return {"id": entry.id, "model": name, "revision": session.revision, "ttl_s": self.store.ttl_s}

    def mutate(self, session_id: str, body: AppendBody, op: str) -> dict:
        entry = self.store.get(session_id)
        tok = self.tokenizers[entry.model]
        text = self.text_of(body, tok)
        with entry.lock:   # a session is single-writer; concurrent requests on one session queue here
            sess = entry.session
            try:
                if op == "append":
                    splice = sess.append(text, expect_revision=body.expect_revision)
                elif op == "edit":
                    splice = sess.edit(body.start, body.end, text, expect_revision=body.expect_revision)
                else:
                    splice = sess.sync(text, expect_revision=body.expect_revision)
            except StaleRevisionError as exc:
                raise ServiceError(409, str(exc), revision=sess.revision) from None
            except SessionError as exc:
                raise ServiceError(400, str(exc)) from None
            ids = sess.ids
            out = {"id": entry.id, "revision": sess.revision, "n_tokens": int(len(ids)), "n_chars": len(sess.text),
                   "keep": int(splice.keep), "path": splice.path}
            if body.return_ids:
                out["ids"] = splice.ids.tolist()
            self.verify(entry.model, sess.text, ids, tuple(sess.allowed_special),
                        context={"session": entry.id, "revision": sess.revision})
        return out

    def get_session(self, session_id: str, ids: bool) -> dict:
        entry = self.store.get(session_id)
        with entry.lock:
            sess = entry.session
            out = {"id": entry.id, "model": entry.model, "revision": sess.revision, "n_tokens": int(len(sess.ids)),
                   "text_chars": len(sess.text), "nbytes": int(sess.nbytes),
                   "idle_s": round(self.store.clock() - entry.last_used, 3), "stats": _jsonable(sess.stats),
                   "allowed_special": sorted(sess.allowed_special)}
            if ids:
                out["ids"] = np.asarray(sess.ids).tolist()
        return out

    def stats(self) -> dict:
        self.store.sweep()
        return {"sessions": len(self.store), "created": self.store.created, "evicted": self.store.evicted,
                "models": sorted(self.tokenizers),
                "verifier": {name: v.stats() for name, v in self.verifiers.items()}}


def _jsonable(value: Any) -> Any:
    if callable(value):
        value = value()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if hasattr(value, "__dataclass_fields__"):
        return {k: _jsonable(getattr(value, k)) for k in value.__dataclass_fields__}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def add_tokenize_routes(app: FastAPI, tokenizers: Mapping[str, Tokenizer], **options: Any) -> TokenizeService:
    """Mount the tokenize and session routes on `app`; options go to TokenizeService (ttl_s, max_sessions,
    verify_rate, verify_queue, max_body_bytes, default_model). Returns the service (its store and verifiers)."""
    service = TokenizeService(tokenizers, **options)

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > service.max_body_bytes:
            return JSONResponse({"error": f"request body over {service.max_body_bytes:,} bytes"}, status_code=413)
        return await call_next(request)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError):
        return JSONResponse({"error": exc.message, **exc.extra}, status_code=exc.status)

    @app.exception_handler(InvalidTextError)
    async def invalid_text(request: Request, exc: InvalidTextError):
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.exception_handler(TextTooLargeError)
    async def too_large(request: Request, exc: TextTooLargeError):
        return JSONResponse({"error": str(exc)}, status_code=413)

    app.post("/v1/tokenize")(service.tokenize)
    app.post("/v1/sessions")(service.create_session)

    @app.post("/v1/sessions/{session_id}/append")
    def append(session_id: str, body: AppendBody) -> dict:
        return service.mutate(session_id, body, "append")

    @app.post("/v1/sessions/{session_id}/edit")
    def edit(session_id: str, body: EditBody) -> dict:
        return service.mutate(session_id, body, "edit")

    @app.post("/v1/sessions/{session_id}/sync")
    def sync(session_id: str, body: SyncBody) -> dict:
        return service.mutate(session_id, body, "sync")

    @app.get("/v1/sessions/{session_id}")
    def get_session(session_id: str, ids: bool = False) -> dict:
        return service.get_session(session_id, ids)

    @app.delete("/v1/sessions/{session_id}")
    def delete_session(session_id: str) -> dict:
        service.store.delete(session_id)
        return {"id": session_id, "deleted": True}

    app.get("/v1/tokenize/stats")(service.stats)
    app.state.tokenize_service = service
    return service
