"""The tier's upstream request body, with the prompt's token IDs serialized incrementally per conversation session.

Serializing a long prompt's IDs is the largest cost the tier adds on a long conversation: orjson writes a 1.3M-ID
array (a 4M-character context) in ~10 ms, every turn, although the turn changed only its last few hundred IDs. A
session's IDs change by splices (new_ids == old_ids[:keep] + ids, tokenize/session.py), each with its revision, so
the body sent for the previous turn already holds the JSON of every kept ID: this turn's body is the previous one's
bytes up to the keep-th ID, then the JSON of the new IDs. The kept part is found from the end, one comma per dropped
ID (a turn drops a few: the generation prompt's tokens), and copied once, into the new body.

The previous body is reused only when it was written for exactly the session state this turn's splice started from
(same session id, revision before the splice == the revision the body was written at, and the splice is the only
mutation in between); anything else (a new session, another writer, a reset, a body evicted from this cache) writes
the whole array. The reuse is exact by construction and tests/test_ids_json.py checks it against a full
serialization over random splice sequences.

Bodies are `{<other fields>,"prompt":[<ids>]}`: the IDs last, so the fields that differ per request (stream,
max_tokens, ...) sit in front and the ID bytes are one contiguous run.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

_MAX_DROPPED = 1 << 16   # past this many dropped IDs, walking back comma by comma costs more than writing them all


@dataclass(frozen=True)
class IdsOrigin:
    """How a prompt's IDs came from a session: ids == (session's IDs at `base_revision`)[:keep] + the rest, and the
    session is now at `revision`."""
    session: str
    base_revision: int
    revision: int
    keep: int


@dataclass
class _Body:
    raw: bytes
    start: int       # the ID run is raw[start:end], e.g. b"1,2,3"
    end: int
    n: int
    revision: int


def ids_run(ids: Any) -> bytes:
    """b"1,2,3" for IDs [1, 2, 3] (b"" for none)."""
    arr = ids if isinstance(ids, np.ndarray) else np.asarray(ids, dtype=np.int64)
    return orjson.dumps(arr, option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]


class RequestBodies:
    """Upstream request bodies; the last one per session kept (LRU, up to `max_bytes` in all) for the next turn."""

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self._bodies: OrderedDict[str, _Body] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.reused = 0
        self.written = 0

    def forget(self, session: str) -> None:
        with self._lock:
            old = self._bodies.pop(session, None)
            if old is not None:
                self._bytes -= len(old.raw)

    def _reusable(self, origin: IdsOrigin, n: int) -> _Body | None:
        with self._lock:
            prev = self._bodies.get(origin.session)
        if prev is None or prev.revision != origin.base_revision:
            return None
        if origin.revision not in (origin.base_revision, origin.base_revision + 1):
            return None
        if not 0 < origin.keep <= prev.n or origin.keep > n or prev.n - origin.keep > _MAX_DROPPED:
            return None
        return prev

    def build(self, fields: dict[str, Any], ids: np.ndarray | list[int], origin: IdsOrigin | None = None) -> bytes:
        """The JSON body: `fields` and `"prompt": ids`. `origin` (IDs from a session splice) allows reusing the
        session's previous body."""
        head = orjson.dumps(fields)[:-1] + (b',"prompt":[' if fields else b'"prompt":[')
        n = len(ids)
        prev = self._reusable(origin, n) if origin is not None else None
        if prev is None or origin is None:
            run = ids_run(ids)
            raw = b"".join((head, run, b"]}"))
            self.written += 1
        else:
            cut = prev.end
            for _ in range(prev.n - origin.keep):   # back over the dropped IDs' commas (origin.keep > 0)
                cut = prev.raw.rfind(b",", prev.start, cut)
            new = ids_run(ids[origin.keep:]) if n > origin.keep else b""
            raw = b"".join((head, memoryview(prev.raw)[prev.start:cut], b"," if new else b"", new, b"]}"))
            self.reused += 1
        if origin is not None:
            self._keep(origin, _Body(raw, len(head), len(raw) - 2, n, origin.revision))
        return raw

    def _keep(self, origin: IdsOrigin, body: _Body) -> None:
        with self._lock:
            old = self._bodies.get(origin.session)
            if old is not None:
                if old.revision > body.revision:
                    return   # a concurrent later turn of the same session already wrote its body
                self._bytes -= len(old.raw)
            self._bodies[origin.session] = body
            self._bodies.move_to_end(origin.session)
            self._bytes += len(body.raw)
            while self._bytes > self.max_bytes and self._bodies:
                _, dropped = self._bodies.popitem(last=False)
                self._bytes -= len(dropped.raw)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"bodies": len(self._bodies), "bytes": self._bytes, "reused": self.reused,
                    "written": self.written}


__all__ = ["IdsOrigin", "RequestBodies", "ids_run"]
