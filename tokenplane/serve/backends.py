"""What the HTTP layer decodes with: a `Backend` (generate / abort / health), and the two that exist.

- `RuntimeBackend` over `tokenplane.route.runtime.Runtime`: one process per model, continuous batching.
- `InProcessBackend`: the sequential reference in a worker thread, one request at a time, a bounded queue.

Backends raise serve errors (errors.py) for what a client must be told: 400 for a request that can never fit,
429 when the queue is full, 503 while a model is down. Everything else is a bug and reaches the 500 guard.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Protocol, Sequence

from . import calibration_cache
from .config import ServeConfig
from .errors import InvalidRequest, ServiceUnavailable, TooManyRequests, retry_headers

log = logging.getLogger("tokenplane.serve")

DEFAULT_CALIBRATION_PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that reverses a linked list.",
    "What is 17 * 23? Think step by step.",
    "Summarize the plot of Hamlet.",
]


TokenLogprob = tuple[float, list[tuple[int, float]]]   # (logprob of the token, top (id, logprob) alternatives)


@dataclass
class Chunk:
    token_ids: list[int]
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None
    logprobs: list[TokenLogprob] | None = None   # parallel to token_ids when the request asked for logprobs


@dataclass
class ModelStatus:
    name: str
    state: str                      # "ready" | "starting" | "restarting" | "failed"
    pid: int | None = None
    restarts: int = 0
    last_error: str | None = None
    down_for_s: float | None = None
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    num_waiting: int | None = None
    num_running: int | None = None


@dataclass
class BackendHealth:
    models: list[ModelStatus] = field(default_factory=list)
    live_requests: int = 0
    queued_requests: int = 0

    @property
    def ok(self) -> bool:
        return all(m.state == "ready" for m in self.models)


class Backend(Protocol):
    @property
    def max_model_len(self) -> int | None: ...   # the most tokens one request may hold (prompt + completion)

    @property
    def vocab_size(self) -> int | None: ...

    async def start(self) -> None: ...
    def generate(self, prompt_ids: Sequence[int], params: Any, request_id: str) -> AsyncGenerator[Chunk, None]: ...
    def abort(self, request_id: str) -> None: ...
    def health(self) -> BackendHealth: ...
    def close(self) -> None: ...


class InProcessBackend:
    """The sequential reference behind the HTTP API: one request at a time in a worker thread, at most `max_queued`
    waiting (429 beyond). `abort` stops a running request between two tokens (its KV is freed) or drops a queued one."""

    def __init__(self, router: Any, *, max_queued: int = 64) -> None:
        self.router = router
        self.max_queued = max_queued
        self._queue_lock = asyncio.Lock()
        self._run_lock = threading.Lock()   # the runners are not thread-safe: one worker at a time, always
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenplane-route")
        self._abort: dict[str, threading.Event] = {}
        self._waiting = 0
        self._running = 0
        pool = [r.block_manager.num_blocks * r.block_size for r in router.runners if hasattr(r, "block_manager")]
        ctx = router.max_model_len
        caps = [c for c in [ctx, *pool] if c]
        self.max_model_len: int | None = min(caps) if caps else None
        sizes = [getattr(getattr(r, "cfg", None), "vocab_size", None) for r in router.runners]
        known = [s for s in sizes if s]
        self.vocab_size: int | None = min(known) if known else None

    async def start(self) -> None:
        return None

    def health(self) -> BackendHealth:
        models = [ModelStatus(name=f"model{i}", state="ready", kv_blocks_used=r.block_manager.num_used_blocks
                              if hasattr(r.block_manager, "num_used_blocks") else None,
                              kv_blocks_total=r.block_manager.num_blocks)
                  for i, r in enumerate(self.router.runners)]
        return BackendHealth(models, live_requests=self._running + self._waiting, queued_requests=self._waiting)

    def abort(self, request_id: str) -> None:
        """Stop a running or queued request; an id not seen yet is remembered (bounded) in case it arrives."""
        self._abort.setdefault(request_id, threading.Event()).set()
        while len(self._abort) > 4096:
            self._abort.pop(next(iter(self._abort)))

    async def generate(self, prompt_ids: Sequence[int], params: Any, request_id: str) -> AsyncGenerator[Chunk, None]:
        if self._waiting >= self.max_queued and self._queue_lock.locked():
            raise TooManyRequests(f"{self._waiting} requests are already waiting; retry later",
                                  headers=retry_headers(1.0), code="queue_full")
        flag = self._abort.setdefault(request_id, threading.Event())
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
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
                        elif event.logprob is not None:
                            put(Chunk([event.token], logprobs=[(event.logprob, event.top_logprobs or [])]))
                        else:
                            put(Chunk([event.token]))
                except BaseException as exc:   # surfaced to the awaiting handler
                    put(exc)
                finally:
                    stream.close()             # frees the request's KV blocks in every model
                    put(done)

        self._waiting += 1
        try:
            await self._queue_lock.acquire()
        finally:
            self._waiting -= 1
        self._running += 1
        try:
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
            self._running -= 1
            self._queue_lock.release()
            self._abort.pop(request_id, None)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


class RuntimeBackend:
    """Adapter over tokenplane.route.runtime.Runtime (one process per model); maps its errors to HTTP ones."""

    def __init__(self, runtime: Any, *, max_model_len: int | None, vocab_size: int | None,
                 names: Sequence[str] = ()) -> None:
        self.runtime = runtime
        cap = getattr(runtime, "max_request_tokens", None)
        self.max_model_len = min(c for c in (max_model_len, cap) if c) if (max_model_len or cap) else None
        self.vocab_size = vocab_size
        self.names = list(names)

    async def start(self) -> None:
        return None

    def abort(self, request_id: str) -> None:
        self.runtime.abort(request_id)

    def health(self) -> BackendHealth:
        health = getattr(self.runtime, "health", None)
        if health is None:
            return BackendHealth([ModelStatus(f"model{i}", "ready") for i in range(self.runtime.num_models)])
        now = time.time()   # ModelHealth.down_since is wall-clock time
        models = []
        for h in health():
            state = getattr(h.state, "name", str(h.state)).lower()
            name = self.names[h.model] if h.model < len(self.names) else f"model{h.model}"
            models.append(ModelStatus(name, state, h.pid, h.restarts, h.last_error,
                                      None if h.down_since is None else round(now - h.down_since, 3),
                                      h.kv_blocks_used, h.kv_blocks_total, h.num_waiting, h.num_running))
        return BackendHealth(models, live_requests=int(getattr(self.runtime, "num_live", 0)),
                             queued_requests=int(getattr(self.runtime, "num_queued", 0)))

    async def generate(self, prompt_ids: Sequence[int], params: Any, request_id: str) -> AsyncGenerator[Chunk, None]:
        from tokenplane.route import errors as route_errors
        try:
            async for c in self.runtime.generate(list(prompt_ids), params, request_id=request_id):
                lps = getattr(c, "logprobs", None)
                yield Chunk(list(c.tokens), c.finish_reason, c.stats,
                            [(float(lp), [(int(i), float(v)) for i, v in top]) for lp, top in lps] if lps else None)
        except route_errors.RequestRejected as exc:
            raise InvalidRequest(str(exc), param=exc.param) from None
        except route_errors.Overloaded as exc:
            raise TooManyRequests(str(exc), headers=retry_headers(exc.retry_after_s), code="queue_full") from None
        except route_errors.ModelUnavailable as exc:
            raise ServiceUnavailable(str(exc), headers=retry_headers(exc.retry_after_s),
                                     code="model_unavailable") from None
        except route_errors.RequestFailed as exc:
            raise ServiceUnavailable(str(exc), code="request_failed") from None

    def close(self) -> None:
        self.runtime.shutdown()


# -- building ---------------------------------------------------------------------------------------------------
def build_algorithm(cfg: ServeConfig, thresholds: dict[str, float] | None = None) -> Any:
    from tokenplane.route.algorithms import make_algorithm
    params = dict(cfg.parameters)
    params.setdefault("seed", cfg.seed)
    if cfg.algorithm == "ensemble":
        params.setdefault("num_models", len(cfg.models))
    if thresholds is not None:
        params["thresholds"] = thresholds
    return make_algorithm(cfg.algorithm, **params)


def _runners(cfg: ServeConfig) -> list[Any]:
    from tokenplane.route.reference import build_runner
    dtype = cfg.torch_dtype()
    devices = cfg.devices or ["cpu"] * len(cfg.models)
    return [build_runner(m, device=d, dtype=dtype, num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                         seed=cfg.seed) for m, d in zip(cfg.models, devices)]


def calibrated_algorithm(cfg: ServeConfig, tokenizer: Any, runners: list[Any] | None = None,
                         use_cache: bool = True) -> Any:
    """The configured algorithm, its thresholds calibrated at warm-up when its mode needs it (from the cache when
    this exact calibration ran before)."""
    from tokenplane.engine.sampler import SamplingParams
    from tokenplane.route.reference import calibrate
    algorithm = build_algorithm(cfg)
    gates = algorithm.calibration_gates() if hasattr(algorithm, "calibration_gates") else []
    if not gates or getattr(algorithm, "calibrated", True):
        return algorithm
    texts = list(cfg.calibration.get("prompts", DEFAULT_CALIBRATION_PROMPTS))
    max_tokens = int(cfg.calibration.get("max_tokens", 16))
    key = calibration_cache.calibration_key(list(cfg.models), cfg.seed, cfg.dtype, cfg.algorithm,
                                            dict(cfg.parameters), texts, max_tokens) if use_cache else None
    cached = calibration_cache.load(key) if key else None
    if key and cached is not None:
        log.info("calibration: %s thresholds %s from the cache (%s)", algorithm.name, cached, key[:12])
        return build_algorithm(cfg, cached)
    log.info("calibration: running %d warm-up prompts through %d models (once; cached afterwards)",
             len(texts), len(cfg.models))
    runners = runners if runners is not None else _runners(cfg)
    prompts = [tokenizer.encode(t).tolist() for t in texts]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    thresholds = calibrate(algorithm, runners, prompts, sp)
    log.info("calibration: %s thresholds %s in %.1f s", algorithm.name, thresholds, time.perf_counter() - t0)
    if key:
        calibration_cache.store(key, dict(thresholds))
    return algorithm


def build_router(cfg: ServeConfig, tokenizer: Any, *, use_cache: bool = True) -> Any:
    """Sequential router over the configured models (calibrated when the algorithm needs it)."""
    from tokenplane.route.reference import SequentialRouter
    runners = _runners(cfg)
    algorithm = calibrated_algorithm(cfg, tokenizer, runners, use_cache=use_cache)
    return SequentialRouter(algorithm, runners)


def model_limits(cfg: ServeConfig) -> tuple[int | None, int | None]:
    """(context length, vocabulary size) shared by every configured model (the minimum of each)."""
    from tokenplane.engine.loader import resolve_config
    cfgs = [resolve_config(m)[0] for m in cfg.models]
    return min(c.max_position_embeddings for c in cfgs), min(c.vocab_size for c in cfgs)


def resolve_tokenizer(cfg: ServeConfig) -> tuple[Any, Any]:
    """(tokenizer, chat template) for the served models. `tokenizer: "auto"` takes the first model's own files (an
    HF directory's tokenizer.json and tokenizer_config.json, as the GGUF conversion writes them) and falls back to
    qwen3 for random-weight presets; a family name or a tokenizer.json path is loaded as given."""
    from pathlib import Path

    import tokenplane

    from .chat import ChatTemplate, template_for
    name = cfg.tokenizer
    if name == "auto":
        from tokenplane.engine.loader import resolve_config  # torch: only when the models' own files are asked for
        directory = resolve_config(cfg.models[0])[1]
        if directory is not None and (Path(directory) / "tokenizer.json").is_file():
            tok = tokenplane.load(str(Path(directory) / "tokenizer.json"))
            tc = Path(directory) / "tokenizer_config.json"
            return tok, ChatTemplate.from_tokenizer_config(tok, tc) if tc.is_file() else template_for(tok)
        name = "qwen3"
    tok = tokenplane.load(name)
    return tok, template_for(tok)


def model_label(source: Any) -> str:
    return source if isinstance(source, str) else str(source.get("name", "config")) if isinstance(source, dict) \
        else str(source)


def build_backend(cfg: ServeConfig, kind: str, tokenizer: Any, *, max_queued: int = 64,
                  use_cache: bool = True) -> Backend:
    if kind == "inprocess":
        return InProcessBackend(build_router(cfg, tokenizer, use_cache=use_cache), max_queued=max_queued)
    from tokenplane.route import runtime as rt
    # Calibrate once here (or read the cache) and hand the frozen thresholds to every model process through
    # algorithm.config(), so all of them decide identically.
    algorithm = calibrated_algorithm(cfg, tokenizer, use_cache=use_cache)
    devices = set(cfg.devices or ["cpu"])
    if len(devices) > 1:
        raise ValueError(f"the process backend runs every model on one device; got {sorted(devices)}")
    wanted = {"models": list(cfg.models), "algorithm": cfg.algorithm, "algorithm_kwargs": algorithm.config(),
              "device": devices.pop(), "dtype": cfg.dtype, "num_blocks": cfg.num_blocks,
              "block_size": cfg.block_size, "seeds": [cfg.seed] * len(cfg.models), **cfg.runtime}
    fields = set(getattr(rt.RuntimeConfig, "__dataclass_fields__", {}))
    if "max_queued" in fields:
        wanted.setdefault("max_queued", max_queued)
    unknown = sorted(set(wanted) - fields)
    if unknown:
        raise ValueError(f"RuntimeConfig has no field(s) {unknown}")
    log.info("starting %d model processes", len(cfg.models))
    t0 = time.perf_counter()
    runtime = rt.Runtime(rt.RuntimeConfig(**wanted))   # spawns one process per model, waits until all are ready
    log.info("model processes ready in %.1f s (pids %s)", time.perf_counter() - t0, runtime.pids)
    max_len, vocab = model_limits(cfg)
    return RuntimeBackend(runtime, max_model_len=max_len, vocab_size=vocab,
                          names=[model_label(m) for m in cfg.models])


__all__ = ["Backend", "BackendHealth", "Chunk", "InProcessBackend", "ModelStatus", "RuntimeBackend",
           "build_algorithm", "build_backend", "build_router", "calibrated_algorithm", "model_limits",
           "resolve_tokenizer"]
