"""Per-output-position records that travel with committed tokens: the producing model and, when asked, the logprob.

A committed token's logprob entry is `[logprob, [[id, logprob], ...top k]]` (msgpack-friendly) under the raw
distribution of the model that committed it (`sampler.token_logprobs`, what the reference's TokenEvent reports). It is
computed where the token is committed, from that step's logits, and then only copied: the home model streams it, a
peer sends it back inside HandoffMsg, standard serving carries it through Yield / AddRequest. A request that did not
ask keeps None instead of a list, so the log_softmax over the vocabulary is paid only by requests that asked.
"""

from __future__ import annotations

from typing import Any


def logprob_entry(logits: Any, token: int, k: int) -> list[Any]:
    """The wire entry of `token` committed from `logits` ([V]), with its top-k alternatives."""
    from tokenplane.engine.sampler import token_logprobs
    lp, top = token_logprobs(logits, int(token), int(k))
    return [lp, [[i, v] for i, v in top]]


def record(rec: Any, model: int, result: Any, token: int) -> None:
    """Per-position records of a token `model` commits (rec: route_request.RouteRequest); its logprob, from the logits
    of `result` (the api.StepResult that produced it: read only here, so a deferred projection runs only when the
    request asked for logprobs)."""
    rec.models.append(model)
    if rec.logprobs is not None:
        rec.logprobs.append(logprob_entry(result.logits, token, rec.params.logprobs))


def set_received(rec: Any, h: Any, models: list[int], logprobs: list[Any] | None, start: int | None = None) -> None:
    """The records of the positions a handoff `h` delivered, [start, committed length) (default start: its anchor),
    from the sender's lists; rec: route_request.RouteRequest after receive() / apply_handoff."""
    start = max(h.anchor, 0) if start is None else start
    n = len(rec.view.output_ids)
    splice(rec.models, start, [int(m) for m in models], n, h.source)
    if rec.logprobs is not None:
        splice(rec.logprobs, start, list(logprobs or []), n, None)


def splice(dst: list[Any], start: int, src: list[Any], n: int, fill: Any) -> None:
    """dst[start:] = src, then cut or pad with `fill` to n entries. `receive()` may accept fewer or more tokens than
    a handoff carried; a token the sender never produced is attributed to `fill` (the sender as producing model; no
    logprob, None, since no model computed one)."""
    del dst[start:]
    dst.extend(src)
    del dst[n:]
    dst.extend([fill] * (n - len(dst)))


def window(values: list[Any] | None, start: int, end: int | None = None) -> list[Any] | None:
    """values[start:end], or None for a request that carries no such record (logprobs not asked)."""
    return None if values is None else values[start:end]


__all__ = ["logprob_entry", "record", "set_received", "splice", "window"]
