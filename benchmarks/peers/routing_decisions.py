"""The routing decisions a stock-vLLM composition takes (routing_vs_vllm.py): synthetic or calibrated.

synthetic   a gate fires iff counter_uniform(seed, request id, output position, model) < rate, exactly as the
            runtime's ThresholdAlgorithm.decide in synthetic mode, so both sides take the same decisions by
            construction.
calibrated  the algorithm's real signal (R2R's router MLP / CITER's and Co-LLM's heads on the hidden state,
            R-Stitch's entropy) against thresholds calibrated at warm-up to each algorithm's target rate
            (tokenplane.route.reference.calibrate on warm-up prompts). A stock server returns no hidden states, so a
            composition would need the router beside it anyway; here the decisions are computed once, before
            measuring, by the reference router (tokenplane.route.reference.SequentialRouter, its own runners in the
            driver process, sharing no cache with either measured side) and replayed on the vLLM side: the vLLM
            composition is charged nothing for running its router (generous to it). The runtime takes its own
            decisions; the per-token models of both sides are compared request by request.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenplane.route.api import counter_uniform


@dataclass
class Decisions:
    """fires(rid, position, model): does the gate of `model` fire at this output position of request `rid`?

    One-token corrections (R2R, CITER, Co-LLM): the small model's gate fires where the large model wrote the position.
    R-Stitch: the small model's switch gate fires where the large model wrote the position (the small model's token
    there is dropped); the large model's return gate fires after it wrote the position and the small model writes
    the next one (the large model's token is kept)."""
    mode: str
    seed: int = 0
    rates: dict[str, float] = field(default_factory=dict)
    models: dict[str, list[int]] = field(default_factory=dict)   # calibrated: rid -> per-position producing model

    def fires(self, rid: str, position: int, model: int, gate: str) -> bool:
        if self.mode == "synthetic":
            return counter_uniform(self.seed, rid, position, model, stream=0) < self.rates[gate]
        ms = self.models[rid]
        if model == 0:
            return position < len(ms) and ms[position] == 1
        return position + 1 < len(ms) and ms[position + 1] == 0


# Each algorithm's published signal where the runtime's default is another: CITER's official router is an MLP on
# the small model's hidden state (its "router" signal); the runtime's default, max_prob, is the training-free
# variant. R2R's router and Co-LLM's deferral head are their algorithms' defaults already.
SIGNALS: dict[str, dict[str, Any]] = {"citer": {"signal": "router"}}


def calibrate(alg: str, dirs: list[str], rates: dict[str, float], warmup: list[list[int]], max_tokens: int,
              seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(algorithm_kwargs for the runtime: mode calibrated + the calibrated thresholds, provenance for the results)."""
    import torch

    from tokenplane.engine.sampler import SamplingParams
    from tokenplane.route.algorithms import make_algorithm
    from tokenplane.route.reference import calibrate as ref_calibrate
    t0 = time.perf_counter()
    algorithm = make_algorithm(alg, mode="calibrated", rates=dict(rates), seed=seed, **SIGNALS.get(alg, {}))
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    thresholds = ref_calibrate(algorithm, dirs, warmup, sp, dtype=torch.float32, num_blocks=512)
    kwargs = algorithm.config()
    kwargs.pop("num_models", None)
    return kwargs, {"thresholds": thresholds, "rates": dict(rates), "warmup_prompts": len(warmup),
                    "warmup_max_tokens": max_tokens, "seconds": time.perf_counter() - t0}


def reference_router(alg: str, algorithm_kwargs: dict[str, Any], dirs: list[str]) -> Any:
    """The reference router of the calibrated algorithm, its own runners (built once per algorithm)."""
    import torch

    from tokenplane.route.algorithms import make_algorithm
    from tokenplane.route.reference import SequentialRouter
    return SequentialRouter(make_algorithm(alg, **algorithm_kwargs), dirs, dtype=torch.float32, num_blocks=512)


def reference_models(router: Any, prompts: list[list[int]], rids: list[str], gen: int) -> dict[str, list[int]]:
    """The calibrated algorithm's per-token models for each request, from the reference router (greedy)."""
    from tokenplane.engine.sampler import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    return {rid: router.generate(p, sp, rid).token_models for p, rid in zip(prompts, rids)}


def decide_all(jobs: list[tuple[str, dict[str, float], list[list[int]], list[list[int]], list[str], list[int]]],
               dirs: list[str], calib_tokens: int, seed: int
               ) -> dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, list[int]]]]:
    """Per job (algorithm, rates, warm-up prompts, prompts, request ids, tokens each): the calibrated algorithm's
    runtime kwargs, its provenance, and the reference router's per-token models of every request."""
    from tokenplane.engine.sampler import SamplingParams
    out = {}
    for alg, rates, warmup, prompts, rids, gens in jobs:
        kwargs, prov = calibrate(alg, dirs, rates, warmup, calib_tokens, seed)
        t0 = time.perf_counter()
        router = reference_router(alg, kwargs, dirs)
        models = {rid: router.generate(p, SamplingParams(temperature=0.0, max_tokens=g, ignore_eos=True),
                                       rid).token_models for p, rid, g in zip(prompts, rids, gens)}
        prov.update(decide_seconds=time.perf_counter() - t0, decided_requests=len(rids),
                    large_share=sum(sum(m) for m in models.values()) / max(1, sum(map(len, models.values()))))
        out[alg] = (kwargs, prov, models)
        del router
    return out
