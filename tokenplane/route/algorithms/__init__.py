"""The five routing algorithms, each in signal / calibrated / synthetic mode, and `single` (one model, no routing).
`make_algorithm(name, **kwargs)`."""

from __future__ import annotations

import importlib
from typing import Any

from ..api import Algorithm

# name -> (module, class); imported on use so R2R's router code is not loaded by an ensemble run.
ALGORITHMS: dict[str, tuple[str, str]] = {
    "r2r": ("tokenplane.route.algorithms.r2r", "R2R"),
    "citer": ("tokenplane.route.algorithms.citer", "CITER"),
    "co_llm": ("tokenplane.route.algorithms.co_llm", "CoLLM"),
    "r_stitch": ("tokenplane.route.algorithms.r_stitch", "RStitch"),
    "ensemble": ("tokenplane.route.algorithms.ensemble", "Ensemble"),
    "single": ("tokenplane.route.algorithms.single", "Single"),
}


def make_algorithm(name: str, **kwargs: Any) -> Algorithm:
    """Build an algorithm by name; `make_algorithm(a.name, **a.config())` rebuilds `a` exactly (other processes)."""
    key = name.replace("-", "_").lower()
    if key not in ALGORITHMS:
        raise ValueError(f"unknown routing algorithm {name!r}; known: {sorted(ALGORITHMS)}")
    module, cls = ALGORITHMS[key]
    return getattr(importlib.import_module(module), cls)(**kwargs)


__all__ = ["ALGORITHMS", "make_algorithm"]
