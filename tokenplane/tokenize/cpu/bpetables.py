"""The BPE kernel's compact tables of one tokenizer, built once from the reference engine and memory-mapped after.

Building them needs the reference engine (the vocabulary as bytes, the merges of an HF file as HF serializes them),
the pair-table and whole-piece builders and, for HF files, a self-encoding pass over every token: ~1-2 s and, for
qwen3, two parses of an 11 MB tokenizer.json. A fresh process needs none of that: the finished arrays are kept in the
cache directory as plain .npy files in a folder keyed by the sha256 of the tokenizer file (the content, never its
name or path), the family and TABLE_VERSION, and are opened with `np.load(mmap_mode="c")`: copy-on-write pages, so
the kernels see ordinary writable C arrays (the same numba signatures as freshly built tables) and the OS shares and
pages them.

A missing, partial or unreadable folder is rebuilt on demand (nothing here assumes a cache is present); a folder is
written under a temporary name and renamed into place, so a reader sees all of it or none of it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..reference import HFReference, ReferenceEngine, bytes_to_unicode
from ..spec.artifacts import cache_dir
from . import backtrack
from .bpe import _build_pairs, _build_whole, _pair_entries, table_cap
from .merge import _last_merges, pair_records, table_width
from .piecemap import whole_map

TABLE_VERSION = 13      # bump when what a table holds or how it is built changes: old folders are then ignored
_ARRAYS = ("tok_flat", "tok_off", "byte_ids", "pkeys", "pranks", "pnews", "ptab", "whole_ids", "wkeys", "wids",
           "wmap", "warena", "btda", "btrec", "missing")


@dataclass(frozen=True)
class BpeTables:
    family_name: str
    content_hash: str
    n_vocab: int
    n_pairs: int
    tok_flat: np.ndarray        # uint8: every token's bytes, concatenated
    tok_off: np.ndarray         # int64[n_vocab + 1]
    byte_ids: np.ndarray        # int32[256]: the token of each single byte, -1 where the vocabulary has none
    pkeys: np.ndarray           # uint64 pair keys (left << 32 | right), open addressing
    pranks: np.ndarray          # int32
    pnews: np.ndarray           # int32
    ptab: np.ndarray            # uint64[1 or 2, cap]: the same pairs as the kernels read them (merge.pair_records)
    whole_ids: np.ndarray       # int64: tokens a whole piece may map to directly
    wkeys: np.ndarray           # uint64: FNV hash table over whole_ids, then its filter (merge.table_width)
    wids: np.ndarray            # int32
    wmap: np.ndarray            # uint64[cap + filter rows, 2]: the same lookup for tokens of <= 8 bytes, keyed as
                                #   the piece map, then its filter; also a piece map's seed (piecemap.whole_map)
    warena: np.ndarray          # uint32: the seed's arena entries (tokens of 9-16 bytes)
    btda: np.ndarray            # uint64: backtrack.py's double-array trie of the self-encoding tokens (empty: the
                                #   orders are not monotone and new pieces keep merge.py's kernels)
    btrec: np.ndarray           # int64[n_vocab, 2] (or [0, 2]): backtrack.py's per-token order, parts, prefix
    missing: np.ndarray | None  # bool[256]: bytes the reference drops (None: the vocabulary has all 256)


def _tiktoken_pairs(token_bytes: list[bytes], n_ordinary: int):
    ids = {tok: i for i, tok in enumerate(token_bytes[:n_ordinary]) if tok}
    left, right, rank = [], [], []
    for tok, t in ids.items():
        for k in range(1, len(tok)):
            x = ids.get(tok[:k])
            if x is not None:
                y = ids.get(tok[k:])
                if y is not None:
                    left.append(x)
                    right.append(y)
                    rank.append(t)
    rank = np.asarray(rank, dtype=np.int32)
    return np.asarray(left, dtype=np.int32), np.asarray(right, dtype=np.int32), rank, rank.copy()


def _hf_pairs(model: dict):
    vocab = model["vocab"]
    left, right, rank, new = [], [], [], []
    for r, merge in enumerate(model["merges"]):
        x, y = merge.split(" ", 1) if isinstance(merge, str) else merge
        left.append(vocab[x])
        right.append(vocab[y])
        rank.append(r)
        new.append(vocab[x + y])
    as32 = lambda v: np.asarray(v, dtype=np.int32)  # noqa: E731
    return as32(left), as32(right), as32(rank), as32(new)


def _own_pairs(left, right, rank, new, tok_flat, tok_off, multi, byte_ids):
    """The pair table the kernels need: (keys, ranks, merged IDs, own) where own[j] says token multi[j] is
    self-encoding (the BPE of its own bytes yields it alone).

    Of all pairs that concatenate to a token, only one per self-encoding token can ever merge: the last merge of
    the BPE of the token's own bytes. In any BPE run every part is a self-encoding token and the merges inside its
    span are exactly those of its own bytes' BPE (nothing outside the span changes the pairs inside it while the span's
    ends stay part boundaries, so the leftmost minimum inside is merged next in both runs). So a pair that merges
    into T is T's own last merge, and a pair not kept is never the leftmost minimum where it is looked up: dropping
    it leaves every choice, and so the IDs, unchanged. cl100k has 233K pairs (every split of a token into two
    tokens) and 100K own pairs: a 2 MB table instead of 4, which a merge probes once or twice a step."""
    if not np.isin(new, multi).all():
        raise ValueError("a pair merges into a token outside the ordinary multi-byte vocabulary")
    keys, ranks, news = _build_pairs(left, right, rank, new, table_cap(len(left)))
    lo, hi = _last_merges(tok_flat, tok_off, multi, byte_ids, pair_records(keys, ranks, news))
    own = lo >= 0
    lo, hi = lo[own], hi[own]
    r, n = _pair_entries(keys, ranks, news, lo, hi)
    if not np.array_equal(n, multi[own]):
        raise ValueError("a token's last merge is not a pair of the table")
    return (*_build_pairs(lo, hi, r, n, table_cap(len(lo))), own)


def build(reference: ReferenceEngine, content_hash: str) -> BpeTables:
    """The tables of the tokenizer whose reference engine this is (no cache involved)."""
    fam = reference.family
    tokens = reference.token_bytes
    n_ord = reference.n_ordinary
    lengths = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
    tok_off = np.zeros(len(tokens) + 1, dtype=np.int64)
    np.cumsum(lengths, out=tok_off[1:])
    tok_flat = np.frombuffer(b"".join(tokens), dtype=np.uint8).copy()
    # HF: the model section of the tokenizer's own file (a file loaded by path may share a family's splitter, not
    # its merges)
    model = reference.model_config() if isinstance(reference, HFReference) else None
    if fam.engine == "tiktoken":
        left, right, rank, new = _tiktoken_pairs(tokens, n_ord)
        byte_map = {tok[0]: i for i, tok in enumerate(tokens[:n_ord]) if len(tok) == 1}
        ignore_merges = True
    else:
        if model is None:
            raise ValueError(f"{fam.name}: an HF family needs an HF reference engine")
        if model.get("byte_fallback") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") \
                or model.get("dropout"):
            raise ValueError(f"{fam.name}: BPE options outside what this kernel implements")
        left, right, rank, new = _hf_pairs(model)
        vocab = model["vocab"]
        byte_map = {b: vocab[c] for b, c in bytes_to_unicode().items() if c in vocab}
        ignore_merges = bool(model.get("ignore_merges") or False)
    missing = reference.missing_bytes
    if len(byte_map) != 256 and (missing is None or int(missing.sum()) != 256 - len(byte_map)):
        raise ValueError(f"{fam.name}: {256 - len(byte_map)} single bytes have no token")
    byte_ids = np.array([byte_map.get(b, -1) for b in range(256)], dtype=np.int32)
    multi = np.flatnonzero(lengths[:n_ord] >= 2).astype(np.int64)
    pkeys, pranks, pnews, own = _own_pairs(left, right, rank, new, tok_flat, tok_off, multi, byte_ids)
    ptab = pair_records(pkeys, pranks, pnews)
    if not ignore_merges:
        # Merges decide, but a piece's BPE depends on its bytes alone: a piece equal to a token whose own bytes
        # merge back to exactly that token encodes to it, so one lookup replaces the merge rounds (most words).
        multi = multi[own]
    cap = table_cap(len(multi))
    wkeys, wids = _build_whole(tok_flat, tok_off, multi, cap, table_width(cap))
    wmap, warena = whole_map(tok_flat, tok_off, multi, wkeys, wids)
    btda, btrec = backtrack.build(tok_flat, tok_off, byte_ids, ptab)
    return BpeTables(fam.name, content_hash, len(tokens), int(np.count_nonzero(own)), tok_flat, tok_off, byte_ids,
                     pkeys, pranks, pnews, ptab, multi, wkeys, wids, wmap, warena, btda, btrec,
                     None if missing is None else np.asarray(missing, dtype=bool))


def folder(family_name: str, content_hash: str) -> Path:
    # the family is part of the key: a tiktoken file's table holds its family's special tokens
    return cache_dir() / f"bpe-tables-v{TABLE_VERSION}-{family_name}-{content_hash[:32]}"


def _read(path: Path, family_name: str, content_hash: str) -> BpeTables | None:
    """The tables in `path`, memory-mapped; None when the folder is absent, partial, or describes other content."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("version") != TABLE_VERSION or meta.get("content_hash") != content_hash \
                or meta.get("family") != family_name:
            return None
        arrays = {}
        for name in _ARRAYS:
            if name == "missing" and not meta["has_missing"]:
                arrays[name] = None
                continue
            arr = np.load(path / f"{name}.npy", mmap_mode="c", allow_pickle=False)
            if list(arr.shape) != meta["shapes"][name] or str(arr.dtype) != meta["dtypes"][name]:
                return None
            arrays[name] = np.asarray(arr)     # a plain ndarray view of the mapping (no memmap subclass)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return BpeTables(family_name, content_hash, int(meta["n_vocab"]), int(meta["n_pairs"]), **arrays)


