"""Typed messages between the front end and the per-model sub-servers, one dataclass per message, grouped by direction.

Every message becomes a plain dict (`to_wire`) of msgpack-able values tagged with its type name; `encode` / `decode`
wrap msgpack. Nothing is pickled: a message from a peer can only ever become one of the dataclasses below.

    front end  -> sub-server : AddRequest, Abort, StepGrant, Peers, PeerRestarted, StatsQuery, Configure, Shutdown
    sub-server -> sub-server : HandoffMsg (wraps tokenplane.route.api.Handoff), Release, PeerStatus
    sub-server -> front end  : Ready, TokenChunk, Finished, Error, Heartbeat, StepDone, Yield, StatsReply
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, dataclass_transform

import msgpack

from .api import Handoff
from .stats import RouteStats

_REGISTRY: dict[str, Any] = {}   # name -> message class (a _Wire dataclass)


@dataclass_transform()
def _message(cls):
    """Register a dataclass as a wire message under its class name."""
    cls = dataclass(cls)
    _REGISTRY[cls.__name__] = cls
    return cls


_FIELDS: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    # dataclasses.fields() rebuilds its tuple on every call; a token's messages pass here several times per step.
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


class _Wire:
    """Default wire mapping: fields by name; subclasses override for nested types (Handoff)."""
    nested: ClassVar[dict[str, Any]] = {}

    def to_wire(self) -> dict[str, Any]:
        d = {name: getattr(self, name) for name in _field_names(type(self))}
        for name in self.nested:
            if d[name] is not None:
                d[name] = d[name].to_wire()
        d["type"] = type(self).__name__
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]):
        names = _field_names(cls)
        kw = {k: v for k, v in d.items() if k in names}
        for name, typ in cls.nested.items():
            if kw.get(name) is not None:
                kw[name] = typ.from_wire(kw[name])
        return cls(**kw)


# -- front end -> sub-server ---------------------------------------------------------------------------------------

@_message
class AddRequest(_Wire):
    """Admit a request. Normally sent to the home model (0) with an empty output. In standard-serving mode the front
    end re-submits every step to the model that decodes next, carrying the whole request view and the handoff."""
    request_id: str
    prompt: list[int]
    params: dict[str, Any]
    output: list[int] = field(default_factory=list)
    models: list[int] = field(default_factory=list)       # per output position: the model that produced it
    state: dict[str, Any] = field(default_factory=dict)   # RequestView.state (algorithm state)
    num_handoffs: int = 0
    handoff: Handoff | None = None                        # standard serving: the switch that led here
    inc: int = 0                                          # incarnation: a request id may be reused after it ends
    stats: dict[str, Any] | None = None                   # standard serving: routing stats so far (stats_to_wire)
    logprobs: list | None = None                          # parallel to `models` when params ask (see TokenChunk)
    nested: ClassVar[dict[str, Any]] = {"handoff": Handoff}


@_message
class Abort(_Wire):
    request_id: str
    reason: str = "abort"
    inc: int = 0


@_message
class StepGrant(_Wire):
    """Sync modes: run at most one step. `expected[k]` = handoffs model k has sent to this model so far; the
    sub-server drains its peer socket until it has received that many, so a step never misses a handoff that the
    coordinator already counted."""
    round: int
    expected: list[int]


@_message
class Peers(_Wire):
    """Addresses of every model's peer inbox (index = model)."""
    addresses: list[str]


@_message
class PeerRestarted(_Wire):
    model: int
    address: str


@_message
class StatsQuery(_Wire):
    token: int


@_message
class Configure(_Wire):
    """Switch execution-mode flags (and optionally the algorithm) of an idle sub-server: the modes are flags of one
    code path, so one set of processes can run every mode (tests, ablations) without re-spawning."""
    mode: str
    pending_return: bool
    standard_serving: bool
    thresholds: list[int]
    concurrency: int
    max_delay_s: float
    algorithm: str | None = None
    algorithm_kwargs: dict[str, Any] | None = None
    standard_unit: str = "token"   # standard serving: one call per token or per segment (see standard.py)


@_message
class Shutdown(_Wire):
    reason: str = "shutdown"


# -- sub-server -> sub-server --------------------------------------------------------------------------------------

@_message
class HandoffMsg(_Wire):
    """A request crossing models. `handoff` is what the algorithm built; the rest is runtime bookkeeping that the
    sequential reference keeps in one shared object: per-model seen counts, per-position producing model, the
    sampling parameters (a first visit needs them) and the handoff counter."""
    handoff: Handoff
    seen: list[int]
    models: list[int]          # producing model of each output position in [max(anchor, 0), handoff.position)
    params: dict[str, Any]
    num_handoffs: int = 0
    final: bool = False        # finish delivery to the home model: tokens are committed, receive() is not called
    inc: int = 0               # incarnation of the request id (see AddRequest.inc)
    logprobs: list | None = None   # parallel to `models` when the request asked for logprobs (see TokenChunk)
    nested: ClassVar[dict[str, Any]] = {"handoff": Handoff}


