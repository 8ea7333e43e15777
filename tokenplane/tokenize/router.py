"""Encode-path registration and the `path="auto"` router.

`enable_fast_paths(tok)` registers on a Tokenizer:
  "cpu"  -> the data-parallel CPU path (parallel.CpuEncoder), built lazily on first use;
  "auto" -> Router: until the CPU path is built (in the background on first use) the reference engine answers;
            then small segments to the CPU path, segments above `gpu_min_chars` to the GPU encoder when one is
            present (tokenplane.tokenize.gpu, imported lazily; ImportError or "unavailable" means no GPU), spilled to
            the CPU path when the GPU already has `gpu_max_inflight` requests (backpressure);
  "gpu"  -> the GPU encoder alone, only when a device is available.
Unsupported families ("hf-generic", any splitter or class table the pre-tokenizer was not derived for) get the
reference engine under both names: same IDs, no speed-up. The output contract never changes with the route.
"""

from __future__ import annotations

import os
import threading
from typing import Callable

import numpy as np

from . import pretokenize

GPU_MIN_CHARS = 2048        # the seed's 2 KB threshold (characters of the segment; tunable per router)
GPU_MAX_INFLIGHT = 4


class _Lazy:
    """Build an encoder on first call (the BPE tables of a family take a few seconds the first time)."""

    def __init__(self, build: Callable[[], Callable[[str], np.ndarray]]):
        self._build = build
        self._fn: Callable[[str], np.ndarray] | None = None
        self._lock = threading.Lock()

    def get(self) -> Callable[[str], np.ndarray]:
        if self._fn is None:
            with self._lock:
                if self._fn is None:
                    self._fn = self._build()
        return self._fn

    def __call__(self, text: str) -> np.ndarray:
        return self.get()(text)

    @property
    def ready(self) -> bool:
        return self._fn is not None

    def warm_async(self) -> None:
        """Build in a background thread (once), so a router can answer from the reference meanwhile."""
        with self._lock:
            if self._fn is not None or getattr(self, "_warming", False):
                return
            self._warming = True
        threading.Thread(target=self.get, name="tokenplane-warm", daemon=True).start()


def _gpu_encoder(tok):
    """A GPU encoder for tok, or None (no numba-cuda, no device, unsupported family, disabled, or a failed start)."""
    if os.environ.get("TOKENPLANE_GPU", "1") == "0":
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

    def __init__(self, tok, cpu: Callable[[str], np.ndarray], *, gpu_min_chars: int = GPU_MIN_CHARS,
                 gpu_max_inflight: int = GPU_MAX_INFLIGHT, gpu_factory=_gpu_encoder):
        self.tok = tok
        self.cpu = cpu
        self.gpu_min_chars = gpu_min_chars
        self._gpu_factory = gpu_factory
        self._gpu = None
        self._gpu_checked = False
        self._gpu_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(gpu_max_inflight)
        self.stats = {"cpu": 0, "gpu": 0, "spill": 0}

    def gpu(self):
        if not self._gpu_checked:
            with self._gpu_lock:
                if not self._gpu_checked:
                    self._gpu = self._gpu_factory(self.tok)
                    self._gpu_checked = True
        return self._gpu

    def __call__(self, text: str) -> np.ndarray:
        cpu = self.cpu
        if isinstance(cpu, _Lazy) and not cpu.ready:
            # First use: the BPE tables take seconds to build; answer from the reference (same IDs) meanwhile.
            cpu.warm_async()
            self.stats["reference"] = self.stats.get("reference", 0) + 1
            return self.tok.reference.encode_ordinary(text)
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
        return self.cpu(text)


# Touches every pre-tokenizer branch family by family: letters, case, contractions, digits, punctuation runs,
# whitespace and newlines, marks, CJK, emoji (4-byte UTF-8), a long piece.
_WARM_TEXT = ("Hello, World! don't I'LL 12345 x\n\n  \t(y) e\u0301 \u65e5\u672c\u8a9e\u3067\u3059 "
              "\U0001F44D\U0001F3FD " + "a" * 40 + " " + "\u4e2d" * 30 + "\r\n")


def enable_fast_paths(tok, **router_options) -> bool:
    """Register "cpu", "auto" (and "gpu" when a device is present) on `tok`. Returns True when the family has the
    fast CPU path, False when both names fall back to the reference engine."""
    if tok.family.name == "hf-generic" or not pretokenize.supported(tok.family):
        ref = tok.reference.encode_ordinary
        tok.register_path("cpu", ref)
        tok.register_path("auto", ref)
        return False

    def build_cpu():
        from .parallel import CpuEncoder

        enc = CpuEncoder(tok)
        # First calls load every numba kernel from its on-disk cache (~0.5 s of llvmlite work); do it here, in the
        # build (a background thread under warm_async), not inside the first request that takes this path.
        enc.encode(_WARM_TEXT, parallel=False)
        enc.encode_parallel(_WARM_TEXT * 8, n_chunks=2)   # explicit chunks: a text this short is otherwise serial
        return enc

    cpu = _Lazy(build_cpu)
    router = Router(tok, cpu, **router_options)
    tok.register_path("cpu", cpu)
    tok.register_path("auto", router)

    def build_gpu():
        enc = router.gpu()
        if enc is None:
            from .tokenizer import PathUnavailableError

            raise PathUnavailableError(f"no GPU encoder for {tok.name} here")
        return enc.encode

    if _gpu_present_cheap() and "gpu" not in getattr(tok, "_paths", {}):   # the GPU helper may register its own
        tok.register_path("gpu", _Lazy(build_gpu))
    return True


def _gpu_present_cheap() -> bool:
    """Whether a "gpu" path is worth registering, without importing numba.cuda on CPU-only machines."""
    if os.environ.get("TOKENPLANE_GPU", "1") == "0":
        return False
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return True
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")
