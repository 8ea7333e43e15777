"""kernel_cache.prune and `tokenplane warmup`'s use of it: the kernel caches of other source versions go, the current
ones and the most recent others stay, and nothing the kernel caches did not name is touched."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tokenplane import kernel_cache
from tokenplane.tokenize import warmup
from tokenplane.tokenize.cpu import kernels


def _folder(root: Path, name: str, age_s: int, size: int = 10) -> Path:
    f = root / name
    (f / "sub").mkdir(parents=True)
    (f / "sub" / "x.nbc").write_bytes(b"k" * size)
    t = 1_700_000_000 - age_s
    os.utime(f, (t, t))
    return f


def test_prune_keeps_the_current_keys_and_the_most_recent_others(tmp_path):
    cur, eng = "a" * 24, "engine-" + "b" * 24
    for name in (cur, eng):
        _folder(tmp_path, name, 10_000)              # the current keys, however old
    olds = [_folder(tmp_path, f"{i:x}" * 24, 100 * i) for i in range(1, 6)]          # newest first
    engines = [_folder(tmp_path, f"engine-{i:x}" + "0" * 23, 100 * i, 7) for i in range(1, 4)]
    (tmp_path / f"{olds[4].name}.failed").write_text("traceback")
    (tmp_path / f"{olds[0].name}.failed").write_text("traceback")
    others = [_folder(tmp_path, "models", 99_999), _folder(tmp_path, "c" * 23, 99_999),
              _folder(tmp_path, "engine-" + "c" * 25, 99_999)]
    removed = kernel_cache.prune(tmp_path, {cur, eng}, keep_recent=2)
    assert sorted(p.name for p, _ in removed) == sorted(p.name for p in olds[2:] + engines[2:])
    assert {size for p, size in removed} == {10, 7}
    for kept in [*olds[:2], *engines[:2], *others, tmp_path / cur, tmp_path / eng]:
        assert kept.is_dir(), kept
    for gone in olds[2:] + engines[2:]:
        assert not gone.exists()
    assert not (tmp_path / f"{olds[4].name}.failed").exists()      # a removed key's failed-build marker goes too
    assert (tmp_path / f"{olds[0].name}.failed").exists()
    assert kernel_cache.prune(tmp_path / "absent", {cur}) == []
    assert kernel_cache.prune(tmp_path, {cur, eng}, keep_recent=0) and not olds[0].exists()


def test_warmup_prunes_both_kernel_caches_keeping_its_own_keys(tmp_path, monkeypatch):
    """prune_caches on cache roots of a test's own (the engine's cache folder is redirected too: the real caches of
    the machine running the tests are never touched)."""
    pytest.importorskip("torch")
    from tokenplane.engine import numbacache

    aot, numba_root = tmp_path / "aot", tmp_path / "numba"
    monkeypatch.setenv("TOKENPLANE_AOT_DIR", str(aot))
    monkeypatch.setenv("TOKENPLANE_NUMBA_CACHE_DIR", str(numba_root))
    engine_now = numba_root / ("engine-" + "e" * 24)
    monkeypatch.setattr(numbacache, "cache_dir", lambda: engine_now)
    key = kernels.cache_key()
    keep = [_folder(aot, key, 5_000), _folder(numba_root, key, 5_000), _folder(numba_root, engine_now.name, 5_000)]
    old = [_folder(aot, "1" * 24, 100), _folder(aot, "2" * 24, 200), _folder(numba_root, "3" * 24, 300),
           _folder(numba_root, "4" * 24, 400), _folder(numba_root, "engine-" + "5" * 24, 500),
           _folder(numba_root, "engine-" + "6" * 24, 600)]
    seconds, outcome = warmup.prune_caches(keep_recent=1)
    assert "removed 3 folders" in outcome
    assert all(f.is_dir() for f in keep)
    assert [f.exists() for f in old] == [True, False, True, False, True, False]

