"""GpuEncoder: the bytes-to-IDs chain on the device, per input-size bucket, eager or replayed as a CUDA graph.

Launch sequence (identical in every mode): lead-byte flags -> scan -> decode -> document flags -> classify ->
4 max-scans (run start, document start, last non-absorbable, last non-caseless) -> run aggregates -> predicate ->
scan (piece index) -> piece starts -> dispatch by length -> BPE thread/warp/block -> scan (token slot) -> emit.
Every trip count is read from the device `meta` block, so the geometry depends on the bucket capacity alone: one
graph per bucket replays any input that fits. The host waits twice per request: once for `meta` (token count and
flags) and once for the IDs. `sync_counts=True` is the conventional baseline on the same code path: it reads the
counts back after each stage (8 waits) and sizes later launches from them.

On the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) graph capture is skipped; launches and waits are counted the same.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..errors import InvalidTextError, PathUnavailableError, TextTooLargeError
from .layout import (
    F_CL100K,
    F_DEEPSEEK,
    F_LLAMA3,
    F_O200K,
    F_QWEN3,
    F_SMOLLM2,
    FALLBACK,
    INVALID,
    META_LEN,
    N_BYTES,
    N_CHARS,
    N_DOCS,
    N_LARGE,
    N_MEDIUM,
    N_PIECES,
    N_SMALL,
    N_TOKENS,
)
from .scan import OP_ADD, OP_MAX, launch_scan, make_scan

# Bytes one device pass takes: positions are int32, and the pre-tokenizer's last-non-CR/LF scan packs 2 * position +
# a document-start bit into one (so 2^30 - 1). A list [limit]: tests lower it.
MAX_PASS_BYTES = [(1 << 30) - 1]

if TYPE_CHECKING:   # type names only: these modules sit above this one
    from ..tokenizer import Tokenizer


class UnsupportedFamilyError(PathUnavailableError):
    """The tokenizer's family has no device rules here; use a CPU path."""


def simulator_enabled() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "") == "1"


def family_code(tokenizer: Tokenizer) -> int:
    from ..spec.families import FAMILIES

    fam = tokenizer.family
    for name, code in (("cl100k_base", F_CL100K), ("llama3", F_LLAMA3), ("o200k_base", F_O200K),
                       ("qwen3", F_QWEN3), ("deepseek_v4", F_DEEPSEEK), ("smollm2", F_SMOLLM2)):
        ref = FAMILIES[name]
        if (fam.engine, fam.patterns, fam.normalizer) == (ref.engine, ref.patterns, ref.normalizer):
            return code
    raise UnsupportedFamilyError(f"{tokenizer.name}: family {fam.name!r} has no GPU pre-tokenizer rules; the CPU path "
                                 f"serves it")


