"""cpu/hugepages.py: arrays on anonymous mappings of their own (the piece map's slots and arena, the append
window's scratch)."""

import numpy as np

from tokenplane.tokenize.cpu import hugepages, piecemap


def test_zeros_and_copy_are_writable_zero_filled_and_aligned():
    for huge in (True, False):
        a = hugepages.zeros((1000, 2), np.uint64, huge=huge)
        assert a.shape == (1000, 2) and a.dtype == np.uint64 and a.flags.c_contiguous and a.flags.writeable
        assert not a.any()
        a[999, 1] = 7
        assert int(a.sum()) == 7
        if huge:
            assert a.ctypes.data % hugepages.HUGE_PAGE == 0
    src = np.arange(10_000, dtype=np.uint32)
    b = hugepages.copy(src)
    assert b.dtype == np.uint32 and np.array_equal(b, src) and b.ctypes.data % hugepages.HUGE_PAGE == 0
    b[0] = 5
    assert src[0] == 0
    assert hugepages.zeros(0, np.uint8).shape == (0,)


def test_a_piece_map_lives_on_its_own_mappings():
    """The slots and arena start on 2 MB boundaries (mappings of their own, whatever the heap holds); emptying the
    map refills the same arrays from its seed."""
    seed = np.zeros((1 << 12, 2), np.uint64)
    seed[5] = (11, 22)
    pm = piecemap.PieceMap(seed=seed, seed_arena=np.arange(8, dtype=np.uint32))
    for arr in (pm.slots, pm.arena):
        assert arr.ctypes.data % hugepages.HUGE_PAGE == 0
    slots = pm.slots
    slots[7] = (1, 2)
    pm.clear()
    assert pm.slots is slots and slots[5].tolist() == [11, 22] and not slots[7].any()
    assert pm.arena[:8].tolist() == list(range(8)) and pm.window_scratch.shape == (piecemap.WINDOW_SCRATCH,)
