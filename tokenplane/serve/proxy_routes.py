"""OpenAI-compatible routes of the tokenization tier: prompts are tokenized here (model's chat template,
conversation sessions) and forwarded as token IDs to an upstream engine's /v1/completions (upstream.py).

A chat request is forwarded as a completion of the rendered prompt's IDs, with the template's end-of-turn tokens
as vLLM's `stop_token_ids`, and its answer converted back to chat format (JSON or SSE chunks). Completions pass
through as the upstream wrote them. Every response gains the `tokenization` field; a client that disconnects closes
the upstream request (vLLM aborts it), and a failed turn leaves the conversation's session valid (it holds the
prompt the client will resend).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError

from .backends import BackendHealth, ModelStatus
from .body_delta import BodyDeltas, KeptTurn, Parsed
from .conversations import Take, TokenizationReport, copied
from .errors import APIError, InvalidRequest
from .event_stream import EventStream
from .grpc_wire import VARINT_IDS
from .id_answers import IdAnswer, gathered, upstream_fields
from .ids_json import JSON_IDS, Chunks, IdsOrigin, RequestBodies
from .openai_routes import ClientDisconnected, OpenAIServer
from .protocol import FORWARDABLE_SAMPLING, ChatCompletionRequest, ChatMessage, CompletionRequest
from .tool_calls import ToolCallStream, calls_delta
from .upstream import FORWARDED, UpstreamPool, error_from, sse_data
from .upstream_sessions import MISMATCH, SessionTurns, Turn
from .upstream_sessions import PATH as SESSION_PATH

_DISCONNECT_POLL_S = 0.25
_FINISH_S = 0.25        # how long the relay waits for an upstream stream to end after its [DONE]
# A body parsed in full gets its state built (body_delta.remember) once its turn's answer has been sent, or at the
# latest this long after the turn was tokenized (past the first chunk of a long answer): only the next turn needs
# it, and a client sends its next turn after the answer. A fixed delay alone left the state missing for a next turn
# that came within it (each such turn parsed in full again and rendered and synced the whole prompt).
_STATE_DELAY_S = 0.05
# Chat work runs on the event loop when it is small: the worker-thread hop (a hand-off and a loop wake-up each way)
# cost 0.2-0.5 ms of a turn's overhead on 2 shared CPUs, more than half of a ~24K-character turn's own work. Small
# means: a body up to _INLINE_CHAT_BYTES, or a resent body up to _INLINE_DELTA_BYTES whose part past the kept messages
# (body_delta.py) is up to _INLINE_CHAT_BYTES (its work is O(new part) but for a few O(context) memcmp/copies, ~1-2 ms
# at most on the loop). Everything else (a first turn of a long context, a large append) goes to the worker thread.
_INLINE_CHAT_BYTES = 64 << 10
_INLINE_DELTA_BYTES = 2 << 20
_MESSAGES: TypeAdapter[list[ChatMessage]] = TypeAdapter(list[ChatMessage])
log = logging.getLogger("tokenplane.serve")


class UpstreamBackend:
    """The Backend face of an upstream pool (health, limits); generation goes through ProxyServer's routes."""

    vocab_size: int | None = None

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool

    @property
    def max_model_len(self) -> int | None:
        return self.pool.max_model_len

    async def start(self) -> None:
        await self.pool.start()

    def generate(self, prompt_ids: Any, params: Any, request_id: str) -> Any:
        raise NotImplementedError("the tokenization tier forwards requests; it does not decode")

    def abort(self, request_id: str) -> None:
        return None

    def health(self) -> BackendHealth:
        return BackendHealth([ModelStatus(h["name"], h["state"], restarts=h["failures"], last_error=h["last_error"])
                              for h in self.pool.health()])

    def close(self) -> None:
        return None

    async def aclose(self) -> None:
        await self.pool.close()


