"""Host-built lookup tables for the device pipeline: compact character classes, vocabulary hash, merge-pair hash.

Everything here is plain numpy, built once per tokenizer (cached on disk, keyed by the tokenizer's sha256) and
uploaded once. The device hash functions in `hashing` and the host ones here must agree bit for bit; both are
written in int64 arithmetic whose products stay below 2**63, so numpy, the CUDA simulator and the GPU compute the
same values without relying on wrap-around.

BPE semantics are tiktoken's: a part's rank is the rank of its bytes, and every part is a vocabulary token (all 256
single bytes are tokens and a merge yields the concatenation's token), so "rank of bytes(left) + bytes(right)" equals
a lookup of the pair (left_id, right_id) in a table of every split of every token. For tiktoken vocabularies
rank == token id, which the builder checks.

HF byte-level BPE (qwen3, deepseek_v4) runs on the same kernels when merge ranks are ordered like the ids they
produce, so "lowest id" picks the lowest-rank merge, and the pair table holds exactly the listed merges (the builder
checks it, else it refuses). The whole-piece lookup then holds only the tokens whose own bytes merge back to them
(the CPU BPE's self-encoding set): for those one lookup answers what the merges would, and any other piece, such as
DeepSeek's 3 tokens that the merges never produce from their own bytes, goes through the merge rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..spec.artifacts import cache_dir
from ..spec.charclass import BIT, class_table
from ..spec.families import Family

if TYPE_CHECKING:   # type names only: these modules sit above this one
    from ..tokenizer import Tokenizer

TABLE_VERSION = 3       # 2: an HF whole-piece lookup holds only self-encoding tokens; 3: own pairs only
EMPTY = -1
PAIR_SHIFT = 20          # key = left << 20 | right; vocabularies up to 2**20 ids
FNV_OFFSET = 2166136261
FNV_PRIME = 16777619
MASK32 = 0xFFFFFFFF

# compact class code per code point: bits 0-1 class (L, N, W, O), then case/mark bits for the o200k rules
K_L, K_N, K_W, K_O = 0, 1, 2, 3
B_PU, B_PL, B_C, B_M = 4, 8, 16, 32


def compact_classes(engine: str = "tiktoken") -> np.ndarray:
    """uint8 code per code point from the probed class bitmasks (never from unicodedata)."""
    t = class_table(engine)
    code = np.full(t.shape, K_O, dtype=np.uint8)
    is_l = (t & BIT["L"]) != 0
    is_n = ((t & BIT["N"]) != 0) & ~is_l
    is_w = ((t & BIT["s"]) != 0) & ~is_l & ~is_n
    code[is_w] = K_W
    code[is_n] = K_N
    code[is_l] = K_L
    code[(t & (BIT["Lu"] | BIT["Lt"])) != 0] |= B_PU
    code[(t & BIT["Ll"]) != 0] |= B_PL
    code[(t & (BIT["Lm"] | BIT["Lo"])) != 0] |= B_C
    code[(t & BIT["M"]) != 0] |= B_M
    return code


def fnv1a(data: bytes) -> int:
    h = FNV_OFFSET
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & MASK32
    return h


def pair_hash_np(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    h = left.astype(np.int64) * 0x9E3779B1 + right.astype(np.int64) * 0x85EBCA77
    h = h & MASK32
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & MASK32
    h ^= h >> 13
    return h


def _insert_linear(home: np.ndarray, mask: int) -> np.ndarray:
    """Slot of each entry under linear probing, placing entries in index order (vectorized rounds)."""
    size = mask + 1
    slot_of = np.full(len(home), -1, dtype=np.int64)
    owner = np.full(size, -1, dtype=np.int64)
    pending = np.arange(len(home))
    dist = np.zeros(len(home), dtype=np.int64)
    while len(pending):
        slots = (home[pending] + dist[pending]) & mask
        free = owner[slots] < 0
        cand, cand_slots = pending[free], slots[free]
        # first (lowest index) candidate per free slot wins this round
        uniq, first = np.unique(cand_slots, return_index=True)
        winners = cand[first]
        owner[uniq] = winners
        slot_of[winners] = uniq
        placed = np.zeros(len(home), dtype=bool)
        placed[winners] = True
        pending = pending[~placed[pending]]
        dist[pending] += 1
    return slot_of


@dataclass
class HostTables:
    classes: np.ndarray      # uint8[0x110000]
    byte_id: np.ndarray      # int32[256]
    tok_off: np.ndarray      # int32[n+1]
    tok_blob: np.ndarray     # uint8[...]
    vocab_slots: np.ndarray  # int32[pow2]: token id or -1, keyed by fnv1a(bytes)
    pair_keys: np.ndarray    # int64[pow2]: left << 20 | right, or -1
    pair_vals: np.ndarray    # int32[pow2]: merged token id (== rank)
    max_token_bytes: int
    n_pairs: int


def _build(token_bytes: list[bytes], n_ordinary: int, merges: tuple | None = None, classes: np.ndarray | None = None,
           whole_ids: np.ndarray | None = None, missing: np.ndarray | None = None) -> HostTables:
    """`whole_ids`: the multi-byte tokens the whole-piece lookup may answer (None: every token, tiktoken).
    `missing`: bytes without a token (their documents fall back, the table holds token 0 for them)."""
    toks = token_bytes[:n_ordinary]
    index = {t: i for i, t in enumerate(toks)}
    if missing is not None:
        index.update({bytes([b]): 0 for b in np.flatnonzero(missing).tolist()})
    if len(index) != n_ordinary + (0 if missing is None else int(missing.sum())) \
            or any(bytes([b]) not in index for b in range(256)):
        raise ValueError("vocabulary must hold 256 single bytes and unique tokens for tiktoken BPE semantics")
    byte_id = np.array([index[bytes([b])] for b in range(256)], dtype=np.int32)
    lens = np.fromiter((len(t) for t in toks), dtype=np.int64, count=n_ordinary)
    tok_off = np.zeros(n_ordinary + 1, dtype=np.int64)
    np.cumsum(lens, out=tok_off[1:])
    blob = np.frombuffer(b"".join(toks), dtype=np.uint8).copy()

    if whole_ids is None:
        looked_up = np.arange(n_ordinary, dtype=np.int64)
    else:
        looked_up = np.union1d(byte_id.astype(np.int64), np.asarray(whole_ids, dtype=np.int64))
    vsize = 1 << int(np.ceil(np.log2(max(2 * len(looked_up), 1024))))
    vhome = np.fromiter((fnv1a(toks[t]) for t in looked_up), dtype=np.int64, count=len(looked_up)) & (vsize - 1)
    vslot = _insert_linear(vhome, vsize - 1)
    vocab_slots = np.full(vsize, EMPTY, dtype=np.int32)
    vocab_slots[vslot] = looked_up.astype(np.int32)

    lefts, rights, vals = [], [], []
    get = index.get
    if merges is not None:          # HF: the listed merges only, (left, right) -> merged id
        lefts, rights, vals = (list(map(int, m)) for m in merges)
    else:
        for tid, t in enumerate(toks):
            for k in range(1, len(t)):
                a = get(t[:k])
                if a is not None:
                    b = get(t[k:])
                    if b is not None:
                        lefts.append(a)
                        rights.append(b)
                        vals.append(tid)
    left = np.array(lefts, dtype=np.int64)
    right = np.array(rights, dtype=np.int64)
    psize = 1 << int(np.ceil(np.log2(max(2 * len(vals), 1024))))
    pslot = _insert_linear(pair_hash_np(left, right) & (psize - 1), psize - 1)
    pair_keys = np.full(psize, EMPTY, dtype=np.int64)
    pair_vals = np.full(psize, EMPTY, dtype=np.int32)
    pair_keys[pslot] = (left << PAIR_SHIFT) | right
    pair_vals[pslot] = np.array(vals, dtype=np.int32)
    return HostTables(compact_classes() if classes is None else classes, byte_id, tok_off.astype(np.int32), blob,
                      vocab_slots, pair_keys, pair_vals, int(lens.max()), len(vals))


def class_codes(family: Family, missing_bytes: np.ndarray | None = None) -> np.ndarray:
    """The per-code-point code the family's classify kernel reads (`missing_bytes`: bytes without a token, whose
    characters smollm2's code flags for the fallback)."""
    if family.name == "deepseek_v4":
        from ..cpu.pretokenize import _cp_feat_deepseek

        return _cp_feat_deepseek(family.engine)
    if family.name == "smollm2":
        from ..cpu.pretokenize import _cp_kind_smollm2
        from .pretokenize_smollm2 import F_DROP

        code = _cp_kind_smollm2(family.engine).astype(np.uint8)
        return code | np.where(_drop_codepoints(missing_bytes), F_DROP, 0).astype(np.uint8)
    return compact_classes(family.engine)


