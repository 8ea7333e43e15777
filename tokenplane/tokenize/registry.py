"""Loading tokenizers: pinned artifacts or local files, one shared instance per (name, options).

`load` builds the fast encode paths (router.fast_paths) and passes them to the Tokenizer; it never hands back an
instance built with other options: `load("qwen3", max_chars=10)` is a distinct instance from `load("qwen3")`, and a
`family=` or `sha256=` that contradicts a registered name is an error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from pathlib import Path

from . import router
from .errors import ArtifactError
from .spec.artifacts import ARTIFACTS, artifact_bytes, read_verified
from .spec.families import FAMILIES, Family
from .tokenizer import DEFAULT_MAX_CHARS, Tokenizer

_INSTANCES: dict[tuple[str, tuple], Tokenizer] = {}
_CONTENT: dict[str, tuple[str, Family]] = {}     # name -> (sha256, family): a name never changes content
_LOCK = threading.Lock()
_GENERIC_LOGGED: set[str] = set()                # content hashes already reported as "no fast path" (log once)
log = logging.getLogger(__name__)


def register(name: str, tokenizer: Tokenizer) -> Tokenizer:
    """Share `tokenizer` under `name` (for its options); returns the instance already registered for the same name
    and options. Entries are immutable: re-registering a name with different content is an error."""
    with _LOCK:
        known = _CONTENT.get(name)
        if known is not None and known != (tokenizer.content_hash, tokenizer.family):
            raise ArtifactError(f"{name!r} is already registered with different content")
        _CONTENT[name] = (tokenizer.content_hash, tokenizer.family)
        return _INSTANCES.setdefault((name, tokenizer.options), tokenizer)


def _split_chain(config: dict) -> tuple[str, ...] | None:
    """The Split regexes of a pre-tokenizer that is exactly `Split(Regex, Isolated)*` then a byte mapping without a
    regex (`ByteLevel(use_regex=false)`) and no other step, under a normalizer that is absent, empty or NFC, with a
    byte-level BPE; None for anything else (another step, a Split of another behaviour, a prefix space...)."""
    pre = config.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    norm = config.get("normalizer")
    if norm not in (None, {"type": "NFC"}, {"type": "Sequence", "normalizers": []}):
        return None
    model = config.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or model.get("dropout"):
        return None
    if not steps or steps[-1] != {**steps[-1], "type": "ByteLevel", "add_prefix_space": False, "use_regex": False}:
        return None
    patterns = []
    for step in steps[:-1]:
        if step.get("type") != "Split" or step.get("behavior") != "Isolated" or step.get("invert") \
                or "Regex" not in (step.get("pattern") or {}):
            return None
        patterns.append(step["pattern"]["Regex"])
    return tuple(patterns)


def _family_for_json(config: dict) -> Family:
    """Pick the frozen family whose whole pre-tokenizer chain and normalizer equal this tokenizer.json's (else: the
    reference-only "hf-generic"). A family whose chain is not all Splits (smollm2) is recognized by its file's hash
    only (`load`)."""
    norm = (config.get("normalizer") or {}).get("type")
    patterns = _split_chain(config)
    if patterns is not None:
        for fam in FAMILIES.values():
            if fam.engine == "hf" and fam.onig_patterns and fam.patterns == patterns \
                    and (fam.normalizer == "nfc") == (norm == "NFC"):
                return fam
    return Family(name="hf-generic", engine="hf", patterns=patterns or (), onig_patterns=patterns or (),
                  normalizer="nfc" if norm == "NFC" else None)


def build(name: str, family: Family, data: bytes, *, max_chars: int = DEFAULT_MAX_CHARS,
          gpu_min_chars: int = router.GPU_MIN_CHARS, gpu_max_inflight: int = router.GPU_MAX_INFLIGHT,
          content_hash: str | None = None) -> Tokenizer:
    """A new, unregistered Tokenizer with its fast paths (for callers that need a private instance).
    `content_hash`: the sha256 of `data` when the caller has just verified it."""
    if not isinstance(max_chars, int) or max_chars < 1:
        raise ValueError(f"max_chars must be a positive int, got {max_chars!r}")
    options = (("max_chars", max_chars), ("gpu_min_chars", gpu_min_chars), ("gpu_max_inflight", gpu_max_inflight))
    paths = functools.partial(router.fast_paths, gpu_min_chars=gpu_min_chars, gpu_max_inflight=gpu_max_inflight)
    return Tokenizer(name, family, data, max_chars=max_chars, encoders=paths, options=options,
                     content_hash=content_hash)


def load(name_or_path: str | Path, *, family: str | None = None, sha256: str | None = None,
         max_chars: int = DEFAULT_MAX_CHARS, gpu_min_chars: int = router.GPU_MIN_CHARS,
         gpu_max_inflight: int = router.GPU_MAX_INFLIGHT) -> Tokenizer:
    """Load a registered tokenizer (`cl100k_base`, `o200k_base`, `llama3`, `qwen3`, `deepseek_v4`, `smollm2`) or a
    local `tokenizer.json` / `.tiktoken` file. Pinned files are sha256-verified (fail closed); for local files, pass
    `sha256=` to pin them, and `family=` to give a `.tiktoken` file its splitter. A local file whose content is a
    registered tokenizer's (same sha256) is that tokenizer (e.g. the tokenizer.json of a converted SmolLM2 folder is
    `load("smollm2")`). A tokenizer.json of a configuration no family was derived for encodes through the reference
    engine (same IDs, no fast path, sessions re-encode fully), which is logged once per file content. Each distinct
    set of options is its own shared instance."""
    key = str(name_or_path)
    opts = {"max_chars": max_chars, "gpu_min_chars": gpu_min_chars, "gpu_max_inflight": gpu_max_inflight}
    if key in ARTIFACTS:
        if family is not None and family != key:
            raise ValueError(f"{key!r} is family {key!r}; family={family!r} contradicts it")
        if sha256 is not None and sha256 != ARTIFACTS[key].sha256:
            raise ArtifactError(f"{key!r} is pinned to sha256 {ARTIFACTS[key].sha256}, not {sha256}")
        options = tuple(opts.items())
        with _LOCK:
            if (key, options) in _INSTANCES:
                return _INSTANCES[(key, options)]
        return register(key, build(key, FAMILIES[key], artifact_bytes(key), content_hash=ARTIFACTS[key].sha256,
                                   **opts))
    path = Path(key)
    if not path.exists():
        raise ArtifactError(f"{key!r} is neither a known tokenizer ({sorted(ARTIFACTS)}) nor an existing file")
    data = read_verified(path, sha256) if sha256 else path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    registered = next((art.name for art in ARTIFACTS.values() if art.sha256 == digest), None)
    if registered is not None and (family is None or family == registered):
        return load(registered, max_chars=max_chars, gpu_min_chars=gpu_min_chars, gpu_max_inflight=gpu_max_inflight)
    if path.suffix == ".json":
        if family is not None:
            raise ValueError("family= applies to .tiktoken files; a tokenizer.json names its own splitter")
        fam = _family_for_json(json.loads(data))
        if fam.name == "hf-generic":
            _log_generic(path, digest)
    else:
        if family is None or family not in FAMILIES or FAMILIES[family].engine != "tiktoken":
            raise ValueError("a .tiktoken file needs family= one of cl100k_base, o200k_base, llama3")
        fam = FAMILIES[family]
    name = f"{path.name}@{digest[:12]}"
    with _LOCK:
        hit = _INSTANCES.get((name, tuple(opts.items())))
    if hit is not None and hit.family == fam:
        return hit
    return register(name, build(name, fam, data, content_hash=digest, **opts))


def _log_generic(path: Path, digest: str) -> None:
    with _LOCK:
        if digest in _GENERIC_LOGGED:
            return
        _GENERIC_LOGGED.add(digest)
    log.warning("%s (sha256 %s…): pre-tokenizer configuration of no registered family (%s); encoding through the "
                "reference engine: exact IDs, no fast CPU/GPU path, sessions re-encode fully", path, digest[:12],
                ", ".join(FAMILIES))
