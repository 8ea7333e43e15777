"""Request-centric routing API: an algorithm decides per token, per request, as if the request were alone.

The runtime (tokenplane.route.runtime) and the sequential reference (tokenplane.route.reference) both drive an
`Algorithm` through the same four calls, so a routing algorithm is written once:

    result = <model `m` decodes one token of request `req`>                 # StepResult
    peers = alg.ensemble_peers(result, req)                                 # ME only; [] for switching algorithms
    if peers:   each peer p receives alg.send(req, result, p) (a score visit), catches up, runs, and answers
                alg.score_reply(req_p, result_p, m); then token = alg.combine(req, result, {p: payload}) is committed
    else:       target = alg.route(result, req)
                target == m  -> commit result.token, m keeps decoding
                target != m  -> h = alg.send(req, result, target); commit result.token iff h.keep_last;
                                target model: tokens = alg.receive(req_t, h); append tokens to its own sequence
                                (num_tokens - num_computed_tokens = the catch-up prefill), decode the next position.

`route` returns the index of the model that decodes next. Returning `result.model` means "stay"; for the primary
(model 0) that is the paper's "0 = continue"; on a peer, returning 0 hands the request back to the primary.

Positions are output positions: 0 is the first generated token; the prompt occupies [-len(prompt), 0). A Handoff's
`anchor` is the output position of `tokens[0]`, so a peer's first visit (it has seen nothing) has a negative anchor
and its tokens start with the prompt.

Purity: every decision must be a pure function of (model outputs, request state, seed, request_id, position).
Randomness comes from `counter_uniform` (a hash of those keys), never from a global RNG, so a multi-process runtime
and the sequential reference decide identically. Per-request algorithm state lives in `RequestView.state`
(msgpack-able values only) and travels inside each Handoff, so the receiving process continues from it.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Callable
from typing import Sequence as Seq

import torch

WIRE_VERSION = 1
_DEFERRED = torch.empty(0)     # StepResult.logits until a deferred result's `project` has run


def counter_uniform(seed: int, request_id: str, position: int, model: int, stream: int = 0) -> float:
    """A uniform float in [0, 1) from a keyed hash: identical in every process, independent of call order."""
    key = struct.pack("<qqqq", int(seed), int(position), int(model), int(stream)) + request_id.encode("utf-8")
    (x,) = struct.unpack("<Q", hashlib.blake2b(key, digest_size=8).digest())
    return (x >> 11) * (1.0 / (1 << 53))


@dataclass
class StepResult:
    """One decoded token of one request on one model: what `route` sees.

    `logits` may be given as a function that computes them (`project`): a sub-server whose algorithm routes on
    hidden states alone (`Algorithm.uses_logits` False) takes greedy tokens from the engine's greedy screen and
    projects a row onto the vocabulary only if something reads its logits (the same values: the projection of a row
    does not depend on its batch)."""
    request_id: str
    model: int
    position: int                   # output position the token goes to
    token: int                      # sampled on `model`
    logits: torch.Tensor            # [V], the logits that produced `token` (float32; float64 in equivalence tests)
    hidden: torch.Tensor | None = None   # [H], final-norm hidden state at the same position
    top_logits: torch.Tensor | None = None   # the k largest logits, descending, where the sub-server computed them
    #                                          (Algorithm.top_logits: R2R's router input) without projecting in full

    @classmethod
    def deferred(cls, request_id: str, model: int, position: int, token: int, project: Callable[[], torch.Tensor],
                 hidden: torch.Tensor | None = None, top_logits: torch.Tensor | None = None) -> StepResult:
        """A result whose logits `project()` computes on first read."""
        r = cls(request_id, model, position, token, _DEFERRED, hidden, top_logits)
        r.__dict__["_project"] = project
        return r

    def probs(self) -> torch.Tensor:
        return torch.softmax(self.logits, dim=-1)

    def log_probs(self) -> torch.Tensor:
        return torch.log_softmax(self.logits, dim=-1)

    def entropy(self) -> float:
        """Shannon entropy of the next-token distribution, in nats (entropy.py: one compiled pass with float64 sums,
        the same bits for a row whatever batch, process or thread count computed its logits' entropy)."""
        from .entropy import entropy
        return entropy(self.logits)

    def normalized_entropy(self) -> float:
        """Entropy / log V, in [0, 1] (R-Stitch's signal)."""
        return self.entropy() / math.log(self.logits.shape[-1])

    def max_prob(self) -> float:
        return float(self.probs().max())

    def topk(self, k: int) -> tuple[list[int], list[float]]:
        """Top-k token ids and probabilities (ties broken by lower id, deterministically)."""
        p = self.probs()
        k = min(k, p.shape[-1])
        # torch.topk's tie order is unspecified; a stable sort on -p makes ties deterministic across processes.
        order = torch.sort(-p, stable=True).indices[:k]
        return [int(i) for i in order], [float(p[i]) for i in order]


def _get_logits(self: StepResult) -> torch.Tensor:
    v = self.__dict__["_logits"]
    if v is _DEFERRED:
        v = self.__dict__["_logits"] = self.__dict__.pop("_project")()
    return v


def _set_logits(self: StepResult, value: torch.Tensor) -> None:
    self.__dict__["_logits"] = value


# `logits` reads through the deferred projection (the dataclass __init__ assigns it through the setter)
StepResult.logits = property(_get_logits, _set_logits)  # type: ignore[assignment]


@dataclass
class Handoff:
    """What crosses from one model to another: the unseen token suffix plus request semantics (never KV)."""
    request_id: str
    tokens: list[int]               # suffix the target has not seen, starting at output position `anchor`
    anchor: int                     # output position of tokens[0] (negative: inside the prompt, first visit)
    done: bool = False              # the request finished with these tokens (EOS / stop / length)
    keep_last: bool = True          # the sender's just-sampled token was committed (True) or dropped for regeneration
    target: int = 0                 # receiving model index
    source: int = 0                 # sending model index
    position: int = 0               # output position the target decodes next (= committed output length)
    metadata: dict[str, Any] = field(default_factory=dict)   # msgpack-able; "state" carries RequestView.state

    def to_wire(self) -> dict[str, Any]:
        """Plain dict of msgpack-able values (no pickle on any wire)."""
        return {"v": WIRE_VERSION, "rid": self.request_id, "tokens": [int(t) for t in self.tokens],
                "anchor": int(self.anchor), "done": bool(self.done), "keep_last": bool(self.keep_last),
                "target": int(self.target), "source": int(self.source), "position": int(self.position),
                "meta": self.metadata}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Handoff:
        if not isinstance(d, dict) or d.get("v") != WIRE_VERSION:
            raise ValueError(f"not a version-{WIRE_VERSION} handoff: {d!r:.200}")
        return cls(request_id=str(d["rid"]), tokens=[int(t) for t in d["tokens"]], anchor=int(d["anchor"]),
                   done=bool(d["done"]), keep_last=bool(d["keep_last"]), target=int(d["target"]),
                   source=int(d["source"]), position=int(d["position"]), metadata=dict(d.get("meta") or {}))


@dataclass
class RequestView:
    """What an algorithm sees of a request on one model (each model process keeps its own view)."""
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]           # committed output tokens known to this view
    model: int                      # model currently decoding the request
    seen: list[int]                 # per model: how many sequence tokens (prompt + output) it has been given
    state: dict[str, Any] = field(default_factory=dict)   # per-request algorithm state (msgpack-able)
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def new(cls, request_id: str, prompt_ids: Seq[int], num_models: int, *, max_tokens: int = 16,
            stop_token_ids: Seq[int] = (), model: int = 0) -> RequestView:
        return cls(request_id, list(prompt_ids), [], model, [0] * num_models, {}, max_tokens, tuple(stop_token_ids))

    @classmethod
    def from_handoff(cls, handoff: Handoff, num_models: int) -> RequestView:
        """The receiving model's view on a first visit (the handoff carries the prompt and the request limits)."""
        info = handoff.metadata.get("request")
        if info is None or handoff.anchor != -int(info["prompt_len"]):
            raise ValueError(f"request {handoff.request_id}: not a first-visit handoff (anchor {handoff.anchor})")
        prompt = [int(t) for t in handoff.tokens[:int(info["prompt_len"])]]
        return cls.new(handoff.request_id, prompt, num_models, max_tokens=int(info["max_tokens"]),
                       stop_token_ids=tuple(int(t) for t in info["stop_token_ids"]), model=handoff.target)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    def finishes_with(self, token: int, position: int) -> bool:
        """Committing `token` at output `position` ends the request (stop token or length)."""
        return token in self.stop_token_ids or position + 1 >= self.max_tokens


