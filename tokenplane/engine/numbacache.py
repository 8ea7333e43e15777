"""`numba.njit` for the engine's (and the router's entropy) kernels, cached under a key of their sources.

The engine's kernels compile in cpu_simd's vector intrinsics and the routing entropy its pointer helper, from other
files than their own, which numba's timestamp check of a cached kernel does not see (../kernel_cache.py). Here every
engine kernel's cache lives in a folder keyed by all the engine's sources, the router's entropy.py and the numba,
numpy and Python versions (`cache_dir`), so any change starts an empty cache.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from contextlib import AbstractContextManager
from functools import cache
from pathlib import Path
from typing import Any, Callable

import numba
import numpy as np

from ..kernel_cache import cached_under
from .artifacts import cache_dir as tokenplane_cache

_PACKAGE = Path(__file__).resolve().parents[1]


@cache
def cache_dir() -> Path:
    """TOKENPLANE_NUMBA_CACHE_DIR (else `numba/` in the tokenplane cache) / engine-<key of the sources>."""
    h = hashlib.sha256()
    for path in [*sorted((_PACKAGE / "engine").glob("*.py")), _PACKAGE / "route" / "entropy.py"]:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(f"{numba.__version__} {np.__version__} {sys.implementation.cache_tag} {platform.machine()}".encode())
    env = os.environ.get("TOKENPLANE_NUMBA_CACHE_DIR")
    return (Path(env) if env else tokenplane_cache() / "numba") / f"engine-{h.hexdigest()[:24]}"


def _keyed() -> AbstractContextManager[None]:
    return cached_under(cache_dir())


def njit(*args: Any, **options: Any) -> Any:
    """numba.njit with the same arguments (`@njit`, `@njit(...)`, `njit(signature, ...)`), made under the keyed
    cache folder."""
    if len(args) == 1 and callable(args[0]) and not options:
        with _keyed():
            return numba.njit(args[0])

    def wrap(func: Callable[..., Any]) -> Any:
        with _keyed():
            return numba.njit(*args, **options)(func)
    return wrap


__all__ = ["cache_dir", "njit"]
