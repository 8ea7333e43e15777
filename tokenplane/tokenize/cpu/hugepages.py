"""Arrays on transparent huge pages: anonymous mappings of their own, 2 MB-aligned, advised MADV_HUGEPAGE before
their first touch.

The piece map (piecemap.py: 4-8 MB of slots probed at random, one probe a piece) is bound by address translation as
much as by its cache misses where its pages are 4 KB: a probe of a cold slot then also walks the page table, and on
a virtual machine that walk is two-dimensional. numpy advises its own allocations of 4 MB or more for huge pages,
but an array malloc places in heap pages that earlier work touched keeps their 4 KB pages (the kernel only backs a
2 MB range with a huge page at its first fault, or much later through khugepaged). Measured (AMD EPYC VM, cold
1.4K-character appends to a 1M-character DeepSeek V4 session after a 128 MB sweep, scratch `/tmp/s72/pol3.py`): in
a fresh process the map sat in 6 MB of huge pages and an append took 98-99 us; after one HF `tokenizers` encode of
1M characters in the same process, malloc reused that encode's freed heap for the map, which then had no huge page,
and the same append took 153-226 us (its kernel 110-154 against 66-67). A mapping of the array's own is independent
of what the process did before.

Where the kernel has no huge page to give (THP off, or memory too fragmented), the mapping is an ordinary one of
4 KB pages: the same array, the same results.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20


def zeros(shape: int | tuple[int, ...], dtype: np.dtype | type, *, huge: bool = True) -> np.ndarray:
    """A zero-filled C-contiguous array on an anonymous mapping of its own (a new mapping reads as zeros; its pages
    are taken at their first touch), 2 MB-aligned and advised for transparent huge pages unless `huge` is False (a
    scratch touched only in part: its resident size stays what it uses). The array keeps the mapping alive."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if nbytes == 0:
        return np.zeros(shape, dt)
    pad = HUGE_PAGE if huge else 0
    mm = mmap.mmap(-1, nbytes + pad, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:     # (a kernel without THP: plain pages)
            pass
    raw = np.frombuffer(mm, dtype=np.uint8)
    off = (-raw.ctypes.data) % HUGE_PAGE if huge else 0
    return raw[off:off + nbytes].view(dt).reshape(shape)


def copy(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of `a` on huge pages (`zeros`)."""
    out = zeros(a.shape, a.dtype)
    np.copyto(out, a)
    return out


__all__ = ["HUGE_PAGE", "copy", "zeros"]
