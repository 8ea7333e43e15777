"""The public Tokenizer: one immutable registry entry per tokenizer, a reference engine, and the encode paths.

Contract (the only one): every path returns exactly the reference engine's IDs for the same text, or raises.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from functools import cached_property
from pathlib import Path
from typing import Callable, Collection, Literal

import numpy as np

from .artifacts import ARTIFACTS, ArtifactError, artifact_bytes, read_verified
from .families import FAMILIES, Family
from .reference import ReferenceEngine, make_reference

DEFAULT_MAX_CHARS = 64 * 1024 * 1024
EncodePath = Literal["auto", "reference", "cpu", "gpu"]


class InvalidTextError(ValueError):
    """Input is not valid Unicode text (not str, invalid UTF-8 bytes, lone surrogates)."""


class TextTooLargeError(ValueError):
    """Input exceeds the tokenizer's configured maximum size."""


class PathUnavailableError(RuntimeError):
    """An explicitly requested encode path cannot run here (e.g. `path="gpu"` without a GPU)."""


def validate_text(text: str | bytes, max_chars: int) -> str:
    """Return text as a str that is valid Unicode, or raise a clear error. O(n) in C."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidTextError(f"input is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    elif not isinstance(text, str):
        raise InvalidTextError(f"expected str or UTF-8 bytes, got {type(text).__name__}")
    if len(text) > max_chars:
        raise TextTooLargeError(f"input has {len(text):,} characters; the limit is {max_chars:,}")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidTextError(
                f"input contains a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}") from None
    return text


class SpecialMatcher:
    """Leftmost-longest literal pass over the allowed added/special tokens."""

    def __init__(self, specials: dict[str, int]):
        self.specials = specials
        literals = sorted(specials, key=len, reverse=True)  # first alternative wins at a position -> longest
        self.regex = re.compile("|".join(map(re.escape, literals))) if literals else None

    def split(self, text: str, allowed: Collection[str]) -> list[tuple[str, int | None]]:
        """Segments of (text, None) for ordinary text and (literal, id) for allowed specials."""
        if self.regex is None or not allowed:
            return [(text, None)]
        out: list[tuple[str, int | None]] = []
        pos = 0
        for m in self.regex.finditer(text):
            literal = m.group()
            if literal not in allowed:
                continue   # text like a special but not allowed: ordinary text (tiktoken encode_ordinary semantics)
            if m.start() > pos:
                out.append((text[pos:m.start()], None))
            out.append((literal, self.specials[literal]))
            pos = m.end()
        if pos < len(text) or not out:
            out.append((text[pos:], None))
        return out


class Tokenizer:
    """A frozen tokenizer: family configuration + verified vocabulary + reference engine + fast paths."""

    def __init__(self, name: str, family: Family, data: bytes, *, max_chars: int = DEFAULT_MAX_CHARS):
        self.name = name
        self.family = family
        self.content_hash = hashlib.sha256(data).hexdigest()
        self.max_chars = max_chars
        self.reference: ReferenceEngine = make_reference(family, data)
        self.specials: dict[str, int] = dict(self.reference.specials)
        self._special_matcher = SpecialMatcher(self.specials)
        # Fast encode paths register here (name -> callable(normalized_text) -> ids); "reference" is always present.
        self._paths: dict[str, Callable[[str], np.ndarray]] = {}
        self._lock = threading.Lock()
        from .router import enable_fast_paths  # "cpu" / "auto" (and "gpu" with a device); built lazily

        enable_fast_paths(self)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, family={self.family.name!r}, sha256={self.content_hash[:12]}…)"

    @property
    def n_vocab(self) -> int:
        return len(self.reference.token_bytes)

    @cached_property
    def max_token_chars(self) -> int:
        return self.reference.max_token_chars

    # -- encoding -------------------------------------------------------------------------------------------------
    def _resolve_allowed(self, allowed_special: Collection[str] | Literal["all"]) -> Collection[str]:
        if allowed_special == "all":
            return self.specials.keys()
        unknown = set(allowed_special) - self.specials.keys()
        if unknown:
            raise ValueError(f"not special tokens of {self.name}: {sorted(unknown)[:5]}")
        return allowed_special

    def encode(self, text: str | bytes, *, allowed_special: Collection[str] | Literal["all"] = (),
               path: EncodePath = "auto") -> np.ndarray:
        """IDs (uint32) equal to the reference encode of `text`; no BOS/EOS. Special-token strings are ordinary
        text unless listed in `allowed_special` (like tiktoken)."""
        text = validate_text(text, self.max_chars)
        allowed = self._resolve_allowed(allowed_special)
        parts = []
        for segment, special_id in self._special_matcher.split(text, allowed):
            if special_id is not None:
                parts.append(np.array([special_id], dtype=np.uint32))
            elif segment:
                parts.append(self._encode_ordinary(segment, path))
        if not parts:
            return np.zeros(0, dtype=np.uint32)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _encode_ordinary(self, text: str, path: EncodePath) -> np.ndarray:
        if path == "reference":
            return self.reference.encode_ordinary(text)
        if path == "auto":
            router = self._paths.get("auto")
            return router(text) if router is not None else self.reference.encode_ordinary(text)
        fast = self._paths.get(path)
        if fast is None:
            raise PathUnavailableError(f"encode path {path!r} is not available for {self.name} here")
        return fast(text)

    def register_path(self, name: str, fn: Callable[[str], np.ndarray]) -> None:
        with self._lock:
            self._paths[name] = fn

    def encode_with_ends(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Reference IDs of ordinary text plus each token's end (characters of the normalized text)."""
        return self.reference.encode_with_ends(validate_text(text, self.max_chars))

    def normalize(self, text: str) -> str:
        return self.reference.normalize(text)

    def decode_bytes(self, ids) -> bytes:
        try:
            return self.reference.decode_bytes(int(i) for i in ids)
        except IndexError:
            raise ValueError("token id out of range") from None

    def decode(self, ids, errors: str = "replace") -> str:
        return self.decode_bytes(ids).decode("utf-8", errors=errors)

    # -- sessions -------------------------------------------------------------------------------------------------
    def session(self, **options):
        """A stateful session whose IDs always equal encode(session.text)."""
        from .session import Session

        return Session(self, **options)


