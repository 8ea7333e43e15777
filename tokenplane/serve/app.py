"""One HTTP entry point for routed decoding: OpenAI-compatible completions and chat (JSON and SSE streaming).

Clients see one model; switches between the routed models are hidden. Responses carry text, usage and a `routing`
extension field (per-request routing statistics: token shares, routing rate, handoffs, catch-up prefill sizes).

The server talks to a backend with `async generate(prompt_ids, params, request_id) -> AsyncIterator[chunk]` and
`abort(request_id)`: the multi-process `tokenplane.route.runtime.Runtime` ("process") or `InProcessBackend`, the
sequential reference run in a worker thread one request at a time ("inprocess"). A chunk has `token_ids`
(or `tokens`), `finish_reason` (None until the last chunk) and, on the last chunk, `stats`.

    tokenplane serve [--config FILE] [--backend process|inprocess] [--host 127.0.0.1] [--port 8000]

Config file (JSON; every key optional):
    {"models": ["tiny-small", "tiny-large"],       preset names, HF config dicts, or checkpoint directories
     "devices": ["cpu", "cpu"], "dtype": "float32",
     "algorithm": "r_stitch", "parameters": {"mode": "calibrated", "rates": {"switch": 0.1, "return": 0.5}},
     "calibration": {"prompts": ["..."], "max_tokens": 16},
     "served_model_name": "tokenplane-router", "tokenizer": "qwen3", "num_blocks": 1024, "block_size": 16,
     "seed": 0, "default_max_tokens": 16,
     "runtime": {"mode": "delayed_async", "thresholds": "auto", ...}}   extra RuntimeConfig fields (process backend)
Errors are OpenAI-shaped {"error": {"message", "type", "param", "code"}}: 400 malformed JSON or fields, prompt not
shorter than the context, max_tokens <= 0, token ids outside the vocabulary; 404 unknown model.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import dataclasses
import importlib.util
import json
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

log = logging.getLogger("tokenplane.serve")

DEFAULT_CALIBRATION_PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that reverses a linked list.",
    "What is 17 * 23? Think step by step.",
    "Summarize the plot of Hamlet.",
]
CHATML_SPECIALS = ("<|im_start|>", "<|im_end|>")
CHAT_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


# -- configuration --------------------------------------------------------------------------------------------------
@dataclass
class ServeConfig:
    models: list[Any] = field(default_factory=lambda: ["tiny-small", "tiny-large"])
    devices: list[str] | None = None
    dtype: str = "float32"
    algorithm: str = "r_stitch"
    parameters: dict[str, Any] = field(default_factory=lambda: {"mode": "calibrated"})
    calibration: dict[str, Any] = field(default_factory=dict)
    served_model_name: str = "tokenplane-router"
    tokenizer: str = "qwen3"
    num_blocks: int = 1024
    block_size: int = 16
    seed: int = 0
    default_max_tokens: int = 16
    runtime: dict[str, Any] = field(default_factory=dict)   # extra RuntimeConfig fields (mode, thresholds, ...)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ServeConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known: {sorted(names)}")
        cfg = cls(**d)
        if not cfg.models:
            raise ValueError("config needs at least one model")
        if cfg.devices is not None and len(cfg.devices) != len(cfg.models):
            raise ValueError(f"{len(cfg.models)} models but {len(cfg.devices)} devices")
        return cfg

    @classmethod
    def load(cls, path: str | Path | None) -> "ServeConfig":
        return cls() if path is None else cls.from_dict(json.loads(Path(path).read_text()))

    def torch_dtype(self) -> Any:
        import torch
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        return dt


# -- backends -------------------------------------------------------------------------------------------------------
@dataclass
class Chunk:
    token_ids: list[int]
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None


class InProcessBackend:
    """The sequential reference behind the HTTP API: one request at a time in a worker thread.

    `abort` stops a running request between two tokens (its KV is freed) or drops a queued one.
    """

    def __init__(self, router: Any):
        self.router = router
        self._queue_lock = asyncio.Lock()
        self._run_lock = threading.Lock()   # the runners are not thread-safe: one worker at a time, always
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenplane-route")
        self._abort: dict[str, threading.Event] = {}

    @property
    def max_model_len(self) -> int | None:
        return self.router.max_model_len

    @property
    def vocab_size(self) -> int | None:
        sizes = [getattr(getattr(r, "cfg", None), "vocab_size", None) for r in self.router.runners]
        sizes = [s for s in sizes if s]
        return min(sizes) if sizes else None

    def abort(self, request_id: str) -> None:
        self._abort.setdefault(request_id, threading.Event()).set()

    async def generate(self, prompt_ids: Sequence[int], params: Any, request_id: str) -> AsyncIterator[Chunk]:
        flag = self._abort.setdefault(request_id, threading.Event())
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        def put(item: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> None:
            from tokenplane.route.reference import RouteOutput
            with self._run_lock:
                stream = self.router.stream(prompt_ids, params, request_id)
                try:
                    for event in stream:
                        if flag.is_set():
                            put(Chunk([], "abort"))
                            break
                        if isinstance(event, RouteOutput):
                            put(Chunk([], event.finish_reason, event.stats.to_dict()))
                        else:
                            put(Chunk([event.token]))
                except BaseException as exc:   # surfaced to the awaiting handler
                    put(exc)
                finally:
                    stream.close()             # frees the request's KV blocks in every model
                    put(done)

        try:
            async with self._queue_lock:
                if flag.is_set():
                    yield Chunk([], "abort")
                    return
                future = loop.run_in_executor(self._executor, work)
                try:
                    while True:
                        item = await queue.get()
                        if item is done:
                            break
                        if isinstance(item, BaseException):
                            raise item
                        yield item
                finally:
                    flag.set()   # a consumer that stops early (disconnect, stop string) stops the worker too
                    await asyncio.shield(future)
        finally:
            self._abort.pop(request_id, None)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


class RuntimeBackend:
    """Adapter over tokenplane.route.runtime.Runtime (one process per model)."""

    def __init__(self, runtime: Any, *, max_model_len: int | None, vocab_size: int | None):
        self.runtime = runtime
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    async def start(self) -> None:
        """Runs inside the server's event loop (the runtime's sockets and tasks belong to it)."""
        start = getattr(self.runtime, "start", None)
        if start is not None:
            result = start()
            if asyncio.iscoroutine(result):
                await result

    def abort(self, request_id: str) -> None:
        result = self.runtime.abort(request_id)
        if asyncio.iscoroutine(result):
            asyncio.ensure_future(result)

    async def generate(self, prompt_ids: Sequence[int], params: Any, request_id: str) -> AsyncIterator[Any]:
        async for chunk in self.runtime.generate(list(prompt_ids), params, request_id=request_id):
            yield chunk

    def close(self) -> None:
        self.runtime.shutdown()


def runtime_available() -> bool:
    return importlib.util.find_spec("tokenplane.route.runtime") is not None


def build_algorithm(cfg: ServeConfig) -> Any:
    from tokenplane.route.algorithms import make_algorithm
    params = dict(cfg.parameters)
    params.setdefault("seed", cfg.seed)
    if cfg.algorithm == "ensemble":
        params.setdefault("num_models", len(cfg.models))
    return make_algorithm(cfg.algorithm, **params)


def build_router(cfg: ServeConfig, algorithm: Any, tokenizer: Any) -> Any:
    """Sequential router over the configured models; runs warm-up calibration when the algorithm needs it."""
    from tokenplane.engine.sampler import SamplingParams
    from tokenplane.route.reference import SequentialRouter, build_runner, calibrate
    dtype = cfg.torch_dtype()
    devices = cfg.devices or ["cpu"] * len(cfg.models)
    runners = [build_runner(m, device=d, dtype=dtype, num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                            seed=cfg.seed) for m, d in zip(cfg.models, devices)]
    router = SequentialRouter(algorithm, runners)
    gates = algorithm.calibration_gates() if hasattr(algorithm, "calibration_gates") else []
    if gates and not getattr(algorithm, "calibrated", True):
        texts = cfg.calibration.get("prompts", DEFAULT_CALIBRATION_PROMPTS)
        prompts = [tokenizer.encode(t).tolist() for t in texts]
        sp = SamplingParams(temperature=0.0, max_tokens=int(cfg.calibration.get("max_tokens", 16)), ignore_eos=True)
        t0 = time.perf_counter()
        thresholds = calibrate(algorithm, router, prompts, sp)
        log.info("calibrated %s thresholds %s in %.1fs", algorithm.name, thresholds, time.perf_counter() - t0)
    return router


def model_limits(cfg: ServeConfig) -> tuple[int | None, int | None]:
    """(context length, vocabulary size) shared by every configured model (the minimum of each)."""
    from tokenplane.engine.loader import resolve_config
    cfgs = [resolve_config(m)[0] for m in cfg.models]
    return min(c.max_position_embeddings for c in cfgs), min(c.vocab_size for c in cfgs)


def build_backend(cfg: ServeConfig, kind: str, tokenizer: Any) -> Any:
    algorithm = build_algorithm(cfg)
    if kind == "inprocess":
        return InProcessBackend(build_router(cfg, algorithm, tokenizer))
    from tokenplane.route import runtime as rt
    if algorithm.calibration_gates() if hasattr(algorithm, "calibration_gates") else False:
        # Calibrate once here (warm-up copies of the models, dropped afterwards) and hand the frozen thresholds to
        # every model process through algorithm.config(), so all of them decide identically.
        build_router(cfg, algorithm, tokenizer)
    devices = set(cfg.devices or ["cpu"])
    if len(devices) > 1:
        raise ValueError(f"the process backend runs every model on one device; got {sorted(devices)}")
    wanted = {"models": list(cfg.models), "algorithm": cfg.algorithm, "algorithm_kwargs": algorithm.config(),
              "device": devices.pop(), "dtype": cfg.dtype, "num_blocks": cfg.num_blocks,
              "block_size": cfg.block_size, "seeds": [cfg.seed] * len(cfg.models), **cfg.runtime}
    names = {f.name for f in dataclasses.fields(rt.RuntimeConfig)}
    unknown = sorted(set(wanted) - names)
    if unknown:
        raise ValueError(f"RuntimeConfig has no field(s) {unknown}")
    runtime = rt.Runtime(rt.RuntimeConfig(**wanted))   # spawns one process per model, waits until all are ready
    max_len, vocab = model_limits(cfg)
    return RuntimeBackend(runtime, max_model_len=max_len, vocab_size=vocab)


# -- text -------------------------------------------------------------------------------------------------------------
class ChatTemplate:
    """Qwen3 ChatML: <|im_start|>{role}\\n{content}<|im_end|>\\n ... <|im_start|>assistant\\n."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        missing = [s for s in CHATML_SPECIALS if s not in tokenizer.specials]
        if missing:
            raise ValueError(f"tokenizer {tokenizer.name} lacks ChatML tokens {missing}")
        self.stop_token_ids = tuple(tokenizer.specials[s] for s in CHAT_STOP_TOKENS if s in tokenizer.specials)

    def encode(self, messages: list[tuple[str, str]]) -> list[int]:
        segments: list[tuple[str, bool]] = []   # (text, template text whose specials are real)
        for role, content in messages:
            segments += [(f"<|im_start|>{role}\n", True), (content, False), ("<|im_end|>\n", True)]
        segments.append(("<|im_start|>assistant\n", True))
        tok = self.tokenizer
        if not any(s in content for _, content in messages for s in tok.specials):
            # One encode of the rendered text, exactly what HF apply_chat_template + encode gives.
            return tok.encode("".join(t for t, _ in segments), allowed_special=CHATML_SPECIALS).tolist()
        # Content quoting special-token text stays ordinary text (no template injection).
        ids: list[int] = []
        for text, template in segments:
            ids += tok.encode(text, allowed_special=CHATML_SPECIALS if template else ()).tolist()
        return ids


