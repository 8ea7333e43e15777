"""Shadow verifier: re-encode a sample of served requests with a fresh reference engine, off the serving path.

Differential suites run in fresh processes and cannot see history-dependent bugs (an engine whose output depends on
what it encoded before). The shadow verifier checks what was actually served, after the fact, with an engine
instance that shares no state with the serving path: a new ReferenceEngine built from the same pinned file, owned by
one worker thread. Sampling is a Bernoulli draw per request; the queue is bounded and a full queue drops the sample
(counted), so the verifier can never add latency or memory pressure to serving.
"""

from __future__ import annotations

import enum
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence

import numpy as np

from .reference import ReferenceEngine, make_reference
from .tokenizer import SpecialMatcher, Tokenizer

REPRO_MAX_CHARS = 65536   # mismatch reports carry the full text up to this size, else a window around the divergence


class VerifierState(enum.IntEnum):
    STARTING = 0   # worker is building its reference engine; samples queue up
    RUNNING = 1
    CLOSED = 2
    FAILED = 3     # the reference engine could not be built; samples are counted as dropped


@dataclass
class Mismatch:
    """One served output that differs from the fresh reference, with enough to reproduce it."""
    tokenizer: str
    index: int                 # first differing token position
    window_start: int          # the windows below start here (a few tokens before `index`)
    served_len: int
    expected_len: int
    served_window: list[int]
    expected_window: list[int]
    text_chars: int
    text: str                  # full text if small, else a window around the divergence (see `text_is_window`)
    text_is_window: bool
    allowed_special: list[str]
    context: dict = field(default_factory=dict)

    def reproduction(self) -> str:
        allowed = f", allowed_special={self.allowed_special!r}" if self.allowed_special else ""
        note = "  # text is a window around the divergence" if self.text_is_window else ""
        return (f"import tokenplane\ntok = tokenplane.load({self.tokenizer!r})\ntext = {self.text!r}{note}\n"
                f"ids = tok.encode(text{allowed}, path='reference').tolist()\n"
                f"# first difference at token {self.index}; served has {self.served_len} tokens, "
                f"reference {self.expected_len}\n"
                f"# served[{self.window_start}:] starts {self.served_window}\n"
                f"# expected[{self.window_start}:] starts {self.expected_window}\n")


def default_reference_factory(tokenizer: Tokenizer) -> Callable[[], ReferenceEngine]:
    """A factory for a brand-new reference engine from the tokenizer's pinned file (never the serving instance)."""
    from .spec.artifacts import ARTIFACTS, artifact_bytes

    # Identify the file by content, so renamed or size-limited Tokenizers over a pinned file work too.
    name = next((a.name for a in ARTIFACTS.values() if a.sha256 == tokenizer.content_hash), None)
    if name is None:
        raise ValueError(f"{tokenizer.name!r} is not built from a pinned artifact; pass reference_factory= to "
                         "ShadowVerifier")
    return lambda: make_reference(tokenizer.family, artifact_bytes(name))


