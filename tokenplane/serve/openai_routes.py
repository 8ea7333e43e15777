"""OpenAI-compatible completions and chat completions over a Backend (JSON or SSE streaming).

Per request: bytes are read under the body limit, parsed and validated (protocol.py), the prompt tokenized in a
worker thread (never on the event loop), checked against the context and the KV capacity, and decoded. Errors before
the first token get a real HTTP status; a failure after the stream started is sent as an error event, then
`data: [DONE]`. A client that disconnects aborts its request, streaming or not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Sequence, TypeVar

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .backends import Backend, TokenLogprob
from .chat import ChatTemplate, template_for
from .config import Limits
from .conversations import ConversationCache, SessionText, Take, TokenizationReport, blocks, copied
from .errors import APIError, InvalidRequest, NotFound, PayloadTooLarge
from .metrics import Metrics
from .protocol import (
    ENGINE_SAMPLING,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_request,
    validate,
)
from .text_stream import TextStream, completion_logprobs, token_bytes
from .tool_calls import ToolChoices, chat_extras

log = logging.getLogger("tokenplane.serve")
T = TypeVar("T")
PromptIds = np.ndarray | list[int]   # an array when tokenized here, the client's list when it sent IDs
_INLINE_BYTES = 64 << 10   # bodies up to this parse on the loop (tens of microseconds); larger ones in a thread
_DISCONNECT_POLL_S = 0.25


class ClientDisconnected(Exception):
    pass


@dataclass
class Job:
    prompt_ids: list[int]
    params: Any            # tokenplane.engine.sampler.SamplingParams
    stop: list[str]
    tokenization: TokenizationReport | None = None
    include_stop: bool = False    # the matched stop string ends the text (vLLM's include_stop_str_in_output)
    skip_special: bool = True     # special tokens are not text (vLLM's skip_special_tokens)


@dataclass
class Event:
    delta: str
    finish_reason: str | None
    stats: dict[str, Any] | None
    completion_tokens: int
    logprobs: list[tuple[int, TokenLogprob]] | None = None   # (token, its logprob entry) since the last event


class OpenAIServer:
    def __init__(self, backend: Backend, tokenizer: Any, *, model_name: str, limits: Limits,
                 metrics: Metrics | None = None, default_max_tokens: int = 16,
                 chat_template: ChatTemplate | None = None) -> None:
        self.backend, self.tokenizer, self.model_name = backend, tokenizer, model_name
        self.limits, self.metrics = limits, metrics
        self.default_max_tokens = default_max_tokens
        self.chat = chat_template or template_for(tokenizer)
        # what the engine behind implements (sampling parameters; tools where this template writes parseable calls)
        self.forwarded_sampling: frozenset[str] = ENGINE_SAMPLING | ({"tools"} if self.chat.calls_tools else set())
        self.created = int(time.time())
        self._cpu = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenplane-text")
        self.chat_sessions: ConversationCache | None = None
        self.prompt_sessions: ConversationCache | None = None
        self._in_flight: set[str] = set()       # backend request ids being generated (client ids must not clash)

    async def warm_up(self) -> None:
        """Compile the tokenizer's fast paths (numba JIT) before the first request instead of during it: one full
        encode, and one conversation session grown turn by turn as an agent's is, then dropped. Its turns take the
        kernels a real conversation reaches: text over 1K characters in one str width, then wider characters after
        it (the prefix compare across str widths), then more text after those (a wide run the text store packs).
        Without them a machine with no AOT module yet compiled one inside the first real follow-up request (0.4-0.6
        s of its tokenization, measured on the demo's conversation)."""
        def work() -> None:
            text = "Warm-up: tokenizer 123, sessions!\n" * 64
            wide = "more text \u2014 caf\u00e9 \U0001F44D\n"
            self.tokenizer.encode(text)
            plain = [text, text + "more text", text + wide, text + wide + text, text + wide + text + "x"]
            # a rendered chat too: windows cut by the template's control tokens take their own kernels
            turns = [("user", text), ("assistant", "ok"), ("user", "more text"), ("assistant", wide), ("user", text),
                     ("assistant", "x"), ("user", "y")]
            try:
                chat_texts = [self.chat.render(turns[:k]) for k in (1, 3, 5, 7)]
            except InvalidRequest:      # a template that refuses this conversation: plain text warms the rest
                chat_texts = plain
            for cache, texts in ((self.chat_sessions, chat_texts), (self.prompt_sessions, plain)):
                if cache is None:
                    continue
                made = set()
                for t in texts:
                    _, report = cache.encode(t, blocks(t), "tokenplane-warm-up")
                    if report.session is not None:
                        made.add(report.session)
                for sid in made:
                    try:
                        cache.store.delete(sid)
                    except NotFound:    # evicted already (a small session store)
                        pass
        t0 = time.perf_counter()
        await self.offload(work)
        log.info("tokenizer warm-up %.2f s", time.perf_counter() - t0)

    def use_sessions(self, store: Any) -> None:
        """Tokenize prompts through conversation sessions kept in `store` (the tokenize service's SessionStore)."""
        self.chat_sessions = ConversationCache(self.tokenizer, store, allowed_special="all")
        self.prompt_sessions = ConversationCache(self.tokenizer, store)

    def close(self) -> None:
        self._cpu.shutdown(wait=False, cancel_futures=True)

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    # -- parsing ------------------------------------------------------------------------------------------------
    async def read(self, request: Request, model: type[Any]) -> Any:
        raw = await request.body()
        body, checked = parse_request(raw) if len(raw) <= _INLINE_BYTES else await self.offload(parse_request, raw)
        return self.checked(request, model, body, checked)

    def checked(self, request: Request, model: type[Any], body: dict[str, Any], checked: bool) -> Any:
        """A parsed body validated as `model`, with the conversation header and the model name applied."""
        return self.applied(request, validate(model, body, checked, self.forwarded_sampling))

    def applied(self, request: Request, req: Any) -> Any:
        """A request validated from its body, with the conversation header and the model name applied."""
        if req.prompt_cache_key is None and (header := request.headers.get("x-conversation-id")):
            req.prompt_cache_key = header   # what a consistent-hash load balancer in front keys on, too
        if req.model is not None and req.model != self.model_name:
            raise NotFound(f"model {req.model!r} does not exist; available: [{self.model_name!r}]", param="model",
                           code="model_not_found")
        return req

    def _check_chars(self, n: int) -> None:
        if n > self.limits.max_prompt_chars:
            raise PayloadTooLarge(f"the prompt has {n:,} characters; the limit is {self.limits.max_prompt_chars:,}",
                                  param="prompt", code="prompt_too_large")

    def completion_ids(self, req: CompletionRequest) -> tuple[PromptIds, TokenizationReport | None]:
        """Prompt IDs (a numpy array when tokenized here) and how they were obtained."""
        prompt = req.prompt_value
        if not isinstance(prompt, str):
            return list(prompt), None
        if self.prompt_sessions is None:
            t0 = time.perf_counter()
            direct = self.tokenizer.encode(prompt)
            return direct, TokenizationReport("full_encode", 0, len(direct), (time.perf_counter() - t0) * 1e3)
        return self.prompt_sessions.encode(prompt, blocks(prompt), req.conversation_key)

    def chat_ids(self, req: ChatCompletionRequest, clean: int = 0, session: str | None = None,
                 messages: list[tuple[str, str]] | None = None,
                 prior: tuple[Sequence[tuple[str, str]], SessionText] | None = None,
                 take: Take = copied) -> tuple[Any, TokenizationReport | None]:
        """clean: leading messages known to quote no control token; session: the session this conversation's
        previous turn repaired (the prefix-hash lookup is skipped while it lives); messages: the request's (role,
        text) pairs if the caller has them; prior: the previous turn's pairs, which the caller knows this request
        starts with, and the session text that turn left: the new messages alone are rendered and appended
        (ChatTemplate.extend, ConversationCache.append_on), else the whole prompt is rendered and synced; take:
        what to make of the IDs (conversations.Take; a copy of a session's IDs by default)."""
        if messages is None:
            messages = [(m.role, m.text()) for m in req.messages]
        t0 = time.perf_counter()   # both paths time the template render too, so their figures compare
        extras = chat_extras(req.messages, req.tools if req.calls_tools else None)
        if extras is not None:      # a tool conversation: rendered whole (no incremental render), then synced
            prior = None
        if self.chat_sessions is None or self.chat.quotes_specials(messages, clean if extras is None else 0):
            direct = self.chat.encode(messages, extras=extras)
            path = "bypass" if self.chat_sessions is not None else "full_encode"
            return take(direct, None), TokenizationReport(path, 0, len(direct), (time.perf_counter() - t0) * 1e3)
        if prior is not None:
            tail = self.chat.extend(prior[0], messages)
            found = self.chat_sessions.append_on(prior[1], tail, take) if tail is not None else None
            if found is not None:
                found[1].time_ms = (time.perf_counter() - t0) * 1e3
                return found
        text = self.chat.render(messages, extras=extras)
        found = self.chat_sessions.encode_on(session, text, take) if session is not None else None
        ids, report = found if found is not None else \
            self.chat_sessions.encode(text, blocks(text), req.conversation_key, take)
        report.time_ms = (time.perf_counter() - t0) * 1e3
        return ids, report

    @staticmethod
    def listed(found: tuple[PromptIds, TokenizationReport | None]) -> tuple[list[int], TokenizationReport | None]:
        """The engine's prompt is a list (it crosses to the sub-servers as msgpack); converted in the worker thread."""
        ids, report = found
        return ids if isinstance(ids, list) else np.asarray(ids).tolist(), report

    def jobs(self, req: Any, prompt_ids: list[int], extra_stop_ids: Sequence[int] = (),
             tokenization: TokenizationReport | None = None) -> list[Job]:
        from tokenplane.engine.sampler import SamplingParams
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        vocab = self.backend.vocab_size
        if vocab is not None and max(prompt_ids) >= vocab:
            raise InvalidRequest(f"prompt token id {max(prompt_ids)} is outside the model vocabulary ({vocab})",
                                 param="prompt", code="token_out_of_vocabulary")
        asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
        n_prompt = len(prompt_ids)
        limit = self.backend.max_model_len
        if limit is not None:
            if n_prompt >= limit:
                raise InvalidRequest(f"this model's maximum context length is {limit} tokens; the prompt has "
                                     f"{n_prompt} tokens", param="prompt", code="context_length_exceeded")
            if asked is not None and n_prompt + asked > limit:
                raise InvalidRequest(f"this model's maximum context length is {limit} tokens; you requested "
                                     f"{n_prompt + asked} tokens ({n_prompt} in the prompt, {asked} in the "
                                     f"completion)", param="max_tokens", code="context_length_exceeded")
        sampling = req.sampling()
        biased = max((t for t, _ in sampling["logit_bias"]), default=-1)
        if vocab is not None and biased >= vocab:
            raise InvalidRequest(f"logit_bias token id {biased} is outside the model vocabulary ({vocab})",
                                 param="logit_bias", code="token_out_of_vocabulary")
        max_tokens = asked if asked is not None else self.default_max_tokens
        if limit is not None:
            max_tokens = min(max_tokens, limit - n_prompt)
        if sampling["min_tokens"] > max_tokens:
            raise InvalidRequest(f"min_tokens ({sampling['min_tokens']}) must not exceed max_tokens ({max_tokens})",
                                 param="min_tokens")
        out = []
        for i in range(req.n):
            seed = None if req.seed is None else (req.seed + i) % (1 << 63)   # the runtime's seed range
            params = SamplingParams(temperature=req.temperature, top_p=req.top_p, max_tokens=max_tokens, seed=seed,
                                    stop_token_ids=(*extra_stop_ids, *(req.stop_token_ids or ())),
                                    ignore_eos=req.ignore_eos,
                                    logprobs=req.num_logprobs, **sampling)
            out.append(Job(prompt_ids, params, req.stops, tokenization, req.include_stop_str_in_output,
                           req.skip_special_tokens))
        return out

    # -- generation ---------------------------------------------------------------------------------------------
    async def events(self, job: Job, request_id: str) -> AsyncGenerator[Event, None]:
        text = TextStream(self.tokenizer, job.stop, skip_special=job.skip_special, include_stop=job.include_stop)
        n = 0
        lps: list[tuple[int, TokenLogprob]] | None = [] if job.params.logprobs is not None else None
        t0 = time.perf_counter()
        backend_done = False   # the backend finished the request itself; otherwise it must be told to stop
        if request_id in self._in_flight:    # only a client's X-Request-Id can repeat (ours are random)
            raise APIError(f"request id {request_id!r} is already in flight", status=409, param="X-Request-Id",
                           code="duplicate_request_id")
        self._in_flight.add(request_id)
        try:
            async with aclosing(self.backend.generate(job.prompt_ids, job.params, request_id)) as chunks:
                async for chunk in chunks:
                    if n == 0 and chunk.token_ids and self.metrics is not None:
                        self.metrics.ttft.observe(time.perf_counter() - t0)
                    n += len(chunk.token_ids)
                    if lps is not None and chunk.logprobs:
                        lps.extend(zip(chunk.token_ids, chunk.logprobs))
                    delta = text.push(chunk.token_ids, armed=n >= job.params.min_tokens)
                    backend_done = chunk.finish_reason is not None
                    if text.stopped:   # a stop string: the text ends before it, whatever the backend says
                        yield Event(delta, "stop", chunk.stats, n, lps)
                        return
                    if chunk.finish_reason is not None:
                        yield Event(delta + text.flush(), chunk.finish_reason, chunk.stats, n, lps)
                        return
                    if delta:
                        yield Event(delta, None, None, n, lps)
                        lps = [] if lps is not None else None
            backend_done = True
            yield Event(text.flush(), "stop", None, n, lps)
        finally:
            self._in_flight.discard(request_id)
            if not backend_done:   # client went away, stop string, or an error: free the request's resources
                self.backend.abort(request_id)
            if self.metrics is not None:
                self.metrics.generation_tokens.inc(n)

    def _record(self, final: Event) -> None:
        if self.metrics is not None:
            self.metrics.record_routing(final.stats)

    async def _collect(self, job: Job, rid: str) -> Event:
        parts: list[str] = []
        lps: list[tuple[int, TokenLogprob]] | None = None
        final = Event("", "stop", None, 0)
        async for ev in self.events(job, rid):
            parts.append(ev.delta)
            if ev.logprobs is not None:
                lps = (lps or []) + ev.logprobs
            if ev.finish_reason is not None:
                final = ev
        self._record(final)
        return Event("".join(parts), final.finish_reason, final.stats, final.completion_tokens, lps)

    async def _collect_all(self, request: Request, jobs: list[Job], rid: str) -> list[Event]:
        """All choices, aborted when the client disconnects (a non-streaming client that left must not keep
        decoding and holding KV)."""
        tasks = [asyncio.ensure_future(self._collect(job, f"{rid}-{i}" if len(jobs) > 1 else rid))
                 for i, job in enumerate(jobs)]
        gathered = asyncio.gather(*tasks)
        try:
            while True:
                done, _ = await asyncio.wait({gathered}, timeout=_DISCONNECT_POLL_S)
                if done:
                    return gathered.result()
                if await request.is_disconnected():
                    raise ClientDisconnected
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)   # their finally blocks abort in the backend
            if gathered.done() and not gathered.cancelled():
                gathered.exception()   # retrieved: the error that ended the wait is the one raised
            raise

    def usage(self, jobs: list[Job], events: Sequence[Event]) -> dict[str, Any]:
        p = len(jobs[0].prompt_ids)
        c = sum(e.completion_tokens for e in events)
        out: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        cached = [e.stats["cached_prompt_tokens"] for e in events if e.stats and "cached_prompt_tokens" in e.stats]
        if cached:   # prompt tokens served from the KV prefix cache, as OpenAI reports them
            out["prompt_tokens_details"] = {"cached_tokens": int(cached[0])}
        return out

    async def _primed(self, jobs: list[Job], rid: str) -> list[tuple[AsyncGenerator[Event, None], Event | None]]:
        """Start every choice's stream and wait for its first event, so that errors at admission (queue full,
        model down, request too large) are answered with their HTTP status rather than inside a 200 stream."""
        streams: list[tuple[AsyncGenerator[Event, None], Event | None]] = []
        try:
            for i, job in enumerate(jobs):
                gen = self.events(job, f"{rid}-{i}" if len(jobs) > 1 else rid)
                try:
                    first: Event | None = await gen.__anext__()
                except StopAsyncIteration:
                    first = None
                streams.append((gen, first))
        except BaseException:
            for gen, _ in streams:
                await gen.aclose()
            raise
        return streams

    async def _merged(self, streams: list[tuple[AsyncGenerator[Event, None], Event | None]]
                      ) -> AsyncIterator[tuple[int, Event]]:
        if len(streams) == 1:
            gen, first = streams[0]
            if first is not None:
                yield 0, first
            async for ev in gen:
                yield 0, ev
            return
        queue: asyncio.Queue[tuple[int, Event | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, gen: AsyncGenerator[Event, None], first: Event | None) -> None:
            try:
                if first is not None:
                    await queue.put((i, first))
                async for ev in gen:
                    await queue.put((i, ev))
                await queue.put((i, None))
            except Exception as exc:   # noqa: BLE001 - forwarded to the consumer
                await queue.put((i, exc))
        tasks = [asyncio.ensure_future(pump(i, g, f)) for i, (g, f) in enumerate(streams)]
        try:
            open_ = len(tasks)
            while open_:
                i, item = await queue.get()
                if item is None:
                    open_ -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for gen, _ in streams:
                await gen.aclose()

    async def _sse(self, streams: list[tuple[AsyncGenerator[Event, None], Event | None]], jobs: list[Job],
                   head: dict[str, Any], choice: Callable[[int, Event], dict[str, Any]], include_usage: bool,
                   preamble: Sequence[dict[str, Any]] = ()) -> AsyncIterator[str]:
        finals: dict[int, Event] = {}
        try:
            for p in preamble:
                yield f"data: {json.dumps({**head, 'choices': [p], **({'usage': None} if include_usage else {})})}\n\n"
            async for i, ev in self._merged(streams):
                if not ev.delta and ev.finish_reason is None and not ev.logprobs:
                    continue
                out: dict[str, Any] = {**head, "choices": [choice(i, ev)]}
                if include_usage:
                    out["usage"] = None
                if ev.finish_reason is not None:
                    finals[i] = ev
                    out["routing"] = ev.stats
                    self._record(ev)
                yield f"data: {json.dumps(out)}\n\n"
            if include_usage:
                usage = self.usage(jobs, list(finals.values()))
                last: dict[str, Any] = {**head, "choices": [], "usage": usage}
                if jobs[0].tokenization is not None:
                    last["tokenization"] = jobs[0].tokenization.to_dict()
                yield f"data: {json.dumps(last)}\n\n"
        except Exception as exc:   # noqa: BLE001 - told to the client in the stream, then the stream ends cleanly
            err = exc if isinstance(exc, APIError) else APIError(f"internal error: {type(exc).__name__}", status=500)
            if not isinstance(exc, APIError):
                log.exception("stream failed")
            if self.metrics is not None:
                self.metrics.errors.labels(err.code or str(err.status)).inc()
            yield f"data: {json.dumps(err.body())}\n\n"
        yield "data: [DONE]\n\n"

    # -- routes -------------------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Any:
        req = await self.read(request, CompletionRequest)
        if isinstance(req.prompt_value, str):
            self._check_chars(len(req.prompt_value))
        prompt_ids, report = await self.offload(lambda: self.listed(self.completion_ids(req)))
        jobs = self.jobs(req, prompt_ids, tokenization=report)
        return await self._respond(request, req, jobs, "cmpl", "text_completion", self._completion_choice)

    async def chat_completions(self, request: Request) -> Any:
        req = await self.read(request, ChatCompletionRequest)
        self._check_chars(sum(len(m.text()) for m in req.messages))
        prompt_ids, report = await self.offload(lambda: self.listed(self.chat_ids(req)))
        jobs = self.jobs(req, prompt_ids, self.chat.stop_token_ids, tokenization=report)
        choice = ToolChoices(self._chat_choice, Event) if req.calls_tools else self._chat_choice
        return await self._respond(request, req, jobs, "chatcmpl", "chat.completion", choice)

    async def tokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /tokenize: the IDs the completion or chat route would send to the engine for this prompt or
        conversation (the sessionless encode: a session gives the same IDs by construction)."""
        req = await self.read(request, TokenizeRequest)
        if req.prompt is not None:
            self._check_chars(len(req.prompt))
        else:
            self._check_chars(sum(len(m.text()) for m in req.messages or ()))

        def work() -> dict[str, Any]:   # in a worker thread: O(prompt) work never runs on the event loop
            if req.prompt is not None:
                ids: list[int] = self.tokenizer.encode(req.prompt).tolist()
            else:
                messages = [(m.role, m.text()) for m in req.messages or ()]
                ids = self.chat.encode(messages, req.add_generation_prompt, chat_extras(req.messages or (), req.tools))
            out: dict[str, Any] = {"count": len(ids), "max_model_len": self.backend.max_model_len, "tokens": ids}
            if req.return_token_strs:
                out["token_strs"] = [token_bytes(self.tokenizer, t).decode("utf-8", "replace") for t in ids]
            return out
        return await self.offload(work)

    async def detokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /detokenize: the text of token IDs (every ID must be in the vocabulary)."""
        req = await self.read(request, DetokenizeRequest)
        vocab = self.tokenizer.n_vocab
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary ({vocab})", param="tokens",
                                 code="token_out_of_vocabulary")
        return {"prompt": await self.offload(self.tokenizer.decode, req.tokens)}

    def _completion_logprobs(self, ev: Event) -> dict[str, Any] | None:
        if ev.logprobs is None:
            return None
        return completion_logprobs(self.tokenizer, ((token, lp, top) for token, (lp, top) in ev.logprobs))[0]

    def _chat_logprobs(self, ev: Event) -> dict[str, Any] | None:
        if ev.logprobs is None:
            return None

        def entry(token: int, lp: float) -> dict[str, Any]:
            raw = token_bytes(self.tokenizer, token)
            return {"token": raw.decode("utf-8", "replace"), "logprob": lp, "bytes": list(raw)}
        return {"content": [{**entry(token, lp), "top_logprobs": [entry(t, v) for t, v in top]}
                            for token, (lp, top) in ev.logprobs]}

    def _completion_choice(self, i: int, ev: Event, stream: bool = True) -> dict[str, Any]:
        return {"index": i, "text": ev.delta, "logprobs": self._completion_logprobs(ev),
                "finish_reason": ev.finish_reason}

    def _chat_choice(self, i: int, ev: Event, stream: bool = True) -> dict[str, Any]:
        if not stream:
            return {"index": i, "message": {"role": "assistant", "content": ev.delta},
                    "logprobs": self._chat_logprobs(ev), "finish_reason": ev.finish_reason}
        return {"index": i, "delta": {"content": ev.delta} if ev.delta else {}, "logprobs": self._chat_logprobs(ev),
                "finish_reason": ev.finish_reason}

    async def _respond(self, request: Request, req: Any, jobs: list[Job], prefix: str, obj: str,
                       choice: Callable[..., dict[str, Any]]) -> Any:
        rid = f"{prefix}-{_client_request_id(request) or secrets.token_hex(12)}"
        base = {"id": rid, "created": int(time.time()), "model": self.model_name}
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(jobs[0].prompt_ids))
        if not req.stream:
            try:
                events = await self._collect_all(request, jobs, rid)
            except ClientDisconnected:
                return JSONResponse({"error": {"message": "client disconnected", "type": "client_closed_request",
                                               "param": None, "code": None}}, status_code=499)
            stats = events[0].stats if len(events) == 1 else [e.stats for e in events]
            out = {**base, "object": obj, "choices": [choice(i, e, False) for i, e in enumerate(events)],
                   "usage": self.usage(jobs, events), "routing": stats}
            if jobs[0].tokenization is not None:
                out["tokenization"] = jobs[0].tokenization.to_dict()
            return out
        streams = await self._primed(jobs, rid)
        head = {**base, "object": obj + ".chunk" if obj == "chat.completion" else obj}
        preamble = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None} for i in range(len(jobs))] if obj == "chat.completion" else []
        return StreamingResponse(self._sse(streams, jobs, head, choice, req.include_usage, preamble),
                                 media_type="text/event-stream")


def _client_request_id(request: Request) -> str | None:
    """The client's X-Request-Id header (as vLLM's --enable-request-id-headers takes it): the response id and the
    backend's request id derive from it, so a client can trace a request through the logs, and routing decisions
    keyed on the request id (synthetic mode) repeat for a repeated id."""
    given = request.headers.get("x-request-id")
    if given is None:
        return None
    if not 0 < len(given) <= 128 or not given.isascii() or not given.isprintable():
        raise APIError("X-Request-Id must be 1 to 128 printable ASCII characters", status=400, param="X-Request-Id",
                       code="invalid_request_id")
    return given


__all__ = ["OpenAIServer"]
