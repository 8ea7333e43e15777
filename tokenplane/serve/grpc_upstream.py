"""Upstreams reached over vLLM's gRPC engine service (`--upstream grpc://HOST:PORT`): channels, calls, and each
answer presented as the completion stream an ID-only HTTP upstream sends, so one relay serves both.

vLLM serves this with `python -m vllm.entrypoints.launchers.grpc_server --model DIR --port N` (the `vllm[grpc]`
extra); the protocol is grpc_wire.py's. An answer's messages become the SSE lines of vLLM's own `/v1/completions`
stream for a tokenizer-less engine (empty text, the new IDs as `token_ids`, then a usage chunk and `[DONE]`), which
id_answers.IdAnswer turns into text. A call is cancelled when the client goes away or the tier ends the answer on
a stop string; vLLM's servicer aborts the request then.

An upstream that cannot be reached (gRPC UNAVAILABLE before any answer) is failed over along the ring as an HTTP
connect failure is; any other status is passed on as the matching OpenAI-shaped error.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson

from .errors import APIError
from .grpc_wire import SERVICE, Logprobs, ModelInfo, Output, WireError, read_model_info, read_output, request_id_field

try:   # the `grpc` extra
    import grpc
    import grpc.aio
except ImportError:   # pragma: no cover - told at start-up, when a grpc:// upstream is configured
    grpc = None

# gRPC status -> (HTTP status, OpenAI error code)
_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"), "OUT_OF_RANGE": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"), "NOT_FOUND": (404, "not_found"),
    "RESOURCE_EXHAUSTED": (429, "upstream_overloaded"), "UNAUTHENTICATED": (401, "upstream_unauthenticated"),
    "PERMISSION_DENIED": (403, "upstream_forbidden"), "DEADLINE_EXCEEDED": (504, "upstream_timeout"),
    "UNAVAILABLE": (503, "upstream_unavailable"), "UNIMPLEMENTED": (501, "upstream_unimplemented"),
}


class Unreachable(Exception):
    """The upstream could not be reached (nothing was answered): fail over."""


def is_grpc(url: str) -> bool:
    return url.startswith("grpc://")


def _target(url: str) -> str:
    return url.removeprefix("grpc://").rstrip("/")


def _output(url: str, msg: bytes) -> Output:
    try:
        return read_output(msg)
    except WireError as exc:
        raise APIError(f"upstream {url} sent a message that is not a GenerateResponse: {exc}", status=502,
                       code="upstream_error") from None


def _id_logprobs(lp: Logprobs | None) -> dict[str, Any] | None:
    """A chunk's logprobs as vLLM's HTTP server writes them for a tokenizer-less engine: tokens as "token_id:N",
    values clamped at -9999.0 as it does (JSON has no -inf). The top entries are what the servicer sends: the first
    `logprobs` entries of vLLM's dict (the sampled token, then the most likely), the sampled token alone at 0, as
    the HTTP server writes it then."""
    if lp is None:
        return None
    tops = lp.top or [[(t, v)] for t, v in zip(lp.token_ids, lp.values)]
    return {"tokens": [f"token_id:{t}" for t in lp.token_ids],
            "token_logprobs": [max(v, -9999.0) for v in lp.values],
            "top_logprobs": [{f"token_id:{t}": max(v, -9999.0) for t, v in top} for top in tops],
            "text_offset": []}


def _error(url: str, exc: Any) -> APIError:
    """A failed call (grpc.aio.AioRpcError) as the matching OpenAI-shaped error."""
    status, code = _STATUS.get(exc.code().name, (502, "upstream_error"))
    return APIError(f"upstream {url}: {exc.details()}", status=status, code=code)


class GrpcAnswer:
    """One Generate call, read as vLLM's ID-only completion stream (`lines()`: SSE lines). Close it (aclose) when
    done with it: an unfinished call is cancelled."""

    status_code = 200

    def __init__(self, url: str, call: Any, first: Output, model: str | None, read_timeout: float) -> None:
        self.url, self.call, self.first, self.model = url, call, first, model
        self.read_timeout = read_timeout
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.ended = False

    def _line(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        data: dict[str, Any] = {"id": self.id, "object": "text_completion", "created": self.created,
                                "model": self.model, "choices": choices}
        if usage is not None:
            data["usage"] = usage
        return b"data: " + orjson.dumps(data)

    async def _outputs(self) -> AsyncIterator[Output]:
        yield self.first
        while True:
            try:
                async with asyncio.timeout(self.read_timeout):
                    msg = await self.call.read()
            except TimeoutError:
                raise APIError(f"upstream {self.url} sent nothing for {self.read_timeout:.0f} s", status=504,
                               code="upstream_timeout") from None
            except grpc.aio.AioRpcError as exc:
                raise _error(self.url, exc) from None
            if msg is grpc.aio.EOF:
                return
            yield _output(self.url, msg)

    async def lines(self) -> AsyncIterator[bytes]:
        prompt = 0
        tokens: dict[int, int] = {}
        async for out in self._outputs():
            prompt = out.prompt_tokens or prompt
            if not out.complete:
                tokens[out.index] = tokens.get(out.index, 0) + len(out.token_ids)
                yield self._line([{"index": out.index, "text": "", "token_ids": out.token_ids,
                                   "logprobs": _id_logprobs(out.logprobs), "finish_reason": None,
                                   "stop_reason": None}])
            else:   # streamed: its IDs were the last chunk's, sent already
                yield self._line([{"index": out.index, "text": "", "token_ids": [], "logprobs": None,
                                   "finish_reason": out.finish_reason or "stop", "stop_reason": out.stop_reason}])
        out_tokens = sum(tokens.values())
        yield self._line([], {"prompt_tokens": prompt, "completion_tokens": out_tokens,
                              "total_tokens": prompt + out_tokens})
        self.ended = True
        yield b"data: [DONE]"

    async def aread(self) -> bytes:
        return b""

    async def finish(self, timeout: float) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if not self.ended and not self.call.done():
            self.call.cancel()


class GrpcUpstreams:
    """One channel per upstream (HTTP/2: every call of a conversation on it), opened on first use."""

    def __init__(self, connect_timeout_s: float = 5.0, read_timeout_s: float = 600.0) -> None:
        if grpc is None:
            raise RuntimeError("grpc:// upstreams need grpcio: pip install 'tokenplane[grpc]'")
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self._channels: dict[str, Any] = {}
        self.models: dict[str, str] = {}

    def _channel(self, url: str) -> Any:
        ch = self._channels.get(url)
        if ch is None:
            ch = self._channels[url] = grpc.aio.insecure_channel(_target(url), options=[
                ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1),
                ("grpc.enable_retries", 0)])
        return ch

    async def model_info(self, url: str) -> ModelInfo:
        call = self._channel(url).unary_unary(SERVICE + "GetModelInfo", request_serializer=None,
                                              response_deserializer=None)
        try:
            raw = await call(b"", timeout=self.connect_timeout_s + 5.0)
        except grpc.aio.AioRpcError as exc:
            raise Unreachable(f"{exc.code().name}: {exc.details()}") from None
        info = read_model_info(raw)
        self.models[url] = info.served_model_name
        return info

    async def generate(self, url: str, body: Sequence[bytes | memoryview]) -> GrpcAnswer:
        """Start a Generate call with `body` (grpc_wire.generate_body's pieces) and read its first answer."""
        request = b"".join((request_id_field(uuid.uuid4().hex), *body))
        call = self._channel(url).unary_stream(SERVICE + "Generate", request_serializer=None,
                                               response_deserializer=None)(request)
        try:
            async with asyncio.timeout(self.read_timeout_s):
                msg = await call.read()
        except TimeoutError:
            call.cancel()
            raise APIError(f"upstream {url} timed out: no answer", status=504, code="upstream_timeout") from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise Unreachable(f"UNAVAILABLE: {exc.details()}") from None
            raise _error(url, exc) from None
        except BaseException:
            call.cancel()
            raise
        if msg is grpc.aio.EOF:
            raise APIError(f"upstream {url} ended the call without an answer", status=502, code="upstream_error")
        try:
            first = _output(url, msg)
        except APIError:
            call.cancel()
            raise
        return GrpcAnswer(url, call, first, self.models.get(url), self.read_timeout_s)

    async def aclose(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


__all__ = ["GrpcAnswer", "GrpcUpstreams", "Unreachable", "is_grpc"]
