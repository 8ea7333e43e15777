"""GPU tokenizer body (numba-cuda): exact encoding on the device for every family.

`available()` says whether a device path can run here; `GpuEncoder(tokenizer)` encodes. Nothing here imports numba
at module import time, so `tokenplane` imports on CPU-only machines without numba-cuda.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # type names only: these modules sit above this one
    from ..tokenizer import Tokenizer


def _numpy_names_for_numba() -> None:
    """numba-cuda (0.2x) registers overloads for numpy functions that numpy 2.5 removed (np.row_stack, np.in1d,
    np.trapz); without them `numba.cuda`'s typing registry fails to import on a real device. Distinct stand-ins
    (not aliases, which would share an overload key with the function they alias) let it import."""
    import numpy as np

    def row_stack(tup: Any, *, dtype: Any = None, casting: Any = "same_kind") -> Any:
        return np.vstack(tup, dtype=dtype, casting=casting)

    def in1d(ar1: Any, ar2: Any, assume_unique: bool = False, invert: bool = False) -> Any:
        return np.isin(np.ravel(ar1), ar2, assume_unique=assume_unique, invert=invert)

    def trapz(y: Any, x: Any = None, dx: float = 1.0, axis: int = -1) -> Any:
        return np.trapezoid(y, x=x, dx=dx, axis=axis)

    for fn in (row_stack, in1d, trapz):
        if not hasattr(np, fn.__name__):
            setattr(np, fn.__name__, fn)


_numpy_names_for_numba()


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
