"""In-place moves of a session's record arrays (ids, ends): the shifted right part of an edit in one pass.

An edit that changes the token count moves every record right of it; numpy's overlapping slice assignment copies
through a temporary, and the end offsets then take a second pass for the length change. This kernel moves both
arrays in the safe direction and shifts the ends on the way: one read and one write per record.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _move(ids, ends, src, dst, count, delta):
    if dst <= src:
        for i in range(count):
            ids[dst + i] = ids[src + i]
            ends[dst + i] = np.uint32(np.int64(ends[src + i]) + delta)
    else:
        for i in range(count - 1, -1, -1):
            ids[dst + i] = ids[src + i]
            ends[dst + i] = np.uint32(np.int64(ends[src + i]) + delta)


def move_right_part(ids: np.ndarray, ends: np.ndarray, src: int, dst: int, count: int, delta: int) -> None:
    """ids[dst:dst+count] = ids[src:src+count] and ends likewise plus `delta` (the records may overlap)."""
    if count and (src != dst or delta):
        _move(ids, ends, src, dst, count, delta)