@dataclass
class Phases:
    """When a turn passed each phase in the tier, in ms from its handler's start (after the server read the request
    head): the body received, the upstream body ready (parse + validate + render + repair + serialize), the
    upstream's answer head in, its first data chunk in, that chunk handed to the server. Reported with the
    tokenization report of a stream's final usage chunk (`tokenization.phases_ms`), so where a turn's time goes is
    observable from outside (benchmarks/tier_overhead.py reads it)."""
    t0: float = field(default_factory=time.perf_counter)
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        self.marks[name] = round((time.perf_counter() - self.t0) * 1e3, 4)


@dataclass(frozen=True)
class _Forwarded:
    """A prompt's length in tokens and the upstream body that carries it (`turn`: sent on an upstream session)."""
    n: int
    body: Chunks
    turn: Turn | None = None


def conversation_key(req: Any, text: str) -> str:
    """What pins a conversation to an upstream: the client's key, else its first 1K characters (stable across
    tokenplane replicas, unlike a session id)."""
    if req.conversation_key:
        return "key:" + req.conversation_key
    return "text:" + hashlib.blake2b(text[:1024].encode(), digest_size=16).hexdigest()


class ProxyServer(OpenAIServer):
    def __init__(self, pool: UpstreamPool, tokenizer: Any, **kwargs: Any) -> None:
        # No served name given: serve under the upstream's own model name (learned at start-up).
        self._follow_upstream_name = not kwargs.get("model_name")
        super().__init__(UpstreamBackend(pool), tokenizer, **kwargs)
        self.pool = pool
        # vLLM and SGLang implement the sampling fields; tools are rendered and their calls parsed here
        self.forwarded_sampling = FORWARDABLE_SAMPLING | ({"tools"} if self.chat.calls_tools else set())
        self.bodies = RequestBodies(codec=VARINT_IDS if pool.grpc is not None else JSON_IDS)
        self.deltas = BodyDeltas()   # resent chat bodies parsed in O(new part) (body_delta.py)
        self.turns = SessionTurns() if pool.sessions else None   # upstream sessions (upstream_sessions.py)
        self._states = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenplane-bodies")
        self._answered: dict[str, threading.Event] = {}   # session -> set when its turn's answer is out

    async def warm_up(self) -> None:
        if self._follow_upstream_name and self.pool.model:
            self.model_name = self.pool.model
        if self.pool.grpc is not None:
            VARINT_IDS.run([0])   # the compiled varint writer loaded (or built) before the first turn
        await super().warm_up()

    def use_sessions(self, store: Any) -> None:
        super().use_sessions(store)
        store.on_evict.append(self.bodies.forget)
        store.on_evict.append(self.deltas.forget)
        if self.turns is not None:
            store.on_evict.append(self.turns.forget)

    def _fields(self, req: Any, stop_ids: tuple[int, ...]) -> dict[str, Any]:
        """The upstream request's fields other than the prompt."""
        body: dict[str, Any] = {k: getattr(req, k) for k in FORWARDED if hasattr(req, k)}
        body = {k: v.model_dump() if hasattr(v, "model_dump") else v for k, v in body.items() if v is not None}
        if isinstance(req, ChatCompletionRequest):
            if req.max_completion_tokens is not None:
                body["max_tokens"] = req.max_completion_tokens
            body.pop("logprobs", None)
            if req.num_logprobs is not None:
                body["logprobs"] = req.num_logprobs
        if not body.get("stop"):
            body.pop("stop", None)
        for name, default in (("include_stop_str_in_output", False), ("skip_special_tokens", True)):
            if body.get(name) == default:
                body.pop(name)      # vLLM's defaults: sent only when the client asked otherwise
        if stop_ids:
            body["stop_token_ids"] = list(stop_ids)
        body["model"] = self.pool.model
        if self.pool.sampling_defaults:
            body = {**self.pool.sampling_defaults, **body}
        return upstream_fields(body, req, ids_in_answer=self.pool.grpc is not None) if self.pool.answers_ids else body

    def _chat_ids(self, req: ChatCompletionRequest, parsed: Parsed, take: Take = copied,
                  fields: dict[str, Any] | None = None) -> tuple[Any, TokenizationReport | None]:
        """chat_ids with what the conversation's previous body says: which leading messages are known to quote no
        control token, their (role, text) pairs, and (same conversation key) the session to repair, or, when this
        body keeps every message of that one, the session text to append the new messages' text to; then this
        body kept for the next turn."""
        base, reused = parsed.base, parsed.reused
        kept = base.turn if base is not None else None
        clean = min(base.clean, reused) if base is not None else 0
        same = base is not None and base.conversation_key == req.conversation_key
        session = base.session if same and base is not None else None
        if kept is not None and 0 < reused <= len(kept.pairs):   # equal bytes: equal messages, equal pairs
            pairs = kept.pairs[:reused] + [(m.role, m.text()) for m in req.messages[reused:]]
        else:
            pairs = [(m.role, m.text()) for m in req.messages]
        prior = (kept.pairs, kept.rendered) if same and kept is not None and kept.rendered is not None \
            and reused == len(kept.pairs) else None
        prompt_ids, report = self.chat_ids(req, clean, session, pairs, prior, take)
        if report is None:
            return prompt_ids, report
        if report.path in ("session", "new_session"):   # every message scanned: none quotes
            clean = len(req.messages)
        turn = KeptTurn(req.messages, pairs, report.text if report.path in ("session", "new_session") else None, req,
                        fields)
        if parsed.state is not None:
            self.deltas.keep(parsed.state, report.session, req.conversation_key, clean, turn)
        elif parsed.raw is not None:
            answered = threading.Event()
            if report.session is not None:
                self._answered[report.session] = answered
            self._states.submit(self._remember, parsed.raw, parsed.body.get("messages"), report.session,
                                req.conversation_key, clean, turn, answered)
        return prompt_ids, report

    def _remember(self, raw: bytes, messages: Any, session: str | None, key: str | None, clean: int,
                  turn: KeptTurn, answered: threading.Event) -> None:
        """A body parsed in full, kept for the next turn once this turn's answer is out, or _STATE_DELAY_S after it
        was tokenized (its state costs a few parses: body_delta.remember)."""
        answered.wait(_STATE_DELAY_S)
        if session is not None and self._answered.get(session) is answered:
            self._answered.pop(session, None)
        try:
            self.deltas.remember(raw, messages, session, key, clean, turn)
        except Exception:   # noqa: BLE001 - the next turn parses in full instead
            log.exception("keeping a chat body's state failed")

    def _answer_out(self, session: str | None) -> None:
        """The turn on `session` has sent its answer: a state waiting to be built for its body is built now."""
        answered = self._answered.pop(session, None) if session is not None else None
        if answered is not None:
            answered.set()

    def close(self) -> None:
        self._states.shutdown(wait=False, cancel_futures=True)
        super().close()

    def _prepared(self, req: Any, chat: bool, parsed: Parsed | None = None
                  ) -> tuple[int, TokenizationReport | None, Chunks, Turn | None]:
        """Worker-thread part of a request: its prompt IDs, checked against the context, and the upstream body
        (ids_json.py: the IDs' JSON reuses the session's previous body where the splice allows). A chat's body is
        written under its session's lock from the session's own IDs (conversations.Take): no copy of the context's
        IDs, only the JSON of the IDs the previous body lacks."""
        kept = parsed.base.turn if parsed is not None and parsed.fields_kept and parsed.base is not None else None
        if kept is not None and kept.fields is not None and kept.fields.get("model") == self.pool.model:
            fields = kept.fields   # made from equal fields (the kept request reused), never mutated
        else:
            fields = self._fields(req, self.chat.stop_token_ids if chat else ())
        if chat:
            turns = self.turns if self.turns is not None and req.n == 1 and req.num_logprobs is None else None

            def take(ids: Any, origin: IdsOrigin | None) -> _Forwarded:
                got = turns.chunks(fields, ids, origin) if turns is not None and origin is not None else None
                if got is not None:
                    return _Forwarded(len(ids), *got)
                return _Forwarded(len(ids), self.bodies.chunks(fields, ids, origin))
            fwd, report = self._chat_ids(req, parsed, take, fields) if parsed is not None \
                else self.chat_ids(req, take=take)
        else:
            prompt_ids, report = self.completion_ids(req)
            fwd = _Forwarded(len(prompt_ids), self.bodies.chunks(fields, prompt_ids,
                                                                 report.origin if report is not None else None))
        n = fwd.n
        if n == 0:
            raise InvalidRequest("the prompt is empty", param="prompt")
        limit = self.backend.max_model_len
        if limit is not None and n >= limit:
            raise InvalidRequest(f"this model's maximum context length is {limit} tokens; the prompt has "
                                 f"{n} tokens", param="prompt", code="context_length_exceeded")
        return n, report, fwd.body, fwd.turn

    async def completions(self, request: Request) -> Any:
        phases = Phases()
        req = await self.read(request, CompletionRequest)
        phases.mark("received")
        if isinstance(req.prompt_value, str):
            self._check_chars(len(req.prompt_value))
        n, report, body, _ = await self.offload(self._prepared, req, False)
        phases.mark("prepared")
        text = req.prompt_value if isinstance(req.prompt_value, str) else ""
        return await self._forward(request, req, n, body, report, conversation_key(req, text), False, phases)

    def _chat_work(self, request: Request, raw: bytes, parsed: Parsed | None = None,
                   fast_tried: bool = False) -> tuple[Any, int, TokenizationReport | None, Chunks, Turn | None]:
        """A chat body to its validated request and upstream body, on the loop or in one worker-thread hop (each hop
        is a thread hand-off and a loop wake-up). `parsed`: already parsed through a kept body; `fast_tried`: that
        was tried and missed (the full parse follows)."""
        if parsed is None:
            parsed = self.deltas.full(raw) if fast_tried else self.deltas.parse(raw)
        req = self._validated(request, parsed)
        self._check_chars(sum(len(m.text()) for m in req.messages))
        return (req, *self._prepared(req, True, parsed))

    def _validated(self, request: Request, parsed: Parsed) -> ChatCompletionRequest:
        """The body validated as a chat request. Through a kept body, only the new messages are validated: the
        kept ones are the bytes, hence the objects, the previous turn validated (a message validates on its own:
        ChatMessage has no cross-message rule, and the list's own rules, at least one message and each text free
        of lone surrogates, hold for the joined list when they hold for both parts). Any refusal is redone on
        the whole body, so that its error names the field as the client sent it. When the body's other members are
        the kept body's, byte for byte, they validate as they did then: the kept request is reused with the new
        messages validated alone (ChatMessage's own schema: what the request's list validates them with)."""
        base, reused = parsed.base, parsed.reused
        kept = base.turn.validated if base is not None and base.turn is not None else None
        messages = parsed.body.get("messages")
        if kept is not None and parsed.checked and 0 < reused <= len(kept) and isinstance(messages, list) \
                and len(messages) > reused:
            prev = base.turn.request if base is not None and base.turn is not None else None
            if prev is not None and parsed.state is not None and base is not None and parsed.state.same_fields(base):
                try:
                    new = _MESSAGES.validate_python(messages[reused:], context={"text_checked": True})
                except ValidationError:
                    pass
                else:   # prompt_cache_key as the body says (the kept request's may come from a header)
                    parsed.fields_kept = True
                    return self.applied(request, prev.model_copy(update={
                        "messages": kept[:reused] + new, "prompt_cache_key": parsed.body.get("prompt_cache_key")}))
            try:
                req = self.checked(request, ChatCompletionRequest, {**parsed.body, "messages": messages[reused:]},
                                   True)
            except APIError:
                pass
            else:
                req.messages = kept[:reused] + req.messages
                return req
        return self.checked(request, ChatCompletionRequest, parsed.body, parsed.checked)

    async def chat_completions(self, request: Request) -> Any:
        phases = Phases()
        raw = await request.body()
        phases.mark("received")
        if len(raw) <= _INLINE_CHAT_BYTES:
            req, n, report, body, turn = self._chat_work(request, raw)
        else:
            parsed = self.deltas.fast(raw) if len(raw) <= _INLINE_DELTA_BYTES else None
            if parsed is not None and parsed.new_bytes <= _INLINE_CHAT_BYTES:
                req, n, report, body, turn = self._chat_work(request, raw, parsed)
            else:
                req, n, report, body, turn = await self.offload(self._chat_work, request, raw, parsed,
                                                                parsed is None and len(raw) <= _INLINE_DELTA_BYTES)
        phases.mark("prepared")
        first = req.messages[0].text()[:1024] if req.messages else ""
        return await self._forward(request, req, n, body, report, conversation_key(req, first), True, phases, turn)

    async def _forward(self, request: Request, req: Any, n_prompt: int, body: Chunks,
                       report: TokenizationReport | None, key: str, chat: bool, phases: Phases,
                       turn: Turn | None = None) -> Any:
        extra = {"tokenization": {**report.to_dict(), "phases_ms": phases.marks}} if report is not None else {}
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(n_prompt)
        session = report.session if report is not None else None
        answer = IdAnswer(self.tokenizer, req.stops, n_prompt, req.n, req.num_logprobs, req.min_tokens or 0,
                          req.include_stop_str_in_output, req.skip_special_tokens) if self.pool.answers_ids else None
        calls: dict[int, ToolCallStream] | None = {} if chat and req.calls_tools else None
        if not req.stream:
            try:
                data = await self._until_disconnect(request, self._exchange(key, body, answer, turn, req))
            except ClientDisconnected:
                return JSONResponse({"error": {"message": "client disconnected", "type": "client_closed_request",
                                               "param": None, "code": None}}, status_code=499)
            self._answer_out(session)
            return {**(self._to_chat(data, calls is not None) if chat else data), **extra}
        url, resp, turn = await self._send(key, body, turn, req)
        phases.mark("upstream_head")
        if turn is not None and "tokenization" in extra:   # what the upstream session was sent: the new IDs alone?
            extra["tokenization"]["upstream_session"] = {"sent_ids": turn.sent, "context": turn.context}
        if resp.status_code != 200:
            if turn is not None:
                turn.fail()
            raise await error_from(resp, url)
        return EventStream(self._relay(resp, chat, extra, phases, session, answer, req.include_usage, calls, turn))

    async def _send(self, key: str, body: Chunks, turn: Turn | None, req: Any) -> tuple[str, Any, Turn | None]:
        """The request to the conversation's upstream: on its session route for a session turn, and when the
        upstream no longer holds the session (409: restarted, expired, another upstream), once more with the whole
        prompt as a new session (the conversation's IDs prepared again from its token session)."""
        if turn is None:
            return (*await self.pool.send(key, body), None)
        url, resp = await self.pool.send(key, body, SESSION_PATH)
        if resp.status_code != 409 or turn.context == 0:
            return url, resp, turn
        err = await error_from(resp, url)
        if err.code != MISMATCH:
            turn.fail()
            raise err
        assert self.turns is not None
        self.turns.forget(turn.session)     # the retry below opens a new upstream session
        _, _, body, turn = await self.offload(self._prepared, req, True)
        url, resp = await self.pool.send(key, body, SESSION_PATH if turn is not None else "/v1/completions")
        return url, resp, turn

    async def _exchange(self, key: str, body: Chunks, answer: IdAnswer | None = None, turn: Turn | None = None,
                        req: Any = None) -> dict[str, Any]:
        """A non-streaming answer; from an ID-only upstream, its stream gathered and decoded here (id_answers)."""
        url, resp, turn = await self._send(key, body, turn, req)
        done = False
        try:
            if resp.status_code != 200:
                raise await error_from(resp, url)
            if answer is None:
                return json.loads(await resp.aread())
            out = await gathered(answer, self._decoded(resp, answer, turn))
            done = True
            return out
        finally:
            await resp.aclose()
            if turn is not None and not done:
                turn.fail()

    @staticmethod
    async def _decoded(resp: Any, answer: IdAnswer, turn: Turn | None = None) -> AsyncIterator[dict[str, Any]]:
        stream = sse_data(resp)
        finished = False
        try:
            async for payload in stream:
                if payload == b"[DONE]":
                    return
                data = _loads(payload)
                if "error" in data:
                    err = data["error"]
                    raise APIError(str(err.get("message") if isinstance(err, dict) else err), status=502,
                                   code="upstream_error")
                if turn is not None and "tokenplane_session" in data:
                    finished = turn.finish(data.pop("tokenplane_session"))
                yield answer.convert(data)
        finally:
            await stream.aclose()
            if turn is not None and not finished:
                turn.fail()

    @staticmethod
    async def _until_disconnect(request: Request, work: Any) -> Any:
        """Await `work`, cancelling it (which closes the upstream connection, and vLLM aborts the request) if the
        client goes away first: a non-streaming upstream sends nothing until it is done, so waiting on it blind
        would hold a decoding slot for a client that left."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise ClientDisconnected
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    @staticmethod
    def _chat_logprobs(lp: Any) -> dict[str, Any] | None:
        """Completions-style logprobs (tokens, token_logprobs, top_logprobs) in chat's format."""
        if not isinstance(lp, dict) or "tokens" not in lp:
            return None

        def entry(token: str, value: float) -> dict[str, Any]:
            return {"token": token, "logprob": value, "bytes": list(token.encode("utf-8", "surrogatepass"))}
        tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
        return {"content": [{**entry(t, v), "top_logprobs": [entry(k, x) for k, x in (top or {}).items()]}
                            for t, v, top in zip(lp["tokens"], lp["token_logprobs"], tops)]}

    @classmethod
    def _to_chat(cls, data: dict[str, Any], tools: bool = False) -> dict[str, Any]:
        """tools: the answer may hold tool calls (tool_calls.py), parsed out of each choice's text."""
        choices = []
        for c in data.get("choices", []):
            msg: dict[str, Any] = {"role": "assistant", "content": c.get("text", "")}
            reason = c.get("finish_reason")
            if tools:
                content, found, reason = ToolCallStream().step(msg["content"], reason, True)
                if found:
                    msg.update(content=content or None, tool_calls=found)
            choices.append({"index": c.get("index", 0), "message": msg,
                            "logprobs": cls._chat_logprobs(c.get("logprobs")), "finish_reason": reason})
        out = {"id": "chatcmpl-" + str(data.get("id", secrets.token_hex(12))).removeprefix("cmpl-"),
               "object": "chat.completion", "created": data.get("created", int(time.time())),
               "model": data.get("model"), "choices": choices}
        if "usage" in data:
            out["usage"] = data["usage"]
        return out

    async def _relay(self, resp: Any, chat: bool, extra: dict[str, Any], phases: Phases,
                     session: str | None = None, answer: IdAnswer | None = None,
                     client_usage: bool = True, calls: dict[int, ToolCallStream] | None = None,
                     turn: Turn | None = None) -> AsyncIterator[bytes]:
        """The upstream's SSE chunks to the client (chat format for a chat). From an ID-only upstream each chunk's
        token IDs become text here, a stop string found here ends the answer (and closes the upstream request),
        and the usage chunk, always asked of it, reaches the client only if the client asked for it."""
        started: set[int] = set()
        first = True
        ended = False   # the upstream sent [DONE]: the rest of its stream is its terminator
        finished = False   # a session turn's report came: the upstream session's context is known
        stream = sse_data(resp)
        try:
            async for payload in stream:
                if first:
                    phases.mark("upstream_first")
                if payload == b"[DONE]":
                    ended = True
                    break
                data = _loads(payload)
                if "error" in data:
                    yield b"data: " + payload + b"\n\n"
                    continue
                if turn is not None and "tokenplane_session" in data:
                    finished = turn.finish(data.pop("tokenplane_session"))
                if answer is not None:
                    data = answer.convert(data)
                    if not data["choices"] and not (client_usage and data.get("usage")):
                        continue   # the usage the client did not ask for, or a choice already ended here
                yield self._event(data, chat, extra, started, calls)
                if first:
                    phases.mark("first_sent")   # the server has taken the chunk (resumed by the next ask)
                    first = False
                if answer is not None and answer.ended_here:
                    if client_usage:
                        yield self._event(answer.usage_chunk(), chat, extra, started, calls)
                    break   # not `ended`: the upstream request is closed below, and vLLM aborts it
        except Exception as exc:   # noqa: BLE001 - told to the client in the stream, which still ends cleanly
            err = exc if isinstance(exc, APIError) else APIError(f"upstream stream failed: {type(exc).__name__}",
                                                                 status=502, code="upstream_error")
            yield b"data: " + _dumps(err.body()) + b"\n\n"
        finally:
            await stream.aclose()
            if not ended:   # failed, cancelled (the client left) or ended without [DONE]: closed unless complete
                await resp.aclose()
            if turn is not None and not finished:
                turn.fail()
        yield b"data: [DONE]\n\n"
        self._answer_out(session)
        # Read the upstream's stream to its end so that its connection is kept for the next turn (a new connection
        # per turn cost ~1 ms of connect and close on the loop); one that does not end promptly is closed.
        await resp.finish(_FINISH_S)

    def _event(self, data: dict[str, Any], chat: bool, extra: dict[str, Any], started: set[int],
               calls: dict[int, ToolCallStream] | None = None) -> bytes:
        if data.get("usage") and not data.get("choices"):
            data.update(extra)   # the final usage chunk carries the tokenization report too
        if chat:
            data = self._chunk_to_chat(data, started, calls)
        return b"data: " + _dumps(data) + b"\n\n"

    @classmethod
    def _chunk_to_chat(cls, data: dict[str, Any], started: set[int],
                       calls: dict[int, ToolCallStream] | None = None) -> dict[str, Any]:
        choices = []
        for c in data.get("choices", []):
            i = c.get("index", 0)
            text, reason = c.get("text", ""), c.get("finish_reason")
            found: list[dict[str, Any]] = []
            if calls is not None:   # content streams until a tool call starts; the calls come with the end
                text, found, reason = calls.setdefault(i, ToolCallStream()).step(text, reason, reason is not None)
            delta: dict[str, Any] = {"content": text} if text else {}
            if found:
                delta["tool_calls"] = calls_delta(found)
            if i not in started:
                started.add(i)
                delta = {"role": "assistant", **delta}
            choices.append({"index": i, "delta": delta, "logprobs": cls._chat_logprobs(c.get("logprobs")),
                            "finish_reason": reason})
        out = {k: v for k, v in data.items() if k != "choices"}
        out.update(object="chat.completion.chunk", choices=choices,
                   id="chatcmpl-" + str(data.get("id", "")).removeprefix("cmpl-"))
        return out


def _loads(payload: bytes) -> Any:
    """orjson, or the stdlib where orjson refuses what json accepts (lone surrogate escapes, NaN, huge ints)."""
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return json.loads(payload)


def _dumps(data: Any) -> bytes:
    try:
        return orjson.dumps(data)
    except TypeError:   # a lone surrogate or an int past 64 bits: the stdlib writes them (as JSON escapes)
        return json.dumps(data).encode()


__all__ = ["Phases", "ProxyServer", "UpstreamBackend", "conversation_key"]
