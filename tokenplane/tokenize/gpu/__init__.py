"""GPU tokenizer body (numba-cuda): exact encoding on the device for every family.

`available()` says whether a device path can run here; `GpuEncoder(tokenizer)` encodes. Nothing here imports numba
at module import time, so `tokenplane` imports on CPU-only machines without numba-cuda.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # type names only: these modules sit above this one
    from ..tokenizer import Tokenizer


def simulator_enabled() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "") == "1"


def available() -> bool:
    """True when numba-cuda is installed and either a CUDA device is present or the simulator was enabled
    explicitly (NUMBA_ENABLE_CUDASIM=1)."""
    try:
        from numba import cuda
    except Exception:  # noqa: BLE001 - numba missing or broken: no device path
        return False
    if simulator_enabled():
        return True
    if cuda.jit.__module__.startswith("numba.cuda.simulator"):
        return False   # numba.cuda was imported in simulator mode earlier in this process: no real device
    try:
        return bool(cuda.is_available())
    except Exception:  # noqa: BLE001 - driver probing failed
        return False


def supports(tokenizer: Tokenizer) -> bool:
    """True when the tokenizer's family has device pre-tokenizer rules (cl100k_base, o200k_base, llama3, qwen3,
    deepseek_v4, smollm2)."""
    from .encoder import UnsupportedFamilyError, family_code

    try:
        family_code(tokenizer)
    except UnsupportedFamilyError:
        return False
    return True


def __getattr__(name: str) -> type:
    if name in ("GpuEncoder", "UnsupportedFamilyError"):
        from . import encoder

        return getattr(encoder, name)
    raise AttributeError(name)


__all__ = ["available", "supports", "simulator_enabled", "GpuEncoder", "UnsupportedFamilyError"]
