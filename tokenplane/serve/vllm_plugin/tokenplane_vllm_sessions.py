"""Conversation sessions on a stock vLLM server: each turn sends only the token IDs its context lacks.

Loaded into vLLM's own OpenAI server as an HTTP middleware (no fork, no patch):

    PYTHONPATH=$(tokenplane vllm-plugin-path) vllm serve MODEL --skip-tokenizer-init \\
        --middleware tokenplane_vllm_sessions.session_turns

It serves POST /tokenplane/v1/session_completions and passes every other request on. Why: a chat resent whole as
token IDs still costs vLLM O(context) per turn outside the model (parsing the IDs, hashing every block for the
prefix cache, building the request): 118 ms at 314K tokens on the tier's benchmark machine against ~4 ms of the
tier's own work (benchmarks/results/agent_ttft_sw4096_ids.md). vLLM's engine already keeps a request alive across
input chunks (`AsyncLLM.generate` with an async generator of `StreamingInput`, the engine's "resumable" requests,
which its realtime API uses): a new chunk extends the live request, whose KV stays where it is, and only the new
tokens are hashed and computed. This middleware puts that behind one HTTP route, one live request per session.

Request (JSON): the fields of vLLM's /v1/completions (sampling: max_tokens, temperature, top_p, seed,
stop_token_ids, ignore_eos, min_tokens, ...), `prompt`: the new token IDs, and
`tokenplane_session`: {"id": str, "context": int, "replaces": str | null}. `context` is how many tokens the caller
believes the session holds: 0 opens a new session with this id (closing `replaces`); any other value must equal the
session's own count, else the answer is 409 `session_mismatch` (unknown, expired, busy or out of step: the caller
sends the whole prompt as a new session). n > 1, stop strings and beam search are refused (400): the engine's
streaming input does not take them; so are prompt logprobs and echo (a turn's prompt is not re-read).

Answer: Server-Sent Events shaped as vLLM's completion stream for a tokenizer-less engine (each chunk's new IDs as
`token_ids`, empty text), then a usage chunk that also carries `tokenplane_session`: {"id", "context", "kept"}, where
`context` is the session's token count after the turn and `kept` the answer's tokens the session holds: every
sampled token but the last, which the engine has not run through the model (its KV does not exist; the next turn
sends it again if the conversation keeps it). `logprobs` (completions' count) come in vLLM's token-ID form
("token_id:N" keys, as `return_tokens_as_token_ids` writes them). A client that disconnects mid-answer aborts the
session.

Sessions pin their KV blocks while idle, and vLLM counts an idle session against max_num_seqs, so at most
TOKENPLANE_VLLM_SESSIONS (default: half of max_num_seqs) are open; past that the least recently used idle one is
closed (its blocks go back to the prefix cache), as is any idle for TOKENPLANE_VLLM_SESSION_IDLE_S (default 600).

This file imports nothing from tokenplane: it runs in vLLM's environment.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

PATH = "/tokenplane/v1/session_completions"
_UNSTARTED_S = 30.0   # a taken session whose answer has not started for this long is reclaimed
# fields the engine's streaming input refuses or this route does not answer: (name, values that mean "not asked")
_REFUSED: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("n", (None, 1)), ("best_of", (None, 1)), ("prompt_logprobs", (None,)),
    ("stop", (None, "", [])), ("use_beam_search", (None, False)), ("echo", (None, False)))


class SessionError(Exception):
    def __init__(self, message: str, status: int = 409, code: str = "session_mismatch") -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class _Session:
    id: str
    request_id: str
    inputs: asyncio.Queue[Any]
    outputs: AsyncIterator[Any] | None = None
    context: int = 0
    busy: bool = False        # taken by a turn (from its request until its answer ends)
    started: bool = False     # that turn's answer stream runs (the engine has its chunk)
    closing: bool = False     # closed while a turn was answering: that turn's stream drains the rest
    last_used: float = field(default_factory=time.monotonic)


class Sessions:
    """The open sessions of one server (one event loop)."""

    def __init__(self, engine: Any, max_sessions: int, idle_s: float) -> None:
        self.engine = engine
        self.max_sessions = max(1, max_sessions)
        self.idle_s = idle_s
        self.open: OrderedDict[str, _Session] = OrderedDict()

    def close(self, sid: str, abort: bool = False) -> None:
        """Close a session: its input stream ends (the engine finishes the request, its blocks stay cached) or,
        with `abort`, the request is aborted (a turn cut short: its state is not what the caller knows)."""
        s = self.open.pop(sid, None)
        if s is None:
            return
        if abort:
            asyncio.ensure_future(self.engine.abort(s.request_id))
        else:
            s.inputs.put_nowait(None)   # the input stream ends: the engine finishes the request (blocks cached)
            if s.busy:
                s.closing = True        # one reader at a time: the answering turn reads to its end, then drains
            elif s.outputs is not None:
                asyncio.ensure_future(_drain(s.outputs))

    def _make_room(self) -> None:
        now = time.monotonic()
        for sid in [k for k, s in self.open.items() if not s.busy and now - s.last_used > self.idle_s]:
            self.close(sid)
        # a turn whose answer never started (its client left before the response began): nothing will release it
        for sid in [k for k, s in self.open.items() if s.busy and not s.started and now - s.last_used > _UNSTARTED_S]:
            self.close(sid, abort=True)
        while len(self.open) >= self.max_sessions:
            idle = next((k for k, s in self.open.items() if not s.busy), None)
            if idle is None:
                raise SessionError(f"all {self.max_sessions} sessions are answering", status=429,
                                   code="sessions_busy")
            self.close(idle)

    def take(self, spec: Any) -> _Session:
        if not isinstance(spec, dict) or not isinstance(spec.get("id"), str) or not spec["id"]:
            raise SessionError("tokenplane_session needs an id", status=400, code="invalid_request_error")
        sid, context = spec["id"], spec.get("context")
        if not isinstance(context, int) or isinstance(context, bool) or context < 0:
            raise SessionError("tokenplane_session.context must be an int >= 0", status=400,
                               code="invalid_request_error")
        if context == 0:
            if isinstance(spec.get("replaces"), str):
                self.close(spec["replaces"])
            self.close(sid)
            self._make_room()
            s = _Session(sid, f"tps-{uuid.uuid4().hex}", asyncio.Queue())
            self.open[sid] = s
        else:
            found = self.open.get(sid)
            if found is None or found.busy or found.context != context:
                why = "unknown or closed" if found is None else "answering" if found.busy \
                    else f"at {found.context} tokens"
                raise SessionError(f"session {sid} is {why}, not at {context} tokens")
            self.open.move_to_end(sid)
            s = found
        s.busy, s.started, s.last_used = True, False, time.monotonic()
        return s


async def _drain(outputs: AsyncIterator[Any]) -> None:
    try:
        async for _ in outputs:
            pass
    except Exception:   # noqa: BLE001 - a closed session's last outputs: nobody reads them
        pass


def _sessions(app: Any) -> Sessions:
    s = getattr(app.state, "tokenplane_sessions", None)
    if s is None:
        engine = app.state.engine_client
        max_seqs = engine.vllm_config.scheduler_config.max_num_seqs
        limit = int(os.environ.get("TOKENPLANE_VLLM_SESSIONS", max(1, max_seqs // 2)))
        s = Sessions(engine, min(limit, max(1, max_seqs - 1)),
                     float(os.environ.get("TOKENPLANE_VLLM_SESSION_IDLE_S", 600)))
        app.state.tokenplane_sessions = s
    return s


def _error(message: str, status: int, code: str) -> Any:
    from starlette.responses import JSONResponse
    kind = "invalid_request_error" if status == 400 else "session_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status)


def _sampling(app: Any, body: dict[str, Any], n_total: int) -> Any:
    """vLLM's own SamplingParams for these completion fields (its CompletionRequest's defaults and checks)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
    from vllm.sampling_params import RequestOutputKind
    engine = app.state.engine_client
    defaults = getattr(app.state, "tokenplane_sampling_defaults", None)
    if defaults is None:   # the model's generation_config, as vLLM's completions route applies it (read once: ~4 ms)
        serving = getattr(app.state, "openai_serving_completion", None)
        defaults = getattr(serving, "default_sampling_params", None)
        if defaults is None:
            defaults = engine.model_config.get_diff_sampling_param()
        app.state.tokenplane_sampling_defaults = defaults
    fields = {k: v for k, v in body.items() if k not in ("prompt", "tokenplane_session", "stream", "stream_options",
                                                         "return_tokens_as_token_ids", "return_token_ids")}
    req = CompletionRequest(**fields, prompt=[0])
    max_tokens = get_max_tokens(engine.model_config.max_model_len, req.max_tokens, n_total, defaults)
    sp = req.to_sampling_params(max_tokens, defaults)
    sp.output_kind = RequestOutputKind.DELTA
    sp.detokenize = False
    return sp