def _drop_codepoints(missing_bytes: np.ndarray | None) -> np.ndarray:
    """bool per code point: its UTF-8 holds a byte without a token (lead bytes and ASCII; a vocabulary without a
    continuation byte would flag most of Unicode and is refused)."""
    out = np.zeros(0x110000, dtype=bool)
    if missing_bytes is None:
        return out
    cp = np.arange(0x110000)
    if missing_bytes[0x80:0xC0].any():
        raise ValueError("a vocabulary without a UTF-8 continuation byte has no device path")
    for b in np.flatnonzero(missing_bytes).tolist():
        if b < 0x80:
            out[b] = True
        elif 0xC2 <= b < 0xE0:
            out |= (cp >= 0x80) & (cp < 0x800) & ((cp >> 6) == (b & 0x1F))
        elif 0xE0 <= b < 0xF0:
            out |= (cp >= 0x800) & (cp < 0x10000) & ((cp >> 12) == (b & 0x0F))
        elif 0xF0 <= b < 0xF5:
            out |= (cp >= 0x10000) & ((cp >> 18) == (b & 0x07))
    return out


def _hf_merges(tokenizer) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """(left, right, merged id) of an HF byte-level BPE whose merges the device kernels can run exactly, and the
    tokens the whole-piece lookup may answer."""
    from ..cpu import bpetables

    bpe = bpetables.load(tokenizer.family.name, tokenizer.content_hash, lambda: tokenizer.reference)
    keys, ranks, news = bpe.pkeys, bpe.pranks, bpe.pnews
    live = ranks >= 0
    left = (keys[live] >> np.uint64(32)).astype(np.int64)
    right = (keys[live] & np.uint64(0xFFFFFFFF)).astype(np.int64)
    rank, new = ranks[live].astype(np.int64), news[live].astype(np.int64)
    order = np.argsort(rank, kind="stable")
    if np.any(np.diff(new[order]) <= 0):
        raise ValueError(f"{tokenizer.name}: merge ranks are not ordered like merged ids; no device BPE")
    return (left, right, new), bpe.whole_ids


