"""Resent chat bodies parsed in O(new part): an agent resends its whole conversation every turn, and parsing it
(orjson: ~7-10 ms for a 4M-character context) is the largest per-turn cost of the tier after the tokenization itself.

A body's state keeps its bytes, the offset A of the `[` that opens its top-level "messages" array and the offset
just past each message object in it (ends[i]). A new body whose bytes equal the kept ones up to ends[i] (a memcmp,
never a Python loop) holds, by the JSON grammar, the same header and the same messages 0..i: a parser reading
body[:ends[i]] is in the same state in both (inside the same array, after the same i+1 values). The rest is parsed
as a small document: body[:A+1] + SENTINEL + body[ends[i]:], i.e. the first i+1 elements replaced by one value, which
is valid exactly when the body is (the grammar is context-free and a complete value is one node) and parses to the
same object but for that one element. It is parsed twice, with sentinels 0 and 1: a later duplicate "messages" key
(which would win in a full parse) lies wholly in the new part and cannot read 0 in one and 1 in the other, so both
sentinels showing where they were put proves the array read is the one at A. Any doubt (no kept state, no common
message, a parse error, a duplicate key in the kept body, an element that is not an object) takes the full parse,
which also produces the error a bad body gets. tests/test_body_delta.py checks every outcome against orjson.loads of
the whole body, over edits anywhere, changed or reordered fields, whitespace and escapes.

The message boundaries of a new part are found by a scanner over JSON structure (strings skipped with bytes.find,
escapes counted) and then proved: each span must start with `{`, end with `}` and parse on its own (orjson) to the
object the document parse gave; a span that parses as one complete object starting where the element starts ends
where it ends (an object's end is unique). A body parsed in full gets its state later (`remember`: the structure scan
and the span proofs cost a few parses, ~40 ms at 4M characters), off its turn's path: only the next turn needs it.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from .protocol import parse_request

KEY_BYTES = 256            # bodies are indexed by their first KEY_BYTES bytes (header and start of the first message)
_PER_KEY = 16              # conversations kept per index key (many share a system prompt)
_WS = frozenset(b" \t\n\r")
_STRUCT = re.compile(rb'["{}\[\]]')
_SCALAR_END = re.compile(rb"[,\]}\s]")


@dataclass
class BodyState:
    """A parsed chat body and where its messages lie in its bytes."""
    raw: bytes
    array: int                          # offset of the messages array's `[`
    ends: list[int]                     # offset just past message i's closing `}`
    messages: list[Any]                 # message i as orjson parsed it
    clean: int = 0                      # leading messages known to quote no control token (chat.quotes_specials)
    session: str | None = None          # the tokenization session the body's prompt went to
    conversation_key: str | None = None
    nbytes: int = field(default=0)
    turn: KeptTurn | None = None        # what its turn derived from the messages (for the next turn's kept ones)
    after: int = -1                     # offset just past the messages array's `]` (-1: not known)

    def same_fields(self, other: BodyState) -> bool:
        """Both bodies hold the same members besides "messages", byte for byte: the same bytes before the array
        (a body parsed through `other` shares them) and after it. Equal bytes are equal JSON values of the same
        types, which an equality of parsed values (1 == 1.0 == True) is not."""
        if self.after < 0 or other.after < 0 or self.array != other.array:
            return False
        n = len(self.raw) - self.after
        if n != len(other.raw) - other.after or self.raw[:self.array] != other.raw[:other.array]:
            return False
        return memoryview(self.raw)[self.after:] == memoryview(other.raw)[other.after:]


@dataclass(frozen=True)
class KeptTurn:
    """What the turn that sent a body derived from its messages, one entry per message. A later body whose bytes
    equal this one's through message i holds equal messages 0..i, so its turn takes these for them and works on its
    new messages only (proxy_routes.py)."""
    validated: list[Any]                # protocol.ChatMessage
    pairs: list[tuple[str, str]]        # (role, text), as the chat template renders them
    rendered: Any = None                # conversations.SessionText: the session held exactly render(pairs)
    request: Any = None                 # protocol.ChatCompletionRequest as validated from the body alone
    fields: dict[str, Any] | None = None   # the upstream request's fields other than the prompt, made from it


@dataclass
class Parsed:
    """A chat body parsed through a kept state (`state` set, `reused` messages taken from it) or in full."""
    body: dict[str, Any]
    checked: bool                       # strings known free of lone surrogates (parse_request's flag)
    state: BodyState | None             # this body's own state, to keep once its turn is tokenized
    reused: int = 0                     # messages taken from a kept body
    base: BodyState | None = None       # the kept state it came from
    raw: bytes | None = None            # parsed in full: its state can be built (`remember`), off the turn's path
    fields_kept: bool = False           # its members besides "messages" are base's bytes (base's request reused)

    @property
    def new_bytes(self) -> int:
        """Bytes of the body past the messages taken from the kept body (all of it when parsed in full)."""
        if self.state is None or self.base is None or self.reused == 0:
            return len(self.state.raw) if self.state is not None else (len(self.raw) if self.raw is not None else 0)
        return len(self.state.raw) - self.base.ends[self.reused - 1]


# -- a scanner over valid JSON ------------------------------------------------------------------------------------
def _skip_ws(raw: bytes, p: int) -> int:
    n = len(raw)
    while p < n and raw[p] in _WS:
        p += 1
    return p


def _string_end(raw: bytes, p: int) -> int:
    """Offset just past the string opening at raw[p] == '"': the first quote after it preceded by an even number of
    backslashes (JSON strings hold no raw quote)."""
    q = p + 1
    while True:
        q = raw.find(b'"', q)
        if q < 0:
            raise ValueError("unterminated string")
        k = q - 1
        while raw[k] == 0x5C:
            k -= 1
        if (q - 1 - k) % 2 == 0:
            return q + 1
        q += 1


def value_end(raw: bytes, p: int) -> int:
    """Offset just past the JSON value starting at raw[p] (no leading whitespace)."""
    c = raw[p]
    if c == 0x22:
        return _string_end(raw, p)
    if c in (0x7B, 0x5B):
        depth, q = 0, p
        while True:
            m = _STRUCT.search(raw, q)
            if m is None:
                raise ValueError("unterminated container")
            at = m.start()
            ch = raw[at]
            if ch == 0x22:
                q = _string_end(raw, at)
                continue
            depth += 1 if ch in (0x7B, 0x5B) else -1
            q = at + 1
            if depth == 0:
                return q
    m = _SCALAR_END.search(raw, p)
    return m.start() if m is not None else len(raw)


def _elements(raw: bytes, p: int, stop_after: int | None = None) -> tuple[list[int], list[int], int]:
    """Starts and ends of the array elements from raw[p] (just inside `[`, or at a `,` after an element); and the
    offset past the closing `]`."""
    starts: list[int] = []
    ends: list[int] = []
    q = _skip_ws(raw, p)
    if raw[q] == 0x2C:                 # continuing after a kept element
        q = _skip_ws(raw, q + 1)
    elif raw[q] == 0x5D:
        return starts, ends, q + 1
    while True:
        starts.append(q)
        q = value_end(raw, q)
        ends.append(q)
        q = _skip_ws(raw, q)
        if raw[q] == 0x5D:
            return starts, ends, q + 1
        if raw[q] != 0x2C:
            raise ValueError("malformed array")
        q = _skip_ws(raw, q + 1)


def _messages_array(raw: bytes) -> tuple[int, list[int], list[int], int] | None:
    """(offset of `[`, element starts, element ends, offset past `]`) of the top-level "messages" array; None when
    there is no such array or the key appears more than once."""
    p = _skip_ws(raw, 0)
    if raw[p] != 0x7B:
        return None
    p = _skip_ws(raw, p + 1)
    found: tuple[int, list[int], list[int], int] | None = None
    seen = 0
    if raw[p] == 0x7D:
        return None
    while True:
        key_end = _string_end(raw, p)
        key = orjson.loads(raw[p:key_end])
        p = _skip_ws(raw, key_end)
        if raw[p] != 0x3A:
            return None
        p = _skip_ws(raw, p + 1)
        if key == "messages":
            seen += 1
            if raw[p] != 0x5B:
                return None
            starts, ends, end = _elements(raw, p + 1)
            found = (p, starts, ends, end)
        else:
            end = value_end(raw, p)
        p = _skip_ws(raw, end)
        if raw[p] == 0x7D:
            break
        if raw[p] != 0x2C:
            return None
        p = _skip_ws(raw, p + 1)
    return found if seen == 1 else None


def _proved(raw: bytes, starts: list[int], ends: list[int], values: list[Any]) -> bool:
    """Each span is exactly one JSON object equal to its parsed value (see the module doc)."""
    if len(starts) != len(values):
        return False
    for s, e, v in zip(starts, ends, values):
        if raw[s] != 0x7B or raw[e - 1] != 0x7D or not isinstance(v, dict):
            return False
        try:
            if orjson.loads(memoryview(raw)[s:e]) != v:
                return False
        except orjson.JSONDecodeError:
            return False
    return True


# -- the kept states ----------------------------------------------------------------------------------------------
class BodyDeltas:
    """Recent chat bodies (LRU, up to `max_bytes` of body bytes), and the parse of a new body through them."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._index: dict[bytes, list[BodyState]] = {}
        self._lru: OrderedDict[int, BodyState] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def parse(self, raw: bytes) -> Parsed:
        """The body parsed (== parse_request(raw)), through a kept state when one shares a message prefix."""
        fast = self.fast(raw)
        return fast if fast is not None else self.full(raw)

    def fast(self, raw: bytes) -> Parsed | None:
        """The body parsed through a kept state, or None (then `full`): O(new part) plus a memcmp."""
        fast = self._through_kept(raw) if len(raw) >= KEY_BYTES else None
        if fast is not None:
            self.hits += 1
        return fast

    def full(self, raw: bytes) -> Parsed:
        """The body parsed in full (parse_request), for a body `fast` could not take."""
        self.misses += 1
        body, checked = parse_request(raw)
        return Parsed(body, checked, None, raw=raw if checked and len(raw) >= KEY_BYTES else None)

    def remember(self, raw: bytes, messages: Any, session: str | None, conversation_key: str | None,
                 clean: int, turn: KeptTurn | None = None) -> bool:
        """Build and keep the state of a body parsed in full (`Parsed.raw`; `messages` as parsed). Its structure
        scan and span proofs cost a few times the parse (~40 ms at 4M characters), so the tier runs this off the
        turn's path: the state is needed by the next turn only."""
        state = self._state_of(raw, messages)
        if state is None:
            return False
        self.keep(state, session, conversation_key, clean, turn)
        return True

    def _state_of(self, raw: bytes, messages: Any) -> BodyState | None:
        if not isinstance(messages, list) or not messages:
            return None
        try:
            found = _messages_array(raw)
        except (ValueError, IndexError, orjson.JSONDecodeError):
            return None
        if found is None:
            return None
        array, starts, ends, after = found
        if not _proved(raw, starts, ends, messages):
            return None
        return BodyState(raw, array, ends, list(messages), after=after)

    def _best(self, raw: bytes) -> tuple[BodyState, int] | None:
        with self._lock:
            candidates = list(self._index.get(raw[:KEY_BYTES], ()))
        best: tuple[BodyState, int] | None = None
        for st in candidates:
            ends = st.ends
            old = memoryview(st.raw)
            if best is not None:
                floor = best[0].ends[best[1]]
                # to do better it must share more than `floor` bytes: one compare settles most candidates (other
                # conversations with the same system prompt part ways at their first user message)
                if ends[-1] <= floor or not raw.startswith(old[:floor + 1]):
                    continue
            if raw.startswith(old[:ends[-1]]):   # memcmp (memoryview == compares item by item)
                i = len(ends) - 1
            else:   # an edit: the last message end still shared (prefix equality is monotone in the length)
                lo, hi = -1, len(ends) - 1
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    e = ends[mid]
                    if raw.startswith(old[:e]):
                        lo = mid
                    else:
                        hi = mid - 1
                i = lo
            if i >= 0 and (best is None or ends[i] > best[0].ends[best[1]]):
                best = (st, i)
        return best

    def _through_kept(self, raw: bytes) -> Parsed | None:
        found = self._best(raw)
        if found is None:
            return None
        st, i = found
        cut = st.ends[i]
        head, rest = raw[:st.array + 1], memoryview(raw)[cut:]
        try:
            body, checked = parse_request(b"".join((head, b"0", rest)))
            other = orjson.loads(b"".join((head, b"1", rest)))
        except Exception:   # noqa: BLE001 - any refusal: the full parse tells the error
            return None
        got, got1 = body.get("messages"), other.get("messages") if isinstance(other, dict) else None
        if not checked or not isinstance(got, list) or not isinstance(got1, list) or not got or not got1 \
                or type(got[0]) is not int or got[0] != 0 or type(got1[0]) is not int or got1[0] != 1:
            return None
        new = got[1:]
        try:
            starts, ends, after = _elements(raw, cut) if new else ([], [], -1)
        except (ValueError, IndexError):
            return None
        if not _proved(raw, starts, ends, new):
            return None
        messages = st.messages[:i + 1] + new
        body["messages"] = messages
        state = BodyState(raw, st.array, st.ends[:i + 1] + ends, messages, clean=min(st.clean, i + 1),
                          session=st.session, conversation_key=st.conversation_key, after=after)
        return Parsed(body, True, state, reused=i + 1, base=st)

    def keep(self, state: BodyState, session: str | None, conversation_key: str | None, clean: int,
             turn: KeptTurn | None = None) -> None:
        """Keep a body's state for the next turn (after its prompt was tokenized); `turn` only when it has an entry
        for each of the body's messages."""
        state.session, state.conversation_key, state.clean = session, conversation_key, clean
        n = len(state.messages)
        state.turn = turn if turn is not None and len(turn.validated) == n and len(turn.pairs) == n else None
        state.nbytes = len(state.raw)
        key = state.raw[:KEY_BYTES]
        with self._lock:
            bucket = self._index.setdefault(key, [])
            # The body this one grew from is superseded: a conversation keeps one state.
            for old in [s for s in bucket if s.session == session and session is not None]:
                self._drop(old)
            bucket = self._index.setdefault(key, [])
            bucket.insert(0, state)
            self._lru[id(state)] = state
            self._bytes += state.nbytes
            while len(bucket) > _PER_KEY:
                self._drop(bucket[-1])
            while self._bytes > self.max_bytes and self._lru:
                self._drop(next(iter(self._lru.values())))

    def _drop(self, state: BodyState) -> None:
        if self._lru.pop(id(state), None) is None:
            return
        self._bytes -= state.nbytes
        key = state.raw[:KEY_BYTES]
        bucket = self._index.get(key)
        if bucket is not None:
            bucket[:] = [s for s in bucket if s is not state]
            if not bucket:
                del self._index[key]

    def forget(self, session: str) -> None:
        """A session went away: drop the bodies that point at it."""
        with self._lock:
            for st in [s for s in self._lru.values() if s.session == session]:
                self._drop(st)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"bodies": len(self._lru), "bytes": self._bytes, "hits": self.hits, "misses": self.misses}


__all__ = ["BodyDeltas", "BodyState", "KeptTurn", "Parsed", "value_end"]