def first_difference(a: np.ndarray, b: np.ndarray) -> int:
    """Index of the first position where a and b differ (len of the shorter if one is a prefix), -1 if equal."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    if diff.size:
        return int(diff[0])
    return -1 if len(a) == len(b) else n


class ShadowVerifier:
    """`submit(text, ids)` samples with probability `rate` and enqueues; a worker thread re-encodes with a fresh
    reference and records mismatches. `stats()` is cheap and thread-safe; `close()` stops the worker."""

    def __init__(self, tokenizer: Tokenizer, rate: float = 0.05, max_queue: int = 256, *,
                 reference_factory: Callable[[], ReferenceEngine] | None = None, seed: int | None = None,
                 on_mismatch: Callable[[Mismatch], None] | None = None, max_reports: int = 32):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.tokenizer = tokenizer
        self.rate = rate
        self.on_mismatch = on_mismatch
        self.max_reports = max_reports
        self._factory = reference_factory or default_reference_factory(tokenizer)
        self._matcher: SpecialMatcher | None = None
        self._matcher_ref: ReferenceEngine | None = None
        self._rng = random.Random(seed)
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._counts = {"submitted": 0, "sampled": 0, "checked": 0, "mismatches": 0, "dropped": 0, "errors": 0}
        self._check_seconds = 0.0
        self.reports: list[Mismatch] = []
        self.state = VerifierState.STARTING
        self.error: str | None = None
        self._ready = threading.Event()
        self._worker = threading.Thread(target=self._run, name=f"shadow-verify-{tokenizer.name}", daemon=True)
        self._worker.start()

    # -- serving side ---------------------------------------------------------------------------------------------
    def submit(self, text: str, ids: Sequence[int] | np.ndarray, *, allowed_special: Collection[str] = (),
               context: dict | None = None) -> bool:
        """Offer one served (text, ids) pair. Returns True if it was sampled and queued. Never blocks."""
        with self._lock:
            self._counts["submitted"] += 1
            if self.state == VerifierState.CLOSED or self.rate <= 0.0 or self._rng.random() >= self.rate:
                return False
            self._counts["sampled"] += 1
            if self.state == VerifierState.FAILED:
                self._counts["dropped"] += 1
                return False
        # Copy: the caller's array may be a view into session state that keeps changing.
        item = (text, np.array(ids, dtype=np.int64, copy=True), tuple(allowed_special), dict(context or {}))
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            with self._lock:
                self._counts["dropped"] += 1
            return False

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            out["check_seconds"] = round(self._check_seconds, 6)
        out.update(rate=self.rate, queue_depth=self._queue.qsize(), state=self.state.name.lower(),
                   tokenizer=self.tokenizer.name)
        if self.error:
            out["error"] = self.error
        return out

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every queued sample has been checked (for tests and orderly shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0 and self._ready.is_set():
                return True
            time.sleep(0.005)
        return False

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            if self.state == VerifierState.CLOSED:
                return
            self.state = VerifierState.CLOSED
        try:
            self._queue.put(None, timeout=timeout)   # sentinel; the worker finishes what is queued first
        except queue.Full:
            pass
        self._worker.join(timeout)

    def __enter__(self) -> ShadowVerifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- worker side ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            reference = self._factory()
        except Exception as exc:   # the verifier must never take serving down; it reports and counts drops
            self.error = f"reference engine failed to build: {exc!r}"
            self.state = VerifierState.FAILED
            self._ready.set()
            self._drain_as_dropped()
            return
        with self._lock:
            if self.state == VerifierState.STARTING:
                self.state = VerifierState.RUNNING
        self._ready.set()
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                t0 = time.perf_counter()
                self._check(reference, *item)
                with self._lock:
                    self._check_seconds += time.perf_counter() - t0
            except Exception as exc:
                with self._lock:
                    self._counts["errors"] += 1
                self.error = f"check failed: {exc!r}"
            finally:
                self._queue.task_done()

    def _drain_as_dropped(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=0.5 if self.state != VerifierState.CLOSED else 0.0)
            except queue.Empty:
                if self.state == VerifierState.CLOSED:
                    return
                continue
            if item is not None:
                with self._lock:
                    self._counts["dropped"] += 1
            self._queue.task_done()
            if item is None:
                return

    def _matcher_for(self, reference: ReferenceEngine) -> SpecialMatcher:
        """A literal matcher of the fresh engine's own specials, built once by the worker (no serving state)."""
        if self._matcher is None or self._matcher_ref is not reference:
            self._matcher, self._matcher_ref = SpecialMatcher(reference.specials), reference
        return self._matcher

    def expected_ids(self, reference: ReferenceEngine, text: str, allowed: Collection[str]) -> np.ndarray:
        parts = []
        for segment, special_id in self._matcher_for(reference).split(text, allowed):
            if special_id is not None:
                parts.append(np.array([special_id], dtype=np.int64))
            elif segment:
                parts.append(reference.encode_ordinary(segment).astype(np.int64))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _check(self, reference: ReferenceEngine, text: str, served: np.ndarray, allowed: tuple, context: dict
               ) -> None:
        expected = self.expected_ids(reference, text, allowed)
        idx = first_difference(served, expected)
        with self._lock:
            self._counts["checked"] += 1
            if idx < 0:
                return
            self._counts["mismatches"] += 1
            keep = len(self.reports) < self.max_reports
        report = self._report(reference, text, served, expected, idx, allowed, context)
        if keep:
            with self._lock:
                self.reports.append(report)
        if self.on_mismatch is not None:
            self.on_mismatch(report)

    def _report(self, reference, text, served, expected, idx, allowed, context) -> Mismatch:
        lo, hi = max(0, idx - 4), idx + 8
        if len(text) <= REPRO_MAX_CHARS:
            snippet, is_window = text, False
        else:
            # Locate the divergence in characters via the expected tokens' byte lengths; keep a generous window.
            consumed = len(reference.decode_bytes(int(i) for i in expected[:idx]).decode("utf-8", "replace"))
            start = max(0, consumed - 4096)
            snippet, is_window = text[start:consumed + 4096], True
        return Mismatch(tokenizer=self.tokenizer.name, index=idx, window_start=lo, served_len=len(served),
                        expected_len=len(expected),
                        served_window=served[lo:hi].tolist(), expected_window=expected[lo:hi].tolist(),
                        text_chars=len(text), text=snippet, text_is_window=is_window,
                        allowed_special=sorted(allowed), context=context)