def _write(path: Path, tables: BpeTables) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shapes, dtypes = {}, {}
    for name in _ARRAYS:
        arr = getattr(tables, name)
        if arr is None:
            continue
        np.save(tmp / f"{name}.npy", np.ascontiguousarray(arr), allow_pickle=False)
        shapes[name], dtypes[name] = list(arr.shape), str(arr.dtype)
    meta = {"version": TABLE_VERSION, "content_hash": tables.content_hash, "family": tables.family_name,
            "n_vocab": tables.n_vocab, "n_pairs": tables.n_pairs, "has_missing": tables.missing is not None,
            "shapes": shapes, "dtypes": dtypes}
    (tmp / "meta.json").write_text(json.dumps(meta))   # written last: a folder without it is never read
    if path.exists() and _read(path, tables.family_name, tables.content_hash) is None:
        shutil.rmtree(path, ignore_errors=True)     # a stale or partial folder of another version: replace it
    try:
        os.replace(tmp, path)
    except OSError:     # another process put a complete folder there first: keep it
        shutil.rmtree(tmp, ignore_errors=True)


def load(family_name: str, content_hash: str, reference: Callable[[], ReferenceEngine]) -> BpeTables:
    """The tables of the tokenizer file whose sha256 is `content_hash`: memory-mapped from the cache, or built from
    `reference()` (called only then) and cached."""
    path = folder(family_name, content_hash)
    tables = _read(path, family_name, content_hash)
    if tables is not None:
        return tables
    built = build(reference(), content_hash)
    try:
        _write(path, built)
    except OSError:     # an unwritable cache costs the next process a rebuild, never this one its tables
        pass
    return built
