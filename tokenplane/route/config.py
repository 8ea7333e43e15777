"""RuntimeConfig: what a routing runtime serves and how (models, algorithm, execution-mode flags, limits, timeouts),
and the delayed_async thresholds it resolves to. Importable from tokenplane.route.runtime too."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .standard import validate_unit
from .subserver_spec import MODES

log = logging.getLogger("tokenplane.route.runtime")


@dataclass
class RuntimeConfig:
    models: list[Any]                                  # model sources: preset name | HF config dict | checkpoint dir
    algorithm: str = "r2r"
    algorithm_kwargs: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    dtype: Any = "float32"                             # torch dtype or its name
    num_blocks: int | list[int] = 512                  # per model (KV pool size in blocks)
    block_size: int = 16
    mode: str = "delayed_async"                        # stepwise_sync | model_sync | immediate_async | delayed_async
    pending_return: bool = True
    standard_serving: bool = False
    standard_unit: str = "token"                       # standard serving: one call per "token" | per "segment"
    thresholds: list[int] | str | None = None          # delayed_async: T_m list, "auto" (no fits: all 1), None = all 1
    concurrency: int = 8                               # what thresholds are validated / chosen for
    routing_probs: Any = None                          # thresholds="auto": routing model (see throughput_model)
    latency_fits: list[dict] | None = None             # thresholds="auto": LatencyFit dicts, one per model
    runner: str = "torch"                              # "torch" | "latency-model"
    seeds: list[int] | None = None                     # weight seeds per model (default 0, as the reference)
    transport: str = "ipc"                             # "ipc" | "tcp" (127.0.0.1)
    threads_per_model: int = 1
    max_num_seqs: int = 256                            # per model: requests in one step
    max_num_batched_tokens: int = 2048                 # per model: tokens computed in one step (chunked prefill)
    max_queued: int = 256                              # live requests beyond max_num_seqs before Overloaded
    enforce_eager: bool = False
    heartbeat_s: float = 0.5
    heartbeat_timeout_s: float = 15.0                  # silence of a sub-server's heartbeat THREAD before a kill
    step_timeout_s: float | None = 120.0               # one step longer than this is a hung step: kill (None: never)
    # A (re)starting sub-server is killed when its first heartbeat has not come this long after its spawn (the
    # interpreter's start and imports: its heartbeat thread starts before the model loads), or, after one, on a
    # silence of heartbeat_timeout_s. A slow load that keeps heartbeating is waited for, up to startup_limit_s.
    startup_timeout_s: float = 180.0
    startup_limit_s: float = 1800.0
    request_timeout_s: float = 600.0
    max_delay_s: float = 0.2                           # delayed_async backstop: max wait below threshold
    grant_timeout_s: float = 30.0
    auto_restart: bool = True

    def validate(self) -> None:
        single = self.algorithm.replace("-", "_").lower() == "single"
        if single and len(self.models) != 1:
            raise ValueError(f"algorithm 'single' serves exactly 1 model, got {len(self.models)}")
        if not single and len(self.models) < 2:
            raise ValueError(f"the routing runtime needs at least 2 models for {self.algorithm!r} "
                             "(one model: algorithm 'single')")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        validate_unit(self.standard_unit)
        if self.runner not in ("torch", "latency-model"):
            raise ValueError(f"runner must be 'torch' or 'latency-model', got {self.runner!r}")
        if self.transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {self.transport!r}")
        if self.seeds is not None and len(self.seeds) != len(self.models):
            raise ValueError("seeds needs one entry per model")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_queued < 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1, max_queued >= 0")
        if not 0 < self.heartbeat_s < self.heartbeat_timeout_s:
            raise ValueError(f"need 0 < heartbeat_s ({self.heartbeat_s}) < heartbeat_timeout_s "
                             f"({self.heartbeat_timeout_s})")
        if self.step_timeout_s is not None and self.step_timeout_s <= 0:
            raise ValueError("step_timeout_s must be > 0 or None")


def resolve_thresholds(cfg: RuntimeConfig) -> list[int]:
    """The delayed_async launch thresholds T_m for `cfg` (all 1 outside delayed_async or when None)."""
    num_models = len(cfg.models)
    if cfg.mode != "delayed_async" or cfg.thresholds is None:
        return [1] * num_models
    if cfg.thresholds == "auto":
        from tokenplane.engine.latency_runner import LatencyFit

        from .throughput_model import choose_thresholds
        fits = cfg.latency_fits
        if fits is None and cfg.runner == "latency-model":
            fits = [m.get("latency") for m in cfg.models]
        if cfg.routing_probs is None or fits is None or not all(isinstance(f, dict) for f in fits):
            # Without a routing model and latency fits there is nothing to choose from; all 1 (launch whenever
            # anything is ready) is always feasible and never slower than immediate_async.
            log.warning("thresholds='auto' without routing_probs and one LatencyFit dict per model (latency_fits, "
                        "or latency-model sources with a 'latency' dict): using thresholds all 1")
            return [1] * num_models
        fns = [LatencyFit.from_dict(f).at_context(1024) for f in fits]
        return choose_thresholds(cfg.concurrency, cfg.routing_probs, fns)
    from .batching import BatchPolicy
    ts = [int(t) for t in cfg.thresholds]
    if len(ts) != num_models:
        raise ValueError(f"thresholds needs one entry per model, got {ts}")
    BatchPolicy(ts, cfg.concurrency)   # raises ValueError when infeasible
    return ts


__all__ = ["RuntimeConfig", "resolve_thresholds"]
