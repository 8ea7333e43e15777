"""vLLM's gRPC engine service on the wire: the messages the tier sends and reads, in protobuf's wire format.

The service is `vllm.grpc.engine.VllmEngine` (vllm_engine.proto of the smg-grpc-proto package), which vLLM serves
with `python -m vllm.entrypoints.launchers.grpc_server` (the `vllm[grpc]` extra) for the SGLang model gateway:
token IDs in (`TokenizedInput.input_ids`, packed varints), token IDs out, no text either way. It is the cheapest way
to hand a long prompt's IDs to vLLM: over HTTP vLLM parses a JSON array into a pydantic list[int]; a cached
1M-character turn (314K tokens) sent straight to vLLM took 105 ms over gRPC and 118 ms over HTTP, 314 and 380 ms at
4M characters (benchmarks/results/agent_ttft_sw4096_grpc.md and _ids.md, column (c), separate runs).

Written by hand, not through protobuf's Python classes: a prompt's IDs are almost all of a request, and here they are
a varint run that a conversation's next turn reuses up to its splice (ids_json.RequestBodies with VARINT_IDS, as the
JSON bodies are), so a turn encodes only its new IDs. Only the fields the tier uses are written or read; every other
field of an answer is skipped by its wire type. tests/test_serve_upstream_grpc.py checks each message against the
official generated classes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba import njit

from .ids_json import Chunks, IdsCodec, Segment

SERVICE = "/vllm.grpc.engine.VllmEngine/"
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class WireError(ValueError):
    """A message that is not valid protobuf wire format."""


def varint(n: int) -> bytes:
    """n (>= 0, or a negative int32/int64 as its 64-bit two's complement, as protobuf writes them) as a varint."""
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(num: int, wire: int) -> bytes:
    return varint(num << 3 | wire)


def _len(num: int, payload: bytes) -> bytes:
    return _key(num, _LEN) + varint(len(payload)) + payload


def _float(num: int, x: float) -> bytes:
    return _key(num, _I32) + struct.pack("<f", x)


def _uint(num: int, n: int) -> bytes:
    return _key(num, _VARINT) + varint(int(n))


@njit(cache=True, nogil=True)
def _varints(ids: np.ndarray, out: np.ndarray) -> int:   # pragma: no cover - compiled
    j = 0
    for i in range(ids.shape[0]):
        v = ids[i]
        while v >= 0x80:
            out[j] = (v & 0x7F) | 0x80
            v >>= 7
            j += 1
        out[j] = v
        j += 1
    return j


def varint_run(ids: Any) -> bytes:
    """The IDs as one packed-varint run (each ID's 7-bit groups, low first, the last byte of each ID below 0x80).
    Compiled (numba, cached on disk): a turn's new IDs in ~1 us per hundred, a 330K-ID first turn in ~1 ms."""
    v = np.asarray(ids)
    if v.size == 0:
        return b""
    if v.dtype != np.uint32:
        if int(v.min()) < 0 or int(v.max()) >= 1 << 32:
            raise WireError("token IDs must be in [0, 2^32)")
        v = v.astype(np.uint32)
    out = np.empty(5 * v.size, dtype=np.uint8)
    return out[:_varints(np.ascontiguousarray(v), out)].tobytes()


def read_varints(buf: bytes | memoryview) -> list[int]:
    """A packed-varint run's values."""
    mv = memoryview(buf)
    out: list[int] = []
    i = 0
    while i < len(mv):
        value, i = _read_varint(mv, i, "a packed varint")
        out.append(value)
    return out


def _cut(run: tuple[Segment, ...], dropped: int) -> list[Segment] | None:
    """The run without its last `dropped` IDs: back over one terminating byte (< 0x80) per ID, from the end."""
    segs = list(run)
    for _ in range(dropped):
        if not segs:
            return None
        raw, start, end = segs[-1]
        i = end - 2   # end - 1 is the last ID's own terminator
        while i >= start and raw[i] & 0x80:
            i -= 1
        if i < start:   # the segment held one ID
            segs.pop()
        else:
            segs[-1] = (raw, start, i + 1)
    return segs if segs else None


# What a request's fields (the dict the JSON bodies are written from) become in SamplingParams: field number and
# kind. Everything else in the dict (model, stream, user...) has no place here: the answer's IDs come back as IDs,
# and the tier matches stop strings itself. logprobs is in the fields only when the client asked for them
# (id_answers.upstream_fields).
_SAMPLING: dict[str, tuple[int, str]] = {
    "temperature": (1, "float"), "top_p": (2, "float"), "top_k": (3, "uint"), "min_p": (4, "float"),
    "frequency_penalty": (5, "float"), "presence_penalty": (6, "float"), "repetition_penalty": (7, "float"),
    "max_tokens": (8, "uint"), "min_tokens": (9, "uint"), "stop_token_ids": (11, "packed"),
    "ignore_eos": (14, "bool"), "n": (15, "uint"), "logprobs": (22, "int"), "seed": (24, "int"),
}


def sampling_params(fields: dict[str, Any]) -> bytes:
    """SamplingParams from a request's fields. top_k <= 0 means no limit (vLLM's -1), which protobuf says by leaving
    the field out."""
    out = bytearray()
    for name, (num, kind) in _SAMPLING.items():
        value = fields.get(name)
        if value is None or value is False:
            continue
        if kind == "float":
            out += _float(num, float(value))
        elif kind == "packed":
            run = varint_run(value)
            if run:
                out += _len(num, run)
        elif kind == "bool":
            out += _uint(num, 1)
        elif kind == "uint":
            if int(value) < 0 or (name == "top_k" and int(value) == 0):
                continue
            out += _uint(num, int(value))
        else:
            out += _uint(num, int(value))
    return bytes(out)


def generate_body(fields: dict[str, Any], pieces: Sequence[bytes | memoryview], size: int) -> Chunks:
    """GenerateRequest less its request_id (the sender puts one in front: fields may come in any order): the
    prompt's IDs (`pieces`, `size` bytes of packed varints) as TokenizedInput, the sampling parameters, streamed."""
    inner = 1 + len(varint(size)) + size
    head = _key(2, _LEN) + varint(inner) + _key(2, _LEN) + varint(size)
    return (head, *pieces, _len(4, sampling_params(fields)) + _uint(5, 1))


def request_id_field(request_id: str) -> bytes:
    return _len(1, request_id.encode())


VARINT_IDS = IdsCodec(run=varint_run, sep=b"", cut=_cut, frame=generate_body)


def _read_varint(mv: memoryview, i: int, what: str) -> tuple[int, int]:
    """The varint at mv[i:], and the index past it."""
    n = shift = 0
    while True:
        if i >= len(mv):
            raise WireError(f"a message ends inside {what}")
        b = mv[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def fields(buf: bytes | memoryview) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a message: an int for varints and fixed widths, a memoryview for
    length-delimited fields."""
    mv = memoryview(buf)
    i, end = 0, len(mv)
    while i < end:
        key, i = _read_varint(mv, i, "a field key")
        num, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, i = _read_varint(mv, i, "a varint")
            yield num, wire, value
        elif wire == _LEN:
            size, i = _read_varint(mv, i, "a length")
            if i + size > end:
                raise WireError("a length-delimited field runs past its message")
            yield num, wire, mv[i:i + size]
            i += size
        elif wire in (_I64, _I32):
            width = 8 if wire == _I64 else 4
            if i + width > end:
                raise WireError("a message ends inside a fixed-width field")
            yield num, wire, int.from_bytes(mv[i:i + width], "little")
            i += width
        else:
            raise WireError(f"wire type {wire} is not one this service uses")


@dataclass
class Output:
    """One GenerateResponse: a streamed chunk (new token IDs of one choice) or a choice's completion."""
    complete: bool
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None   # the stop token ID or stop string vLLM matched
    logprobs: Logprobs | None = None       # when the request asked for them


@dataclass
class Logprobs:
    """OutputLogProbs: per new token its ID and logprob, and the top (ID, logprob) pairs vLLM sent for it."""
    token_ids: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)


# field numbers of GenerateStreamChunk / GenerateComplete
_CHUNK = {"ids": 1, "prompt": 2, "completion": 3, "cached": 4, "logprobs": 5, "index": 7}
_COMPLETE = {"ids": 1, "finish": 2, "prompt": 3, "completion": 4, "cached": 5, "logprobs": 6, "index": 8, "token": 10,
             "string": 11}


def _floats(wire: int, value: Any) -> list[float]:
    """A repeated float field's values: packed (little-endian float32s) or one fixed32."""
    if wire == _LEN:
        if len(value) % 4:
            raise WireError("a packed float field whose length is not a multiple of 4")
        return np.frombuffer(value, "<f4").tolist()
    if wire == _I32:
        return [struct.unpack("<f", value.to_bytes(4, "little"))[0]]
    raise WireError(f"a float field of wire type {wire}")


def _uints(wire: int, value: Any) -> list[int]:
    return read_varints(value) if wire == _LEN else [value]


def _read_top(buf: memoryview) -> list[tuple[int, float]]:
    values: list[float] = []
    ids: list[int] = []
    for num, wire, value in fields(buf):
        if num == 1:
            values += _floats(wire, value)
        elif num == 2:
            ids += _uints(wire, value)
    if len(ids) != len(values):
        raise WireError("top logprobs with unequal numbers of token IDs and values")
    return list(zip(ids, values))


def _read_logprobs(buf: memoryview) -> Logprobs:
    out = Logprobs()
    for num, wire, value in fields(buf):
        if num == 1:
            out.values += _floats(wire, value)
        elif num == 2:
            out.token_ids += _uints(wire, value)
        elif num == 3 and wire == _LEN:
            out.top.append(_read_top(value))
    if len(out.token_ids) != len(out.values) or (out.top and len(out.top) != len(out.values)):
        raise WireError("output logprobs with unequal numbers of tokens, values and top entries")
    return out


def read_output(buf: bytes) -> Output:
    for num, wire, value in fields(buf):
        if num in (1, 2) and wire == _LEN:
            return _read_output(value, complete=num == 2)
    raise WireError("a GenerateResponse with neither a chunk nor a completion")


def _read_output(buf: memoryview, complete: bool) -> Output:
    f = _COMPLETE if complete else _CHUNK
    out = Output(complete=complete)
    for num, wire, value in fields(buf):
        if num == f["ids"]:
            if wire == _LEN:
                out.token_ids += read_varints(value)
            else:
                out.token_ids.append(value)
        elif num == f["index"]:
            out.index = value
        elif num == f["prompt"]:
            out.prompt_tokens = value
        elif num == f["completion"]:
            out.completion_tokens = value
        elif num == f["cached"]:
            out.cached_tokens = value
        elif num == f["logprobs"] and wire == _LEN:
            out.logprobs = _read_logprobs(value)
        elif complete and num == f["finish"]:
            out.finish_reason = bytes(value).decode()
        elif complete and num == f["token"]:
            out.stop_reason = value
        elif complete and num == f["string"]:
            out.stop_reason = bytes(value).decode()
    return out


@dataclass(frozen=True)
class ModelInfo:
    """GetModelInfoResponse, the fields the tier uses."""
    served_model_name: str
    model_path: str
    max_context_length: int | None
    vocab_size: int | None
    default_sampling: dict[str, Any]   # what vLLM's HTTP server would apply to a request that leaves them out


# vLLM's default sampling parameters (the model's generation_config) under their request names
_DEFAULT_KEYS = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens"}


def read_model_info(buf: bytes) -> ModelInfo:
    text: dict[int, str] = {}
    ints: dict[int, int] = {}
    for num, wire, value in fields(buf):
        if wire == _LEN:
            text[num] = bytes(value).decode()
        elif wire == _VARINT:
            ints[num] = value
    defaults: dict[str, Any] = {}
    if text.get(14):
        raw = json.loads(text[14])
        if isinstance(raw, dict):
            if "max_new_tokens" in raw and "max_tokens" not in raw:
                raw["max_tokens"] = raw.pop("max_new_tokens")
            defaults = {k: v for k, v in raw.items() if k in _DEFAULT_KEYS and v is not None}
    return ModelInfo(served_model_name=text.get(6) or text.get(1, ""), model_path=text.get(1, ""),
                     max_context_length=ints.get(3) or None, vocab_size=ints.get(4) or None,
                     default_sampling=defaults)


__all__ = ["SERVICE", "VARINT_IDS", "Logprobs", "ModelInfo", "Output", "WireError", "fields", "generate_body",
           "read_model_info", "read_output", "read_varints", "request_id_field", "sampling_params", "varint",
           "varint_run"]
