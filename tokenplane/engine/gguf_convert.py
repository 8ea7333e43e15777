"""Convert a GGUF checkpoint once into a cached HF directory, verified by hashes on every later use.

`$TOKENPLANE_CACHE/models/<first 16 hex of the GGUF's sha256>/` holds config.json, model.safetensors (float32),
tokenizer.json + tokenizer_config.json (when the GGUF's tokenizer is supported), NOTICE (source and modification,
Apache-2.0 §4), LICENSE (when the source package ships one) and manifest.json (the GGUF's sha256 and each file's). The
folder is built under a temporary name (holding a lock file: one converter per GGUF) and renamed into place. Using it
re-hashes every file against the manifest, and, for a registered model, the manifest against the pinned output hashes: a
corrupted or half-written folder is detected and rebuilt; a conversion whose output differs from the pins fails closed.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenplane.engine.artifacts import (
    ModelArtifact,
    ModelArtifactError,
    cache_dir,
    license_text,
    lookup,
    package_file,
    sha256_file,
)

MANIFEST = "manifest.json"
FORMAT = 1


def model_dir(name: str) -> Path:
    """The converted, verified HF directory of a registered model (see artifacts.MODELS)."""
    art = lookup(name)
    return gguf_model_dir(package_file(art), expected_sha256=art.sha256, artifact=art)


def gguf_model_dir(path: str | os.PathLike, *, expected_sha256: str | None = None,
                   artifact: ModelArtifact | None = None, progress: bool = True) -> Path:
    """Convert `path` into the cache on first use; later calls verify the cached folder's hashes and reuse it."""
    path = Path(path)
    if not path.is_file():
        raise ModelArtifactError(f"{path}: no such GGUF file")
    sha = sha256_file(path)
    if expected_sha256 is not None and sha != expected_sha256:
        raise ModelArtifactError(f"{path}: sha256 {sha} does not match the pinned {expected_sha256}")
    pins = artifact.outputs if artifact else None
    folder = cache_dir() / "models" / sha[:16]
    if verify_folder(folder, sha, pins) is None:
        return folder
    with _exclusive(folder.with_name(f".{folder.name}.lock")):   # one converter at a time per GGUF
        problem = verify_folder(folder, sha, pins)                  # another process may have just built it
        if problem is None:
            return folder
        if folder.exists():
            print(f"tokenplane: cached model {folder} is invalid ({problem}); rebuilding", file=sys.stderr)
        tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            hashes = convert(path, tmp, sha, artifact=artifact, progress=progress)
            if pins and hashes != pins:
                diff = sorted(k for k in set(hashes) | set(pins) if hashes.get(k) != pins.get(k))
                raise ModelArtifactError(f"{path}: converted files {diff} do not match the pinned hashes "
                                         f"(got {{{', '.join(f'{k}: {hashes.get(k)}' for k in diff)}}})")
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


@contextlib.contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """An advisory lock file (POSIX flock; elsewhere no lock: concurrent converters then race on the rename)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def verify_folder(folder: Path, sha: str, pins: dict[str, str] | None) -> str | None:
    """None if `folder` is a complete conversion of the GGUF with this sha256, else what is wrong."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, ValueError) as e:
        return f"unreadable {MANIFEST}: {e}"
    if not isinstance(manifest, dict):
        return f"{MANIFEST} is not an object"
    files = manifest.get("files")
    if manifest.get("format") != FORMAT or manifest.get("source_sha256") != sha or not isinstance(files, dict):
        return f"{MANIFEST} is for another source or format"
    if pins and files != pins:
        return f"{MANIFEST} disagrees with the pinned output hashes"
    for name in ("config.json", "model.safetensors"):
        if name not in files:
            return f"{MANIFEST} lacks {name}"
    for name, want in files.items():
        file = folder / name
        if not file.is_file():
            return f"{name} is missing"
        if sha256_file(file) != want:
            return f"{name} does not match its sha256 in {MANIFEST}"
    return None


def convert(path: Path, out: Path, sha: str, *, artifact: ModelArtifact | None = None,
            progress: bool = True) -> dict[str, str]:
    """Write the HF directory for GGUF `path` into `out`; -> {file name: sha256} (also written as the manifest)."""
    from safetensors.numpy import save_file

    from tokenplane.engine.gguf_reader import read_gguf
    from tokenplane.engine.gguf_tokenizer import tokenizer_files

    model = read_gguf(path)
    out.mkdir(parents=True)
    tensors = {}
    with _progress_bar(model.num_tensors, f"converting {path.name}", enabled=progress) as bar:
        for name, array in model.tensors():
            tensors[name] = array
            bar.update(1)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    _write_json(out / "config.json", model.hf_config)
    tok = tokenizer_files(model.field)
    if isinstance(tok, str):
        print(f"tokenplane: {path.name}: no tokenizer.json written: {tok}", file=sys.stderr)
    else:
        _write_json(out / "tokenizer.json", tok[0])
        _write_json(out / "tokenizer_config.json", tok[1])
    (out / "NOTICE").write_text(notice(model, path, sha, artifact), encoding="utf-8")
    if artifact is not None and (text := license_text(artifact)) is not None:
        (out / "LICENSE").write_text(text, encoding="utf-8")
    hashes = {f.name: sha256_file(f) for f in sorted(out.iterdir())}
    _write_json(out / MANIFEST, {"format": FORMAT, "source": path.name, "source_sha256": sha, "files": hashes})
    return hashes


def notice(model: Any, path: Path, sha: str, artifact: ModelArtifact | None) -> str:
    """The Apache-2.0 §4(b) notice: what the weights are, where they come from, and how this copy was modified."""
    meta = model.metadata
    what = artifact.name if artifact else meta.get("general.name", path.stem)
    source = artifact.source if artifact else ", ".join(
        f"{k.split('.', 1)[1]}: {meta[k]}" for k in ("general.name", "general.organization", "general.source.url")
        if k in meta) or "not stated in the GGUF metadata"
    license_ = artifact.license if artifact else meta.get("general.license", "not stated in the GGUF metadata")
    types = ", ".join(f"{n} ({c} tensor{'s' * (c != 1)})" for n, c in model.tensor_types.items())
    permuted = " undid the Q/K row permutation llama.cpp applies for its rope layout," \
        if model.config.architecture == "llama" else ""
    return (f"{what}: float32 Hugging Face-format copy of a GGUF checkpoint, made by tokenplane.\n\n"
            f"Source file: {path.name} (sha256 {sha})\n"
            f"Source: {source}\n"
            f"License: {license_} (LICENSE in this folder where the source package ships it)\n\n"
            f"Modification (Apache-2.0 section 4(b)): tokenplane dequantized every tensor from {types} to float32,"
            f"{permuted} renamed the tensors to Hugging Face names, and wrote config.json, tokenizer.json and "
            f"tokenizer_config.json from the GGUF metadata. No weight was trained or otherwise changed.\n")


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


class _SimpleBar:
    """A stderr progress line for when tqdm is not installed."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.n, self.t0, self.shown = total, desc, 0, time.monotonic(), -1

    def update(self, n: int) -> None:
        self.n += n
        pct = 100 * self.n // max(self.total, 1)
        if pct // 5 != self.shown // 5 or self.n == self.total:
            self.shown = pct
            print(f"\r{self.desc}: {pct:3d}% {self.n}/{self.total} {time.monotonic() - self.t0:.1f}s",
                  end="", file=sys.stderr, flush=True)

    def __enter__(self) -> _SimpleBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        print(file=sys.stderr)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _progress_bar(total: int, desc: str, *, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _SimpleBar(total, desc)
    return tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr)
