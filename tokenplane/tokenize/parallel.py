"""The data-parallel CPU encode path: per-character pre-tokenizer + numba BPE, serial or chunk-parallel.

Chunk-parallel mode cuts a long (normalized) text at *stable* positions (boundary.py: a position p, judged from the
two characters around it, where a piece provably starts whatever lies left of p-1 or right of p, and no match that
starts left of p reads beyond p). Chunk [a, b) is pre-tokenized on text[a:b+1] (the one character right of the cut
is all a left match may read) and its pieces left of b are the serial pieces there; pieces right of a are a function
of text[a:] because matching restarts at every piece start and no alternative looks behind. So concatenating the
chunks' IDs is exactly the serial result. As a run-time guard, every cut must also be a piece start of the left
chunk's own pre-tokenization; if one is not, the whole text is encoded serially (and `stats["cut_rejected"]` counts
it). Chunks (up to four per worker) are pulled from one queue by the calling thread and workers - 1 pool threads:
the pre-tokenizer loops and the BPE kernel are numba nogil.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import boundary, pretokenize
from .bpe import BPE, piece_byte_bounds, utf8_offsets

PARALLEL_MIN_CHARS = 256 * 1024     # below this the thread hand-off costs more than it saves
CHUNK_CHARS = 500_000               # chunk size aimed at: several chunks per worker even out uneven text
MAX_CHUNKS_PER_WORKER = 4
CUT_SEARCH_CHARS = 4096             # how far past a target offset to look for a stable position


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


class CpuEncoder:
    """Exact CPU encoder of one tokenizer's ordinary text (IDs equal `tok.reference.encode_ordinary`)."""

    def __init__(self, tok, *, workers: int | None = None, parallel_min_chars: int = PARALLEL_MIN_CHARS):
        if not pretokenize.supported(tok.family):
            raise pretokenize.UnsupportedFamily(tok.family.name)
        self.tok = tok
        self.family = tok.family
        self.bpe = BPE(tok.reference, tok.content_hash)
        self.rule = boundary.rule_for(tok.family)
        self.workers = workers or default_workers()
        self.parallel_min_chars = parallel_min_chars
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.stats = {"serial": 0, "parallel": 0, "chunks": 0, "cut_rejected": 0}

    # -- serial ---------------------------------------------------------------------------------------------------
    def _encode_norm(self, norm: str, lookahead: str = "") -> np.ndarray:
        """IDs of `norm` (already normalized); `lookahead`: the character right of a chunk cut, read by the
        pre-tokenizer but not encoded."""
        if not norm:
            return np.zeros(0, dtype=np.uint32)
        cps = pretokenize.codepoints(norm + lookahead)
        starts = pretokenize.piece_starts(self.family, cps)
        n = len(norm)
        if lookahead and not starts[n]:
            raise _CutRejected(n)
        bounds = piece_byte_bounds(cps[:n], starts[:n])
        buf = np.frombuffer(norm.encode("utf-8"), dtype=np.uint8)
        return self.bpe.encode_bytes(buf, bounds).view(np.uint32)

    def encode(self, text: str, *, parallel: bool | None = None) -> np.ndarray:
        norm = self.tok.reference.normalize(text)
        use_parallel = parallel if parallel is not None else (
            self.workers > 1 and len(norm) >= self.parallel_min_chars and self.rule is not None)
        if use_parallel and self.rule is not None:
            return self.encode_parallel_normalized(norm)
        self.stats["serial"] += 1
        return self._encode_norm(norm)

    __call__ = encode

    # -- chunk-parallel -------------------------------------------------------------------------------------------
    @staticmethod
    def _targets(norm: str, n_chunks: int) -> list[int]:
        """Character offsets that split the text into n_chunks parts of about equal UTF-8 size. Work follows bytes
        more than characters (a CJK character is 3 bytes and more merges), so equal-character halves of mixed text
        leave one thread idle; the byte profile is estimated from every step-th character (about 64K samples)."""
        n = len(norm)
        step = max(1, n // 65536)
        cum = utf8_offsets(pretokenize.codepoints(norm[::step]))[1:]
        goals = cum[-1] * np.arange(1, n_chunks) / n_chunks
        return [int(min(n - 1, step * int(np.searchsorted(cum, g)))) for g in goals]

    def cuts(self, norm: str, n_chunks: int) -> list[int]:
        """Stable positions at or after byte-balanced targets (k = 1..n_chunks-1), strictly increasing; fewer if
        none is near."""
        n = len(norm)
        out: list[int] = []
        for goal in self._targets(norm, n_chunks):
            target = max(goal, (out[-1] + 1) if out else 1)
            if target >= n:
                break
            lo = target - 1
            found = self.rule.stable_positions(norm[lo:min(n, target + CUT_SEARCH_CHARS)], offset=lo)
            found = found[(found >= target) & (found < n)]
            if found.size:
                out.append(int(found[0]))
        return out

    def _pool_get(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="tokenplane-cpu")
            return self._pool

    def _run_jobs(self, jobs: list[tuple[str, str]]) -> list[np.ndarray]:
        """Encode every chunk with the calling thread and workers - 1 pool threads pulling from one queue: the
        caller works instead of waiting (measured: handing both halves of 1M characters to the pool and waiting
        gave 1.36-1.46x where the caller taking one gave 1.60-1.68x), and a queue evens out uneven chunks."""
        results: list[np.ndarray | None] = [None] * len(jobs)
        order = iter(range(len(jobs)))
        lock = threading.Lock()

        def drain() -> None:
            while True:
                with lock:
                    i = next(order, None)
                if i is None:
                    return
                results[i] = self._encode_norm(*jobs[i])

        helpers = [self._pool_get().submit(drain) for _ in range(min(self.workers, len(jobs)) - 1)]
        try:
            drain()
        finally:
            for h in helpers:       # wait for every helper; a helper's _CutRejected surfaces here
                h.result()
        return results

    def encode_parallel_normalized(self, norm: str, *, n_chunks: int | None = None) -> np.ndarray:
        """Chunk-parallel encode of normalized text; equals the serial encode (see module docstring)."""
        # About CHUNK_CHARS per chunk, up to MAX_CHUNKS_PER_WORKER per worker, pulled from one queue (_run_jobs): the
        # cost per character varies along real text (one half of a CJK slice took twice the other's BPE time).
        chunks = n_chunks or max(self.workers, min(len(norm) // CHUNK_CHARS,
                                                   MAX_CHUNKS_PER_WORKER * self.workers))
        cuts = self.cuts(norm, chunks) if chunks > 1 else []
        if not cuts:
            self.stats["serial"] += 1
            return self._encode_norm(norm)
        edges = [0, *cuts, len(norm)]
        jobs = [(norm[a:b], norm[b:b + 1]) for a, b in zip(edges[:-1], edges[1:])]
        try:
            parts = self._run_jobs(jobs)
        except _CutRejected:
            self.stats["cut_rejected"] += 1
            self.stats["serial"] += 1
            return self._encode_norm(norm)
        self.stats["parallel"] += 1
        self.stats["chunks"] += len(jobs)
        return np.concatenate(parts)

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None


class _CutRejected(RuntimeError):
    """A chunk cut was not a piece start of the left chunk's own pre-tokenization (boundary rule disagrees)."""
