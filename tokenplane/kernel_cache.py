"""numba's on-disk kernel cache moved under a folder of the caller's choosing while dispatchers are made.

numba validates a cached kernel against its own file's timestamp only, while a kernel compiles in the kernels and
intrinsics it calls from other files: an edit or an upgrade that changes one file leaves the others' cached kernels
running code built from the old one (seen here: wrong token IDs from the JIT path after an edit to the merge
kernels). The tokenizer's kernels (tokenize/cpu/lazyjit.py) and the engine's (engine/numbacache.py) are therefore
made under `cached_under(folder)` with a folder named by a hash of all their sources, so any change starts an empty
cache. numba's setting is restored afterwards: other code's kernels keep numba's default.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def cached_under(folder: Path) -> Iterator[None]:
    """numba's CACHE_DIR set to `folder` for the dispatchers made inside (numba reads it when a dispatcher with
    cache=True is made)."""
    from numba.core import config

    before = config.CACHE_DIR  # type: ignore[attr-defined]  # (numba's config attributes are made at run time)
    config.CACHE_DIR = str(folder)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        config.CACHE_DIR = before  # type: ignore[attr-defined]


__all__ = ["cached_under"]
