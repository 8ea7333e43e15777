"""In-place moves of a session's record arrays (ids, ends): the shifted right part of an edit.

An edit that changes the token count moves every record right of it. numpy's overlapping slice assignment copies
a rightward move through a temporary (two passes); `memmove` moves either way in one pass, and the end offsets then
take one vectorized add for the length change (uint32 arithmetic wraps, so a negative delta is an add of 2**32 -
|delta|: ends stay below 2**32 by the tokenizer's size limit).
"""

from __future__ import annotations

import ctypes

import numpy as np


def move_right_part(ids: np.ndarray, ends: np.ndarray, src: int, dst: int, count: int, delta: int) -> None:
    """ids[dst:dst+count] = ids[src:src+count] and ends likewise plus `delta` (the records may overlap). Both arrays
    are contiguous uint32 (the session allocates them)."""
    if not count:
        return
    if src != dst:
        for a in (ids, ends):
            ctypes.memmove(a.ctypes.data + 4 * dst, a.ctypes.data + 4 * src, 4 * count)
    if delta:
        tail = ends[dst:dst + count]
        tail += np.uint32(delta % (1 << 32))
