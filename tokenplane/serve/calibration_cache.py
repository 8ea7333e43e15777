"""Calibrated routing thresholds cached on disk, keyed by everything that decides them.

Calibration runs every warm-up prompt through every model (tens of seconds on a CPU). Its result is a pure function
of the model weights, the algorithm and its target rates, the warm-up prompts, the sampling settings and the dtype,
so it is computed once per distinct key: model files enter the key by their sha256 (checkpoint directories) or by
their config and seed (random-weight presets, drawn deterministically by the loader), plus the torch version.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("tokenplane.serve")


def cache_dir() -> Path:
    root = os.environ.get("TOKENPLANE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenplane")
    return Path(root) / "calibration"


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_identity(source: Any, seed: int) -> Any:
    """What fixes a model's weights: its files' hashes, or (config, seed) for random weights."""
    from tokenplane.engine.loader import resolve_config
    cfg, ckpt = resolve_config(source)
    if ckpt is None:
        return {"config": json.loads(json.dumps(cfg.__dict__, default=str)), "seed": int(seed)}
    files = sorted(p for p in Path(ckpt).iterdir() if p.is_file() and p.suffix in (".json", ".safetensors"))
    return {"files": {p.name: _file_digest(p) for p in files}}


def calibration_key(models: list[Any], seed: int, dtype: str, algorithm: str, parameters: dict[str, Any],
                    prompts: list[str], max_tokens: int) -> str:
    import torch
    doc = {"models": [model_identity(m, seed) for m in models], "dtype": dtype, "algorithm": algorithm,
           "parameters": parameters, "prompts": prompts, "max_tokens": max_tokens, "torch": torch.__version__,
           "format": 1}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def load(key: str) -> dict[str, float] | None:
    path = cache_dir() / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        thresholds = {str(k): float(v) for k, v in data["thresholds"].items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring unreadable calibration cache %s (%s)", path, exc)
        return None
    return thresholds


def store(key: str, thresholds: dict[str, float]) -> None:
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"thresholds": thresholds}))
        tmp.replace(directory / f"{key}.json")   # atomic: a concurrent start never reads half a file
    except OSError as exc:
        log.warning("could not cache calibration in %s: %s", directory, exc)


__all__ = ["calibration_key", "load", "store"]