_REGISTRY: dict[str, Tokenizer] = {}
_REGISTRY_LOCK = threading.Lock()


def register(name: str, tokenizer: Tokenizer) -> Tokenizer:
    """Entries are immutable: re-registering a name with different content is an error."""
    with _REGISTRY_LOCK:
        existing = _REGISTRY.get(name)
        if existing is not None:
            if existing.content_hash != tokenizer.content_hash or existing.family != tokenizer.family:
                raise ArtifactError(f"{name!r} is already registered with different content")
            return existing
        _REGISTRY[name] = tokenizer
        return tokenizer


def _family_for_json(config: dict) -> Family:
    """Pick the frozen family whose splitter chain equals this tokenizer.json's (else: no fast path family)."""
    pre = config.get("pre_tokenizer") or {}
    splits = pre.get("pretokenizers", [pre])
    patterns = tuple(s["pattern"].get("Regex", "") for s in splits if s.get("type") == "Split")
    norm = (config.get("normalizer") or {}).get("type")
    for fam in FAMILIES.values():
        if fam.engine == "hf" and fam.patterns == patterns and (fam.normalizer == "nfc") == (norm == "NFC"):
            return fam
    return Family(name="hf-generic", engine="hf", patterns=patterns, onig_patterns=patterns,
                  normalizer="nfc" if norm == "NFC" else None)


def load(name_or_path: str | Path, *, family: str | None = None, sha256: str | None = None,
         max_chars: int = DEFAULT_MAX_CHARS) -> Tokenizer:
    """Load a registered tokenizer (`cl100k_base`, `o200k_base`, `llama3`, `qwen3`, `deepseek_v4`) or a local
    `tokenizer.json` / `.tiktoken` file. Pinned files are sha256-verified (fail closed); for local files, pass
    `sha256=` to pin them, and `family=` to give a `.tiktoken` file its splitter."""
    key = str(name_or_path)
    if key in ARTIFACTS:
        with _REGISTRY_LOCK:
            if key in _REGISTRY:
                return _REGISTRY[key]
        tok = Tokenizer(key, FAMILIES[key], artifact_bytes(key), max_chars=max_chars)
        return register(key, tok)
    path = Path(key)
    if not path.exists():
        raise ArtifactError(f"{key!r} is neither a known tokenizer ({sorted(ARTIFACTS)}) nor an existing file")
    data = read_verified(path, sha256) if sha256 else path.read_bytes()
    if path.suffix == ".json":
        fam = _family_for_json(json.loads(data))
    else:
        if family is None or family not in FAMILIES or FAMILIES[family].engine != "tiktoken":
            raise ValueError("a .tiktoken file needs family= one of cl100k_base, o200k_base, llama3")
        fam = FAMILIES[family]
    tok = Tokenizer(f"{path.name}@{hashlib.sha256(data).hexdigest()[:12]}", fam, data, max_chars=max_chars)
    return register(tok.name, tok)