def host_tables(tokenizer: Tokenizer) -> HostTables:
    """Tables for a tiktoken-engine tokenizer (or an HF byte-level BPE that passes `_hf_merges`), cached on disk by
    content hash."""
    ref = tokenizer.reference
    n = getattr(ref, "n_ordinary", None)
    engine = tokenizer.family.engine
    if n is None or (engine != "tiktoken" and tokenizer.family.name not in ("qwen3", "deepseek_v4", "smollm2")):
        raise ValueError(f"{tokenizer.name}: device BPE tables need tiktoken rank semantics")
    missing = getattr(ref, "missing_bytes", None)
    classes = class_codes(tokenizer.family, missing)
    path = cache_dir() / f"gpu-tables-v{TABLE_VERSION}-{tokenizer.content_hash[:24]}.npz"
    if path.exists():
        try:
            with np.load(path) as z:
                return HostTables(classes, z["byte_id"], z["tok_off"], z["tok_blob"], z["vocab_slots"],
                                  z["pair_keys"], z["pair_vals"], int(z["max_token_bytes"]), int(z["n_pairs"]))
        except (OSError, ValueError, KeyError):
            pass
    merges, whole_ids = (None, None) if engine == "tiktoken" else _hf_merges(tokenizer)
    t = _build(ref.token_bytes, n, merges, classes, whole_ids, missing)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, byte_id=t.byte_id, tok_off=t.tok_off, tok_blob=t.tok_blob, vocab_slots=t.vocab_slots,
             pair_keys=t.pair_keys, pair_vals=t.pair_vals, max_token_bytes=t.max_token_bytes, n_pairs=t.n_pairs)
    tmp.replace(path)
    return t
