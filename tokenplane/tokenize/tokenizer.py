"""The public Tokenizer: family configuration + verified vocabulary + reference engine + the encode paths it was given.

Contract (the only one): every path returns exactly the reference engine's IDs for the same text, or raises.
A Tokenizer never builds or replaces its own fast paths: `registry.load` builds them (router.fast_paths) and passes
them in as a factory, once, at construction.
"""

from __future__ import annotations

import hashlib
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import cache, cached_property
from typing import TYPE_CHECKING, Callable, Collection, Iterable, Literal, Mapping, Sequence

import numpy as np

from . import batch
from .cpu import nfc
from .cpu.segments import with_literals
from .errors import InvalidTextError, PathUnavailableError, TextTooLargeError, validate_text  # noqa: F401
from .reference import ReferenceEngine, bytes_to_unicode, make_reference
from .router import encode_segments_on, segment_encoder
from .spec.families import Family
from .spec.vocabmeta import VocabFacts, cached_facts, cached_meta

if TYPE_CHECKING:   # sessions (and the numba kernels they run) are imported on first use, not by `import tokenplane`
    from .cpu.boundary import BoundaryRule
    from .repair import WindowRepair
    from .session import Session
    from .splice import SpliceSearch

DEFAULT_MAX_CHARS = 64 * 1024 * 1024
EncodePath = Literal["auto", "reference", "cpu", "gpu"]
Encoder = Callable[[str], np.ndarray]
EncoderFactory = Callable[["Tokenizer"], Mapping[str, Encoder]]
AllowedSpecial = Collection[str] | Literal["all"]


@cache
def _hf_nfc() -> Callable[[str], str]:
    """HF tokenizers' NFC (`normalizers.NFC`), the normalizer a plain-NFC tokenizer.json holds; like the reference
    engine's `normalize`, ASCII is returned as is (NFC is the identity on it)."""
    from tokenizers import normalizers

    fn = normalizers.NFC().normalize_str
    return lambda text: text if text.isascii() else fn(text)


class SpecialMatcher:
    """Leftmost-longest literal pass over the added/special tokens."""

    def __init__(self, specials: dict[str, int]):
        self.specials = specials

    @cached_property
    def regex(self) -> re.Pattern[str] | None:
        """Compiled on first use: an encode with no allowed specials never needs it, and deepseek_v4's ~800
        literals take ~30 ms to compile, a tenth of a cold start."""
        literals = sorted(self.specials, key=len, reverse=True)  # first alternative wins at a position -> longest
        return re.compile("|".join(map(re.escape, literals))) if literals else None

    def matches(self, text: str) -> Iterable[tuple[int, int, str]]:
        """Every literal match (start, end, literal), allowed or not, in text order."""
        if self.regex is None:
            return ()
        return ((m.start(), m.end(), m.group()) for m in self.regex.finditer(text))

    def split(self, text: str, allowed: Collection[str]) -> list[tuple[str, int | None]]:
        """Segments of (text, None) for ordinary text and (literal, id) for allowed specials."""
        if not allowed or self.regex is None:
            return [(text, None)]
        out: list[tuple[str, int | None]] = []
        pos = 0
        for start, end, literal in self.matches(text):
            if literal not in allowed:
                continue   # text like a special but not allowed: ordinary text (tiktoken encode_ordinary semantics)
            if start > pos:
                out.append((text[pos:start], None))
            out.append((literal, self.specials[literal]))
            pos = end
        if pos < len(text) or not out:
            out.append((text[pos:], None))
        return out


@cache
def _byte_of_char() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


