"""What a Tokenizer needs of its file without the reference engine, cached by the file's sha256.

`Tokenizer` builds its reference engine only when something needs it (reference encodes, decoding, the verifier).
- VocabMeta (specials, vocabulary size, normalizer kind, the ids a decode skips): what construction needs.
  Deriving it parses the whole file (json.loads of 11 MB for qwen3, ~0.1-0.2 s; the rank lines of a .tiktoken
  file), so it is kept as a few hundred bytes of JSON.
- VocabFacts (characters each token starts, whether it starts inside a character, the longest token in
  characters): what a session needs to derive token ends and certify splice points. Derived from the reference's
  token bytes (building the reference: ~1.3 s for qwen3 on the first session of a process), kept as one .npz
  (~3 bytes per token).
Both live in the cache directory, keyed by family and content hash; a missing, unreadable or mismatched entry is
derived again (never assumed present).
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..reference import FamilyLike, VocabMeta, vocab_meta
from .artifacts import cache_dir

META_VERSION = 2
FACTS_VERSION = 1


def cached_meta(family: FamilyLike, data: bytes, content_hash: str) -> VocabMeta:
    path = cache_dir() / f"vocab-meta-v{META_VERSION}-{family.name}-{content_hash[:32]}.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw["content_hash"] == content_hash:
            return VocabMeta({str(k): int(v) for k, v in raw["specials"].items()}, int(raw["n_vocab"]),
                             str(raw["normalizer"]), frozenset(int(i) for i in raw["skipped"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    meta = vocab_meta(family, data)
    record = {"content_hash": content_hash, "specials": meta.specials, "n_vocab": meta.n_vocab,
              "normalizer": meta.normalizer, "skipped": sorted(meta.skipped)}
    _store(path, lambda tmp: tmp.write_text(json.dumps(record, ensure_ascii=False), encoding="utf-8"))
    return meta


def _store(path: Path, write: Callable[[Path], object]) -> None:
    """`write` a temporary file beside `path`, then rename it into place (readers see a whole file or none)."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}{path.suffix}")    # np.savez keeps a name ending in .npz
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError:     # an unwritable cache only costs the next process the derivation
        pass


@dataclass(frozen=True)
class VocabFacts:
    token_chars: np.ndarray             # uint16[id]: characters the token's bytes start (reference.token_chars)
    continuation_start: np.ndarray      # bool[id]: the token's first byte continues a character
    max_token_chars: int                # most characters one ordinary token covers


def cached_facts(family: FamilyLike, content_hash: str, derive: Callable[[], VocabFacts]) -> VocabFacts:
    """The file's VocabFacts from the cache, else `derive()` (then stored for the next process)."""
    path = cache_dir() / f"vocab-facts-v{FACTS_VERSION}-{family.name}-{content_hash[:32]}.npz"
    try:
        with np.load(path, allow_pickle=False) as z:
            tc, cs = z["token_chars"], z["continuation_start"]
            ok = (str(z["content_hash"]) == content_hash and tc.dtype == np.uint16 and cs.dtype == np.bool_
                  and tc.ndim == 1 and tc.shape == cs.shape)
            if ok:
                tc.setflags(write=False)
                cs.setflags(write=False)
                return VocabFacts(tc, cs, int(z["max_token_chars"]))
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile):   # absent or damaged: derive
        pass
    facts = derive()
    _store(path, lambda tmp: np.savez(tmp, token_chars=np.ascontiguousarray(facts.token_chars, np.uint16),
                                      continuation_start=np.ascontiguousarray(facts.continuation_start, np.bool_),
                                      max_token_chars=np.int64(facts.max_token_chars),
                                      content_hash=np.str_(content_hash)))
    return facts