class Algorithm:
    """Base class. Subclasses override `route` (and `keep_last`, `signal`, the ensemble hooks when they need them).

    num_models: how many models the algorithm drives (model 0 is the primary, usually the small model).
    seed: keys the counter-based randomness of synthetic modes.
    """
    name = "base"
    num_models = 2
    primary = 0

    def __init__(self, *, seed: int = 0, num_models: int | None = None):
        self.seed = int(seed)
        if num_models is not None:
            self.num_models = int(num_models)

    # -- lifecycle -------------------------------------------------------------------------------------------
    def attach(self, model: int, module: Any) -> None:
        """Called once per local model (nn.Module) before routing, e.g. R2R grabs the small model's embedding."""

    def init_state(self, req: RequestView) -> dict[str, Any]:
        """Per-request algorithm state at admission (msgpack-able)."""
        return {}

    def config(self) -> dict[str, Any]:
        """Constructor kwargs that rebuild this exact algorithm (thresholds included) in another process."""
        return {"seed": self.seed, "num_models": self.num_models}

    # -- the interface -------------------------------------------------------------------------------------
    def uses_logits(self, model: int) -> bool:
        """Whether this algorithm reads `StepResult.logits` (or what derives from them: probs, entropy, top-k) of
        `model`'s results. False lets that model's sub-server take greedy tokens from the engine's greedy screen
        without projecting onto the vocabulary (the logits are still computed if read). Default: True."""
        return True

    def top_logits(self, model: int) -> int:
        """How many of the largest logits of `model`'s results this algorithm reads through `StepResult.top_logits`
        (0: none). With `uses_logits` False, the sub-server's greedy screen computes just those."""
        return 0

    def prepare_step(self, results: list[StepResult]) -> None:
        """Called once per sub-server step with every row that sampled, before their `route` calls: an algorithm
        whose signal is a network (R2R's router) can run it once for the whole batch instead of once per row. Its
        decisions must stay those of the per-row signal (see R2R.divergence)."""

    def route(self, result: StepResult, req: RequestView) -> int:
        """Model that decodes next. `result.model` = stay; any other index = hand the request to that model."""
        return result.model

    def keep_last(self, result: StepResult, req: RequestView, target: int) -> bool:
        """On a switch: commit the just-sampled token (True) or drop it so `target` regenerates it (False)."""
        return True

    def send(self, req: RequestView, result: StepResult, target: int) -> Handoff:
        """Build the handoff: the target's unseen suffix, the anchor, the done flag, state in metadata."""
        keep = self.keep_last(result, req, target)
        full = req.prompt_ids + req.output_ids[:result.position]
        if len(full) != len(req.prompt_ids) + result.position:
            raise ValueError(f"request {req.request_id}: view has {req.num_output} output tokens, "
                             f"result is for position {result.position}")
        start = req.seen[target]
        tokens = full[start:] + ([int(result.token)] if keep else [])
        done = keep and req.finishes_with(int(result.token), result.position)
        meta: dict[str, Any] = {"state": dict(req.state)}
        if start == 0:   # first visit: the target learns the request (prompt = tokens[:prompt_len])
            meta["request"] = {"prompt_len": len(req.prompt_ids), "max_tokens": req.max_tokens,
                               "stop_token_ids": list(req.stop_token_ids)}
        return Handoff(request_id=req.request_id, tokens=tokens, anchor=start - len(req.prompt_ids), done=done,
                       keep_last=keep, target=target, source=result.model,
                       position=result.position + (1 if keep else 0), metadata=meta)

    def receive(self, req: RequestView, handoff: Handoff) -> list[int]:
        """Tokens the receiving model appends to its own sequence (default: accept them all) + state restore."""
        req.state.update(handoff.metadata.get("state", {}))
        return list(handoff.tokens)

    # -- ensemble hooks (ME); switching algorithms keep the defaults ---------------------------------------
    def ensemble_peers(self, result: StepResult, req: RequestView) -> list[int]:
        """Peers whose next-token distributions must be combined at this position ([] = no ensemble here)."""
        return []

    def score(self, result: StepResult) -> dict[str, Any]:
        """A peer's distribution at the anchor, as a msgpack-able payload."""
        raise NotImplementedError(f"{self.name} does not ensemble")

    def score_reply(self, req: RequestView, result: StepResult, target: int) -> Handoff:
        """A peer's answer to a score visit: no tokens, its distribution in metadata."""
        return Handoff(request_id=req.request_id, tokens=[], anchor=result.position, done=False, keep_last=False,
                       target=target, source=result.model, position=result.position,
                       metadata={"scores": self.score(result)})

    def combine(self, req: RequestView, result: StepResult, scores: dict[int, dict[str, Any]]) -> int:
        """Committed token at `result.position` from the primary's result and the peers' score payloads."""
        raise NotImplementedError(f"{self.name} does not ensemble")