class Tokenizer:
    """A frozen tokenizer: family configuration + verified vocabulary + reference engine + exact encode paths.

    `encoders(tok)` returns the fast paths by name ("cpu", "auto", "gpu"); without it, or for a name it does not
    return, "cpu" and "auto" are the reference engine (same IDs, no speed-up) and "gpu" is unavailable.
    """

    def __init__(self, name: str, family: Family, data: bytes, *, max_chars: int = DEFAULT_MAX_CHARS,
                 encoders: EncoderFactory | None = None, options: tuple = (), content_hash: str | None = None):
        """`content_hash`: the sha256 of `data` when the caller has just verified it (saves hashing it again)."""
        self.name = name
        self.family = family
        self.content_hash = content_hash or hashlib.sha256(data).hexdigest()
        self.max_chars = max_chars
        self.options = options          # what the registry built this instance with (its cache key)
        # The reference engine is built on first use (`reference`): a fresh process that only encodes through the
        # fast path never pays for it (qwen3: ~1.5 s of JSON parsing and HF construction). What construction needs
        # of the file comes from a small record cached by content hash (spec/vocabmeta.py).
        self._data = data
        self._reference: ReferenceEngine | None = None
        self._reference_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None     # encode_batch's threads, made on first use
        self._pool_workers = 0
        meta = cached_meta(family, data, self.content_hash)
        self._n_vocab = meta.n_vocab
        self.normalizer_kind = meta.normalizer      # "none" (identity), "nfc" (exactly HF's NFC) or "other"
        self.plain_nfc = meta.normalizer == "nfc"   # exactly HF's NFC (qwen3): the fast NFC may stand in for it
        self.specials: dict[str, int] = dict(meta.specials)
        self.decode_skipped: frozenset[int] = meta.skipped   # dropped by a skip_special_tokens decode
        self._matcher = SpecialMatcher(self.specials)
        self._special_masks: dict[frozenset[str], np.ndarray] = {}
        self._allowed_sets: dict[frozenset[str], frozenset[str]] = {}
        self._splice_searches: dict[object, SpliceSearch] = {}
        self._window_repairs: dict[tuple[object, ...], WindowRepair] = {}
        self._paths: dict[str, Encoder] = dict(encoders(self)) if encoders is not None else {}
        # the "auto" router's short-text call (Router.short), when that path is a router
        self._short: Callable[[str], np.ndarray | None] | None = getattr(self._paths.get("auto"), "short", None)

    @property
    def reference(self) -> ReferenceEngine:
        """The reference engine (tiktoken / HF tokenizers) of this file, built on first use, once."""
        ref = self._reference
        if ref is None:
            with self._reference_lock:
                if self._reference is None:
                    self._reference = make_reference(self.family, self._data)
                ref = self._reference
        return ref

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, family={self.family.name!r}, sha256={self.content_hash[:12]}…)"

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    @cached_property
    def vocab_facts(self) -> VocabFacts:
        """Per-token facts sessions need (spec/vocabmeta.py): from the cache, so a session does not build the
        reference engine."""
        def derive() -> VocabFacts:
            ref = self.reference
            return VocabFacts(ref.token_chars, ref.continuation_start, ref.max_token_chars)

        return cached_facts(self.family, self.content_hash, derive)

    @property
    def max_token_chars(self) -> int:
        return self.vocab_facts.max_token_chars

    @property
    def fast_paths(self) -> frozenset[str]:
        """Names of the exact encode paths this instance was built with (empty: every path is the reference)."""
        return frozenset(self._paths)

    def path(self, name: str) -> Encoder | None:
        """The encoder registered under `name` (e.g. the "auto" router, for its stats), or None."""
        return self._paths.get(name)

    # -- encoding -------------------------------------------------------------------------------------------------
    def resolve_allowed(self, allowed_special: AllowedSpecial) -> frozenset[str]:
        """The allowed special literals as a set; unknown names are an error."""
        allowed = frozenset(self.specials) if allowed_special == "all" else frozenset(allowed_special)
        shared = self._allowed_sets.get(allowed)
        if shared is not None:
            return shared       # one set per distinct value, held by every session that allows it
        unknown = allowed - self.specials.keys()
        if unknown:
            raise ValueError(f"not special tokens of {self.name}: {sorted(unknown)[:5]}")
        return self._allowed_sets.setdefault(allowed, allowed)

    def window_repair(self, allowed: frozenset[str], rule: BoundaryRule | None, window: int, max_widenings: int
                      ) -> WindowRepair:
        """The repair policy sessions with these options share (read-only; see repair.WindowRepair)."""
        key = (allowed, rule, window, max_widenings)
        repair = self._window_repairs.get(key)
        if repair is None:
            from .repair import WindowRepair

            repair = self._window_repairs.setdefault(
                key, WindowRepair(self, allowed, rule, window=window, max_widenings=max_widenings))
        return repair

    def splice_search(self, rule: BoundaryRule | None) -> SpliceSearch:
        """The splice-point search of this vocabulary under `rule` (read-only; one per rule, shared by sessions)."""
        search = self._splice_searches.get(rule)
        if search is None:
            from .cpu.boundary import pair_table
            from .splice import SpliceSearch

            sig, pair = pair_table(rule) if rule is not None else (None, None)
            facts = self.vocab_facts
            search = self._splice_searches.setdefault(
                rule, SpliceSearch(facts.continuation_start, facts.max_token_chars, sig, pair))
        return search

    def special_mask(self, allowed: frozenset[str]) -> np.ndarray:
        """A read-only bool array over the vocabulary, True at the allowed special tokens' ids. One per allowed set,
        shared by every session (a vocabulary-sized array per session would cost ~150 KB each)."""
        mask = self._special_masks.get(allowed)
        if mask is None:
            mask = np.zeros(self._n_vocab, dtype=bool)
            for literal in allowed:
                mask[self.specials[literal]] = True
            mask.flags.writeable = False
            self._special_masks[allowed] = mask
        return mask

    def special_matches(self, text: str) -> Iterable[tuple[int, int, str]]:
        """Every special-token literal in text (start, end, literal), allowed or not, as `encode` finds them."""
        return self._matcher.matches(text)

    def encode(self, text: str | bytes, *, allowed_special: AllowedSpecial = (),
               path: EncodePath = "auto") -> np.ndarray:
        """IDs (uint32) equal to the reference encode of `text`; no BOS/EOS. Special-token strings are ordinary
        text unless listed in `allowed_special` (like tiktoken)."""
        if path == "auto" and not allowed_special and type(text) is str and len(text) <= self.max_chars:
            # a short str straight to the CPU path's block kernel (router.Router.short), which finds a lone
            # surrogate itself; whatever it declines takes the checked path below
            short = self._short
            ids = short(text) if short is not None else None
            if ids is not None:
                return ids
        text = validate_text(text, self.max_chars)
        if not allowed_special:     # no literal is allowed to split it: the text is one ordinary segment
            return self.encode_ordinary(text, path=path) if text else np.zeros(0, dtype=np.uint32)
        allowed = self.resolve_allowed(allowed_special)
        segments = self._matcher.split(text, allowed)
        if len(segments) > 2:
            batched = self._encode_between_literals(text, segments, path)
            if batched is not None:
                return batched
        parts = []
        for segment, special_id in segments:
            if special_id is not None:
                parts.append(np.array([special_id], dtype=np.uint32))
            elif segment:
                parts.append(self.encode_ordinary(segment, path=path))
        if not parts:
            return np.zeros(0, dtype=np.uint32)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _encode_between_literals(self, text: str, segments: list[tuple[str, int | None]],
                                 path: str) -> np.ndarray | None:
        """A text cut by allowed literals (a rendered chat) with every ordinary segment's pieces in one BPE call
        (cpu/segments.py) instead of one encode per segment; None where that path does not apply (a normalizing
        family, whose segments are normalized one by one; see router.encode_segments_on for the rest)."""
        if self.family.normalizer is not None:
            return None
        spans, literals, pos = [], [], 0
        for seg, sid in segments:
            if sid is not None:
                literals.append((pos, pos + len(seg), sid))
            elif seg:
                spans.append((pos, pos + len(seg)))
            pos += len(seg)
        if not spans:
            return np.array([sid for _, _, sid in literals], dtype=np.uint32)
        out = encode_segments_on(self._paths.get(path), self.family.name, text, spans)
        if out is None:
            return None
        return with_literals(out[0], out[1], out[2], spans, literals)[0]

    def encode_batch(self, texts: Sequence[str | bytes], *, allowed_special: AllowedSpecial = (),
                     path: EncodePath = "auto", num_threads: int = 8) -> list[np.ndarray]:
        """`encode` of each text, in order (tiktoken's encode_batch; IDs as uint32 arrays, like `encode`), on up to
        `num_threads` threads: the CPU path's kernels release the GIL and keep their caches per thread; short texts
        go many to one kernel call (batch.py). An invalid text raises its error with the text's index
        (`InvalidTextError.index`); nothing is returned then."""
        return batch.encode_batch(self, list(texts), self.resolve_allowed(allowed_special), path,
                                  max(1, int(num_threads)), self._batch_pool)

    def _batch_pool(self, workers: int) -> ThreadPoolExecutor:
        with self._reference_lock:
            pool = self._pool
            if pool is None or self._pool_workers < workers:
                if pool is not None:
                    pool.shutdown(wait=False)
                pool = self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenplane-batch")
                self._pool_workers = workers
            return pool

    def encode_ordinary_batch(self, texts: Sequence[str], *, path: EncodePath = "auto",
                              num_threads: int = 8) -> list[np.ndarray]:
        """`encode_batch` with every special-token string as ordinary text (tiktoken's encode_ordinary_batch)."""
        return self.encode_batch(texts, path=path, num_threads=num_threads)

    def encode_single_token(self, text_or_bytes: str | bytes) -> int:
        """The id of the one token whose bytes are exactly `text_or_bytes` (an ordinary token first, then a special
        literal, as tiktoken's encode_single_token); KeyError if no single token is."""
        raw = text_or_bytes.encode("utf-8") if isinstance(text_or_bytes, str) else bytes(text_or_bytes)
        token = self._token_ids.get(raw)
        if token is None:
            token = self.specials.get(raw.decode("utf-8", errors="replace"))
        if token is None:
            raise KeyError(text_or_bytes)
        return token

    def decode_single_token_bytes(self, token: int) -> bytes:
        """The bytes of one token (tiktoken's decode_single_token_bytes); ValueError out of the vocabulary."""
        return self.decode_bytes([int(token)])

    def decode_batch(self, batch: Iterable[Iterable[int]], errors: str = "replace") -> list[str]:
        """`decode` of each sequence, in order (tiktoken's decode_batch)."""
        return [self.decode(ids, errors=errors) for ids in batch]

    # -- the rest of tiktoken's Encoding face (same names and answers, for code written against tiktoken) -----------
    def decode_bytes_batch(self, batch: Iterable[Iterable[int]]) -> list[bytes]:
        """`decode_bytes` of each sequence, in order."""
        return [self.decode_bytes(ids) for ids in batch]

    def decode_tokens_bytes(self, tokens: Iterable[int]) -> list[bytes]:
        """Each token's bytes, one entry a token (a character split between tokens stays split)."""
        return [self.decode_single_token_bytes(t) for t in tokens]

    def decode_with_offsets(self, tokens: Iterable[int]) -> tuple[str, list[int]]:
        """(text, the character offset where each token starts in it), as tiktoken: a token that begins inside a
        multi-byte character starts at that character; the bytes must decode strictly (UnicodeDecodeError)."""
        token_bytes = self.decode_tokens_bytes(tokens)
        text_len, offsets = 0, []
        for raw in token_bytes:
            offsets.append(max(0, text_len - (bool(raw) and 0x80 <= raw[0] < 0xC0)))
            text_len += sum(1 for c in raw if not 0x80 <= c < 0xC0)
        return b"".join(token_bytes).decode("utf-8", errors="strict"), offsets

    def encode_to_numpy(self, text: str | bytes, *, allowed_special: AllowedSpecial = (),
                        path: EncodePath = "auto") -> np.ndarray:
        """`encode` (its IDs are already a uint32 array, as tiktoken's encode_to_numpy returns)."""
        return self.encode(text, allowed_special=allowed_special, path=path)

    def token_byte_values(self) -> list[bytes]:
        """The bytes of every ordinary token, sorted (tiktoken's token_byte_values)."""
        return sorted(self._token_ids)

    @property
    def special_tokens_set(self) -> set[str]:
        return set(self.specials)

    def is_special_token(self, token: int) -> bool:
        return int(token) in self._special_ids

    @cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(self.specials.values())

    @property
    def max_token_value(self) -> int:
        """The largest token ID, ordinary or special."""
        return max(self.n_vocab - 1, max(self.specials.values(), default=0))

    # -- HF tokenizers' names of tokens: the byte-level strings ("Ġhello") of the ByteLevel vocabularies here (the
    # tiktoken families' converted tokenizer.json files name their tokens the same way); a special token by its literal
    def id_to_token(self, token: int) -> str | None:
        """The token's name, or None for an ID outside the vocabulary or without bytes (HF's id_to_token)."""
        t = int(token)
        literal = self._special_literals.get(t)
        if literal is not None:
            return literal
        if not 0 <= t < self.n_vocab:
            return None
        raw = self.decode_single_token_bytes(t)
        chars = bytes_to_unicode()
        return "".join(chars[b] for b in raw) if raw else None

    def token_to_id(self, token: str) -> int | None:
        """The ID named `token` (a special literal, else a byte-level string), or None (HF's token_to_id)."""
        special = self.specials.get(token)
        if special is not None:
            return special
        byte_of = _byte_of_char()
        if not token or any(c not in byte_of for c in token):
            return None
        return self._token_ids.get(bytes(byte_of[c] for c in token))

    @cached_property
    def _special_literals(self) -> dict[int, str]:
        return {i: literal for literal, i in self.specials.items()}

    @property
    def eot_token(self) -> int:
        """The ID of `<|endoftext|>` (tiktoken's eot_token); KeyError for a vocabulary without that literal (llama3
        ends text with `<|end_of_text|>`, DeepSeek V4 with its end-of-sentence literal: see `specials`)."""
        try:
            return self.specials["<|endoftext|>"]
        except KeyError:
            raise KeyError(f"{self.name} has no <|endoftext|> special token") from None

    @cached_property
    def _token_ids(self) -> dict[bytes, int]:
        """Token bytes -> id over the ordinary vocabulary (the lowest id where two tokens share bytes)."""
        table = self._token_table
        if table is not None:
            raw, off = table[0].tobytes(), table[1]
            n = off.shape[0] - 1
            token_bytes: Callable[[int], bytes] = lambda t: raw[off[t]:off[t + 1]]   # noqa: E731
        else:
            n, token_bytes = self.n_vocab, lambda t: self.reference.decode_bytes([t])
        special_ids = set(self.specials.values())
        ids: dict[bytes, int] = {}
        for t in range(n):
            if t not in special_ids:
                got = token_bytes(t)
                if got:     # (an unused ID has no bytes: cl100k's 100256)
                    ids.setdefault(got, t)
        return ids

    def encode_ordinary(self, text: str, *, path: EncodePath | str = "auto") -> np.ndarray:
        """IDs of text with every special-token string treated as ordinary text (text already validated)."""
        if path == "reference":
            return self.reference.encode_ordinary(text)
        fast = self._paths.get(path)
        if fast is not None:
            return np.asarray(fast(text), dtype=np.uint32)
        if path in ("auto", "cpu"):
            return self.reference.encode_ordinary(text)
        raise PathUnavailableError(f"encode path {path!r} is not available for {self.name} here")

    def encode_with_ends(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Reference IDs of ordinary text plus each token's end (characters of the normalized text)."""
        return self.reference.encode_with_ends(validate_text(text, self.max_chars))

    def normalize(self, text: str) -> str:
        """The reference normalization of text. Plain NFC (qwen3) runs the reference normalizer only on the regions
        that can change (cpu/nfc.py), with HF's NFC normalizer itself (what a tokenizer.json normalizer of exactly
        {"type": "NFC"} deserializes to), so the reference engine need not be built; the shadow verifier's
        reference never takes this path. No normalizer (tiktoken, deepseek_v4's empty Sequence): the identity,
        as in the reference."""
        if self.normalizer_kind == "none":
            return text
        if self.plain_nfc:
            return nfc.normalize(text, _hf_nfc())
        return self.reference.normalize(text)

    def nfc_changes(self, text: str, a: int = 0, b: int | None = None) -> list[tuple[int, int, str]]:
        """Plain NFC families only: the regions of text `normalize` changes, as (start, end, normalized) in order
        (cpu/nfc.py `changes`); `normalize(text)` is text with each replaced. `a`, `b`: those of text[a:b], as
        positions in text, read in place (a and b: positions NFC cannot act across, cpu/nfc.py `changes_in`)."""
        if not self.plain_nfc:
            raise ValueError(f"{self.family.name} has no plain NFC normalizer")
        if a == 0 and b is None:
            return nfc.changes(text, _hf_nfc())
        return nfc.changes_in(text, a, len(text) if b is None else b, _hf_nfc())

    def normalize_texts(self, texts: list[str], joined: str, check: Callable[[int], None]) -> list[str]:
        """`normalize` of each text; `joined`: their concatenation (plain NFC scans it once, cpu/nfc.py).
        `check(i)` validates text i: called before any text that could hold a lone surrogate is normalized."""
        if self.normalizer_kind == "none":
            return texts
        if self.plain_nfc:
            return nfc.normalize_many(texts, joined, _hf_nfc(), check)
        for i in range(len(texts)):
            check(i)
        return [self.reference.normalize(t) for t in texts]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        table = self._token_table
        if table is None:
            try:
                return self.reference.decode_bytes(int(i) for i in ids)
            except IndexError:
                raise ValueError("token id out of range") from None
        flat, off = table
        n = off.shape[0] - 1
        if isinstance(ids, (list, tuple)) and len(ids) <= 16:    # a streamed token or a few: no array setup
            parts = []
            for i in ids:
                i = int(i)
                if not 0 <= i < n:
                    raise ValueError("token id out of range")
                parts.append(flat[off[i]:off[i + 1]].tobytes())
            return b"".join(parts)
        arr = np.asarray(ids if isinstance(ids, (list, tuple, np.ndarray)) else list(ids))
        if arr.size and (arr.ndim != 1 or arr.dtype.kind not in "iu"):
            arr = np.asarray([int(i) for i in arr.ravel()], dtype=np.int64)
        if not arr.size:
            return b""
        arr = arr.astype(np.int64, copy=False)
        if int(arr.min()) < 0 or int(arr.max()) >= n:
            raise ValueError("token id out of range")
        starts, lens = off[arr], off[arr + 1] - off[arr]
        pos = np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
        return flat[pos].tobytes()

    @cached_property
    def _token_table(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(every token's bytes back to back, offsets): the CPU path's own tables, made from the reference's token
        bytes and cached on disk, so decoding (a server's every response) needs no reference engine (qwen3: ~1.3 s
        to build on a process's first request). None without a CPU path."""
        enc = segment_encoder(self.path("cpu"), 0)
        return None if enc is None else (enc.bpe.tok_flat, enc.bpe.tok_off)

    def decode(self, ids: Iterable[int], errors: str = "replace") -> str:
        return self.decode_bytes(ids).decode("utf-8", errors=errors)

    # -- sessions -------------------------------------------------------------------------------------------------
    def session(self, **options) -> Session:
        """A stateful session whose IDs always equal encode(session.text); options: see Session."""
        from .session import Session

        return Session(self, **options)
