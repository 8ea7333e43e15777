"""A request's parameters, one rule each: validation, the pinned sampling seed, the stop set, the length cap.

The sequential reference (`reference.SequentialRouter`) and the runtime (`Runtime.generate`) both call these, so they
make the same decisions; the sub-server reads the model's EOS with `eos_token_ids` and reports it in Ready.

    validate_params(params)                 range and finiteness of every sampling field -> RequestRejected
    request_params(params, request_id)      pin a seed when sampling randomly without one
    eos_token_ids(cfg)                      a model config's EOS id(s) as a list
    stop_token_ids(params, eos)             params.stop_token_ids + EOS unless ignore_eos
    capped_max_tokens(prompt_len, max_tokens, context)   the context caps max_tokens (a prompt must leave room)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .api import counter_uniform
from .errors import RequestRejected

SEED_MAX = 2**63 - 1          # seeds travel as msgpack int64 and in JSON; the sampler hashes any 64-bit value
MAX_TOKENS_MAX = 2**31 - 1    # far above any context; keeps every count a plain int on the wire
TOKEN_ID_MAX = 2**31 - 1


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(name: str, x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise RequestRejected(f"{name} must be a number, got {type(x).__name__}", param=name)
    try:
        v = float(x)
    except OverflowError:
        raise RequestRejected(f"{name} is out of range: {x}", param=name) from None
    if not math.isfinite(v):
        raise RequestRejected(f"{name} must be finite, got {x}", param=name)
    return v


def validate_params(params: Any) -> None:
    """Raise RequestRejected(message, param=field) for any sampling field the runtime cannot honour exactly."""
    t = _number("temperature", params.temperature)
    if t < 0:
        raise RequestRejected(f"temperature must be >= 0, got {t}", param="temperature")
    p = _number("top_p", params.top_p)
    if not 0 < p <= 1:
        raise RequestRejected(f"top_p must be in (0, 1], got {p}", param="top_p")
    mt = params.max_tokens
    if not _is_int(mt) or not 1 <= mt <= MAX_TOKENS_MAX:
        raise RequestRejected(f"max_tokens must be an integer in [1, {MAX_TOKENS_MAX}], got {mt!r}",
                              param="max_tokens")
    seed = params.seed
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= SEED_MAX):
        raise RequestRejected(f"seed must be an integer in [0, {SEED_MAX}], got {seed!r}", param="seed")
    k = getattr(params, "logprobs", None)
    if k is not None and (not _is_int(k) or not 0 <= k <= 20):
        raise RequestRejected(f"logprobs must be an integer in [0, 20], got {k!r}", param="logprobs")
    mn = getattr(params, "min_tokens", 0)
    if not _is_int(mn) or not 0 <= mn <= (mt if _is_int(mt) else MAX_TOKENS_MAX):
        raise RequestRejected(f"min_tokens must be an integer in [0, max_tokens], got {mn!r}", param="min_tokens")
    top_k = getattr(params, "top_k", 0)
    if not _is_int(top_k) or top_k < -1:
        raise RequestRejected(f"top_k must be an integer >= -1, got {top_k!r}", param="top_k")
    for name, lo, hi in (("min_p", 0.0, 1.0), ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                         ("repetition_penalty", 0.0, 2.0)):
        v = _number(name, getattr(params, name, 1.0 if name == "repetition_penalty" else 0.0))
        if not lo <= v <= hi or (name == "repetition_penalty" and v == 0.0):
            raise RequestRejected(f"{name} must be in {'(' if name == 'repetition_penalty' else '['}{lo}, {hi}], "
                                  f"got {v}", param=name)
    for tok, bias in getattr(params, "logit_bias", ()):
        if not _is_int(tok) or not 0 <= tok <= TOKEN_ID_MAX or not -100.0 <= _number("logit_bias", bias) <= 100.0:
            raise RequestRejected(f"logit_bias maps token ids in [0, {TOKEN_ID_MAX}] to biases in [-100, 100], got "
                                  f"{tok!r}: {bias!r}", param="logit_bias")
    for tok in params.stop_token_ids:
        if not _is_int(tok) or not 0 <= tok <= TOKEN_ID_MAX:
            raise RequestRejected(f"stop_token_ids must be token ids in [0, {TOKEN_ID_MAX}], got {tok!r}",
                                  param="stop_token_ids")


def validate_prompt(prompt: list[int]) -> None:
    if not prompt:
        raise RequestRejected("prompt must contain at least one token", param="prompt")
    bad = next((t for t in prompt if not _is_int(t) or not 0 <= t <= TOKEN_ID_MAX), None)
    if bad is not None:
        raise RequestRejected(f"prompt token ids must be integers in [0, {TOKEN_ID_MAX}], got {bad!r}",
                              param="prompt")


def request_params(params: Any, request_id: str) -> Any:
    """Pin a sampling seed per request when none is given, so random sampling is reproducible in every runtime."""
    if params.temperature > 0 and params.seed is None:
        seed = int(counter_uniform(0, request_id, 0, 0, stream=1) * (1 << 53))
        return dataclasses.replace(params, seed=seed)
    return params


def eos_token_ids(cfg: Any) -> list[int]:
    """A model config's EOS id(s) (`eos_token_id`: None, an int or a list) as a list."""
    eos = getattr(cfg, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def stop_token_ids(params: Any, eos: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """THE stop rule: the request's stop ids, then the home model's EOS unless ignore_eos."""
    ids = tuple(int(t) for t in params.stop_token_ids)
    if not getattr(params, "ignore_eos", False):
        ids += tuple(int(e) for e in eos)
    return ids


def capped_max_tokens(prompt_len: int, max_tokens: int, context: int | None) -> int:
    """max_tokens capped so prompt + output fits the context; RequestRejected when the prompt alone fills it."""
    if context is None:
        return max_tokens
    if prompt_len >= context:
        raise RequestRejected(f"prompt has {prompt_len} tokens; the context is {context} (the prompt must leave "
                              f"room for at least one output token)", param="prompt")
    return min(max_tokens, context - prompt_len)


__all__ = ["SEED_MAX", "capped_max_tokens", "eos_token_ids", "request_params", "stop_token_ids",
           "validate_params", "validate_prompt"]
