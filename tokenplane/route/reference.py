"""The sequential routing reference: one request at a time, one process, every model keeps its own Sequence and KV.

This is the definition of what a routed generation produces. The multi-process runtime must equal it token for token
under greedy decoding (use float64 models in equivalence tests so ULP-level differences between batched and
unbatched GEMMs cannot flip an argmax or a threshold).

Per request, each model m has its own RequestView (as each runtime process does) and its own Sequence whose tokens
are exactly the prefix of prompt + output that m has been given. On a switch, the target receives the handoff's
unseen suffix, appends it (num_tokens - num_computed_tokens = the catch-up prefill) and decodes the next position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator
from typing import Sequence as Seq

import torch

from .api import Algorithm, Handoff, RequestView, StepResult, after_send, apply_handoff, commit
from .params import capped_max_tokens, eos_token_ids, request_params, stop_token_ids
from .stats import RouteStats


@dataclass
class TokenEvent:
    """A committed output token (what a streaming client sees); its logprob and top alternatives when asked for,
    under the distribution of the model that committed it."""
    token: int
    model: int
    position: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class RouteOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    token_models: list[int]
    finish_reason: str          # "stop" | "length"
    stats: RouteStats


def build_runner(source: Any, *, device: str = "cpu", dtype: torch.dtype = torch.float32, num_blocks: int = 256,
                 block_size: int = 16, seed: int = 0) -> Any:
    """A ModelRunner for a model source (preset name, HF config dict, checkpoint dir): random weights from `seed`."""
    from tokenplane.engine.loader import load_model
    from tokenplane.engine.model_runner import ModelRunner
    cfg, model = load_model(source, device=device, dtype=dtype, seed=seed)
    return ModelRunner(model, cfg, num_blocks=num_blocks, block_size=block_size, device=device, dtype=dtype)


def as_runner(obj: Any, **build_kwargs: Any) -> Any:
    """Accept a ModelRunner, an LLMEngine (its runner) or a model source."""
    if hasattr(obj, "run") and hasattr(obj, "block_manager"):
        return obj
    for attr in ("model_runner", "runner"):
        inner = getattr(obj, attr, None)
        if inner is not None and hasattr(inner, "run"):
            return inner
    return build_runner(obj, **build_kwargs)


def stop_ids(params: Any, runner: Any) -> tuple[int, ...]:
    """The stop rule (params.stop_token_ids) applied to a runner's model config."""
    return stop_token_ids(params, eos_token_ids(getattr(runner, "cfg", None)))


def max_model_len(runner: Any) -> int | None:
    return getattr(getattr(runner, "cfg", None), "max_position_embeddings", None)


