"""Agent conversations in the request path: a resent prompt is tokenized by repairing the live session that holds
its longest known prefix, so a growing context costs O(new text) in tokenization, and the IDs stay exactly those of
a full encode.

Lookup. A prompt (a completions prompt, or a chat rendered by its template) is cut into 1K-character blocks. A chain
of hashes over the pieces, h_k = hash((h_{k-1}, hash(piece_k))), keys an index of live sessions: the largest k whose
h_k is known names the session to use. Hashing reads each character once at memory speed, with no tokenization;
the key is only a lookup hint: the session's `sync` compares the stored text with the new one itself (a buffer
compare) and repairs around any difference, so a hash collision, an edited history or a forked conversation costs
time, never correctness. An optional client key (OpenAI's `prompt_cache_key`, or `user`) enters h_0, so two
conversations sharing a system prompt stop sharing a session once the client says they differ.

Bounds. Sessions live in the tokenize service's SessionStore (idle TTL, count cap, byte budget, LRU); an evicted
conversation drops its keys and is re-encoded by its next request.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .ids_json import IdsOrigin
from .tokenize_service import SessionEntry, SessionStore

BLOCK_CHARS = 1024   # prompts are hashed in blocks of this many characters; shorter ones are encoded directly
# What a caller makes of a session's IDs while it holds the session's lock: the IDs are a read-only view of the
# session's array, valid until its next mutation, so anything kept past the call is copied (the default keeps them
# all; the tier writes its upstream body from the view and copies only the IDs it has not written before).
# origin None: IDs encoded directly (no session; the caller's own array or list).
Take = Callable[[Any, IdsOrigin | None], Any]


def copied(ids: Any, origin: IdsOrigin | None) -> Any:
    return np.array(ids, copy=True) if origin is not None else ids


@dataclass(frozen=True)
class SessionText:
    """A session held exactly the text just tokenized: at this revision, with this many characters. While its
    revision is unchanged it still holds that text (every mutation moves the revision), so the next turn may append
    to it without handing over, or comparing, the whole text again (`append_on`)."""
    session: str
    revision: int
    chars: int


@dataclass
class TokenizationReport:
    """What the response's `tokenization` field says about how the prompt's IDs were obtained."""
    path: str                 # "session" (repaired a live session) | "new_session" | "bypass" (too short, or quotes
                              # control tokens: encoded directly) | "full_encode" (sessions turned off)
    reused_tokens: int        # tokens kept from the session's previous IDs
    new_tokens: int           # tokens produced by this request's repair or encode
    time_ms: float            # tokenization time in the server (lookup + repair or encode)
    session: str | None = None
    origin: IdsOrigin | None = None   # how the IDs relate to the session's previous ones (for the body cache)
    text: SessionText | None = None   # the session's state holding exactly this prompt

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "reused_tokens": self.reused_tokens, "new_tokens": self.new_tokens,
                "time_ms": round(self.time_ms, 4), "session": self.session}


def chain(pieces: Sequence[str], salt: str | None) -> list[int]:
    """h_1..h_n over the pieces (h_0 from the salt)."""
    h = hash(("tokenplane.conversation", salt))
    out = []
    for p in pieces:
        h = hash((h, hash(p)))
        out.append(h)
    return out


def blocks(text: str, size: int = BLOCK_CHARS) -> list[str]:
    """Full blocks only: a prefix shared by two prompts produces the same block keys in both."""
    return [text[i:i + size] for i in range(0, len(text) - size + 1, size)]


class ConversationCache:
    """Sessions keyed by prompt-prefix hashes, for one tokenizer and one allowed-special set."""

    def __init__(self, tokenizer: Any, store: SessionStore, *, allowed_special: str | Sequence[str] = (),
                 min_chars: int = BLOCK_CHARS) -> None:
        self.tokenizer = tokenizer
        self.store = store
        self.allowed: str | tuple[str, ...] = allowed_special if isinstance(allowed_special, str) \
            else tuple(allowed_special)
        self.min_chars = min_chars            # shorter prompts are encoded directly (a session would not pay)
        self._index: dict[int, str] = {}      # prefix hash -> session id
        self._keys: dict[str, list[int]] = {}  # session id -> its hashes in the index
        self._lock = threading.Lock()
        store.on_evict.append(self._forget)
        self.hits = 0
        self.misses = 0

    def _forget(self, session_id: str) -> None:
        with self._lock:
            for key in self._keys.pop(session_id, ()):
                if self._index.get(key) == session_id:
                    del self._index[key]

    def _lookup(self, keys: list[int]) -> SessionEntry | None:
        for key in reversed(keys):
            with self._lock:
                sid = self._index.get(key)
            if sid is None:
                continue
            try:
                return self.store.get(sid)
            except Exception:   # noqa: BLE001 - evicted between the index read and the store read
                self._forget(sid)
        return None

    def _remember(self, entry: SessionEntry, keys: list[int]) -> None:
        with self._lock:
            known = self._keys.setdefault(entry.id, [])
            for key in keys:
                old = self._index.get(key)
                if old != entry.id:
                    self._index[key] = entry.id
                    known.append(key)

    def encode(self, text: str, pieces: Sequence[str], salt: str | None = None,
               take: Take = copied) -> tuple[Any, TokenizationReport]:
        """IDs of `text` (== tokenizer.encode(text, allowed_special=self.allowed)), as `take` makes them (a copy by
        default). `pieces` are consecutive prefixes' increments of `text` (their concatenation is a prefix of
        it)."""
        t0 = time.perf_counter()
        if len(text) < self.min_chars:
            ids = self.tokenizer.encode(text, allowed_special=self.allowed)
            report = TokenizationReport("bypass", 0, int(len(ids)), (time.perf_counter() - t0) * 1e3)
            return take(ids, None), report
        keys = chain(pieces, salt)
        entry = self._lookup(keys)
        path = "session"
        if entry is None:
            entry = self.store.create(self.tokenizer.name, self.tokenizer.session(allowed_special=self.allowed))
            path = "new_session"
            self.misses += 1
        else:
            self.hits += 1
        with entry.lock:   # one writer per session; a concurrent turn of the same conversation waits here
            base = entry.session.revision
            splice = entry.session.sync(text)
            origin = IdsOrigin(entry.id, base, entry.session.revision, int(splice.keep))
            ids = take(entry.session.ids, origin)
            held = SessionText(entry.id, entry.session.revision, entry.session.n_chars)
        self.store.resize(entry)
        self._remember(entry, keys)
        report = TokenizationReport(path, int(splice.keep), splice.count, (time.perf_counter() - t0) * 1e3,
                                    entry.id, origin, held)
        return ids, report

    def encode_on(self, session_id: str, text: str, take: Take = copied) -> tuple[Any, TokenizationReport] | None:
        """IDs of `text` by repairing a session known from this conversation's previous body (body_delta.py),
        without the prefix-hash lookup; None when that session is gone. The IDs are exact whichever session is
        repaired (sync compares the texts); the blocks' keys stay those of the turn that last looked it up."""
        t0 = time.perf_counter()
        if len(text) < self.min_chars:
            return None
        try:
            entry = self.store.get(session_id)
        except Exception:   # noqa: BLE001 - evicted or deleted since: the caller takes the lookup path
            return None
        if entry.model != self.tokenizer.name:
            return None
        self.hits += 1
        with entry.lock:
            base = entry.session.revision
            splice = entry.session.sync(text)
            origin = IdsOrigin(entry.id, base, entry.session.revision, int(splice.keep))
            ids = take(entry.session.ids, origin)
            held = SessionText(entry.id, entry.session.revision, entry.session.n_chars)
        self.store.resize(entry)
        return ids, TokenizationReport("session", int(splice.keep), splice.count,
                                       (time.perf_counter() - t0) * 1e3, entry.id, origin, held)

    def append_on(self, held: SessionText, tail: str, take: Take = copied) -> tuple[Any, TokenizationReport] | None:
        """IDs of (the text `held` says the session holds) + `tail`, by appending `tail`: O(tail) in text, where
        `encode_on` compares the whole new text with the stored one. None when the session is gone or has moved
        since (another revision or length): then the caller renders and syncs the whole text. The IDs are exact
        when the caller's claim is: the session's text at that revision is the text whose continuation `tail` is
        (chat.ChatTemplate.extend proves that for a conversation that grew)."""
        t0 = time.perf_counter()
        try:
            entry = self.store.get(held.session)
        except Exception:   # noqa: BLE001 - evicted or deleted since
            return None
        if entry.model != self.tokenizer.name:
            return None
        with entry.lock:
            session = entry.session
            if session.revision != held.revision or session.n_chars != held.chars:
                return None
            splice = session.append(tail)
            origin = IdsOrigin(entry.id, held.revision, session.revision, int(splice.keep))
            ids = take(session.ids, origin)
            now = SessionText(entry.id, session.revision, session.n_chars)
        self.hits += 1
        self.store.resize(entry)
        return ids, TokenizationReport("session", int(splice.keep), splice.count,
                                       (time.perf_counter() - t0) * 1e3, entry.id, origin, now)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "index_keys": len(self._index)}


__all__ = ["ConversationCache", "SessionText", "Take", "TokenizationReport", "blocks", "chain", "copied"]