@_message
class Release(_Wire):
    """The home model finished (or aborted) the request: drop any retained state for it."""
    request_id: str
    reason: str = "finished"
    inc: int = 0


@_message
class PeerStatus(_Wire):
    """Delayed batching: `model`'s state as of this message. `active`: executing (or about to). An idle model also
    reports `ready` (requests queued below its threshold) and its cumulative HandoffMsg counts `sent[k]` / `received[k]`
    to / from each model; a receiver compares them with its own counts, so a report that predates a handoff still
    in flight is recognised as stale instead of read as "idle". Sent when any of these changes while idle, and on
    every idle/active transition. Final deliveries (HandoffMsg.final) are left out of the counts: they never create
    work, so no model waits for one to be acknowledged. An idle report rides in the same frame as the handoffs it
    counts (one send, one drain at the peer). `at`: the sender's time.monotonic() (system-wide), so a receiver can
    measure how late the news of an idle peer reached it."""
    model: int
    active: bool
    ready: int = 0
    sent: list[int] = field(default_factory=list)
    received: list[int] = field(default_factory=list)
    at: float = 0.0


# -- sub-server -> front end ---------------------------------------------------------------------------------------

@_message
class Ready(_Wire):
    model: int
    pid: int
    client_address: str
    peer_address: str
    num_blocks: int
    block_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    max_model_len: int | None = None


@_message
class TokenChunk(_Wire):
    """Committed tokens of one request, in order. `start` is the output position of tokens[0]. The front end hands
    these to `Runtime.generate` callers; the last one carries finish_reason and stats.

    `logprobs` (only when the request's SamplingParams.logprobs is set): parallel to `tokens`, one
    `[logprob, [[id, logprob], ...top k]]` per token under the raw distribution of the model that committed it (an
    ensemble position: the primary's), as `sampler.token_logprobs` gives and the reference's TokenEvent reports."""
    request_id: str
    tokens: list[int]
    models: list[int]
    start: int
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None
    inc: int = 0
    logprobs: list | None = None


@_message
class Finished(_Wire):
    """The request ended on its home model; `tokens` are the not yet streamed tail."""
    request_id: str
    tokens: list[int]
    models: list[int]
    start: int
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)
    inc: int = 0
    logprobs: list | None = None       # parallel to `tokens` (see TokenChunk)


@_message
class Error(_Wire):
    """A request (or, with request_id None, the whole sub-server) failed."""
    request_id: str | None
    message: str
    model: int
    fatal: bool = False
    inc: int | None = None       # None: whichever incarnation is live


@_message
class Heartbeat(_Wire):
    """Sent by the sub-server's heartbeat thread every heartbeat_s whatever the step does (liveness), with the
    scheduler's load as of the last loop turn. `step_started` (None when not stepping) lets the supervisor kill a
    model whose single step exceeds step_timeout_s (a hung step)."""
    model: int
    pid: int
    time: float
    num_waiting: int = 0
    num_running: int = 0
    num_pending: int = 0
    step_started: float | None = None   # time.monotonic() (system-wide on Linux, so the supervisor compares it)
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0


@_message
class StepDone(_Wire):
    """Sync modes: the granted step is over. `sent[k]` = handoffs this model has sent to model k so far."""
    model: int
    round: int
    sent: list[int]
    ran: bool
    num_ready: int


@_message
class Yield(_Wire):
    """Standard serving: one single-token call is over and the request left the model. The front end (the external
    scheduler) streams the new tokens and re-submits the request to `handoff.target` (or the same model)."""
    request_id: str
    model: int
    prompt: list[int]
    output: list[int]
    models: list[int]
    state: dict[str, Any]
    params: dict[str, Any]
    num_handoffs: int
    next_model: int
    finish_reason: str | None = None
    handoff: Handoff | None = None
    inc: int = 0
    stats: dict[str, Any] | None = None          # routing stats so far (stats_to_wire), re-submitted with the call
    final_stats: dict[str, Any] | None = None    # with finish_reason: the request's final stats (as Finished.stats)
    logprobs: list | None = None                 # parallel to `models` when params ask (see TokenChunk)
    nested: ClassVar[dict[str, Any]] = {"handoff": Handoff}


@_message
class StatsReply(_Wire):
    model: int
    token: int
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_preemptions: int
    requests: dict[str, int]        # state name -> count
    counters: dict[str, Any]


# -- wire forms of non-message values (sampling parameters, routing stats) ------------------------------------