class SequentialRouter:
    """Drives one algorithm over N models, one request at a time. `stream()` yields TokenEvents, then RouteOutput."""

    def __init__(self, algorithm: Algorithm, models: Seq[Any], **build_kwargs: Any):
        if len(models) != algorithm.num_models:
            raise ValueError(f"{algorithm.name} drives {algorithm.num_models} models, got {len(models)}")
        self.algorithm = algorithm
        self.runners = [as_runner(m, **build_kwargs) for m in models]
        for i, r in enumerate(self.runners):
            algorithm.attach(i, getattr(r, "model", None))
        lens = [n for n in (max_model_len(r) for r in self.runners) if n]
        self.max_model_len = min(lens) if lens else None

    # -- one model step -----------------------------------------------------------------------------------------
    def _run(self, m: int, seq: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        bm = self.runners[m].block_manager
        if not seq.block_table:
            if not bm.can_allocate(seq):
                raise RuntimeError(f"model {m}: KV cache too small for {seq.num_tokens} tokens")
            bm.allocate(seq)
        else:
            if not bm.can_append(seq):
                raise RuntimeError(f"model {m}: KV cache too small for {seq.num_tokens} tokens")
            bm.append_slots(seq)
        out = self.runners[m].run([seq])
        hidden = out.hidden[0] if getattr(out, "hidden", None) is not None else None
        return out.logits[0], hidden

    def _step(self, m: int, seq: Any, rid: str, position: int, params: Any,
              view: RequestView | None = None) -> StepResult:
        from tokenplane.engine.sampler import sample
        logits, hidden = self._run(m, seq)
        history = (view.prompt_ids, view.output_ids, view.stop_token_ids) if view is not None else None
        token = sample(logits[None], [params], [position], [history])[0]
        return StepResult(rid, m, position, int(token), logits, hidden)

    def _deliver(self, h: Handoff, views: dict[int, RequestView], seqs: dict[int, Any], stats: RouteStats) -> None:
        """The target model's side of a handoff: receive, update its view, extend its own sequence."""
        from tokenplane.engine.sequence import Sequence
        t = h.target
        if t not in views:
            views[t] = RequestView.from_handoff(h, self.algorithm.num_models)
        tokens = self.algorithm.receive(views[t], h)
        apply_handoff(views[t], h, tokens)
        if t not in seqs:
            seqs[t] = Sequence(f"{h.request_id}#{t}", [])
        seqs[t].token_ids.extend(int(x) for x in tokens)
        self._check(t, views[t], seqs[t])
        stats.on_catch_up(t, seqs[t].num_tokens - seqs[t].num_computed_tokens)

    @staticmethod
    def _check(m: int, view: RequestView, seq: Any) -> None:
        # The reference's own invariant: a model's sequence is exactly what its view says it has been given.
        full = view.prompt_ids + view.output_ids
        if seq.token_ids != full[:view.seen[m]]:
            raise RuntimeError(f"request {view.request_id}: model {m} sequence diverged from its view")

    # -- one request ----------------------------------------------------------------------------------------------
    def stream(self, prompt_ids: Seq[int], params: Any, request_id: str) -> Iterator[TokenEvent | RouteOutput]:
        from tokenplane.engine.sequence import Sequence
        alg, n = self.algorithm, self.algorithm.num_models
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        params = request_params(params, request_id)
        max_tokens = capped_max_tokens(len(prompt), params.max_tokens, self.max_model_len)
        view0 = RequestView.new(request_id, prompt, n, max_tokens=max_tokens,
                                stop_token_ids=stop_ids(params, self.runners[0]))
        view0.state = alg.init_state(view0)
        view0.seen[0] = len(prompt)
        views: dict[int, RequestView] = {0: view0}
        seqs: dict[int, Any] = {0: Sequence(f"{request_id}#0", prompt)}
        stats = RouteStats(n)
        m = 0
        finish = None
        try:
            while finish is None:
                view, seq = views[m], seqs[m]
                p = view.num_output
                result = self._step(m, seq, request_id, p, params, view)
                if stats.cached_prompt is None:   # the first step: model 0 just allocated the prompt
                    stats.cached_prompt = seqs[0].num_cached_tokens
                peers = alg.ensemble_peers(result, view)
                if peers:
                    token = self._ensemble(result, peers, views, seqs, stats, params)
                elif (target := alg.route(result, view)) == m:
                    token = result.token
                else:
                    if not 0 <= target < n:
                        raise ValueError(f"{alg.name}.route returned model {target}; there are {n} models")
                    h = alg.send(view, result, target)
                    stats.on_handoff(h)
                    after_send(view, result, h)
                    if h.keep_last:
                        seq.token_ids.append(result.token)
                        stats.on_commit(m)
                        yield self._event(result, result.token, params)
                        finish = self._finish(view, result.token, p)
                    if finish is None:
                        self._deliver(h, views, seqs, stats)
                        m = target
                    continue
                commit(view, m, token)
                seq.token_ids.append(token)
                stats.on_commit(m)
                yield self._event(result, token, params)
                finish = self._finish(view, token, p)
            final = views[m]
            yield RouteOutput(request_id, prompt, list(final.output_ids), list(stats.token_models), finish, stats)
        finally:
            for k, s in seqs.items():
                if s.block_table:
                    self.runners[k].block_manager.free(s)

    @staticmethod
    def _event(result: StepResult, token: int, params: Any) -> TokenEvent:
        """The committed token, with its logprob under the committing model's logits when asked for (an ensemble
        position reports the primary model's)."""
        k = getattr(params, "logprobs", None)
        if k is None:
            return TokenEvent(token, result.model, result.position)
        from tokenplane.engine.sampler import token_logprobs
        lp, top = token_logprobs(result.logits, token, k)
        return TokenEvent(token, result.model, result.position, lp, top)

    @staticmethod
    def _finish(view: RequestView, token: int, position: int) -> str | None:
        if token in view.stop_token_ids:
            return "stop"
        if position + 1 >= view.max_tokens:
            return "length"
        return None

    def _ensemble(self, result: StepResult, peers: list[int], views: dict[int, RequestView], seqs: dict[int, Any],
                  stats: RouteStats, params: Any) -> int:
        """Score visits: each peer catches up, scores the position, answers; the primary combines."""
        alg, m, p = self.algorithm, result.model, result.position
        scores: dict[int, dict[str, Any]] = {}
        for q in peers:
            h = alg.send(views[m], result, q)
            stats.on_handoff(h)
            after_send(views[m], result, h)
            self._deliver(h, views, seqs, stats)
            rq = self._step(q, seqs[q], result.request_id, p, params, views[q])
            reply = alg.score_reply(views[q], rq, m)
            apply_handoff(views[m], reply, alg.receive(views[m], reply))
            scores[q] = reply.metadata["scores"]
        stats.on_ensemble()
        return alg.combine(views[m], result, scores)

    def generate(self, prompt_ids: Seq[int], params: Any, request_id: str) -> RouteOutput:
        for event in self.stream(prompt_ids, params, request_id):
            if isinstance(event, RouteOutput):
                return event
        raise RuntimeError("routing stream ended without an output")


def run_sequential(algorithm: Algorithm, models: Seq[Any], prompts: Seq[Seq[int]], params: Any,
                   *, request_ids: Seq[str] | None = None, **build_kwargs: Any) -> list[RouteOutput]:
    """Route each prompt alone, in order. `models`: ModelRunners, LLMEngines or model sources (built with
    `build_runner(**build_kwargs)`: device, dtype, num_blocks, block_size, seed). `params`: one SamplingParams or one
    per prompt. Request ids default to "req-<i>" (synthetic decisions are keyed on them)."""
    router = SequentialRouter(algorithm, models, **build_kwargs)
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(plist) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
    rids = list(request_ids) if request_ids is not None else [f"req-{i}" for i in range(len(prompts))]
    return [router.generate(p, sp, rid) for p, sp, rid in zip(prompts, plist, rids)]


def warmup_signals(algorithm: Any, models: Seq[Any], prompts: Seq[Seq[int]], params: Any,
                   **build_kwargs: Any) -> dict[str, list[float]]:
    """Each calibrated gate's signal over its model decoding the warm-up prompts alone (no routing)."""
    from tokenplane.engine.sequence import Sequence
    router = SequentialRouter(algorithm, models, **build_kwargs) if not isinstance(models, SequentialRouter) \
        else models
    out: dict[str, list[float]] = {}
    for gate in algorithm.calibration_gates():
        values = out.setdefault(gate.name, [])
        for i, prompt in enumerate(prompts):
            rid = f"warmup-{i}"
            seq = Sequence(f"{rid}#{gate.model}", [int(t) for t in prompt])
            sp = request_params(params, rid)
            try:
                for pos in range(sp.max_tokens):
                    r = router._step(gate.model, seq, rid, pos, sp)
                    values.append(algorithm.signal(gate, r))
                    seq.token_ids.append(r.token)
            finally:
                if seq.block_table:
                    router.runners[gate.model].block_manager.free(seq)
    return out


def calibrate(algorithm: Any, models: Seq[Any], prompts: Seq[Seq[int]], params: Any,
              **build_kwargs: Any) -> dict[str, float]:
    """Calibrated mode: set each threshold so its gate fires at the target rate on the warm-up prompts.
    Returns the thresholds; pass `algorithm.config()` to other processes so they route identically."""
    if not algorithm.calibration_gates():
        return dict(getattr(algorithm, "thresholds", {}))
    return algorithm.calibrate(warmup_signals(algorithm, models, prompts, params, **build_kwargs))


__all__ = ["RouteOutput", "SequentialRouter", "TokenEvent", "build_runner", "calibrate", "run_sequential",
           "warmup_signals"]
