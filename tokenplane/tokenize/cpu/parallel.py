"""The data-parallel CPU encode path: per-character pre-tokenizer + numba BPE, serial or chunk-parallel.

Chunk-parallel mode cuts a long (normalized) text at *stable* positions (boundary.py: a position p, judged from the
two characters around it, where a piece provably starts whatever lies left of p-1 or right of p, and no match that
starts left of p reads beyond p). Chunk [a, b) is pre-tokenized on text[a:b+1] (the one character right of the cut
is all a left match may read) and its pieces left of b are the serial pieces there; pieces right of a are a function
of text[a:] because matching restarts at every piece start and no alternative looks behind. So concatenating the
chunks' IDs is exactly the serial result. As a run-time guard, every cut must also be a piece start of the left
chunk's own pre-tokenization; if one is not, the whole text is encoded serially (and `stats["cut_rejected"]` counts
it). For plain-NFC families (qwen3) the cuts are made in the raw text at positions NFC cannot touch
(`_cut_at_or_after`), and the thread that encodes a chunk builds its NFC from the text's changed regions when it
holds any (`_chunk_nfc`).

Scheduling: guided self-scheduling (big chunks first, smaller ones to even out the end) from one queue shared by the
calling thread and workers - 1 pool threads; a chunk's right cut is found by whoever pulls the chunk. Every stage of
a chunk (code points read from the str's own buffer, pre-tokenizer loop, UTF-8 + piece bounds, BPE) is numba nogil,
so the threads only meet on the GIL for ~50 us of Python glue per chunk.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from . import boundary, bpetables, fullbatch, fullencode, nfc, pretokenize, strbuf
from .bpe import BPE, DroppedBytes
from .startbits import PAD

if TYPE_CHECKING:   # type names only: these modules sit above this one
    from ..tokenizer import Tokenizer

PARALLEL_MIN_CHARS = 256 * 1024     # below this the thread hand-off costs more than it saves
# Characters sampled for the byte profile that places the cut targets. Each sample is a TLB and cache miss on a text the
# previous encode pushed out (1M characters after a 1M encode: 1,024 samples 46 us, 128 samples ~10 us, in a
# parallel encode's critical path); the guided schedule evens out what a coarse profile misses.
TARGET_SAMPLES = 128
MIN_CHUNK_CHARS = 64_000            # smallest guided chunk: per-chunk glue (~50 us) stays small next to its work
CUT_SEARCH_CHARS = 4096             # how far past a target offset to look for a stable position
# A serial encode (and each parallel chunk) runs through per-thread scratch arrays (code points, piece starts, UTF-8,
# piece bounds) that are reused from call to call: a fresh multi-MB array per stage costs a page fault per 4 KB on
# first touch, which measured ~9 ms per MB of text here (a third of the encode). Texts longer than BLOCK_CHARS run
# block by block, cut at stable positions like the parallel chunks, so the scratch stays bounded (~18 bytes a
# character of a block per thread). Smaller blocks measured slower (64K: -10% on 1M characters of English, the
# per-block Python glue and kernel set-up), so blocks are large. Measured again with the kernel's set-up paid once
# (cuts found beforehand, scratch sized once; scratch timing, medians of 7, one core, 1M characters): 64K blocks ran
# the all-hits pass 12-15% faster (their stage arrays stay cached), but the warm cell -3% to +8% on English and
# code and 3-5% slower on CJK text, whose time is mostly merges.
BLOCK_CHARS = 1 << 20
# Texts up to this long may take encode_short: one block, within every thread's scratch (_Scratch's minimum size)
SHORT_CHARS = 4096
_U32 = np.dtype(np.uint32)


class _Scratch:
    """One thread's reusable arrays, grown to the largest block it has encoded (plus the lookahead)."""

    def __init__(self) -> None:
        self.chars = -1
        self.full: tuple[Any, bool, bool, Any] | None = None    # CpuEncoder._full_kernel's binding of these arrays
        self.grow(0)

    def grow(self, chars: int) -> None:
        n = max(chars, SHORT_CHARS) + 2
        self.chars = n
        self.cps = np.empty(n, dtype=np.uint32)
        self.kind = np.empty(n + PAD, dtype=np.uint8)     # the fused kernel's feature bytes (+ startbits' padding)
        self.starts = np.empty(n, dtype=np.bool_)
        self.buf = np.empty(4 * n + 16, dtype=np.uint8)   # + the walk's padding (fullencode._finish)
        self.bounds = np.empty(n + 1, dtype=np.int64)
        self.full = None        # (bound to the arrays replaced here)


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


