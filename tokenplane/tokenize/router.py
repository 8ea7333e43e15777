"""The exact encode paths of a tokenizer and the `path="auto"` router.

`fast_paths(tok)` builds, for a Tokenizer under construction (registry.load passes it in as the encoder factory):
  "cpu"  -> the data-parallel CPU path (parallel.CpuEncoder), built lazily on first use;
  "auto" -> Router: the CPU path (built on first use, in the calling thread: tables memory-mapped from the cache,
            numba kernels loaded from their on-disk cache; the reference engine never answers for it), with
            small segments to the CPU path, segments above `gpu_min_chars` to the GPU encoder when one is
            present (tokenplane.tokenize.gpu, imported lazily; ImportError or "unavailable" means no GPU), spilled to
            the CPU path when the GPU already has `gpu_max_inflight` requests (backpressure);
  "gpu"  -> the GPU encoder alone, only when a device is available.
Unsupported families ("hf-generic", any splitter or class table the pre-tokenizer was not derived for) get no fast
path: the Tokenizer answers "cpu" and "auto" from the reference engine (same IDs, no speed-up). The output contract
never changes with the route.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import numpy as np

from .cpu import pretokenize
from .cpu.segments import MAX_CHARS as SEGMENTS_MAX_CHARS
from .cpu.segments import encode_segments
from .errors import PathUnavailableError

if TYPE_CHECKING:   # type names only: the tokenizer module sits above this one and is never imported from here
    from .tokenizer import Tokenizer

GPU_MIN_CHARS = 2048        # characters of a segment above which the GPU encoder takes it (tunable per router)
GPU_MAX_INFLIGHT = 4
Encoder = Callable[[str], np.ndarray]


class DeviceEncoder(Protocol):
    def encode(self, text: str) -> np.ndarray: ...


class _Lazy:
    """Build an encoder on first call, once (thread-safe): tables from the cache, kernels loaded (or built, the
    first time on a machine)."""

    def __init__(self, build: Callable[[], Encoder]):
        self._build = build
        self._fn: Encoder | None = None
        self.short: Callable[[str], np.ndarray | None] | None = None     # the built encoder's encode_short, if any
        self._lock = threading.Lock()

    def get(self) -> Encoder:
        if self._fn is None:
            with self._lock:
                if self._fn is None:
                    fn = self._build()
                    self.short = getattr(fn, "encode_short", None)
                    self._fn = fn
        return self._fn

    def __call__(self, text: str) -> np.ndarray:
        return self.get()(text)

    @property
    def ready(self) -> bool:
        return self._fn is not None


def _gpu_encoder(tok: Tokenizer) -> DeviceEncoder | None:
    """A GPU encoder for tok, or None (no numba-cuda, no device, unsupported family, disabled, or a failed start)."""
    if not _gpu_present_cheap():   # no device node: skip importing numba.cuda (slow, and it fixes its mode)
        return None
    try:
        from . import gpu
    except ImportError:
        return None
    try:
        if not gpu.available() or not gpu.supports(tok):
            return None
        return gpu.GpuEncoder(tok)
    except Exception:  # noqa: BLE001 - any device start failure means "no GPU" for routing; IDs never change
        return None


class Router:
    """Per-segment routing between the CPU path and the GPU encoder; every route returns the reference IDs."""

    def __init__(self, tok: Tokenizer, cpu: Encoder, *, gpu_min_chars: int = GPU_MIN_CHARS,
                 gpu_max_inflight: int = GPU_MAX_INFLIGHT,
                 gpu_factory: Callable[[Tokenizer], DeviceEncoder | None] = _gpu_encoder):
        self.tok = tok
        self.cpu = cpu
        self.gpu_min_chars = gpu_min_chars
        self._gpu_factory = gpu_factory
        self._gpu: DeviceEncoder | None = None
        self._gpu_checked = False
        self._gpu_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(gpu_max_inflight)
        self.stats = {"cpu": 0, "gpu": 0, "spill": 0}

    def gpu(self) -> DeviceEncoder | None:
        if not self._gpu_checked:
            with self._gpu_lock:
                if not self._gpu_checked:
                    self._gpu = self._gpu_factory(self.tok)
                    self._gpu_checked = True
        return self._gpu

    def short(self, text: str) -> np.ndarray | None:
        """`self(text)` for a text the built CPU path takes in one block call (CpuEncoder.encode_short; the GPU
        never takes a text that short), counted as a CPU call; None where that path does not answer: the caller then
        calls the router."""
        cpu = self.cpu
        fn = cpu.short if type(cpu) is _Lazy else None
        if fn is None or len(text) > self.gpu_min_chars:
            return None
        ids = fn(text)
        if ids is not None:
            self.stats["cpu"] += 1
        return ids

    def __call__(self, text: str) -> np.ndarray:
        # A first call builds the CPU path here (_Lazy), never answering from the reference meanwhile: with the
        # tables and kernels cached on disk the build is the kernels' load, which the reference's own cold start
        # (qwen3: ~1.5 s to build the HF engine) would exceed.
        if len(text) > self.gpu_min_chars:
            gpu = self.gpu()
            if gpu is not None:
                if self._slots.acquire(blocking=False):
                    try:
                        ids = gpu.encode(text)
                    finally:
                        self._slots.release()
                    self.stats["gpu"] += 1
                    return np.asarray(ids, dtype=np.uint32)
                self.stats["spill"] += 1
        self.stats["cpu"] += 1
        cpu = self.cpu
        if isinstance(cpu, _Lazy) and cpu._fn is not None:      # (built: no layer between, a short text's ~0.2 us)
            return cpu._fn(text)
        return cpu(text)


def segment_encoder(encoder: Encoder | None, longest: int) -> Any | None:
    """The CPU encoder (parallel.CpuEncoder, built on first use as the router builds it) behind a registered "cpu" or
    "auto" path, when that path would send every segment of a batch (the longest has `longest` characters) to it;
    else None (a GPU would take a long segment; any other path)."""
    if isinstance(encoder, Router):
        if longest > encoder.gpu_min_chars and encoder.gpu() is not None:
            return None
        encoder = encoder.cpu
    if isinstance(encoder, _Lazy):
        return encoder.get()
    return None


def encode_segments_on(encoder: Encoder | None, family: str, text: str, spans: Sequence[tuple[int, int]], *,
                       tc: np.ndarray | None = None, shift: int = 0
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """`cpu/segments.encode_segments` through the CPU encoder behind a registered path (ids, ends + shift, token
    count per span; `tc` enables its fused kernel); None where that path does not apply: no CPU encoder behind it, a
    GPU-sized segment, spans reaching over `segments.MAX_CHARS` (the encoder's own chunk-parallel path is for
    those), a byte the vocabulary lacks."""
    if not spans or spans[-1][1] - spans[0][0] >= SEGMENTS_MAX_CHARS:
        return None
    longest = spans[0][1] - spans[0][0] if len(spans) == 1 else max(b - a for a, b in spans)
    cpu = segment_encoder(encoder, longest)
    return None if cpu is None else encode_segments(cpu.bpe, family, text, spans, tc=tc, shift=shift)


# Touches every pre-tokenizer branch family by family: letters, case, contractions, digits, punctuation runs,
# whitespace and newlines, marks, CJK, emoji (4-byte UTF-8), a long piece.
_WARM_TEXT = ("Hello, World! don't I'LL 12345 x\n\n  \t(y) e\u0301 \u65e5\u672c\u8a9e\u3067\u3059 "
              "\U0001F44D\U0001F3FD " + "a" * 40 + " " + "\u4e2d" * 30 + "\r\n")


def fast_paths(tok: Tokenizer, *, gpu_min_chars: int = GPU_MIN_CHARS,
               gpu_max_inflight: int = GPU_MAX_INFLIGHT) -> dict[str, Encoder]:
    """The exact paths of `tok` by name: "cpu", "auto" (and "gpu" when a device is present); empty when the family
    has no fast CPU path. Everything is built lazily (first use), nothing here touches a device."""
    if tok.family.name == "hf-generic" or not pretokenize.supported(tok.family):
        return {}

    def build_cpu() -> Encoder:
        from .cpu.parallel import CpuEncoder

        enc = CpuEncoder(tok)
        # First calls load the kernels: the AOT module (cpu/kernels.py, ~1 ms), or else every numba kernel from its
        # on-disk cache (~0.5 s of llvmlite work, after lazyjit's import of numba without the BLAS probe). Do it
        # here, in the build, so the parallel path's kernels are loaded too whichever path the first request takes.
        enc.encode(_WARM_TEXT, parallel=False)
        enc.encode_parallel(_WARM_TEXT * 8, n_chunks=2)   # explicit chunks: a text this short is otherwise serial
        return enc

    cpu = _Lazy(build_cpu)
    router = Router(tok, cpu, gpu_min_chars=gpu_min_chars, gpu_max_inflight=gpu_max_inflight)
    paths: dict[str, Encoder] = {"cpu": cpu, "auto": router}

    def build_gpu() -> Encoder:
        enc = router.gpu()
        if enc is None:
            raise PathUnavailableError(f"no GPU encoder for {tok.name} here")
        return enc.encode

    if _gpu_present_cheap():
        paths["gpu"] = _Lazy(build_gpu)
    return paths


def _gpu_present_cheap() -> bool:
    """Whether a "gpu" path is worth registering, without importing numba.cuda on CPU-only machines."""
    if os.environ.get("TOKENPLANE_GPU", "1") == "0":
        return False
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return True
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")