class TextStream:
    """Token ids -> text deltas: incremental UTF-8 (no split characters) and stop strings (held back until
    they can no longer start a stop string)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = [s for s in stop if s]
        self.pending = ""
        self.stopped = False

    def _bytes(self, token: int) -> bytes:
        try:
            return self.tokenizer.decode_bytes([token])
        except ValueError:   # random-weight models can sample ids the tokenizer does not have
            return "\ufffd".encode()

    def push(self, tokens: Sequence[int]) -> str:
        if self.stopped:
            return ""
        text = self.pending + "".join(self.decoder.decode(self._bytes(t)) for t in tokens)
        return self._emit(text, final=False)

    def flush(self) -> str:
        if self.stopped:
            return ""
        return self._emit(self.pending + self.decoder.decode(b"", final=True), final=True)

    def _emit(self, text: str, final: bool) -> str:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return text[:min(hits)]
        hold = 0 if final else max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])),
                                   default=0)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]


# -- request parsing --------------------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def _number(body: dict, key: str, default: Any, kind: type, lo: float | None = None, hi: float | None = None) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise APIError(400, f"`{key}` must be {'an integer' if kind is int else 'a number'}", param=key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise APIError(400, f"`{key}` must be in [{lo}, {hi}], got {v}", param=key)
    return kind(v)


def _top_p(body: dict) -> float:
    top_p = _number(body, "top_p", 1.0, float, 0.0, 1.0)
    if top_p <= 0.0:
        raise APIError(400, "`top_p` must be in (0, 1]", param="top_p")
    return top_p


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        return stop
    raise APIError(400, "`stop` must be a string or a list of at most 4 strings", param="stop")


@dataclass
class Job:
    prompt_ids: list[int]
    params: Any
    stop: list[str]
    stream: bool
    include_usage: bool


class Server:
    def __init__(self, backend: Any, tokenizer: Any, *, model_name: str, default_max_tokens: int = 16):
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.chat = ChatTemplate(tokenizer)
        self.created = int(time.time())

    # -- parsing ------------------------------------------------------------------------------------------------
    async def body(self, request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        model = body.get("model", self.model_name)
        if not isinstance(model, str):
            raise APIError(400, "`model` must be a string", param="model")
        if model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; available: [{self.model_name!r}]", param="model",
                           code="model_not_found")
        return body

    def job(self, body: dict, prompt_ids: list[int], extra_stop_ids: Sequence[int] = ()) -> Job:
        from tokenplane.engine.sampler import SamplingParams
        if _number(body, "n", 1, int) != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        max_tokens = _number(body, "max_tokens", None, int)
        if "max_completion_tokens" in body:
            max_tokens = _number(body, "max_completion_tokens", None, int)
        if max_tokens is None:
            max_tokens = self.default_max_tokens
        if max_tokens <= 0:
            raise APIError(400, f"`max_tokens` must be positive, got {max_tokens}", param="max_tokens")
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        ctx = self.backend.max_model_len
        if ctx is not None:
            if len(prompt_ids) >= ctx:
                raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this model's context is {ctx} tokens",
                               param="prompt", code="context_length_exceeded")
            max_tokens = min(max_tokens, ctx - len(prompt_ids))
        vocab = self.backend.vocab_size
        if vocab is not None and max(prompt_ids) >= vocab:
            raise APIError(400, f"prompt token id {max(prompt_ids)} is outside the model vocabulary ({vocab})",
                           param="prompt")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, "`stream` must be a boolean", param="stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise APIError(400, "`stream_options` must be an object", param="stream_options")
        seed = _number(body, "seed", None, int)
        params = SamplingParams(temperature=_number(body, "temperature", 1.0, float, 0.0, 2.0),
                                top_p=_top_p(body),
                                max_tokens=max_tokens, seed=seed, stop_token_ids=tuple(extra_stop_ids))
        return Job(prompt_ids, params, _stop_strings(body), stream, bool(opts.get("include_usage", False)))

    def completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]   # a batch of one
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt).tolist()
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                            for t in prompt):
            return list(prompt)
        raise APIError(400, "`prompt` must be a string or a list of token ids (batches are not supported)",
                       param="prompt")

    def chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "`messages` must be a non-empty list", param="messages")
        parsed: list[tuple[str, str]] = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise APIError(400, f"messages[{i}] needs a role of system, user or assistant", param="messages")
            content = m.get("content", "")
            if isinstance(content, list):   # [{"type": "text", "text": ...}, ...]
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported", param="messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise APIError(400, f"messages[{i}].content must be a string", param="messages")
            parsed.append((m["role"], content))
        return self.chat.encode(parsed)

    # -- generation ---------------------------------------------------------------------------------------------
    async def events(self, job: Job, request_id: str) -> AsyncIterator[tuple[str, str | None, dict | None, int]]:
        """(text delta, finish_reason or None, routing stats or None, completion tokens so far)."""
        text = TextStream(self.tokenizer, job.stop)
        n = 0
        backend_done = False   # the backend finished the request itself; otherwise it must be told to stop
        try:
            async with aclosing(self.backend.generate(job.prompt_ids, job.params, request_id)) as chunks:
                async for chunk in chunks:
                    tokens = _field(chunk, "token_ids", "tokens") or []
                    n += len(tokens)
                    delta = text.push(tokens)
                    reason = _field(chunk, "finish_reason")
                    backend_done = reason is not None
                    if text.stopped:   # a stop string: the text ends before it, whatever the backend says
                        yield delta, "stop", _stats(chunk), n
                        return
                    if reason is not None:
                        yield delta + text.flush(), reason, _stats(chunk), n
                        return
                    if delta:
                        yield delta, None, None, n
            backend_done = True
            yield text.flush(), "stop", None, n
        finally:
            if not backend_done:   # client went away, stop string, or an error: free the request's resources
                self.backend.abort(request_id)

    async def collect(self, job: Job, request_id: str) -> tuple[str, str, dict | None, int]:
        parts, reason, stats, n = [], "stop", None, 0
        async for delta, r, s, n in self.events(job, request_id):
            parts.append(delta)
            if r is not None:
                reason, stats = r, s
        return "".join(parts), reason, stats, n

    def usage(self, job: Job, n: int) -> dict:
        p = len(job.prompt_ids)
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

    async def completions(self, request: Request):
        body = await self.body(request)
        job = self.job(body, self.completion_prompt(body))
        rid = f"cmpl-{secrets.token_hex(12)}"
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        if not job.stream:
            text, reason, stats, n = await self.collect(job, rid)
            return {**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}],
                    "usage": self.usage(job, n), "routing": stats}

        async def sse() -> AsyncIterator[str]:
            async for delta, reason, stats, n in self.events(job, rid):
                if not delta and reason is None:
                    continue
                out = {**base, "choices": [{"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}]}
                if reason is not None:
                    out["routing"] = stats
                    out["usage"] = self.usage(job, n)
                yield f"data: {json.dumps(out)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(sse(), media_type="text/event-stream")

    async def chat_completions(self, request: Request):
        body = await self.body(request)
        job = self.job(body, self.chat_prompt(body), self.chat.stop_token_ids)
        rid = f"chatcmpl-{secrets.token_hex(12)}"
        base = {"id": rid, "created": int(time.time()), "model": self.model_name}
        if not job.stream:
            text, reason, stats, n = await self.collect(job, rid)
            return {**base, "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": reason}],
                    "usage": self.usage(job, n), "routing": stats}

        async def sse() -> AsyncIterator[str]:
            head = {**base, "object": "chat.completion.chunk"}
            first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
            yield f"data: {json.dumps(first)}\n\n"
            async for delta, reason, stats, n in self.events(job, rid):
                if not delta and reason is None:
                    continue
                out = {**head, "choices": [{"index": 0, "delta": {"content": delta} if delta else {},
                                            "logprobs": None, "finish_reason": reason}]}
                if reason is not None:
                    out["routing"] = stats
                    out["usage"] = self.usage(job, n)
                yield f"data: {json.dumps(out)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(sse(), media_type="text/event-stream")


def _field(chunk: Any, *names: str) -> Any:
    for name in names:
        if isinstance(chunk, dict):
            if name in chunk:
                return chunk[name]
        elif hasattr(chunk, name):
            return getattr(chunk, name)
    return None


def _stats(chunk: Any) -> dict | None:
    stats = _field(chunk, "stats")
    if stats is not None and hasattr(stats, "to_dict"):
        stats = stats.to_dict()
    return stats


def create_app(backend: Any, tokenizer: Any, *, model_name: str = "tokenplane-router",
               default_max_tokens: int = 16, close_backend: bool = True) -> FastAPI:
    """The FastAPI app over a backend (InProcessBackend, RuntimeBackend, or anything with generate/abort).
    The backend's optional `async start()` runs at server startup and `close()` at shutdown."""
    server = Server(backend, tokenizer, model_name=model_name, default_max_tokens=default_max_tokens)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        start = getattr(backend, "start", None)
        if start is not None:
            await start()
        try:
            yield
        finally:
            close = getattr(backend, "close", None)
            if close is not None and close_backend:
                close()

    app = FastAPI(title="tokenplane", lifespan=lifespan)
    app.state.server = server

    def guarded(handler):
        async def endpoint(request: Request):
            try:
                return await handler(request)
            except APIError as exc:
                return exc.response()
        endpoint.__name__ = handler.__name__
        return endpoint

    app.post("/v1/completions")(guarded(server.completions))
    app.post("/v1/chat/completions")(guarded(server.chat_completions))

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": server.created,
                                            "owned_by": "tokenplane", "max_model_len": backend.max_model_len}]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    # The tokenize service (exact stateful tokenization) shares the port when it is built.
    if importlib.util.find_spec("tokenplane.serve.tokenize_service") is not None:
        try:
            from tokenplane.serve.tokenize_service import add_tokenize_routes
            add_tokenize_routes(app, {tokenizer.name: tokenizer})
        except ImportError as exc:   # a dependency of the service is not built yet
            log.warning("tokenize routes not mounted: %s", exc)
    return app


# -- CLI ---------------------------------------------------------------------------------------------------------------
def main_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="JSON file: models, devices, algorithm, parameters, ...")
    parser.add_argument("--backend", choices=["process", "inprocess"], default=None,
                        help="process = one process per model (default when the runtime is available); "
                             "inprocess = sequential reference, one request at a time")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="info")


def main(args: argparse.Namespace) -> int:
    import uvicorn

    import tokenplane
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    cfg = ServeConfig.load(args.config)
    kind = args.backend or ("process" if runtime_available() else "inprocess")
    tokenizer = tokenplane.load(cfg.tokenizer)
    log.info("loading %s with %s (%s backend)", cfg.models, cfg.algorithm, kind)
    backend = build_backend(cfg, kind, tokenizer)
    app = create_app(backend, tokenizer, model_name=cfg.served_model_name, default_max_tokens=cfg.default_max_tokens)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    main_arguments(p)
    raise SystemExit(main(p.parse_args()))
