"""Keep freed memory in the process heap (glibc) so a CPU forward pass does not page-fault its activations in again.

glibc serves allocations above its mmap threshold (128 KiB to 32 MiB, adjusted at run time) with a fresh mmap and
unmaps them on free, and trims the heap top above its trim threshold, so every large activation of every step
(a prefill of 2048 tokens allocates hundreds of MiB of them per step) comes back as zero-filled pages through one
minor fault per 4 KiB. Measured here, SmolLM2-135M prefill of 8 x 256 tokens, fp32, 1 thread: ~380k minor faults
and 0.9 s of 6.5 s CPU time spent in the kernel per run; with both thresholds raised, 0 faults, 0.05 s kernel time,
prefill 307-320 -> 374-392 tok/s. vLLM's CPU backend gets the same effect by asking for tcmalloc in LD_PRELOAD.

The cost: freed memory is reused by the process rather than returned to the system, so resident memory stays at its
peak (an engine's steady state anyway). Process-wide, like torch.set_num_threads; a no-op off glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util

import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Above the engine's activation tensors (a [2048, 3072] fp32 gate_up output is 24 MiB). Older glibc refuses mmap
# thresholds above 32 MiB on 64-bit (HEAP_MAX_SIZE / 2), so that is the fallback.
_THRESHOLDS = (1 << 30, 32 << 20)

_applied: bool | None = None


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process. Returns whether they are raised."""
    global _applied
    if _applied is None:
        _applied = False
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
            mallopt = getattr(libc, "mallopt", None)
        except OSError:
            mallopt = None
        if mallopt is not None:
            # mallopt returns 1 on success; musl and others lack it (getattr above) or ignore the parameters.
            mmap = any(mallopt(_M_MMAP_THRESHOLD, t) == 1 for t in _THRESHOLDS)
            _applied = mmap and mallopt(_M_TRIM_THRESHOLD, _THRESHOLDS[0]) == 1
    return _applied


_HUGE = 2 << 20        # x86-64 transparent huge page
_MADV_HUGEPAGE = 14


def huge_page_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor starting on a 2 MiB boundary, its whole 2 MiB pages advised as transparent
    huge pages (madvise MADV_HUGEPAGE; Linux with THP in 'madvise' mode, as here). For weight copies a decode step
    streams end to end (cpu_small_gemm's panels: SmolLM2-135M reads ~540 MB a step): 2 MiB pages instead of 4 KiB ones
    for the TLB. SmolLM2-135M decode, 1 row, process CPU ms a step (decode_breakdown.py --bare, 5 alternated runs):
    32.6 with it vs 35.4 without (and 33.3 for the tree that also kept oneDNN copies, whose placement happened to
    suit). Below 2 MiB, or where madvise is missing, a plain tensor."""
    size = torch.empty(0, dtype=dtype).element_size()
    if numel * size < _HUGE:
        return torch.empty(numel, dtype=dtype)
    buf = torch.empty(numel + _HUGE // size, dtype=dtype)
    start = (-buf.data_ptr()) % _HUGE
    out = buf[start // size: start // size + numel]   # a view: keeps buf alive
    madvise = getattr(_libc(), "madvise", None)
    if madvise is not None:
        whole = numel * size - numel * size % _HUGE
        madvise(ctypes.c_void_p(out.data_ptr()), ctypes.c_size_t(whole), _MADV_HUGEPAGE)   # advice: result unused
    return out


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None
