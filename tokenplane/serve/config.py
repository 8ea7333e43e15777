"""`tokenplane serve` configuration: the models and routing (a JSON file) plus the serving limits (flags).

Config file (JSON; every key optional; the default serves SmolLM2-135M-Instruct alone, without routing):
    {"models": ["tiny-small", "tiny-large"],       registry model names, presets, HF config dicts, checkpoint dirs
     "devices": ["cpu", "cpu"], "dtype": "float32",
     "algorithm": "r_stitch", "parameters": {"mode": "calibrated", "rates": {"switch": 0.1, "return": 0.5}},
     "calibration": {"prompts": ["..."], "max_tokens": 16},
     "served_model_name": "tokenplane-router", "tokenizer": "qwen3", "num_blocks": 1024, "block_size": 16,
     "seed": 0, "default_max_tokens": 16,
     "runtime": {"mode": "delayed_async", "thresholds": "auto", ...}}   extra RuntimeConfig fields (process backend)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ServeConfig:
    models: list[Any] = field(default_factory=lambda: ["smollm2-135m-instruct"])
    devices: list[str] | None = None
    dtype: str = "float32"
    algorithm: str = "single"        # one model: no routing; two or more: r2r, citer, co_llm, r_stitch, ensemble
    parameters: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    served_model_name: str = "smollm2-135m-instruct"
    tokenizer: str = "auto"          # "auto": the first model's own tokenizer files (qwen3 for random presets)
    num_blocks: int = 1024
    block_size: int = 16
    seed: int = 0
    default_max_tokens: int = 16
    runtime: dict[str, Any] = field(default_factory=dict)   # extra RuntimeConfig fields (mode, thresholds, ...)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServeConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known: {sorted(names)}")
        cfg = cls(**d)
        if not cfg.models:
            raise ValueError("config needs at least one model")
        if cfg.devices is not None and len(cfg.devices) != len(cfg.models):
            raise ValueError(f"{len(cfg.models)} models but {len(cfg.devices)} devices")
        return cfg

    @classmethod
    def load(cls, path: str | Path | None) -> ServeConfig:
        return cls() if path is None else cls.from_dict(json.loads(Path(path).read_text()))

    def torch_dtype(self) -> Any:
        import torch
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        return dt


@dataclass(frozen=True)
class Limits:
    """Serving limits, set from `tokenplane serve` flags. Sizes are checked before any work is done."""
    max_body_bytes: int = 64 << 20          # whole request body, chunked uploads included
    max_prompt_chars: int = 16 << 20        # characters of a prompt or of all chat messages together
    max_queued: int = 64                    # requests waiting beyond the running ones (in-process backend)
    session_ttl_s: float = 3600.0
    max_sessions: int = 10_000
    session_bytes: int = 1 << 30            # total session state (token arrays + text), LRU-evicted beyond it
    max_session_chars: int = 16 << 20       # one session's text
    verify_rate: float = 0.0
    api_key: str | None = None
    conversation_sessions: bool = True      # tokenize resent prompts by repairing the conversation's session

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_chars", "max_sessions", "session_bytes", "max_session_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_queued < 0 or self.session_ttl_s <= 0 or not 0.0 <= self.verify_rate <= 1.0:
            raise ValueError("max_queued >= 0, session_ttl_s > 0 and 0 <= verify_rate <= 1 are required")


__all__ = ["Limits", "ServeConfig"]
