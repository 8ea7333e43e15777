"""Git revisions checked out side by side for A/B benchmarks that alternate processes (revision_ab.py,
routing/entropy_ab.py): each a detached worktree in a temporary folder, removed afterwards."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def worktrees(root: Path, revs: list[str]) -> Iterator[list[Path]]:
    """One detached worktree of the repository at `root` per revision (in order), removed on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        trees: list[Path] = []
        try:
            for k, rev in enumerate(revs):
                tree = Path(tmp) / f"rev{k}"
                subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", "-q", str(tree), rev],
                               check=True)
                trees.append(tree)
            yield trees
        finally:
            for tree in trees:
                subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)], check=False)
