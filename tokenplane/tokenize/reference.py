"""Reference engines behind one interface: tiktoken for cl100k/o200k/llama3, HF `tokenizers` for qwen3, deepseek_v4,
smollm2.

Every fast path in tokenplane is defined as "returns what `ReferenceEngine.encode_ordinary` returns" and is
differential-tested against it. The engine also reports per-token ends (in characters of the normalized text), which
the session store uses as record positions, and the reference piece boundaries of the pre-tokenizer.

This module imports nothing of tokenplane: the shadow verifier's fresh engine must share no code with the fast paths
it checks, so normalization here is the reference normalizer itself (HF's NFC for qwen3), never the fast NFC of
`cpu/nfc.py`. A family is read by duck typing (`FamilyLike`).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Iterable, Protocol

import numpy as np


class FamilyLike(Protocol):
    """What a reference engine reads of a family (spec.families.Family satisfies it)."""

    @property
    def name(self) -> str: ...
    @property
    def engine(self) -> str: ...
    @property
    def patterns(self) -> tuple[str, ...]: ...
    @property
    def onig_patterns(self) -> tuple[str, ...]: ...
    @property
    def specials(self) -> dict[str, int]: ...


def parse_tiktoken(data: bytes) -> dict[bytes, int]:
    """tiktoken's file format ("base64 rank" lines) -> {token bytes: rank}."""
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-char table used by ByteLevel vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def utf8_char_ends(text: str, byte_ends: np.ndarray) -> np.ndarray:
    """Map byte end offsets (into text's UTF-8) to character end offsets; a token ending inside a multi-byte
    character counts that character as covered."""
    if text.isascii():
        return byte_ends.astype(np.int64, copy=False)
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    leads = np.concatenate(([0], np.cumsum((raw & 0xC0) != 0x80)))
    return leads[byte_ends.astype(np.int64)]


@dataclass(frozen=True)
class VocabMeta:
    """What a Tokenizer needs of its file before (or without) building the reference engine."""

    specials: dict[str, int]
    n_vocab: int            # len(token_bytes) of the reference engine
    normalizer: str         # "none" (identity), "nfc" (exactly HF's NFC, `plain_nfc`) or "other"
    # The ids a decode with skip_special_tokens drops (HF: the added tokens marked special; `<think>` and
    # `<tool_call>` are added but not special, so they stay in the text, as vLLM's detokenizer keeps them).
    skipped: frozenset[int]


def hf_specials(config: dict) -> dict[str, int]:
    return {a["content"]: a["id"] for a in config.get("added_tokens", [])}


def hf_skipped(config: dict) -> frozenset[int]:
    return frozenset(a["id"] for a in config.get("added_tokens", []) if a.get("special"))


def hf_normalizer(config: dict) -> str:
    norm = config.get("normalizer")
    if norm is None or norm == {"type": "Sequence", "normalizers": []}:
        return "none"
    return "nfc" if norm == {"type": "NFC"} else "other"


def vocab_meta(family: FamilyLike, data: bytes) -> VocabMeta:
    """The VocabMeta of a verified file, derived by the same rules as the reference engines' own fields (a test
    checks them equal for every family)."""
    if family.engine == "tiktoken":
        ranks = parse_tiktoken(data)
        specials = dict(family.specials)
        return VocabMeta(specials, max(max(ranks.values()), max(specials.values(), default=0)) + 1, "none",
                         frozenset(specials.values()))
    config = json.loads(data)
    specials = hf_specials(config)
    vocab = config["model"]["vocab"]
    return VocabMeta(specials, max(max(vocab.values()), max(specials.values(), default=0)) + 1,
                     hf_normalizer(config), hf_skipped(config))


