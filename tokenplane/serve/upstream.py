"""The tokenization tier in front of existing OpenAI-compatible engines (vLLM, SGLang, or this project's server).

The client sends text; the tier renders the chat with the model's template, repairs the conversation's session and
forwards exact token IDs (`prompt` as a list of ints on /v1/completions, which vLLM and SGLang accept), so the
engine never re-tokenizes a growing context. The answer comes back as the upstream sent it (text, finish_reason,
usage); a chat request is answered in chat format.

Several upstreams (e.g. vLLM data-parallel replicas) sit on a consistent-hash ring keyed by the conversation, so a
conversation keeps hitting the replica whose prefix cache holds it; an upstream that fails is taken out for a
cool-down and its conversations move to the next one on the ring (their token sessions live here and stay valid).
The ring hashes with blake2b, not Python's per-process `hash`, so several tokenplane replicas behind a
consistent-hash load balancer map a conversation to the same upstream.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import json
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from .errors import APIError, ServiceUnavailable, retry_headers
from .grpc_upstream import GrpcAnswer, GrpcUpstreams, Unreachable, is_grpc
from .http_client import Body, ConnectFailed, HTTPClient, HTTPClientError, Response

# an upstream's answer, opened as a stream: http_client.Response, or a gRPC call read as one (grpc_upstream.py)
UpstreamResponse = Response | GrpcAnswer

log = logging.getLogger("tokenplane.serve")

# Request fields forwarded as they are (OpenAI's, vLLM's stop_token_ids / ignore_eos and its sampling extensions);
# everything else stays here.
FORWARDED = ("max_tokens", "temperature", "top_p", "n", "seed", "stream", "stream_options", "stop", "logprobs",
             "ignore_eos", "stop_token_ids", "user", "presence_penalty", "frequency_penalty", "top_k", "min_p",
             "repetition_penalty", "min_tokens", "include_stop_str_in_output", "skip_special_tokens")


def _point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


@dataclass
class UpstreamState:
    url: str
    down_until: float = 0.0
    failures: int = 0
    requests: int = 0
    last_error: str | None = None

    def up(self, now: float) -> bool:
        return now >= self.down_until


@dataclass
class Ring:
    """Consistent hashing over upstream URLs with virtual nodes."""
    urls: list[str]
    vnodes: int = 64
    points: list[tuple[int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.points = sorted((_point(f"{url}#{i}"), url) for url in self.urls for i in range(self.vnodes))

    def order(self, key: str) -> list[str]:
        """Distinct upstreams clockwise from the key's point: the first is its home, the rest its fail-over."""
        keys = [p for p, _ in self.points]
        i = bisect.bisect(keys, _point(key))
        seen: list[str] = []
        for k in range(len(self.points)):
            url = self.points[(i + k) % len(self.points)][1]
            if url not in seen:
                seen.append(url)
                if len(seen) == len(self.urls):
                    break
        return seen


