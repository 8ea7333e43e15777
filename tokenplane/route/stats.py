"""Per-request routing statistics, recorded from the same events in the reference and in the runtime.

routing_rate = switches away from the primary / committed tokens (R2R's "routing probability"); token_share[m] =
committed tokens produced by model m / committed tokens; runs = maximal stretches of consecutive committed tokens from
one model; prefill = tokens a model had to compute to catch up on each visit (the suffix it was sent, prompt
included on a first visit, plus its own last kept token if that token's KV was never computed); handoff_tokens = the
suffix lengths sent; dropped = sampled tokens discarded for regeneration; ensembled = positions whose token came from
the ME mix; cached_prompt = prompt tokens the home model (0) took from its KV prefix cache at the request's first
admission (None until then; reported as `cached_prompt_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .api import Handoff


@dataclass
class RouteStats:
    num_models: int
    token_models: list[int] = field(default_factory=list)       # committed token -> producing model
    switches: list[tuple[int, int]] = field(default_factory=list)   # (source, target) per switching handoff
    prefill: list[tuple[int, int]] = field(default_factory=list)    # (model, tokens computed to catch up) per visit
    sent: list[tuple[int, int]] = field(default_factory=list)       # (target, suffix length) per handoff
    dropped: int = 0
    ensembled: int = 0
    score_visits: int = 0
    cached_prompt: int | None = None

    # -- events ---------------------------------------------------------------------------------------------
    def on_commit(self, model: int) -> None:
        self.token_models.append(int(model))

    def on_handoff(self, handoff: Handoff) -> None:
        """A handoff left `handoff.source` (switch or score visit); call before committing its kept token."""
        if not handoff.keep_last:
            self.dropped += 1
        if handoff.metadata.get("score"):
            self.score_visits += 1
        else:
            self.switches.append((handoff.source, handoff.target))
        self.sent.append((handoff.target, len(handoff.tokens)))

    def on_catch_up(self, model: int, num_tokens: int) -> None:
        """A model resumed a request after a handoff with `num_tokens` uncomputed tokens (its catch-up prefill:
        the suffix it was sent, plus its own last kept token when that token's KV was never computed)."""
        self.prefill.append((int(model), int(num_tokens)))

    def on_ensemble(self) -> None:
        self.ensembled += 1

    # -- wire (msgpack-able; runtimes move per-request stats between processes) ----------------------------------
    def to_wire(self) -> dict[str, Any]:
        return {"num_models": self.num_models, "token_models": list(self.token_models),
                "switches": [list(x) for x in self.switches], "prefill": [list(x) for x in self.prefill],
                "sent": [list(x) for x in self.sent], "dropped": self.dropped, "ensembled": self.ensembled,
                "score_visits": self.score_visits, "cached_prompt": self.cached_prompt}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RouteStats:
        pairs = lambda key: [(int(a), int(b)) for a, b in d.get(key, [])]   # noqa: E731
        return cls(int(d["num_models"]), token_models=[int(m) for m in d.get("token_models", [])],
                   switches=pairs("switches"), prefill=pairs("prefill"), sent=pairs("sent"),
                   dropped=int(d.get("dropped", 0)), ensembled=int(d.get("ensembled", 0)),
                   score_visits=int(d.get("score_visits", 0)), cached_prompt=d.get("cached_prompt"))

    # -- summaries ------------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_models)

    def runs(self) -> list[tuple[int, int]]:
        """(model, length) of each maximal run of consecutive committed tokens from one model."""
        out: list[tuple[int, int]] = []
        for m in self.token_models:
            if out and out[-1][0] == m:
                out[-1] = (m, out[-1][1] + 1)
            else:
                out.append((m, 1))
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON/msgpack-able summary (the HTTP `routing` field)."""
        n = self.num_tokens
        per_model = [self.token_models.count(m) for m in range(self.num_models)]
        runs = self.runs()
        run_mean = []
        for m in range(self.num_models):
            lengths = [length for model, length in runs if model == m]
            run_mean.append(sum(lengths) / len(lengths) if lengths else 0.0)
        prefill = [[k for model, k in self.prefill if model == m] for m in range(self.num_models)]
        sent = [[k for model, k in self.sent if model == m] for m in range(self.num_models)]
        away = sum(1 for s, _ in self.switches if s == 0)
        return {
            "num_tokens": n,
            "tokens_per_model": per_model,
            "token_share": [c / n if n else 0.0 for c in per_model],
            "routing_rate": away / n if n else 0.0,
            "num_handoffs": len(self.switches),
            "mean_run_length": run_mean,
            "num_runs": [sum(1 for model, _ in runs if model == m) for m in range(self.num_models)],
            "prefill_tokens": prefill,
            "handoff_tokens": sent,
            "dropped_tokens": self.dropped,
            "ensembled_positions": self.ensembled,
            "score_visits": self.score_visits,
            "cached_prompt_tokens": self.cached_prompt or 0,
        }
