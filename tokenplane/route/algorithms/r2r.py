"""R2R (thu-nics/R2R): a neural router on the small model's step decides whether the large model must regenerate
the token. Commit pattern: small token dropped, large model generates exactly 1 token, accepted, back to small.

Router (official `HiddenStatesTokenLMHeadLogitsClassifier`): inputs are the small model's final-norm hidden state,
the embedding of its sampled token (a frozen copy of its input embedding) and its top-100 logit values (sorted,
no softmax). logits_projection Linear(100->H); concat [hidden, token_emb, logits_proj] (3H) -> Linear(3H->D) ->
input_projection Linear(D->D) -> `num_blocks` pre-LN residual MLP blocks (D -> 4D -> D, GELU) -> LayerNorm ->
Linear(D->1) -> sigmoid = divergence probability; route to the large model when it is >= threshold (0.5 = the
official server's default). Official sizes D=1024, 6 blocks; smaller dims are allowed for random-weight runs.

Weights: `router_weights` = a safetensors file with this module's parameter names (`token_embedding.weight`
optional: otherwise the small model's `embed_tokens.weight` is taken through `attach`). Without a file the router is
random-initialized from `seed` (deterministic), which is what calibrated mode is for.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...engine import cpu_small_gemm
from ..api import StepResult
from ..top_values import top_values
from .base import Gate, OneTokenCorrection, load_weights, seeded

# Without the small model's embedding (no attach, no checkpoint), tokens hash into a fixed random table: the router
# still sees the sampled token, but this only makes sense for random-weight runs.
FALLBACK_EMBED_ROWS = 4096
# Router batches up to this many rows stream the weights (a step at concurrency 16 holds ~9 small-model rows; the
# router has no oneDNN packed copy to hand larger batches to); larger ones take F.linear.
STREAM_MAX_ROWS = 32
# A batched router output this close to the threshold is recomputed for its row alone (see R2R.divergence).
BATCH_MARGIN = 1e-4


class StreamedLinear(nn.Linear):
    """nn.Linear (same parameters, same seeded init) that streams a panel copy of its weight for decode-sized fp32
    inputs (1 thread: engine/cpu_small_gemm.py) once `stream()` made it. At the official size the router
    reads ~200 MB of weights per step; MKL's F.linear streamed them at ~6 GB/s here (~32 ms per step at 2-3 rows),
    the panel kernel at memory speed (its error against float64 is below oneDNN's and MKL's; see that module)."""

    panels: torch.Tensor | None = None

    def stream(self) -> None:
        self.panels = cpu_small_gemm.pack(self.weight) if cpu_small_gemm.available(self.weight) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and cpu_small_gemm.applies(x, STREAM_MAX_ROWS):
            return cpu_small_gemm.linear(x, self.panels, self.out_features, self.bias)
        return super().forward(x)


class ResidualBlock(nn.Module):
    def __init__(self, dim: int, expansion: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = StreamedLinear(dim, dim * expansion)
        self.fc2 = StreamedLinear(dim * expansion, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))   # dropout is identity at inference


class R2RRouter(nn.Module):
    def __init__(self, hidden_size: int, *, logits_size: int = 100, dim: int = 1024, num_blocks: int = 6,
                 expansion: int = 4):
        super().__init__()
        self.logits_size = logits_size
        self.logits_projection = StreamedLinear(logits_size, hidden_size)
        self.combined_projection = StreamedLinear(3 * hidden_size, dim)
        self.input_projection = StreamedLinear(dim, dim)
        self.blocks = nn.ModuleList(ResidualBlock(dim, expansion) for _ in range(num_blocks))
        self.final_norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, 1)

    def forward(self, hidden: torch.Tensor, token_emb: torch.Tensor, top_logits: torch.Tensor) -> torch.Tensor:
        x = torch.cat([hidden, token_emb, self.logits_projection(top_logits)], dim=-1)
        x = self.input_projection(self.combined_projection(x))
        for block in self.blocks:
            x = block(x)
        return torch.sigmoid(self.output(self.final_norm(x))).squeeze(-1)


class R2R(OneTokenCorrection):
    name = "r2r"
    default_thresholds = {"switch": 0.5}
    gates = (Gate("switch", 0, "above"),)

    def __init__(self, *, router_weights: str | None = None, router_dim: int = 1024, router_blocks: int = 6,
                 logits_size: int = 100, **kwargs: Any):
        super().__init__(**kwargs)
        self.router_weights = router_weights
        self.router_dim = int(router_dim)
        self.router_blocks = int(router_blocks)
        self.logits_size = int(logits_size)
        self.router: R2RRouter | None = None
        self.embedding: torch.Tensor | None = None
        self._cast: dict[tuple, tuple[R2RRouter, torch.Tensor]] = {}
        self._step: dict[int, float] = {}            # id(StepResult) -> batched divergence, this step's rows only
        self._step_rows: list[StepResult] = []       # keeps those ids alive (and unique) until the next step

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg.update(router_weights=self.router_weights, router_dim=self.router_dim, router_blocks=self.router_blocks,
                   logits_size=self.logits_size)
        return cfg

    def attach(self, model: int, module: Any) -> None:
        if model != 0 or module is None or self.embedding is not None:
            return
        for name, p in module.named_parameters():
            if name.endswith("embed_tokens.weight"):
                self.embedding = p.detach()
                return

    def _build(self, hidden_size: int) -> None:
        with seeded(self.seed):
            self.router = R2RRouter(hidden_size, logits_size=self.logits_size, dim=self.router_dim,
                                    num_blocks=self.router_blocks).eval()
            if self.router_weights is not None:
                load_weights(self.router, self.router_weights)
                from safetensors import safe_open
                with safe_open(str(self.router_weights), framework="pt") as f:
                    if "token_embedding.weight" in f.keys():
                        self.embedding = f.get_tensor("token_embedding.weight")
            if self.embedding is None:
                self.embedding = torch.randn(FALLBACK_EMBED_ROWS, hidden_size) * 0.02
        if self.embedding.shape[-1] != hidden_size:
            raise ValueError(f"r2r: token embedding has width {self.embedding.shape[-1]}, hidden size is {hidden_size}")

    def _router_for(self, hidden: torch.Tensor) -> tuple[R2RRouter, torch.Tensor]:
        if self.router is None:
            self._build(int(hidden.shape[-1]))
        assert self.router is not None and self.embedding is not None   # _build sets both
        dtype, device = hidden.dtype, hidden.device
        if (dtype, device) not in self._cast:   # the router runs where the hidden state lives, in its precision
            router = copy.deepcopy(self.router).to(device=device, dtype=dtype)   # not a fresh module: init would
            for m in router.modules():                                           # consume the global RNG
                if isinstance(m, StreamedLinear):
                    m.stream()
            self._cast[(dtype, device)] = (router, self.embedding.to(device=device, dtype=dtype))
        return self._cast[(dtype, device)]

    def uses_logits(self, model: int) -> bool:
        """The router reads the small model's top logits only (`top_logits`); synthetic decisions read nothing."""
        return False

    def top_logits(self, model: int) -> int:
        return self.logits_size if model == 0 and self.mode != "synthetic" else 0

    def _top(self, results: list[StepResult]) -> torch.Tensor:
        """Each row's k = min(logits_size, V) largest logits, descending: the sub-server's (StepResult.top_logits,
        from the greedy screen) where every row has them, else from the logits (the same values)."""
        tops = [r.top_logits for r in results]
        if all(t is not None for t in tops):     # the sub-server asked for top_logits(0) = logits_size of them
            return torch.stack(tops)  # type: ignore[arg-type]
        logits = [r.logits for r in results]
        return top_values(logits, min(self.logits_size, logits[0].shape[-1]))

    def _run(self, hidden: torch.Tensor, tokens: list[int], results: list[StepResult]) -> torch.Tensor:
        """Router outputs for rows hidden [B, H], sampled tokens [B], the rows' results (their top logits)."""
        router, embedding = self._router_for(hidden)
        rows = tokens if embedding.shape[0] != FALLBACK_EMBED_ROWS else [t % FALLBACK_EMBED_ROWS for t in tokens]
        # The k largest values, then the router's dtype: a monotonic cast keeps which values are largest.
        top = self._top(results).to(device=hidden.device, dtype=hidden.dtype)
        k = top.shape[-1]
        if k < self.logits_size:   # tiny vocabularies: pad with the smallest value so the shape matches
            top = torch.cat([top, top[:, -1:].expand(-1, self.logits_size - k)], dim=-1)
        with torch.no_grad():
            return router(hidden, embedding[torch.tensor(rows, device=hidden.device)], top)

    def prepare_step(self, results: list[StepResult]) -> None:
        """One router call for every small-model row of the step. The router is ~50M parameters at the official
        size: one row at a time it reads all of them per row (about 15 ms per row on one CPU core), a batch reads
        them once."""
        self._step, self._step_rows = {}, []
        if self.mode == "synthetic":   # decisions are counter draws: no router runs
            return
        rows = [r for r in results if r.model == 0 and r.hidden is not None]
        if len(rows) < 2 or len({(r.hidden.dtype, r.hidden.device) for r in rows}) != 1:  # type: ignore[union-attr]
            return
        out = self._run(torch.stack([r.hidden for r in rows]), [int(r.token) for r in rows], rows)  # type: ignore[misc]
        self._step = {id(r): float(v) for r, v in zip(rows, out.tolist())}
        self._step_rows = rows

    def divergence(self, result: StepResult) -> float:
        """The router's divergence probability for this small-model step, as the router gives it for this row alone.

        A batched value (prepare_step) differs from the one-row value only by summation order in the GEMMs, far below
        BATCH_MARGIN (tests/test_r2r_batched.py measures the gap); a batched value within that margin of the
        threshold is recomputed alone, so every decision is the one-row decision."""
        if result.hidden is None:
            raise ValueError("r2r needs the small model's hidden state in StepResult.hidden")
        v = self._step.get(id(result))
        if v is not None and abs(v - self.thresholds["switch"]) > BATCH_MARGIN:
            return v
        return float(self._run(result.hidden[None], [int(result.token)], [result])[0])

    def signal(self, gate: Gate, result: StepResult) -> float:
        return self.divergence(result)


def save_router(router: R2RRouter, path: str | Path, embedding: torch.Tensor | None = None) -> None:
    """Write router weights (and optionally the frozen token embedding) in the format `router_weights` loads."""
    from safetensors.torch import save_file
    tensors = {k: v.contiguous() for k, v in router.state_dict().items()}
    if embedding is not None:
        tensors["token_embedding.weight"] = embedding.contiguous()
    save_file(tensors, str(path))
