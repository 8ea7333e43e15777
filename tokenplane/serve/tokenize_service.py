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

Errors (OpenAI-shaped, errors.py): 400 invalid text (bad UTF-8, lone surrogates, bad base64, bad offsets) or
malformed JSON, 404 unknown model or session (including sessions evicted by TTL, the count cap or the byte budget),
409 stale `expect_revision` (the current revision is in error.revision), 413 oversize body, text or session.

Sessions are bounded three ways: an idle TTL, a count cap and a total byte budget (token arrays + text), evicted
least recently used first; an evicted conversation is simply re-encoded by its next request.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import ctypes.util
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence, TypeVar

import numpy as np
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..tokenize.errors import InvalidTextError, SessionError, StaleRevisionError, TextTooLargeError, validate_text
from ..tokenize.tokenizer import Tokenizer
from ..tokenize.verify import ShadowVerifier
from .errors import Conflict, InvalidRequest, NotFound, PayloadTooLarge
from .protocol import INT64_MAX, parse_body

B = TypeVar("B", bound=BaseModel)


# -- request bodies ----------------------------------------------------------------------------------------------
class TextBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    text_b64: str | None = None


class TokenizeBody(TextBody):
    model: str | None = None
    allowed_special: list[str] | Literal["all"] = []


class CreateSessionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    allowed_special: list[str] | Literal["all"] = []


class AppendBody(TextBody):
    expect_revision: int | None = Field(None, ge=0, le=INT64_MAX)
    return_ids: bool = True


class EditBody(AppendBody):
    start: int = Field(ge=0, le=INT64_MAX)
    end: int = Field(ge=0, le=INT64_MAX)


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
    nbytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS after a large eviction (glibc keeps them in its arenas otherwise, and
    RSS would stay at its peak after every session is gone)."""
    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):
            pass


class SessionStore:
    """Sessions by id, least recently used first, bounded by an idle TTL (checked on access, swept at most once a
    second), a count cap and a byte budget. Creating past the count cap or growing past the budget evicts the least
    recently used sessions (never the one being written)."""

    def __init__(self, ttl_s: float, max_sessions: int, max_bytes: int = 1 << 30,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self.clock = clock
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()
        self._lock = threading.Lock()
        self.on_evict: list[Callable[[str], None]] = []   # called with the id of every session that goes away
        self._last_sweep = 0.0
        self.bytes = 0
        self.evicted = 0
        self.created = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.nbytes
        for callback in self.on_evict:
            callback(key)

    def sweep(self, force: bool = False) -> int:
        now = self.clock()
        with self._lock:
            if not force and now - self._last_sweep < 1.0:
                return 0
            self._last_sweep = now
            dead = [k for k, e in self._entries.items() if now - e.last_used > self.ttl_s]
            for k in dead:
                self._drop(k)
            self.evicted += len(dead)
        if dead:
            _release_freed_memory()
        return len(dead)

    def _evict_until(self, fits: Callable[[], bool], keep: str | None) -> int:
        n = 0
        for key in list(self._entries):
            if fits():
                break
            if key != keep:
                self._drop(key)
                n += 1
        self.evicted += n
        return n

    def create(self, model: str, session: Any) -> SessionEntry:
        self.sweep()
        now = self.clock()
        entry = SessionEntry(id=secrets.token_urlsafe(12), model=model, session=session, created=now, last_used=now,
                             nbytes=int(session.nbytes))
        with self._lock:
            self._evict_until(lambda: len(self._entries) < self.max_sessions
                              and self.bytes + entry.nbytes <= self.max_bytes, None)
            self._entries[entry.id] = entry
            self.bytes += entry.nbytes
            self.created += 1
        return entry

    def get(self, session_id: str) -> SessionEntry:
        self.sweep()
        now = self.clock()
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is not None and now - entry.last_used > self.ttl_s:
                self._drop(session_id)
                self.evicted += 1
                entry = None
            if entry is None:
                raise NotFound(f"unknown session {session_id!r} (never created, deleted, or evicted)",
                               code="session_not_found")
            entry.last_used = now
            self._entries.move_to_end(session_id)
            return entry

    def resize(self, entry: SessionEntry) -> None:
        """Account for a session's new size; evict others (least recently used first) to stay in the budget."""
        size = int(entry.session.nbytes)
        freed = 0
        with self._lock:
            if self._entries.get(entry.id) is not entry:
                return   # deleted or evicted while it was being written
            self.bytes += size - entry.nbytes
            entry.nbytes = size
            freed = self._evict_until(lambda: self.bytes <= self.max_bytes, entry.id)
        if freed:
            _release_freed_memory()

    def delete(self, session_id: str) -> None:
        with self._lock:
            if session_id not in self._entries:
                raise NotFound(f"unknown session {session_id!r}", code="session_not_found")
            self._drop(session_id)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"sessions": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                    "created": self.created, "evicted": self.evicted}