@dataclass
class Geometry:
    tpb: int            # threads per block of elementwise and scan kernels
    max_blocks: int     # cap for grid-stride kernels
    warp_tpb: int       # threads per block of the warp-per-piece kernel
    block_tpb: int      # threads per block of the block-per-piece kernel
    scan_items: int     # elements each scan thread folds serially (tile = tpb * scan_items)

    @staticmethod
    def for_mode(sim: bool) -> Geometry:
        # the simulator runs each CUDA thread as a Python thread and polls them at every syncthreads: one tiny
        # block (and one warp where warps are needed) keeps it fast; the GPU geometry is the one that is timed
        return Geometry(4, 1, 32, 8, 512) if sim else Geometry(256, 132 * 16, 128, 256, 8)

    def grid(self, capacity: int, per_block: int | None = None) -> int:
        return max(1, min(self.max_blocks, -(-capacity // (per_block or self.tpb))))


@dataclass
class Bucket:
    """Device buffers for inputs of up to `capacity` bytes (and `doc_capacity` documents)."""
    capacity: int
    doc_capacity: int
    d: dict = field(default_factory=dict)
    h_meta: np.ndarray | None = None
    h_docs: np.ndarray | None = None
    h_docfb: np.ndarray | None = None
    h_data: np.ndarray | None = None
    graph: object = None
    graph_error: str | None = None
    warm: bool = False        # ran eagerly once (kernels compiled and loaded) before any capture


class GpuEncoder:
    """Exact encoding on a CUDA device (or the numba CUDA simulator) for every family with device rules.

    `encode(text)` returns the reference IDs as uint32; inputs the device rules do not cover (o200k combining marks,
    chained contractions) are flagged on the device and answered by `fallback` (the reference engine by default).
    """

    def __init__(self, tokenizer: Tokenizer, *, small_max: int = 32, medium_max: int = 128, use_graphs: bool = True,
                 sync_counts: bool = False, buckets: tuple[int, ...] | None = None,
                 fallback: Callable[[str], np.ndarray] | None = None, max_docs: int = 4096):
        self.family = family_code(tokenizer)
        if not 1 <= small_max <= medium_max:
            raise ValueError("need 1 <= small_max <= medium_max")
        from numba import cuda

        self.sim = simulator_enabled()
        if self.sim:
            from .simwarp import install
            install()
        elif not cuda.is_available():
            raise PathUnavailableError("no CUDA device")
        self.cuda = cuda
        self.tokenizer = tokenizer
        self.small_max, self.medium_max = small_max, medium_max
        self.use_graphs = use_graphs and not self.sim
        self.sync_counts = sync_counts
        self.max_docs = max_docs
        self.fallback = fallback or tokenizer.reference.encode_ordinary
        self.geo = Geometry.for_mode(self.sim)
        default = (256, 4096, 65536) if self.sim else tuple(4 ** k * 4096 for k in range(7))  # 4 KiB .. 16 MiB
        self.bucket_sizes = tuple(sorted(buckets or default))
        self.buckets: dict[int, Bucket] = {}
        self.stats = {"requests": 0, "fallbacks": 0, "host_syncs": 0, "launches": 0, "graph_replays": 0}
        self.last_host_syncs = 0
        self.last_launches = 0
        # one stream and per-bucket buffers: requests from several threads (the router's in-flight slots) serialize
        self._lock = threading.RLock()

        from .bpe import make_bpe
        from .pretokenize import make_pretokenize
        from .tables import host_tables

        self.k = dict(make_pretokenize())
        if self.family == F_DEEPSEEK:   # same launch sequence and buffers, DeepSeek's classify/aggregate/predicate
            from .pretokenize_deepseek import make_pretokenize_deepseek
            self.k.update(make_pretokenize_deepseek())
        elif self.family == F_SMOLLM2:  # local rules (pretokenize_smollm2.py); dropped-byte documents fall back
            from .pretokenize_smollm2 import make_pretokenize_smollm2
            self.k.update(make_pretokenize_smollm2())
        self.k.update(make_bpe(small_max, self.geo.block_tpb))
        self.scan_k = make_scan(self.geo.tpb, self.geo.scan_items)
        t = host_tables(tokenizer)
        self.max_tok = t.max_token_bytes
        self.stream = cuda.stream()
        to = cuda.to_device
        self.t = dict(classes=to(t.classes), byte_id=to(t.byte_id), tok_off=to(t.tok_off), blob=to(t.tok_blob),
                      vslots=to(t.vocab_slots), pkeys=to(t.pair_keys), pvals=to(t.pair_vals))

    # -- buffers ------------------------------------------------------------------------------------------------
    def _bucket(self, nbytes: int, ndocs: int) -> Bucket:
        cap = next((c for c in self.bucket_sizes if c >= nbytes), None)
        if cap is None:
            cap = 1 << max(12, (nbytes - 1).bit_length())
        key = cap
        b = self.buckets.get(key)
        if b is not None and b.doc_capacity >= ndocs:
            return b
        cuda = self.cuda
        ndoc_cap = max(self.max_docs, ndocs)
        b = Bucket(cap, ndoc_cap)
        i32 = np.int32
        n1 = cap + 1
        d = b.d
        d["data"] = cuda.device_array(n1, dtype=np.uint8)
        for name in ("lead", "cidx", "cp", "cbyte", "docflag", "v_run", "v_doc", "v_nons", "v_nonc", "reff",
                     "rlastnl", "rend", "raux", "startflag", "pidx", "pstart", "small", "medium", "large",
                     "tokflag", "tokidx", "tokid", "wid", "wnx", "wpv", "wrk", "out", "docfb"):
            d[name] = cuda.device_array(n1, dtype=i32)
        # raux: a per-run aggregate whose meaning is the family's (o200k: last non-uppercase letter; deepseek: first
        # character that is not an ASCII letter)
        d["code"] = cuda.device_array(n1, dtype=np.uint8)
        d["sums"] = cuda.device_array(n1 // (self.geo.tpb * self.geo.scan_items) + 2, dtype=i32)
        d["meta"] = cuda.device_array(META_LEN, dtype=i32)
        d["doc_off"] = cuda.device_array(ndoc_cap, dtype=i32)
        d["doc_tok"] = cuda.device_array(ndoc_cap, dtype=i32)
        d["doc_fb"] = cuda.device_array(ndoc_cap, dtype=i32)
        pinned = np.zeros if self.sim else cuda.pinned_array
        b.h_meta = pinned(META_LEN, dtype=i32)
        b.h_docs = pinned(ndoc_cap, dtype=i32)
        b.h_docfb = pinned(ndoc_cap, dtype=i32)
        b.h_data = pinned(cap, dtype=np.uint8)
        self.buckets[key] = b
        return b

    # -- launch sequence ----------------------------------------------------------------------------------------
    def _readback(self, b: Bucket, idx: int) -> int:
        """Baseline only: the host waits for a count before the next launch."""
        b.d["meta"].copy_to_host(b.h_meta, stream=self.stream)
        self.stream.synchronize()
        self._syncs += 1
        return int(b.h_meta[idx])

    def _launch_all(self, b: Bucket, counted: bool) -> None:
        k, d, t, g, s = self.k, b.d, self.t, self.geo, self.stream
        cap = b.capacity
        meta = d["meta"]
        launches = 0

        def grid(n):
            return g.grid(n)

        def scan(src, dst, n_idx, op, exclusive, total_idx=-1, n=cap):
            nonlocal launches
            launch_scan(self.scan_k, g.grid(n, g.tpb * g.scan_items), g.tpb, s, src, dst, d["sums"], meta, n_idx, op,
                        exclusive, total_idx)
            launches += 3

        base = self.sync_counts and counted
        k["k_lead"][grid(cap), g.tpb, s](d["data"], meta, d["lead"], d["tokflag"])
        scan(d["lead"], d["cidx"], N_BYTES, OP_ADD, True, N_CHARS)
        nchars = self._readback(b, N_CHARS) if base else cap
        k["k_decode"][grid(cap), g.tpb, s](d["data"], meta, d["cidx"], d["cp"], d["cbyte"], d["docflag"])
        k["k_docs"][grid(b.doc_capacity), g.tpb, s](d["doc_off"], meta, d["cidx"], d["docflag"])
        k["k_classify"][grid(nchars), g.tpb, s](d["cp"], t["classes"], d["docflag"], meta, self.family, d["code"],
                                                d["v_run"], d["v_doc"], d["v_nons"], d["v_nonc"], d["reff"],
                                                d["rlastnl"], d["rend"], d["raux"], d["docfb"])
        for name in ("v_run", "v_doc", "v_nons", "v_nonc"):
            scan(d[name], d[name], N_CHARS, OP_MAX, False, n=nchars)
        k["k_aggregate"][grid(nchars), g.tpb, s](d["cp"], d["code"], meta, self.family, d["v_run"], d["v_nons"],
                                                 d["reff"], d["rlastnl"], d["rend"], d["raux"], d["v_doc"],
                                                 d["docfb"])
        k["k_predicate"][grid(nchars), g.tpb, s](d["cp"], d["code"], d["docflag"], meta, self.family, d["v_run"],
                                                 d["rend"], d["reff"], d["rlastnl"], d["raux"], d["v_nonc"],
                                                 d["startflag"], d["v_doc"], d["docfb"])
        if base:
            self._readback(b, FALLBACK)
        scan(d["startflag"], d["pidx"], N_CHARS, OP_ADD, True, N_PIECES, n=nchars)
        npieces = self._readback(b, N_PIECES) if base else cap
        k["k_pieces"][grid(nchars), g.tpb, s](d["startflag"], d["pidx"], d["cbyte"], meta, d["pstart"])
        k["k_dispatch"][g.grid(npieces, g.warp_tpb), g.warp_tpb, s](d["pstart"], meta, self.small_max,
                                                                     self.medium_max, d["small"], d["medium"],
                                                                     d["large"])
        nsmall = nmed = nlarge = cap
        if base:
            nsmall = self._readback(b, N_SMALL)
            nmed = int(b.h_meta[N_MEDIUM])
            nlarge = int(b.h_meta[N_LARGE])
        common = (d["data"], meta, d["pstart"])
        tabs = (t["byte_id"], t["vslots"], t["tok_off"], t["blob"], t["pkeys"], t["pvals"], self.max_tok)
        scratch = (d["wid"], d["wnx"], d["wpv"], d["wrk"])
        if nsmall:
            k["k_bpe_thread"][grid(nsmall), g.tpb, s](*common, d["small"], *tabs, d["tokflag"], d["tokid"])
        if nmed:
            wgrid = g.grid(max(1, min(nmed, cap // (self.small_max + 1))) * 32, g.warp_tpb)
            k["k_bpe_warp"][wgrid, g.warp_tpb, s](*common, d["medium"], *tabs, d["tokflag"], d["tokid"], *scratch)
        if nlarge:
            bgrid = max(1, min(g.max_blocks, nlarge, cap // (self.medium_max + 1)))
            k["k_bpe_block"][bgrid, g.block_tpb, s](*common, d["large"], *tabs, d["tokflag"], d["tokid"], *scratch)
        if base:
            self._readback(b, N_BYTES)
        scan(d["tokflag"], d["tokidx"], N_BYTES, OP_ADD, True, N_TOKENS)
        k["k_emit"][grid(cap), g.tpb, s](d["tokflag"], d["tokidx"], d["tokid"], meta, d["doc_off"], d["cidx"],
                                         d["docfb"], d["out"], d["doc_tok"], d["doc_fb"])
        launches += 14
        self._launches = launches

    # -- graphs ---------------------------------------------------------------------------------------------------
    def _graph_launch(self, b: Bucket) -> bool:
        """Replay the bucket's captured graph; capture it on first use. False (and eager) if capture failed."""
        if b.graph_error is not None:
            return False
        from cuda.bindings import driver as drv

        hs = drv.CUstream(int(self.stream))
        if b.graph is None:
            try:
                self.stream.synchronize()
                _check(drv.cuStreamBeginCapture(hs, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
                try:
                    self._launch_all(b, counted=False)
                finally:
                    graph = _check(drv.cuStreamEndCapture(hs))
                b.graph = _check(drv.cuGraphInstantiate(graph, 0))
            except Exception as exc:  # noqa: BLE001 - capture support varies by driver/numba version; stay eager
                b.graph_error = f"{type(exc).__name__}: {exc}"
                return False
        _check(drv.cuGraphLaunch(b.graph, hs))
        self.stats["graph_replays"] += 1
        return True

    # -- requests -------------------------------------------------------------------------------------------------
    def _run(self, blobs: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """IDs of the concatenated documents and each document's first-token offset (len(blobs) + 1)."""
        with self._lock:
            return self._run_locked(blobs)

    def _run_locked(self, blobs: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        lens = np.fromiter((len(x) for x in blobs), dtype=np.int64, count=len(blobs))
        nbytes = int(lens.sum())
        if nbytes > MAX_PASS_BYTES[0]:
            raise TextTooLargeError(f"{nbytes:,} bytes in one device pass; the limit is {MAX_PASS_BYTES[0]:,}")
        starts = np.concatenate(([0], np.cumsum(lens)))
        nonempty = np.flatnonzero(lens > 0)
        b = self._bucket(max(nbytes, 1), len(nonempty))
        self._syncs = 0
        d, s = b.d, self.stream
        b.h_data[:nbytes] = np.frombuffer(b"".join(blobs), dtype=np.uint8)
        b.h_meta[:] = 0
        b.h_meta[N_BYTES] = nbytes
        b.h_meta[N_DOCS] = len(nonempty)
        b.h_docs[:len(nonempty)] = starts[nonempty]
        d["data"][:nbytes].copy_to_device(b.h_data[:nbytes], stream=s)
        d["meta"].copy_to_device(b.h_meta, stream=s)
        d["doc_off"][:max(1, len(nonempty))].copy_to_device(b.h_docs[:max(1, len(nonempty))], stream=s)
        replayed = False
        if self.use_graphs and not self.sync_counts and b.warm:
            replayed = self._graph_launch(b)
        if not replayed:
            self._launch_all(b, counted=True)
            b.warm = True
        self.last_launches = 1 if replayed else self._launches
        # wait 1: counts and flags
        d["meta"].copy_to_host(b.h_meta, stream=s)
        d["doc_tok"][:max(1, len(nonempty))].copy_to_host(b.h_docs[:max(1, len(nonempty))], stream=s)
        d["doc_fb"][:max(1, len(nonempty))].copy_to_host(b.h_docfb[:max(1, len(nonempty))], stream=s)
        s.synchronize()
        self._syncs += 1
        meta = b.h_meta.copy()
        if meta[INVALID]:
            raise InvalidTextError("input is not valid UTF-8 (flagged by the device decoder)")
        ntok = int(meta[N_TOKENS])
        doc_first = np.empty(len(blobs) + 1, dtype=np.int64)
        doc_first[len(blobs)] = ntok
        doc_first[nonempty] = b.h_docs[:len(nonempty)]
        for i in range(len(blobs) - 1, -1, -1):   # an empty document starts where the next one does
            if lens[i] == 0:
                doc_first[i] = doc_first[i + 1]
        # wait 2: the IDs
        out = np.empty(ntok, dtype=np.int32)
        if ntok:
            d["out"][:ntok].copy_to_host(out, stream=s)
            s.synchronize()
        self._syncs += 1
        self.last_host_syncs = self._syncs
        self.stats["host_syncs"] += self._syncs
        self.stats["launches"] += self.last_launches
        self.stats["requests"] += 1
        self._last_fallback = bool(meta[FALLBACK])
        self.last_doc_fallback = np.zeros(len(blobs), dtype=bool)
        self.last_doc_fallback[nonempty] = b.h_docfb[:len(nonempty)] != 0
        self.last_meta = {"chars": int(meta[N_CHARS]), "pieces": int(meta[N_PIECES]), "tokens": ntok,
                          "small": int(meta[N_SMALL]), "medium": int(meta[N_MEDIUM]), "large": int(meta[N_LARGE]),
                          "fallback": bool(meta[FALLBACK])}
        return out.view(np.uint32), doc_first

    def _device_text(self, text: str) -> str:
        # NFC (qwen3) stays on the host, as in the paper: the device pipeline starts from normalized text
        return self.tokenizer.normalize(text) if self.tokenizer.family.normalizer else text

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, str):
            text = self._device_text(text)
        elif self.tokenizer.family.normalizer:
            try:
                text = self._device_text(bytes(text).decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise InvalidTextError(f"input is not valid UTF-8: {exc}") from None
        raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        if not raw:
            return np.zeros(0, dtype=np.uint32)
        with self._lock:
            ids, _ = self._run([raw])
            flagged = self._last_fallback
        if flagged:
            self.stats["fallbacks"] += 1
            return np.asarray(self.fallback(raw.decode("utf-8") if not isinstance(text, str) else text),
                              dtype=np.uint32)
        return ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """One device pass over concatenated documents (runs are cut at document boundaries); a batch over
        MAX_PASS_BYTES runs as several passes (a single text over it is refused by its pass)."""
        if not texts:
            return []
        blobs = [self._device_text(t).encode("utf-8") for t in texts]
        out: list[np.ndarray] = []
        start = size = 0
        for i, blob in enumerate(blobs):
            if i > start and size + len(blob) > MAX_PASS_BYTES[0]:
                out += self._encode_pass(texts[start:i], blobs[start:i])
                start, size = i, 0
            size += len(blob)
        return out + self._encode_pass(texts[start:], blobs[start:])

    def _encode_pass(self, texts: list[str], blobs: list[bytes]) -> list[np.ndarray]:
        if not any(blobs):
            return [np.zeros(0, dtype=np.uint32) for _ in texts]
        with self._lock:
            ids, first = self._run(blobs)
            flagged = self.last_doc_fallback.copy()
        out = [ids[first[i]:first[i + 1]] for i in range(len(texts))]
        for i in np.flatnonzero(flagged):   # flagged documents take the CPU answer
            self.stats["fallbacks"] += 1
            out[i] = np.asarray(self.fallback(texts[i]), dtype=np.uint32)
        return out

    def pieces_batch(self, texts: list[str]) -> list[list[tuple[int, int]]]:
        """Piece spans (character offsets per text, normalized text) of the device pre-tokenizer, for tests."""
        texts = [self._device_text(t) for t in texts]
        blobs = [t.encode("utf-8") for t in texts]
        if not any(blobs):
            return [[] for _ in texts]
        with self._lock:
            self._run(blobs)
            b = self._bucket(sum(map(len, blobs)), len(blobs))
            nchars = self.last_meta["chars"]
            starts = np.flatnonzero(b.d["startflag"][:nchars].copy_to_host())
        out, base = [], 0
        for t in texts:
            mine = starts[(starts >= base) & (starts < base + len(t))] - base
            ends = list(mine[1:]) + [len(t)]
            out.append([(int(a), int(e)) for a, e in zip(mine, ends)])
            base += len(t)
        return out


def _check(result):
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return result[1] if len(result) == 2 else (result[1:] if len(result) > 2 else None)
