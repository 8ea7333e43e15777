"""Standard serving: the baseline where an external scheduler (the front end) composes stock servers.

Stock servers keep no per-request routing state across calls, so every switch is a new call: the front end takes
the request's whole view back (a Yield), and re-submits it to the next model as a fresh AddRequest, which prefix
matches, allocates and recomputes what its cache misses. Two granularities, one code path (`standard_unit`):

    "token"    one token per call (R2R, CITER, Co-LLM: the routing signal is a hidden state, which stock servers do
               not return, so the router must run between tokens and every token is its own call)
    "segment"  one call streams a segment from one model until the router switches (R-Stitch-like: logprobs
               suffice, so the router reads the stream and aborts it when it switches); the committed tokens stream
               to the client as they come, the switch ends the call like a Yield

This module holds both sides of the Yield: building it on the sub-server, and turning it into the client's tokens
and the re-submission on the front end.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from .api import Handoff
from .messages import AddRequest, TokenChunk, Yield, params_to_wire, stats_to_wire
from .positions import window

STANDARD_UNITS = ("token", "segment")

__all__ = ["STANDARD_UNITS", "build_yield", "front_end_yield", "validate_unit"]


def validate_unit(unit: str) -> str:
    if unit not in STANDARD_UNITS:
        raise ValueError(f"standard_unit must be one of {STANDARD_UNITS}, got {unit!r}")
    return unit


def build_yield(rec: Any, model: int, next_model: int, h: Handoff | None, finish_reason: str | None,
                final_stats: dict[str, Any] | None) -> Yield:
    """The Yield that ends a call on `model` (rec: a route_request.RouteRequest)."""
    view = rec.view
    return Yield(rec.request_id, model, list(view.prompt_ids), list(view.output_ids), list(rec.models),
                 dict(view.state), params_to_wire(rec.params), rec.num_handoffs, next_model, finish_reason, h,
                 rec.inc, stats=stats_to_wire(rec.stats), final_stats=final_stats, logprobs=window(rec.logprobs, 0))


class _LiveLike(Protocol):
    streamed: int
    first_token: float | None
    done: bool
    inc: int


def front_end_yield(live: _LiveLike, y: Yield, deliver: Callable[[Any, Any], None],
                    final_stats: Callable[[Any, dict[str, Any] | None], dict[str, Any]],
                    now: float) -> AddRequest | None:
    """A call ended: stream the tokens the client has not seen, then either finish (None) or return the
    re-submission for `y.next_model`."""
    n = len(y.output)
    if n > live.streamed:
        if live.first_token is None:
            live.first_token = now
        deliver(live, TokenChunk(y.request_id, y.output[live.streamed:], y.models[live.streamed:n], live.streamed,
                                 logprobs=None if y.logprobs is None else y.logprobs[live.streamed:n]))
        live.streamed = n
    if y.finish_reason is not None:
        live.done = True
        deliver(live, TokenChunk(y.request_id, [], [], n, y.finish_reason, final_stats(live, y.final_stats)))
        return None
    return AddRequest(y.request_id, y.prompt, y.params, y.output, y.models, y.state, y.num_handoffs, y.handoff,
                      inc=live.inc, stats=y.stats, logprobs=y.logprobs)