class CpuEncoder:
    """Exact CPU encoder of one tokenizer's ordinary text (IDs equal `tok.reference.encode_ordinary`)."""

    def __init__(self, tok: Tokenizer, *, workers: int | None = None, parallel_min_chars: int = PARALLEL_MIN_CHARS,
                 min_chunk_chars: int = MIN_CHUNK_CHARS):
        if not pretokenize.supported(tok.family):
            raise pretokenize.UnsupportedFamily(tok.family.name)
        self.tok = tok
        self.family = tok.family
        # memory-mapped tables from the cache; the reference engine is built only when they must be built
        self.bpe = BPE(bpetables.load(tok.family.name, tok.content_hash, lambda: tok.reference))
        self.rule = boundary.rule_for(tok.family)
        if self.rule is not None:
            boundary.pair_table(self.rule)     # the cut search's table: built here, not in the first request
        self.workers = workers or default_workers()
        self.parallel_min_chars = parallel_min_chars
        self.min_chunk_chars = min_chunk_chars
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._local = threading.local()
        self.block_chars = BLOCK_CHARS
        self.fused = True       # False: the staged chain only (kept to measure against and as the tests' oracle)
        # False: the staged pre-tokenizer (run loops, o200k's Python rescan), then the piece-map walk (kept to measure
        # the fused block kernels against; every supported family has one)
        self.full_kernel = True
        self.stats = {"serial": 0, "parallel": 0, "chunks": 0, "cut_rejected": 0}
        # a list: each chunk of a parallel encode appends (thread ident, start, end, perf_counter at its start and
        # at its end) to it (benchmarks/parallel_contention.py); None: nothing is recorded
        self.chunk_trace: list[tuple[int, int, int, float, float]] | None = None
        # Plain NFC (qwen3): chunks are cut in raw text and normalized by their own threads (encode_parallel).
        self._nfc_inert = None
        if tok.plain_nfc:
            self._nfc_inert = nfc.inert_table()

    # -- serial ---------------------------------------------------------------------------------------------------
    def _scratch(self, chars: int) -> _Scratch:
        """This thread's scratch, grown to hold `chars` characters when that is within a block's size."""
        sc = getattr(self._local, "scratch", None)
        if sc is None:
            sc = self._local.scratch = _Scratch()
        if chars > sc.chars and chars <= self.block_chars + CUT_SEARCH_CHARS + 2:
            sc.grow(chars)
        return sc

    def _full_kernel(self, sc: _Scratch) -> Callable[[str, int, int, str], tuple[np.ndarray, int]]:
        """This thread's block kernel with its scratch bound too (fullencode.scratch_bound_encoder), kept on the
        scratch (grow drops it): the binding's own checks (kernel set, schedule flags) without the lookups of the
        thread's piece map, and no array to check or unbox, on every call."""
        entry = sc.full
        if not fullencode.still_bound(entry, self.bpe):
            fn = fullencode.scratch_bound_encoder(self.bpe, self.family.name, (sc.cps, sc.kind, sc.starts, sc.buf,
                                                                               sc.bounds))
            entry = sc.full = fullencode.binding(self.bpe, fn)
        return entry[3]

    def _encode_range(self, s: str, a: int, b: int, lookahead: str = "") -> np.ndarray:
        """IDs of s[a:b] (already normalized); `lookahead`: the character right of a chunk cut, read by the
        pre-tokenizer but not encoded. One GIL-free fused call (fullencode.py); what it declines (a lone surrogate,
        a byte the vocabulary lacks) runs the staged chain below."""
        n = b - a
        if n <= 0:
            return np.zeros(0, dtype=np.uint32)
        sc = self._scratch(n + len(lookahead))
        if self.fused and self.full_kernel:
            ids, status = self._full_kernel(sc)(s, a, b, lookahead)
            if status == fullencode.OK:
                return ids.view(np.uint32)
            if status == fullencode.CUT_REJECTED:
                raise _CutRejected(b)
            self.stats["fused_declined"] = self.stats.get("fused_declined", 0) + 1
        cps = strbuf.codepoints(s, a, b, lookahead, sc.cps)
        starts = pretokenize.piece_starts(self.family, cps, sc.starts)
        if lookahead and not starts[n]:
            raise _CutRejected(b)
        if self.fused:      # (full_kernel off): the pieces still go through the piece map
            ids, status = fullencode.walk_encoder(self.bpe)(cps, n, starts, sc.buf, sc.bounds)
            if status == fullencode.OK:
                return ids.view(np.uint32)
        buf, bounds = strbuf.utf8_and_bounds(cps, n, starts, sc.buf, sc.bounds)
        return self.bpe.encode_bytes(buf, bounds).view(np.uint32)

    def encode_texts(self, s: str, spans: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """IDs of each span s[a:b] (s normalized; spans int64[k, 2], each under a block) encoded as a text of its
        own, back to back (uint32), and each span's count, in one call (fullbatch.py); None where the fused kernels
        decline one of them (a byte the vocabulary lacks) or are switched off: encode the texts one by one."""
        if not (self.fused and self.full_kernel) or not len(spans):
            return None
        sc = self._scratch(int((spans[:, 1] - spans[:, 0]).max()) + 1)
        ids, counts, status = fullbatch.batch_encoder(self.bpe, self.family.name)(s, spans, sc.cps, sc.kind,
                                                                                  sc.starts, sc.buf, sc.bounds)
        return (ids.view(np.uint32), counts) if status == fullencode.OK else None

    def _encode_blocks(self, s: str, a: int, b: int, lookahead: str = "") -> np.ndarray:
        """IDs of s[a:b] (normalized), block by block: blocks of ~block_chars cut at stable positions (the chunk
        cuts of the module docstring: the concatenation is the IDs of the whole range; a cut the left block's own
        pre-tokenization does not start a piece at raises _CutRejected, and the caller encodes in one go)."""
        if self._one_block(b - a):
            return self._encode_range(s, a, b, lookahead)
        return np.concatenate([self._encode_range(s, x, y, s[y:y + 1] if y < b else lookahead)
                               for x, y in self._block_spans(s, a, b, None)])

    def _block_spans(self, s: str, a: int, b: int, inert: np.ndarray | None) -> Iterator[tuple[int, int]]:
        """The blocks of s[a:b]: ~block_chars each, cut at the first stable position past each block's target (with
        `inert`, one NFC cannot act across either: `_cut_at_or_after`); the rest of the range where none is near."""
        while a < b:
            right = b
            if b - a > self.block_chars + self.block_chars // 2:
                cut = self._cut_at_or_after(s, a + self.block_chars, inert)
                if cut is not None and cut < b:
                    right = cut
            yield a, right
            a = right

    def _one_block(self, chars: int) -> bool:
        """Whether `chars` characters encode as one block (no cut to search for or to reject)."""
        return self.rule is None or chars <= self.block_chars + self.block_chars // 2

    def _encode_norm(self, norm: str) -> np.ndarray:
        if self._one_block(len(norm)):      # (the common case: one block, straight to its kernel)
            return self._encode_range(norm, 0, len(norm))
        try:
            return self._encode_blocks(norm, 0, len(norm))
        except _CutRejected:
            self.stats["cut_rejected"] += 1
            return self._encode_range(norm, 0, len(norm))

    def _encode_raw_blocks(self, text: str, changes: list[tuple[int, int, str]]) -> np.ndarray:
        """Serial encode of a long raw text of a plain-NFC family (qwen3) that NFC changes (`changes`: its changed
        regions, Tokenizer.nfc_changes): blocks cut in raw coordinates where NFC cannot act (`_cut_at_or_after` with
        the inert table, as the parallel chunks); a block that holds no changed region is its own NFC and is encoded
        from the text's own buffer, any other is built from its text and changed regions (`nfc.splice`). A whole-text
        NFC built a second whole-text str: 10-12 ms of a 4M-char qwen3 code text's 62-76 ms (a UCS-4 str, 7 changed
        regions; scratch `w4b.py`, one core, warm); normalizing every block's slice anew scanned the text twice."""
        ends = [e for _, e, _ in changes]
        parts = []
        for a, right in self._block_spans(text, 0, len(text), self._nfc_inert):
            lookahead = text[right:right + 1]     # inert: its own NFC, read by the left block's pre-tokenizer
            k = bisect.bisect_right(ends, a)      # the first changed region that ends after a
            if k < len(changes) and changes[k][0] < right:
                block = nfc.splice(text, a, right, changes, k)
                if block is None:
                    block = self.tok.normalize(text[a:right])
                parts.append(self._encode_blocks(block, 0, len(block), lookahead))
            else:
                parts.append(self._encode_blocks(text, a, right, lookahead))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def encode(self, text: str, *, parallel: bool | None = None) -> np.ndarray:
        use_parallel = parallel if parallel is not None else (
            self.workers > 1 and len(text) >= self.parallel_min_chars and self.rule is not None)
        if use_parallel and self.rule is not None:
            return self.encode_parallel(text)
        self.stats["serial"] += 1
        try:
            if self._nfc_inert is not None and not self._one_block(len(text)) and not text.isascii():
                changes = self.tok.nfc_changes(text)
                if not changes:
                    return self._encode_norm(text)
                try:
                    return self._encode_raw_blocks(text, changes)
                except _CutRejected:
                    self.stats["cut_rejected"] += 1
            return self._encode_norm(self.tok.normalize(text))
        except DroppedBytes:
            return self._reference(text)

    def encode_short(self, text: str) -> np.ndarray | None:
        """`encode` of a text of up to SHORT_CHARS characters, as one call of the thread's bound block kernel with no
        layer between (a chat message: `encode`'s layers cost ~2.5 us against the kernel's ~1.7 on a 70-character
        text); None where it does not answer, and `encode` then does, with its checks, errors and fallbacks: a longer
        text, a non-ASCII text of a normalizing family, the fused kernels switched off, no binding yet on this thread,
        or a status the kernel declines (a lone surrogate, a byte the vocabulary lacks). Not counted in `stats`."""
        sc = getattr(self._local, "scratch", None)
        if sc is None or len(text) > SHORT_CHARS or not (self.fused and self.full_kernel):
            return None
        # texts taken as they are: all of them without a normalizer; with NFC the ASCII ones (an ASCII text is its own
        # NFC); none under another normalizer (not assumed to leave ASCII alone)
        norm = self.tok.normalizer_kind
        if norm != "none" and (norm != "nfc" or not text.isascii()):
            return None
        entry = sc.full
        if not fullencode.still_bound(entry, self.bpe):
            return None
        ids, status = entry[3](text, 0, len(text), "")
        return ids.view(_U32) if status == fullencode.OK else None

    def _reference(self, text: str) -> np.ndarray:
        """A text with a byte the vocabulary lacks (smollm2: six ASCII controls, U+40000-U+BFFFF): the reference
        drops it and merges across it; the kernels do not, so the reference encodes the whole text."""
        self.stats["reference"] = self.stats.get("reference", 0) + 1
        return self.tok.reference.encode_ordinary(text)

    __call__ = encode

    # -- chunk-parallel -------------------------------------------------------------------------------------------
    def _chunk_fractions(self, n_chars: int, n_chunks: int | None) -> list[float]:
        """Cumulative byte fractions of the cuts. `n_chunks` given: equal parts. Otherwise guided self-scheduling:
        each chunk takes 1/(2 * workers) of what remains, down to min_chunk_chars, so big chunks go first and the
        small ones at the end even out what the text's uneven cost leaves (measured on 1M characters of real text:
        the BPE of one half took 5.5 ms, of the other 6.5; with two equal chunks one core idled for the difference)."""
        if n_chunks:
            return [k / n_chunks for k in range(1, n_chunks)]
        share = 1.0 / (2 * self.workers)
        floor = min(1.0, self.min_chunk_chars / max(n_chars, 1))
        out, done = [], 0.0
        while True:
            done += max((1.0 - done) * share, floor)
            if done >= 1.0 - floor / 2:
                return out
            out.append(done)

    @staticmethod
    def _targets(text: str, fractions: list[float]) -> list[int]:
        """Character offsets at the given fractions of the text's UTF-8 size. Work follows bytes more than
        characters (a CJK character is 3 bytes and more merges); the byte profile is estimated from every step-th
        character (TARGET_SAMPLES of them, read GIL-free from the string's own buffer; the guided schedule evens
        out what the estimate misses); an ASCII str needs no profile. Plain Python on the ~10 fractions: numpy's
        array calls cost ~30 us here right after a large encode, ~3 us in Python."""
        n = len(text)
        if text.isascii():      # one byte per character (an O(1) flag of the str)
            return [min(int(n * f), n - 1) for f in fractions]
        step = max(1, n // TARGET_SAMPLES)
        cum = strbuf.sampled_utf8_sizes(text, step).tolist()       # (a few numpy calls cost more than this)
        return [min(bisect.bisect_left(cum, cum[-1] * f) * step, n - 1) for f in fractions]

    def _cut_at_or_after(self, text: str, target: int, inert: np.ndarray | None) -> int | None:
        """The first stable position >= target within CUT_SEARCH_CHARS, or None. `inert` (an NFC inert table,
        nfc.py): `text` is raw, not yet normalized, and the cut p must also have text[p-1], text[p] and text[p+1]
        inert. Then NFC(text) = NFC(text[:p]) + NFC(text[p:]) (text[p] is inert), NFC(text[:p]) ends with text[p-1]
        and NFC(text[p:]) starts with text[p] (neither composes: text[p+1] is inert too), so the two characters the
        stable rule judged are the ones around the cut in the normalized text."""
        return self.rule.first_stable(text, target, min(len(text), target + CUT_SEARCH_CHARS), inert)

    def cuts(self, text: str, n_chunks: int, inert: np.ndarray | None = None) -> list[int]:
        """Stable positions at or after byte-balanced targets (k = 1..n_chunks-1), strictly increasing; fewer if
        none is near (see `_cut_at_or_after` for `inert`)."""
        fractions = self._chunk_fractions(len(text), n_chunks)
        return list(_LazyCuts(self, text, lambda: self._targets(text, fractions), inert))

    def _pool_get(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="tokenplane-cpu")
            return self._pool

    def encode_parallel(self, text: str, *, n_chunks: int | None = None) -> np.ndarray:
        """Chunk-parallel encode of raw text; equals the serial encode. Plain-NFC families (qwen3) are cut in raw
        coordinates at positions NFC cannot touch (see `_cut_at_or_after`), and each chunk's thread finds the
        regions NFC changes in its chunk (`_chunk_nfc`): no serial whole-text NFC pass stands in front of the
        threads."""
        if self._nfc_inert is None or text.isascii():
            return self._encode_parallel(self.tok.normalize(text), n_chunks)
        return self._encode_parallel(text, n_chunks, raw=True)

    def encode_parallel_normalized(self, norm: str, *, n_chunks: int | None = None) -> np.ndarray:
        """Chunk-parallel encode of already normalized text; equals the serial encode (see module docstring)."""
        return self._encode_parallel(norm, n_chunks)

    def _encode_parallel(self, s: str, n_chunks: int | None, *, raw: bool = False) -> np.ndarray:
        """The calling thread and workers - 1 pool threads pull chunks from one queue: the caller works instead of
        waiting (measured: handing both halves of 1M characters to the pool and waiting gave 1.36-1.46x where the
        caller taking one gave 1.60-1.68x). Whoever pulls a chunk first finds its right cut (_LazyCuts), so the cut
        search overlaps the other threads' GIL-free encoding instead of running in front of them. Only the first
        chunk's span (the byte profile and one cut) is found before the helpers are woken: a helper woken first
        wanted the GIL at every nogil call of that search, and each hand-off cost ~30 us (the first chunk began
        ~110 us into a 1M-character encode; alternated with the former order in one process, 24 pairs a cell:
        1.02-1.16x on seven 1M-character cells, 1.01x on three of 4M). `raw`: s is the raw text of a plain-NFC
        family (encode_parallel), else normalized."""
        norm_of = self.tok.normalize
        fractions = self._chunk_fractions(len(s), n_chunks)
        if not fractions:
            self.stats["serial"] += 1
            try:
                return self._encode_norm(norm_of(s) if raw else s)
            except DroppedBytes:
                return self._reference(s)
        cuts = _LazyCuts(self, s, lambda: self._targets(s, fractions), self._nfc_inert if raw else None)
        results: list[np.ndarray] = []
        lock = threading.Lock()
        first = cuts.next_span()        # (the helpers are not woken yet: no lock to take)
        if first is not None:
            results.append(None)

        trace = self.chunk_trace

        def encode_span(i: int, a: int, b: int) -> None:
            t0 = time.perf_counter() if trace is not None else 0.0
            try:
                if raw:
                    chunk = self._chunk_nfc(s, a, b)
                    results[i] = self._encode_blocks(chunk, 0, len(chunk), s[b:b + 1]) if chunk is not None \
                        else self._encode_blocks(s, a, b, s[b:b + 1])
                else:
                    results[i] = self._encode_blocks(s, a, b, s[b:b + 1])
                if trace is not None:
                    trace.append((threading.get_ident(), a, b, t0, time.perf_counter()))
            except BaseException:
                with lock:
                    cuts.stop()     # the text is encoded serially: no thread should start another chunk
                raise

        def drain() -> None:
            while True:
                with lock:
                    span = cuts.next_span()
                    if span is None:
                        return
                    results.append(None)
                encode_span(*span)

        helpers = [self._pool_get().submit(drain) for _ in range(min(self.workers, len(fractions) + 1) - 1)]
        try:
            try:
                if first is not None:
                    encode_span(*first)
                drain()
            finally:
                for h in helpers:       # wait for every helper; a helper's _CutRejected surfaces here
                    h.result()
        except _CutRejected:
            self.stats["cut_rejected"] += 1
            self.stats["serial"] += 1
            try:
                return self._encode_norm(norm_of(s) if raw else s)
            except DroppedBytes:
                return self._reference(s)
        except DroppedBytes:
            return self._reference(s)
        if len(results) == 1:
            self.stats["serial"] += 1
            return results[0]
        self.stats["parallel"] += 1
        self.stats["chunks"] += len(results)
        return np.concatenate(results)

    def _chunk_nfc(self, s: str, a: int, b: int) -> str | None:
        """NFC of the raw chunk s[a:b] (a and b: cuts NFC cannot act across), or None when it is its own NFC: then
        s[a:b] is encoded in place. The chunk is scanned where it lies (GIL-free) and the reference normalizer sees
        only its changed regions. Slicing every chunk's str and normalizing that cost the threads a copy of the text
        (qwen3 english 1M, one core: the chunks' work 3.35 ms against 2.83 in place); one whole-text scan in front of
        the threads instead cost 0.4-1.2 ms before they started at 4M characters."""
        found = self.tok.nfc_changes(s, a, b)
        if not found:
            return None
        block = nfc.splice(s, a, b, found)
        assert block is not None    # (the regions lie within [a, b): none crosses a cut)
        return block

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None


class _CutRejected(RuntimeError):
    """A chunk cut was not a piece start of the left chunk's own pre-tokenization (boundary rule disagrees)."""


class _LazyCuts:
    """Chunk spans in order, each right cut found when the chunk is pulled (the caller holds the queue lock)."""

    def __init__(self, enc: CpuEncoder, text: str, targets: Callable[[], list[int]], inert: np.ndarray | None):
        self.enc, self.text, self.inert = enc, text, inert
        self._targets_of = targets
        self.targets: list[int] | None = None      # made on the first pull
        self.k = 0          # next target to resolve
        self.left = 0       # start of the next span
        self.count = 0

    def stop(self) -> None:
        self.left = len(self.text)

    def next_span(self) -> tuple[int, int, int] | None:
        n = len(self.text)
        if self.left >= n:
            return None
        targets = self.targets
        if targets is None:
            targets = self.targets = self._targets_of()
        right = n
        while self.k < len(targets):
            target = max(targets[self.k], self.left + 1)
            self.k += 1
            if target >= n:
                self.k = len(targets)
                break
            cut = self.enc._cut_at_or_after(self.text, target, self.inert)
            if cut is not None:
                right = cut
                break
        span = (self.count, self.left, right)
        self.count += 1
        self.left = right
        return span

    def __iter__(self):
        while (span := self.next_span()) is not None:
            if span[2] < len(self.text):
                yield span[2]