class ReferenceEngine:
    """Uniform face over tiktoken / HF tokenizers for one family."""

    family: FamilyLike
    token_bytes: list[bytes]        # id -> bytes (specials: their UTF-8)
    specials: dict[str, int]

    def encode_ordinary(self, text: str) -> np.ndarray:
        raise NotImplementedError

    n_ordinary: int
    plain_nfc: bool = False         # the normalizer is exactly NFC (qwen3): the fast NFC may stand in for it

    def normalize(self, text: str) -> str:
        return text

    def pretokenize(self, text: str) -> list[tuple[int, int]]:
        """Reference piece spans (character offsets of the normalized text)."""
        pieces = [(0, len(text))]
        for split in self._onig_splitters:
            out: list[tuple[int, int]] = []
            for start, end in pieces:
                for _, (s, e) in split.pre_tokenize_str(text[start:end]):
                    out.append((start + s, start + e))
            pieces = out
        return pieces

    @cached_property
    def _onig_splitters(self) -> list:
        from tokenizers import Regex, pre_tokenizers

        return [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in self.family.onig_patterns]

    @cached_property
    def token_lengths(self) -> np.ndarray:
        return np.fromiter((len(b) for b in self.token_bytes), dtype=np.int64, count=len(self.token_bytes))

    @cached_property
    def token_chars(self) -> np.ndarray:
        """uint16[id]: characters the token's bytes start (UTF-8 lead bytes), i.e. how far it moves a character end
        (char_ends of consecutive tokens differ by exactly this, but across bytes the vocabulary drops)."""
        flat = np.frombuffer(b"".join(self.token_bytes), dtype=np.uint8)
        leads = np.concatenate(([0], np.cumsum((flat & 0xC0) != 0x80)))
        bounds = np.concatenate(([0], np.cumsum(self.token_lengths)))
        lengths = leads[bounds[1:]] - leads[bounds[:-1]]
        if lengths.size and lengths.max() > 0xFFFF:
            raise ValueError("a token starts more than 65535 characters")
        return lengths.astype(np.uint16)

    @cached_property
    def continuation_start(self) -> np.ndarray:
        """bool[id]: the token's first byte is a UTF-8 continuation byte, i.e. the previous token ended inside a
        character (such a character end is not a clean split point)."""
        return np.fromiter(((len(b) > 0 and (b[0] & 0xC0) == 0x80) for b in self.token_bytes), dtype=bool,
                           count=len(self.token_bytes))

    @cached_property
    def max_token_chars(self) -> int:
        """Most characters one ordinary token can cover (a token that starts inside a character covers it too)."""
        best = 0
        for tok in self.token_bytes:
            n = sum(1 for b in tok if (b & 0xC0) != 0x80) + (1 if tok and (tok[0] & 0xC0) == 0x80 else 0)
            best = max(best, n)
        return best

    # bool[256]: bytes that have no token. HF's BPE without an unknown token or byte fallback drops such a byte from
    # the piece and merges its neighbours across it (SmolLM2 lacks 21 single bytes, 6 of them ASCII controls).
    missing_bytes: np.ndarray | None = None

    def char_ends(self, text: str, ids: np.ndarray) -> np.ndarray:
        """Each token's end in characters of `text` (its IDs `ids`): the character after the token's last byte. When
        the vocabulary drops bytes, the token bytes are the text's bytes without the dropped ones."""
        byte_ends = np.cumsum(self.token_lengths[ids])
        missing = self.missing_bytes
        if missing is not None and not (text.isascii() and not missing[:128].any()):
            raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
            drop = missing[raw]
            if drop.any():
                kept = np.flatnonzero(~drop)
                byte_ends = kept[byte_ends.astype(np.int64) - 1] + 1 if byte_ends.size else byte_ends
        return utf8_char_ends(text, byte_ends)

    def encode_with_ends(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """IDs of normalize(text) plus each token's end offset in characters of normalize(text)."""
        norm = self.normalize(text)
        ids = self.encode_ordinary_normalized(norm)
        return ids, self.char_ends(norm, ids)

    def encode_ordinary_normalized(self, norm: str) -> np.ndarray:
        """Encode text that is already normalized (normalization is idempotent, so this equals encode_ordinary)."""
        return self.encode_ordinary(norm)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.token_bytes[i] for i in ids)


