"""What a sub-server process is started with (SubServerSpec, the spawn argument) and how its parts are built from it.

Its own module because both sides read it: the front end (runtime.py, config.py) builds specs and checks modes
without importing the sub-server's event loop, and the sub-server process builds its runner and algorithm from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SYNC_MODES = ("stepwise_sync", "model_sync")
MODES = ("stepwise_sync", "model_sync", "immediate_async", "delayed_async")

__all__ = ["MODES", "SYNC_MODES", "SubServerSpec", "build_algorithm", "build_runner"]


@dataclass
class SubServerSpec:
    """Everything a sub-server process is started with (the spawn argument; never on the wire). Built by the
    runtime's supervisor from RuntimeConfig; defaults are RuntimeConfig's."""
    model: int
    num_models: int
    source: Any                         # preset name | HF config dict | checkpoint dir | latency-model dict
    frontend: str                       # the front end's inbox address
    generation: int                     # restarts of this model so far + 1 (names its sockets)
    transport: str = "ipc"
    ipc_dir: str | None = None
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    num_blocks: int = 512
    block_size: int = 16
    runner: str = "torch"
    algorithm: str = "r2r"
    algorithm_kwargs: dict[str, Any] = field(default_factory=dict)
    mode: str = "delayed_async"
    pending_return: bool = True
    standard_serving: bool = False
    standard_unit: str = "token"
    thresholds: list[int] = field(default_factory=list)
    concurrency: int = 8
    max_delay_s: float = 0.2
    grant_timeout_s: float = 30.0
    heartbeat_s: float = 0.5
    threads: int = 1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enforce_eager: bool = False


def build_runner(spec: SubServerSpec) -> tuple[Any, Any]:
    """(runner, nn.Module or None) for this model, per spec.runner."""
    import torch
    dtype = getattr(torch, spec.dtype)
    if spec.runner == "latency-model":
        from tokenplane.engine.latency_runner import LatencyFit, LatencyModelRunner, preset
        kw = dict(spec.source) if isinstance(spec.source, dict) else {}
        lat = kw.pop("latency", None)
        if isinstance(lat, str):   # "preset:index", e.g. "seed-r2r:1"
            name, _, idx = lat.partition(":")
            lat = preset(name)[int(idx or spec.model)]
        elif isinstance(lat, dict):
            lat = LatencyFit.from_dict(lat)
        else:
            raise ValueError("latency-model runner: each model source must be a dict with a 'latency' entry "
                             "(LatencyFit dict or 'preset:index')")
        kw.setdefault("seed", spec.model)
        runner: Any = LatencyModelRunner(lat, num_blocks=spec.num_blocks, block_size=spec.block_size, dtype=dtype,
                                    **kw)
        return runner, None
    if spec.runner != "torch":
        raise ValueError(f"runner must be 'torch' or 'latency-model', got {spec.runner!r}")
    from tokenplane.engine.loader import load_model
    from tokenplane.engine.model_runner import ModelRunner
    cfg, model = load_model(spec.source, device=spec.device, dtype=dtype, seed=spec.seed)
    runner = ModelRunner(model, cfg, num_blocks=spec.num_blocks, block_size=spec.block_size,
                         device=spec.device, dtype=dtype, enforce_eager=spec.enforce_eager,
                         max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens)
    # Compile the CPU kernels before serving (a model's first catch-up would otherwise stall it for seconds); greedy
    # too: the algorithm, which can change at run time, decides whether steps take the greedy screen.
    runner.warm_kernels(greedy=True)
    warm_signal_kernels()
    return runner, model


def warm_signal_kernels() -> None:
    """Compile (or load from numba's cache) the routers' own CPU kernels that read a step's logits, so the first
    request of a logit-reading algorithm (R-Stitch's entropy) does not pay it inside a step: measured on this
    machine, 1.5 s to compile on a fresh install, 0.4 s to load from the cache in each new process."""
    import torch

    from tokenplane.route.entropy import entropy

    entropy(torch.zeros(4))


def build_algorithm(spec: SubServerSpec):
    from tokenplane.route.algorithms import make_algorithm
    return make_algorithm(spec.algorithm, **spec.algorithm_kwargs)
