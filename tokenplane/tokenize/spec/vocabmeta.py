"""A tokenizer file's VocabMeta (specials, vocabulary size, normalizer kind), cached by the file's sha256.

`Tokenizer` builds its reference engine only when something needs it (reference encodes, sessions, decoding); what
it needs at construction is this small record. Deriving it parses the whole file (json.loads of 11 MB for qwen3,
~0.1-0.2 s; the rank lines of a .tiktoken file), so it is kept as a few hundred bytes of JSON in the cache directory,
keyed by family and content hash. A missing or unreadable entry is derived again (never assumed present).
"""

from __future__ import annotations

import json
import os

from ..reference import FamilyLike, VocabMeta, vocab_meta
from .artifacts import cache_dir

META_VERSION = 1


def cached_meta(family: FamilyLike, data: bytes, content_hash: str) -> VocabMeta:
    path = cache_dir() / f"vocab-meta-v{META_VERSION}-{family.name}-{content_hash[:32]}.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw["content_hash"] == content_hash:
            return VocabMeta({str(k): int(v) for k, v in raw["specials"].items()}, int(raw["n_vocab"]),
                             str(raw["normalizer"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    meta = vocab_meta(family, data)
    record = {"content_hash": content_hash, "specials": meta.specials, "n_vocab": meta.n_vocab,
              "normalizer": meta.normalizer}
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(record, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:     # an unwritable cache only costs the next process the derivation
        pass
    return meta
