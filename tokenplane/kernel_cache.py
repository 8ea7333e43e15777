"""numba's on-disk kernel cache moved under a folder of the caller's choosing while dispatchers are made.

numba validates a cached kernel against its own file's timestamp only, while a kernel compiles in the kernels and
intrinsics it calls from other files: an edit or an upgrade that changes one file leaves the others' cached kernels
running code built from the old one (seen here: wrong token IDs from the JIT path after an edit to the merge
kernels). The tokenizer's kernels (tokenize/cpu/lazyjit.py) and the engine's (engine/numbacache.py) are therefore
made under `cached_under(folder)` with a folder named by a hash of all their sources, so any change starts an empty
cache. numba's setting is restored afterwards: other code's kernels keep numba's default.

Every source change (an upgrade, an edit) thus leaves the previous keys' folders behind: the tokenizer's AOT module
(~1.5 MB) and JIT kernels (~15-40 MB) and the engine's kernels (~70-90 MB) per key. `prune` removes them, keeping the
current keys and the most recently written others (a rollback, or another installed version sharing the cache,
finds its kernels); `tokenplane warmup` runs it.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path
from typing import Iterator

KEEP_RECENT = 2     # keyed folders kept beside the current ones, most recently written first
_KEYED = re.compile(r"(engine-)?[0-9a-f]{24}")      # what the kernel caches name their folders: nothing else is removed


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


def prune(root: Path, current: set[str], keep_recent: int = KEEP_RECENT) -> list[tuple[Path, int]]:
    """Remove the keyed cache folders directly under `root` (named as the kernel caches name them: 24 hex digits,
    or `engine-` and 24) but those named in `current` and, per kind, the `keep_recent` most recently modified
    others, with a removed key's `<key>.failed` marker (a failed AOT build's); returns (folder, bytes) removed.
    Anything else under `root` is left alone."""
    if not root.is_dir():
        return []
    kinds: dict[bool, list[Path]] = {False: [], True: []}
    for entry in root.iterdir():
        if entry.is_dir() and not entry.is_symlink() and _KEYED.fullmatch(entry.name) and entry.name not in current:
            kinds[entry.name.startswith("engine-")].append(entry)
    removed = []
    for folders in kinds.values():
        folders.sort(key=lambda f: f.stat().st_mtime, reverse=True)
        for folder in folders[keep_recent:]:
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())
            shutil.rmtree(folder, ignore_errors=True)
            (root / f"{folder.name}.failed").unlink(missing_ok=True)
            removed.append((folder, size))
    return removed


__all__ = ["KEEP_RECENT", "cached_under", "prune"]