def commit(req: RequestView, model: int, token: int) -> None:
    """Commit `token` (produced on or chosen by `model`) at the next output position of this view."""
    req.output_ids.append(int(token))
    req.seen[model] = len(req.prompt_ids) + len(req.output_ids)


def after_send(req: RequestView, result: StepResult, handoff: Handoff) -> None:
    """Update the sender's view once `handoff` is sent: commit the kept token, record what the target has seen."""
    if handoff.keep_last:
        commit(req, result.model, result.token)
    req.seen[handoff.target] = len(req.prompt_ids) + handoff.anchor + len(handoff.tokens)
    if not handoff.metadata.get("score"):
        req.model = handoff.target


def apply_handoff(req: RequestView, handoff: Handoff, tokens: list[int]) -> None:
    """Update the receiver's view with the tokens `receive` accepted (the same helper in reference and runtime)."""
    p = len(req.prompt_ids)
    expected = req.seen[handoff.target] - p
    if handoff.anchor != expected:
        raise ValueError(f"request {req.request_id}: handoff anchor {handoff.anchor} but model {handoff.target} "
                         f"has seen up to output position {expected}")
    if handoff.anchor < 0 and tokens[:-handoff.anchor] != req.prompt_ids[p + handoff.anchor:]:
        raise ValueError(f"request {req.request_id}: handoff prompt tokens do not match the prompt")
    out_start = max(handoff.anchor, 0)
    del req.output_ids[out_start:]
    req.output_ids.extend(int(t) for t in tokens[out_start - handoff.anchor:])
    req.seen[handoff.target] = p + handoff.anchor + len(tokens)
    if len(req.output_ids) != handoff.position:
        raise ValueError(f"request {req.request_id}: after handoff output has {len(req.output_ids)} tokens, "
                         f"handoff says position {handoff.position}")
    req.seen[handoff.source] = p + handoff.position   # the sender has exactly the committed output (score visits too)
    if not handoff.metadata.get("score") and handoff.metadata.get("scores") is None:
        req.model = handoff.target


__all__ = ["Algorithm", "Handoff", "RequestView", "StepResult", "after_send", "apply_handoff", "commit",
           "counter_uniform", "WIRE_VERSION"]