class UpstreamPool:
    """Upstream connections (http_client.py: kept connections, one buffer per request), the ring, and each
    upstream's state."""

    def __init__(self, urls: list[str], *, model: str | None = None, timeout_s: float = 600.0,
                 connect_timeout_s: float = 5.0, cooldown_s: float = 10.0, answers_ids: bool = False,
                 sessions: bool = False) -> None:
        if not urls:
            raise ValueError("at least one upstream URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        self.ring = Ring(self.urls)
        self.state = {u: UpstreamState(u) for u in self.urls}
        self.model = model
        self.cooldown_s = cooldown_s
        self.client = HTTPClient(connect_timeout=connect_timeout_s, read_timeout=timeout_s)
        self.max_model_len: int | None = None
        # grpc:// upstreams: vLLM's gRPC engine service (grpc_upstream.py), token IDs both ways. One pool speaks
        # one protocol: the request body is written for it (ids_json.RequestBodies' codec).
        kinds = {is_grpc(u) for u in self.urls}
        if len(kinds) > 1:
            raise ValueError("upstreams must all be grpc:// or all be http(s)://")
        self.grpc = GrpcUpstreams(connect_timeout_s, timeout_s) if kinds == {True} else None
        # The upstreams run without a tokenizer (vLLM/SGLang --skip-tokenizer-init, or gRPC): they answer token
        # IDs, which the tier decodes (id_answers.py).
        self.answers_ids = answers_ids or self.grpc is not None or sessions
        # Upstream sessions (upstream_sessions.py): chat turns go to the session route of vLLM servers that run
        # this project's middleware, as the IDs the upstream's live context lacks.
        if sessions and self.grpc is not None:
            raise ValueError("upstream sessions need http(s):// upstreams (vLLM with tokenplane's middleware)")
        self.sessions = sessions
        # Sampling defaults the upstream would apply to a request that leaves them out (its model's
        # generation_config); vLLM's HTTP server applies its own, its gRPC servicer does not, so the tier does.
        self.sampling_defaults: dict[str, Any] = {}

    async def start(self) -> None:
        """Learn the upstream model name and context length (first upstream that answers)."""
        if self.grpc is not None:
            await self._start_grpc(self.grpc)
            return
        for url in self.urls:
            try:
                async with asyncio.timeout(10):
                    r = await self.client.request("GET", url + "/v1/models")
                    card = json.loads(await r.aread())["data"][0]
            except (TimeoutError, HTTPClientError, ValueError, KeyError, IndexError) as exc:
                log.warning("upstream %s: /v1/models failed at start-up (%s)", url, exc)
                continue
            self.model = self.model or card["id"]
            self.max_model_len = card.get("max_model_len")
            return
        if self.model is None:
            raise RuntimeError(f"no upstream answered /v1/models: {self.urls}")

    async def _start_grpc(self, grpc: GrpcUpstreams) -> None:
        for url in self.urls:
            try:
                info = await grpc.model_info(url)
            except (Unreachable, ValueError) as exc:
                log.warning("upstream %s: GetModelInfo failed at start-up (%s)", url, exc)
                continue
            self.model = self.model or info.served_model_name
            self.max_model_len = info.max_context_length
            self.sampling_defaults = info.default_sampling
            return
        if self.model is None:
            raise RuntimeError(f"no upstream answered GetModelInfo: {self.urls}")

    async def close(self) -> None:
        await self.client.aclose()
        if self.grpc is not None:
            await self.grpc.aclose()

    def candidates(self, key: str) -> list[str]:
        now = time.monotonic()
        order = self.ring.order(key)
        return [u for u in order if self.state[u].up(now)]

    def failed(self, url: str, why: str) -> None:
        st = self.state[url]
        st.failures += 1
        st.last_error = why
        st.down_until = time.monotonic() + self.cooldown_s
        log.error("upstream %s taken out for %.0f s: %s", url, self.cooldown_s, why)

    def health(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{"name": s.url, "state": "ready" if s.up(now) else "failed", "requests": s.requests,
                 "failures": s.failures, "last_error": s.last_error} for s in self.state.values()]

    async def send(self, key: str, body: Body, path: str = "/v1/completions") -> tuple[str, UpstreamResponse]:
        """POST `path` (or a gRPC Generate call) to the conversation's upstream, failing over along the ring when
        one cannot be reached. The response is opened as a stream (the caller reads or relays it and must close
        it)."""
        tried: list[str] = []
        for url in self.candidates(key):
            tried.append(url)
            if self.grpc is not None:
                try:
                    answer = await self.grpc.generate(url, body if not isinstance(body, bytes) else (body,))
                except Unreachable as exc:
                    self.failed(url, str(exc))
                    continue
                self.state[url].requests += 1
                return url, answer
            try:
                resp = await self.client.request("POST", url + path, body)
            except ConnectFailed as exc:
                self.failed(url, f"ConnectFailed: {exc}")
                continue
            except TimeoutError as exc:
                raise APIError(f"upstream {url} timed out: {exc or 'no answer'}", status=504,
                               code="upstream_timeout") from None
            except HTTPClientError as exc:
                self.failed(url, f"{type(exc).__name__}: {exc}")
                continue
            self.state[url].requests += 1
            if resp.status_code >= 500 and resp.status_code != 503:
                self.failed(url, f"HTTP {resp.status_code}")
            return url, resp
        raise ServiceUnavailable(f"no upstream is reachable (tried {tried or 'none: all cooling down'})",
                                 headers=retry_headers(self.cooldown_s), code="upstream_unavailable")


async def error_from(resp: UpstreamResponse, url: str) -> APIError:
    """An upstream's error answer as ours: its OpenAI-shaped body passed on, or wrapped."""
    raw = await resp.aread()
    await resp.aclose()
    try:
        err = json.loads(raw)["error"]
        message = err.get("message") if isinstance(err, dict) else str(err)
        code = err.get("code") if isinstance(err, dict) else None
        param = err.get("param") if isinstance(err, dict) else None
    except (ValueError, KeyError, TypeError):
        message, code, param = raw[:500].decode("utf-8", "replace"), None, None
    return APIError(f"upstream {url}: {message}", status=resp.status_code, param=param,
                    code=code if isinstance(code, str) else None)


async def sse_data(resp: UpstreamResponse) -> AsyncGenerator[bytes, None]:
    """The `data:` payloads of an upstream SSE stream (UTF-8 bytes), [DONE] included."""
    async for line in resp.lines():
        if line.startswith(b"data:"):
            yield line[5:].strip()


__all__ = ["FORWARDED", "Ring", "UpstreamPool", "UpstreamResponse", "error_from", "sse_data"]