# -- the service -------------------------------------------------------------------------------------------------
class TokenizeService:
    def __init__(self, tokenizers: Mapping[str, Tokenizer], *, ttl_s: float = 3600.0, max_sessions: int = 10_000,
                 session_bytes: int = 1 << 30, max_session_chars: int = 16 << 20, verify_rate: float = 0.0,
                 verify_queue: int = 256, max_body_bytes: int = 64 << 20, default_model: str | None = None):
        if not tokenizers:
            raise ValueError("the tokenize service needs at least one tokenizer")
        self.tokenizers = dict(tokenizers)
        self.default_model = default_model or next(iter(self.tokenizers))
        self.store = SessionStore(ttl_s, max_sessions, session_bytes)
        self.max_session_chars = max_session_chars
        self.max_body_bytes = max_body_bytes
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
            raise NotFound(f"unknown model {name!r}; available: {sorted(self.tokenizers)}", param="model",
                           code="model_not_found")
        return name, tok

    @staticmethod
    def text_of(body: TextBody, tok: Tokenizer) -> str:
        if (body.text is None) == (body.text_b64 is None):
            raise InvalidRequest("give exactly one of `text` or `text_b64`", param="text")
        if body.text_b64 is not None:
            if len(body.text_b64) > 4 * ((4 * tok.max_chars + 2) // 3):   # base64 of the largest UTF-8
                raise PayloadTooLarge("text_b64 is larger than the tokenizer's size limit", param="text_b64")
            try:
                raw = base64.b64decode(body.text_b64, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidRequest("text_b64 is not valid base64", param="text_b64") from None
            return validate_text(raw, tok.max_chars)
        return validate_text(body.text or "", tok.max_chars)

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
            raise InvalidRequest(str(exc), param="allowed_special") from None
        allowed = tok.specials.keys() if body.allowed_special == "all" else body.allowed_special
        self.verify(name, text, ids, tuple(allowed))
        return {"model": name, "n_tokens": int(len(ids)), "ids": ids.tolist()}

    def create_session(self, body: CreateSessionBody) -> dict:
        name, tok = self.tokenizer(body.model)
        try:
            session = tok.session(allowed_special=body.allowed_special)
        except ValueError as exc:   # unknown special-token names
            raise InvalidRequest(str(exc), param="allowed_special") from None
        entry = self.store.create(name, session)
        return {"id": entry.id, "model": name, "revision": session.revision, "ttl_s": self.store.ttl_s}

    def mutate(self, session_id: str, body: AppendBody, op: str) -> dict:
        entry = self.store.get(session_id)
        tok = self.tokenizers[entry.model]
        text = self.text_of(body, tok)
        with entry.lock:   # a session is single-writer; concurrent requests on one session queue here
            sess = entry.session
            removed = body.end - body.start if isinstance(body, EditBody) else 0
            grown = sess.n_chars + len(text) - removed
            if op != "sync" and grown > self.max_session_chars or op == "sync" and len(text) > self.max_session_chars:
                raise PayloadTooLarge(f"the session would hold {max(grown, len(text)):,} characters; the limit is "
                                      f"{self.max_session_chars:,}", code="session_too_large")
            try:
                if op == "append":
                    splice = sess.append(text, expect_revision=body.expect_revision)
                elif isinstance(body, EditBody):
                    splice = sess.edit(body.start, body.end, text, expect_revision=body.expect_revision)
                else:
                    splice = sess.sync(text, expect_revision=body.expect_revision)
            except StaleRevisionError as exc:
                raise Conflict(str(exc), param="expect_revision", code="stale_revision",
                               revision=sess.revision) from None
            except SessionError as exc:
                raise InvalidRequest(str(exc)) from None
            ids = sess.ids
            out = {"id": entry.id, "revision": sess.revision, "n_tokens": int(len(ids)), "n_chars": sess.n_chars,
                   "keep": int(splice.keep), "path": splice.path}
            if body.return_ids:
                out["ids"] = splice.ids.tolist()
            if self.verifiers.get(entry.model) is not None:     # sess.text joins the chunks: only when verifying
                self.verify(entry.model, sess.text, ids, tuple(sess.allowed_special),
                            context={"session": entry.id, "revision": sess.revision})
        self.store.resize(entry)
        return out

    def get_session(self, session_id: str, ids: bool) -> dict:
        entry = self.store.get(session_id)
        with entry.lock:
            sess = entry.session
            out = {"id": entry.id, "model": entry.model, "revision": sess.revision, "n_tokens": int(len(sess.ids)),
                   "text_chars": sess.n_chars, "nbytes": int(sess.nbytes),
                   "idle_s": round(self.store.clock() - entry.last_used, 3), "stats": _jsonable(sess.stats),
                   "allowed_special": sorted(sess.allowed_special)}
            if ids:
                out["ids"] = np.asarray(sess.ids).tolist()
        return out

    def stats(self) -> dict:
        self.store.sweep()
        return {**self.store.snapshot(), "models": sorted(self.tokenizers),
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


def _body(raw: bytes, model: type[B]) -> B:
    try:
        return model.model_validate(parse_body(raw))
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise InvalidRequest(f"invalid `{loc}`: {err['msg']}", param=str(err["loc"][0]) if err["loc"] else None
                             ) from None


_NO_SURROGATES = "^[^\\ud800-\\udfff]*$"   # a lone surrogate has no UTF-8 form: refused as invalid text
_BASE64 = "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"


def _schema(model: type[BaseModel], specials: Sequence[str]) -> dict[str, Any]:
    """The request body's JSON schema as the handler enforces it: exactly one of text / text_b64, text without lone
    surrogates, allowed_special drawn from the served tokenizers' special tokens."""
    schema = model.model_json_schema()
    props = schema.get("properties", {})
    if "text" in props:
        props["text"] = {"anyOf": [{"type": "string", "pattern": _NO_SURROGATES}, {"type": "null"}]}
        props["text_b64"] = {"anyOf": [{"type": "string", "pattern": _BASE64}, {"type": "null"}]}
        schema["oneOf"] = [{"required": ["text"], "properties": {"text": {"type": "string"}}},
                           {"required": ["text_b64"], "properties": {"text_b64": {"type": "string"}}}]
    if "allowed_special" in props:
        props["allowed_special"] = {"anyOf": [{"type": "array", "items": {"enum": sorted(specials)}},
                                              {"const": "all"}], "default": []}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


_ERRORS: dict[int | str, dict[str, Any]] = {status: {"description": why, "content": {"application/json": {}}}
                                            for status, why in ((400, "invalid request"), (404, "unknown model or "
                                                                "session"), (409, "stale revision"),
                                                                (413, "too large"))}


def add_tokenize_routes(app: FastAPI, tokenizers: Mapping[str, Tokenizer], **options: Any) -> TokenizeService:
    """Mount the tokenize and session routes on `app`; options go to TokenizeService (ttl_s, max_sessions,
    session_bytes, max_session_chars, verify_rate, verify_queue, max_body_bytes, default_model). Bodies are parsed
    by hand (depth-limited JSON, OpenAI-shaped errors) in FastAPI's worker threads, never on the event loop."""
    service = TokenizeService(tokenizers, **options)
    specials = sorted({s for tok in tokenizers.values() for s in tok.specials})

    def call(fn: Callable[..., dict], raw: bytes, model: type[B], path: dict[str, Any]) -> dict:
        try:
            return fn(_body(raw, model), **path)
        except InvalidTextError as exc:
            raise InvalidRequest(str(exc), param="text", code="invalid_text") from None
        except TextTooLargeError as exc:
            raise PayloadTooLarge(str(exc), param="text", code="text_too_large") from None

    def run(fn: Callable[..., dict], model: type[B]) -> Callable[..., Any]:
        async def handler(request: Request, **path: Any) -> dict:
            from starlette.concurrency import run_in_threadpool
            raw = await request.body()
            return await run_in_threadpool(call, fn, raw, model, path)
        return handler

    @app.post("/v1/tokenize", openapi_extra=_schema(TokenizeBody, specials), responses=_ERRORS)
    async def tokenize(request: Request) -> dict:
        return await run(service.tokenize, TokenizeBody)(request)

    # OpenAPI links: the id a new session returns feeds the session routes (schemathesis follows them).
    links = {name: {"operationId": name, "parameters": {"session_id": "$response.body#/id"}}
             for name in ("session_append", "session_edit", "session_sync", "get_session", "delete_session")}

    @app.post("/v1/sessions", openapi_extra=_schema(CreateSessionBody, specials),
              responses={200: {"description": "the new session", "links": links}, **_ERRORS})
    async def create_session(request: Request) -> dict:
        return await run(service.create_session, CreateSessionBody)(request)

    def mutation(op: str, model: type[AppendBody]) -> Callable[..., Any]:
        async def handler(session_id: str, request: Request) -> dict:
            return await run(lambda body, sid: service.mutate(sid, body, op), model)(request, sid=session_id)
        handler.__name__ = f"session_{op}"
        return handler

    for op, model in (("append", AppendBody), ("edit", EditBody), ("sync", SyncBody)):
        app.post(f"/v1/sessions/{{session_id}}/{op}", openapi_extra=_schema(model, specials),
                 responses=_ERRORS, operation_id=f"session_{op}")(mutation(op, model))

    @app.get("/v1/sessions/{session_id}", responses=_ERRORS, operation_id="get_session")
    def get_session(session_id: str, ids: bool = False) -> dict:
        return service.get_session(session_id, ids)

    @app.delete("/v1/sessions/{session_id}", responses=_ERRORS, operation_id="delete_session")
    def delete_session(session_id: str) -> dict:
        service.store.delete(session_id)
        return {"id": session_id, "deleted": True}

    app.get("/v1/tokenize/stats")(service.stats)
    app.state.tokenize_service = service
    return service