def _chunk_input(ids: list[int], sp: Any) -> Any:
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt
    return StreamingInput(TokensPrompt(prompt_token_ids=ids), sampling_params=sp)


def _logprobs(new: list[int], o: Any) -> dict[str, Any] | None:
    """The new tokens' logprobs in vLLM's completion form with token-ID keys (None where none were asked)."""
    per = getattr(o, "logprobs", None)
    if not per or not new:
        return None
    per = list(per)[-len(new):]
    return {"tokens": [f"token_id:{t}" for t in new], "token_logprobs": [d[t].logprob for t, d in zip(new, per)],
            "top_logprobs": [{f"token_id:{k}": v.logprob for k, v in d.items()} for d in per],
            "text_offset": [0] * len(new)}


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def session_turns(request: Any, call_next: Any) -> Any:
    """vLLM `--middleware` entry point: the session route here, every other request to vLLM."""
    if request.url.path != PATH or request.method != "POST":
        return await call_next(request)
    app = request.app
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        return _error(f"the body is not JSON: {exc}", 400, "invalid_request_error")
    if not isinstance(body, dict):
        return _error("the body must be a JSON object", 400, "invalid_request_error")
    ids = body.get("prompt")
    if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        return _error("prompt must be a non-empty list of token IDs", 400, "invalid_request_error")
    for name, unasked in _REFUSED:
        if body.get(name) not in unasked:
            return _error(f"{name} is not supported on a session turn", 400, "invalid_request_error")
    sessions = _sessions(app)
    try:
        s = sessions.take(body.get("tokenplane_session"))
    except SessionError as exc:
        return _error(str(exc), exc.status, exc.code)
    try:
        sp = _sampling(app, body, s.context + len(ids))
    except Exception as exc:   # noqa: BLE001 - vLLM's own validation: the caller's fields are refused
        s.busy = False
        if s.context == 0:
            sessions.close(s.id)
        return _error(f"{type(exc).__name__}: {exc}", 400, "invalid_request_error")
    from starlette.responses import StreamingResponse
    return StreamingResponse(_answer(sessions, s, _chunk_input(ids, sp), sp, len(ids), app),
                             media_type="text/event-stream")


