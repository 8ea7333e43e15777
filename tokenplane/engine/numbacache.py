"""`numba.njit` for the engine's (and the router's entropy) kernels, cached under a key of their sources.

numba validates a cached kernel against its own file's timestamp only, while a kernel compiles in the intrinsics and
kernels it calls from other files (cpu_simd's vector intrinsics in every CPU kernel, the routing entropy's pointer
helper): a change to one file, or an upgrade that changes it, would leave the others' cached kernels running code
built from the old one. Here every engine kernel's cache lives in a folder keyed by all the engine's sources, the
router's entropy.py and the numba, numpy and Python versions (`cache_dir`), so any change starts an empty cache. The
tokenizer's kernels do the same under their own key (tokenize/cpu/lazyjit.py). numba's setting is restored after
each decoration, so kernels of other code keep numba's default.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import sys
from functools import cache
from pathlib import Path
from typing import Any, Callable, Iterator

import numba
import numpy as np
from numba.core import config

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


@contextlib.contextmanager
def _keyed() -> Iterator[None]:
    before = config.CACHE_DIR  # type: ignore[attr-defined]  # (numba's config attributes are made at run time)
    config.CACHE_DIR = str(cache_dir())  # type: ignore[attr-defined]
    try:
        yield
    finally:
        config.CACHE_DIR = before  # type: ignore[attr-defined]


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
