"""The tier's upstream request body, with the prompt's token IDs serialized incrementally per conversation session.

Serializing a long prompt's IDs is the largest cost the tier adds on a long conversation: orjson writes a 1.3M-ID
array (a 4M-character context) in ~10 ms, every turn, although the turn changed only its last few hundred IDs. A
session's IDs change by splices (new_ids == old_ids[:keep] + ids, tokenize/session.py), each with its revision, so
the body sent for the previous turn already holds the JSON of every kept ID: this turn's body is the previous one's
bytes up to the keep-th ID, then the JSON of the new IDs. The kept part is found from the end, one comma per dropped
ID (a turn drops a few: the generation prompt's tokens). It is not copied: a body is a sequence of pieces (`chunks`),
views of the bytes earlier turns wrote plus this turn's new IDs, that the upstream client writes one after the other
(http_client.py; a copy of the whole body cost ~0.3 ms per turn at 1M characters, ~0.6-1 ms at 4M). The kept run is
joined into one piece once it has _MAX_SEGMENTS pieces.

The previous body is reused only when it was written for exactly the session state this turn's splice started from
(same session id, revision before the splice == the revision the body was written at, and the splice is the only
mutation in between); anything else (a new session, another writer, a reset, a body evicted from this cache) writes
the whole array. The reuse is exact by construction and tests/test_ids_json.py checks it against a full
serialization over random splice sequences.

Bodies are `{<other fields>,"prompt":[<ids>]}`: the IDs last, so the fields that differ per request (stream,
max_tokens, ...) sit in front and the ID bytes are one contiguous run. The same reuse writes gRPC bodies (an
IdsCodec: grpc_wire.VARINT_IDS, packed varints, where the end of each ID's last byte stands for the comma).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
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


Segment = tuple[bytes, int, int]   # raw[start:end] of a bytes object, never copied out of it
Chunks = tuple[bytes | memoryview, ...]   # a body as pieces, written one after the other (writev), never joined
_MAX_SEGMENTS = 64   # a kept run in more pieces than this is joined once (O(context) once per that many turns)


@dataclass
class _Body:
    run: tuple[Segment, ...]   # the ID run (b"1,2,3"): its segments' bytes one after the other, each after the first
                               # starting with the comma before its first ID
    n: int
    revision: int
    size: int                  # bytes in the run


def ids_run(ids: Any) -> bytes:
    """b"1,2,3" for IDs [1, 2, 3] (b"" for none)."""
    arr = ids if isinstance(ids, np.ndarray) else np.asarray(ids, dtype=np.int64)
    return orjson.dumps(arr, option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]


def _cut(run: tuple[Segment, ...], dropped: int) -> list[Segment] | None:
    """The run without its last `dropped` IDs (back over one comma per ID, from the end); None when the run has too
    few IDs for that (not a run this module wrote)."""
    segs = list(run)
    for _ in range(dropped):
        if not segs:
            return None
        raw, start, end = segs[-1]
        comma = raw.rfind(b",", start, end)
        if comma < start:
            return None
        if comma == start:   # the segment held one ID after its leading comma
            segs.pop()
        else:
            segs[-1] = (raw, start, comma)
    return segs if segs else None


def _json_frame(fields: dict[str, Any], pieces: Sequence[bytes | memoryview], size: int) -> Chunks:
    head = orjson.dumps(fields)[:-1] + (b',"prompt":[' if fields else b'"prompt":[')
    return (head, *pieces, b"]}")


@dataclass(frozen=True)
class IdsCodec:
    """How a body writes a prompt's IDs: `run` writes IDs, `sep` goes between a kept run and the run appended to
    it, `cut` takes a run's last IDs off (None: not a run this codec wrote), `frame` puts a run's pieces (of `size`
    bytes in all) into a whole body with the request's other fields."""
    run: Callable[[Any], bytes]
    sep: bytes
    cut: Callable[[tuple[Segment, ...], int], list[Segment] | None]
    frame: Callable[[dict[str, Any], Sequence[bytes | memoryview], int], Chunks]


JSON_IDS = IdsCodec(run=ids_run, sep=b",", cut=_cut, frame=_json_frame)


def _view(seg: Segment) -> bytes | memoryview:
    raw, start, end = seg
    return raw if start == 0 and end == len(raw) else memoryview(raw)[start:end]


class RequestBodies:
    """Upstream request bodies; the last one per session kept (LRU, up to `max_bytes` in all) for the next turn.
    `codec`: JSON completions bodies (HTTP upstreams), or grpc_wire.VARINT_IDS (vLLM's gRPC engine service)."""

    def __init__(self, max_bytes: int = 512 << 20, codec: IdsCodec = JSON_IDS) -> None:
        self.max_bytes = max_bytes
        self.codec = codec
        self._bodies: OrderedDict[str, _Body] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.reused = 0
        self.written = 0

    def forget(self, session: str) -> None:
        with self._lock:
            old = self._bodies.pop(session, None)
            if old is not None:
                self._bytes -= old.size

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
        """The body (JSON: `fields` and `"prompt": ids`). `origin` (IDs from a session splice) allows reusing the
        session's previous body."""
        return b"".join(self.chunks(fields, ids, origin))

    def chunks(self, fields: dict[str, Any], ids: np.ndarray | list[int], origin: IdsOrigin | None = None) -> Chunks:
        """`build`'s body as pieces: the kept ID run's pieces are views of the bytes earlier turns wrote, so a turn
        copies nothing of its context here (the socket write takes the pieces as they are: writev)."""
        codec = self.codec
        n = len(ids)
        prev = self._reusable(origin, n) if origin is not None else None
        segs = codec.cut(prev.run, prev.n - origin.keep) if prev is not None and origin is not None else None
        if segs is None or origin is None:
            run = codec.run(ids)
            segs = [(run, 0, len(run))] if run else []
            self.written += 1
        else:
            if n > origin.keep:
                new = codec.sep + codec.run(ids[origin.keep:])
                segs.append((new, 0, len(new)))
            if len(segs) > _MAX_SEGMENTS:
                run = b"".join(_view(s) for s in segs)
                segs = [(run, 0, len(run))]
            self.reused += 1
        size = sum(e - s for _, s, e in segs)
        if origin is not None:
            self._keep(origin, _Body(tuple(segs), n, origin.revision, size))
        return codec.frame(fields, [_view(s) for s in segs], size)

    def _keep(self, origin: IdsOrigin, body: _Body) -> None:
        with self._lock:
            old = self._bodies.get(origin.session)
            if old is not None:
                if old.revision > body.revision:
                    return   # a concurrent later turn of the same session already wrote its body
                self._bytes -= old.size
            self._bodies[origin.session] = body
            self._bodies.move_to_end(origin.session)
            self._bytes += body.size
            while self._bytes > self.max_bytes and self._bodies:
                _, dropped = self._bodies.popitem(last=False)
                self._bytes -= dropped.size

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"bodies": len(self._bodies), "bytes": self._bytes, "reused": self.reused,
                    "written": self.written}


__all__ = ["JSON_IDS", "Chunks", "IdsCodec", "IdsOrigin", "RequestBodies", "Segment", "ids_run"]