def params_to_wire(p) -> dict[str, Any]:
    return {"temperature": float(p.temperature), "top_p": float(p.top_p), "max_tokens": int(p.max_tokens),
            "seed": None if p.seed is None else int(p.seed), "stop_token_ids": [int(t) for t in p.stop_token_ids],
            "ignore_eos": bool(getattr(p, "ignore_eos", False)),
            "logprobs": None if getattr(p, "logprobs", None) is None else int(p.logprobs),
            "top_k": int(getattr(p, "top_k", 0)), "min_p": float(getattr(p, "min_p", 0.0)),
            "presence_penalty": float(getattr(p, "presence_penalty", 0.0)),
            "frequency_penalty": float(getattr(p, "frequency_penalty", 0.0)),
            "repetition_penalty": float(getattr(p, "repetition_penalty", 1.0)),
            "logit_bias": [[int(t), float(b)] for t, b in getattr(p, "logit_bias", ())],
            "min_tokens": int(getattr(p, "min_tokens", 0))}


def params_from_wire(d: dict[str, Any]):
    from tokenplane.engine.sampler import SamplingParams
    return SamplingParams(temperature=float(d.get("temperature", 0.0)), top_p=float(d.get("top_p", 1.0)),
                          max_tokens=int(d.get("max_tokens", 16)), seed=d.get("seed"),
                          stop_token_ids=tuple(d.get("stop_token_ids", ())),
                          ignore_eos=bool(d.get("ignore_eos", False)), logprobs=d.get("logprobs"),
                          top_k=int(d.get("top_k", 0)), min_p=float(d.get("min_p", 0.0)),
                          presence_penalty=float(d.get("presence_penalty", 0.0)),
                          frequency_penalty=float(d.get("frequency_penalty", 0.0)),
                          repetition_penalty=float(d.get("repetition_penalty", 1.0)),
                          logit_bias=tuple((int(t), float(b)) for t, b in d.get("logit_bias", ())),
                          min_tokens=min(int(d.get("min_tokens", 0)), int(d.get("max_tokens", 16))))


def stats_to_wire(s: RouteStats) -> dict[str, Any]:
    """Everything but token_models (the runtime carries those as `models`)."""
    return {"switches": [list(x) for x in s.switches], "prefill": [list(x) for x in s.prefill],
            "dropped": s.dropped, "ensembled": s.ensembled, "score_visits": s.score_visits,
            "cached_prompt": s.cached_prompt}


def stats_from_wire(num_models: int, d: dict[str, Any] | None, models: list[int]) -> RouteStats:
    d = d or {}
    return RouteStats(num_models, token_models=list(models),
                      switches=[(int(a), int(b)) for a, b in d.get("switches", [])],
                      prefill=[(int(a), int(b)) for a, b in d.get("prefill", [])],
                      dropped=int(d.get("dropped", 0)), ensembled=int(d.get("ensembled", 0)),
                      score_visits=int(d.get("score_visits", 0)), cached_prompt=d.get("cached_prompt"))


def encode(msg) -> bytes:
    return msgpack.packb(msg.to_wire(), use_bin_type=True)


def encode_many(msgs) -> bytes:
    """Several messages to ONE receiver as one frame (a msgpack array), in order: a step's token chunks and
    handoffs to the same destination cost one send and one wake-up of the receiver instead of one per request."""
    return msgpack.packb([m.to_wire() for m in msgs], use_bin_type=True)


def _from_dict(d):
    if not isinstance(d, dict) or d.get("type") not in _REGISTRY:
        raise ValueError(f"unknown message: {str(d)[:200]}")
    return _REGISTRY[d["type"]].from_wire(d)


def decode(data: bytes):
    """Bytes -> message dataclass. Raises ValueError on anything that is not a registered message."""
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"undecodable message: {exc}") from None
    return _from_dict(d)


def decode_all(data: bytes) -> list:
    """A frame from `encode` (one message) or `encode_many` (a list, in order) -> messages. Raises ValueError when
    the frame, or any message in it, is not a registered message (nothing of a bad frame is delivered)."""
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ValueError(f"undecodable message: {exc}") from None
    if isinstance(d, list):
        return [_from_dict(x) for x in d]
    return [_from_dict(d)]


MESSAGE_TYPES = dict(_REGISTRY)

__all__ = ["Abort", "AddRequest", "Configure", "Error", "Finished", "HandoffMsg", "Heartbeat", "MESSAGE_TYPES",
           "PeerRestarted", "PeerStatus", "Peers", "Ready", "Release", "Shutdown", "StatsQuery", "StatsReply",
           "StepDone", "StepGrant", "TokenChunk", "Yield", "decode", "decode_all", "encode", "encode_many",
           "params_from_wire", "params_to_wire", "stats_from_wire", "stats_to_wire"]