async def _answer(sessions: Sessions, s: _Session, chunk: Any, sp: Any, n_new: int, app: Any) -> AsyncIterator[bytes]:
    """The turn's answer. The chunk reaches the engine only once this stream runs: a response that never starts
    (its client left first) gives the engine nothing to do, and its session is reclaimed (_make_room)."""
    s.started = True
    s.inputs.put_nowait(chunk)
    if s.outputs is None:
        async def inputs(q: asyncio.Queue[Any] = s.inputs) -> AsyncIterator[Any]:
            while (item := await q.get()) is not None:
                yield item
        s.outputs = sessions.engine.generate(inputs(), sp, request_id=s.request_id).__aiter__()
    before = s.context
    made: list[int] = []
    rid = f"cmpl-{s.request_id}-{before}"
    created = int(time.time())
    model = getattr(app.state, "tokenplane_model", None)
    if model is None:
        names = getattr(getattr(app.state, "openai_serving_models", None), "base_model_paths", None)
        model = app.state.tokenplane_model = names[0].name if names else ""
    done = False
    try:
        assert s.outputs is not None
        while not done:
            out = await s.outputs.__anext__()
            o = out.outputs[0]
            new = list(o.token_ids)
            made += new
            done = o.finish_reason is not None
            if new or done:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": [{"index": 0, "text": "", "token_ids": new, "logprobs": _logprobs(new, o),
                                         "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}]})
        s.context = before + n_new + len(made) - 1
        s.busy = False
        if s.closing:
            asyncio.ensure_future(_drain(s.outputs))
        s.last_used = time.monotonic()
        prompt = before + n_new
        yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                    "usage": {"prompt_tokens": prompt, "completion_tokens": len(made),
                              "total_tokens": prompt + len(made)},
                    "tokenplane_session": {"id": s.id, "context": s.context, "kept": made[:-1]}})
        yield b"data: [DONE]\n\n"
    except Exception as exc:   # the engine failed or ended the request: the session is gone
        sessions.close(s.id, abort=True)
        yield _sse({"error": {"message": f"session turn failed: {type(exc).__name__}: {exc}",
                              "type": "upstream_error", "param": None, "code": "session_failed"}})
    except BaseException:   # the client left (cancelled, or the stream closed): the turn is cut short
        sessions.close(s.id, abort=True)
        raise


__all__ = ["PATH", "Sessions", "session_turns"]