class TiktokenReference(ReferenceEngine):
    def __init__(self, family: FamilyLike, tiktoken_bytes: bytes):
        import tiktoken

        self.family = family
        ranks = parse_tiktoken(tiktoken_bytes)
        self.specials = dict(family.specials)
        self.encoding = tiktoken.Encoding(
            name=f"tokenplane-{family.name}", pat_str=family.patterns[0], mergeable_ranks=ranks,
            special_tokens=self.specials)
        n = max(max(ranks.values()), max(self.specials.values(), default=0)) + 1
        table: list[bytes] = [b""] * n
        for tok, rank in ranks.items():
            table[rank] = tok
        for text, rank in self.specials.items():
            table[rank] = text.encode()
        self.token_bytes = table
        self.n_ordinary = len(ranks)

    def encode_ordinary(self, text: str) -> np.ndarray:
        return np.asarray(self.encoding.encode_ordinary(text), dtype=np.uint32)


class HFReference(ReferenceEngine):
    """HF tokenizers with added tokens stripped, so special-token strings in user text encode as ordinary text
    (the `allowed_special` decision is ours, made by the literal pass before the splitter)."""

    def __init__(self, family: FamilyLike, json_bytes: bytes):
        from tokenizers import Tokenizer as HFTokenizer

        self.family = family
        config = json.loads(json_bytes)
        self._json_bytes = json_bytes
        self.specials = hf_specials(config)
        config["added_tokens"] = []
        self.ordinary = HFTokenizer.from_str(json.dumps(config))
        self._normalizer = self.ordinary.normalizer
        self.plain_nfc = hf_normalizer(config) == "nfc"
        # An empty Sequence (deepseek_v4) changes nothing, yet normalize_str still builds an alignment map: ~50 ms
        # on 4M characters, serial in front of every encode. Treated as absent.
        if hf_normalizer(config) == "none":
            self._normalizer = None
        vocab = config["model"]["vocab"]
        decode_byte = {c: b for b, c in bytes_to_unicode().items()}
        n = max(max(vocab.values()), max(self.specials.values(), default=0)) + 1
        table: list[bytes] = [b""] * n
        for tok, rank in vocab.items():
            if all(c in decode_byte for c in tok):
                table[rank] = bytes(decode_byte[c] for c in tok)
            else:   # literal vocab entries (e.g. DeepSeek's BOS/EOS at ids 0-2) are not byte-level encoded
                table[rank] = tok.encode()
        for text, rank in self.specials.items():
            table[rank] = text.encode()
        self.token_bytes = table
        self.n_ordinary = len(vocab)
        missing = np.array([c not in vocab for c in bytes_to_unicode().values()], dtype=bool)
        if missing.any() and not (config["model"].get("byte_fallback") or config["model"].get("unk_token")):
            self.missing_bytes = np.zeros(256, dtype=bool)
            self.missing_bytes[[b for b, c in bytes_to_unicode().items() if c not in vocab]] = True

    @cached_property
    def full(self):
        """The file with its added tokens (the chat-template path), built on first use: most processes never need
        it, and it is a second parse of the whole file (~0.4 s for qwen3)."""
        from tokenizers import Tokenizer as HFTokenizer

        return HFTokenizer.from_str(self._json_bytes.decode("utf-8"))

    def pretokenize(self, text: str) -> list[tuple[int, int]]:
        """A family whose chain is not all Splits (smollm2: HF's Digits, then ByteLevel's own regex) has no
        `onig_patterns`; its pieces come from the tokenizer.json's own pre-tokenizer (character offsets)."""
        if self.family.onig_patterns:
            return super().pretokenize(text)
        pre = self.ordinary.pre_tokenizer
        if pre is None:
            return [(0, len(text))] if text else []
        return [span for _, span in pre.pre_tokenize_str(text)]

    def model_config(self) -> dict:
        """The BPE model section (vocab, merges, options) of the loaded file itself, serialized by HF, so a file
        loaded by path is never paired with another file's merges."""
        return json.loads(self.ordinary.to_str())["model"]

    def normalize(self, text: str) -> str:
        if self._normalizer is None or text.isascii():
            return text   # NFC is the identity on ASCII
        return self._normalizer.normalize_str(text)

    def encode_ordinary(self, text: str) -> np.ndarray:
        return np.asarray(self.ordinary.encode(text, add_special_tokens=False).ids, dtype=np.uint32)


def make_reference(family: FamilyLike, data: bytes) -> ReferenceEngine:
    """`data` is the verified file content: tiktoken rank lines or a tokenizer.json."""
    if family.engine == "tiktoken":
        return TiktokenReference(family, data)
    return HFReference(family, data)
