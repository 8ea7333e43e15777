"""Records (records.py) against a plain (id, end) list: every splice shape, the append kernel and the general path.

The records derive each token's end from its ID's character count, checkpoints every 2**SHIFT tokens and exceptions
(tokens whose end moves by more than their own characters). A reference list of (id, end) pairs is spliced the
same way; after every splice the IDs, every derived end, the checkpoints (read through `end` and `locate`) and the
exceptions must match it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tokenplane.tokenize import records as records_mod
from tokenplane.tokenize.cpu import kernels
from tokenplane.tokenize.records import SHIFT, Records

TC = np.array([1, 2, 3, 1, 4, 1, 1, 2, 5, 1, 0, 3], dtype=np.int64)    # characters per ID (0: a continuation byte)


def _mid(rng: random.Random, start: int, count: int, extra_rate: float) -> tuple[np.ndarray, np.ndarray]:
    ids = np.array([rng.randrange(len(TC)) for _ in range(count)], dtype=np.uint32)
    steps = TC[ids] + np.array([rng.randint(1, 3) if rng.random() < extra_rate else 0 for _ in range(count)],
                               dtype=np.int64)
    return ids, start + np.cumsum(steps)


def _check(rec: Records, ref: list[tuple[int, int]]) -> None:
    ids = np.array([i for i, _ in ref], dtype=np.uint32)
    ends = np.array([e for _, e in ref], dtype=np.int64)
    assert rec.n == len(ref)
    assert np.array_equal(rec.ids, ids)
    assert np.array_equal(rec.ends(), ends)
    for j in range(1, ((rec.n - 1) >> SHIFT) + 1 if rec.n else 0):
        assert rec.ck[j] == ends[(j << SHIFT) - 1], j      # the checkpoints themselves
    for i in range(0, rec.n, 7):
        assert rec.end(i) == ends[i]
    for x in range(0, int(ends[-1]) + 2 if len(ends) else 1, 5):
        c = int(np.searchsorted(ends, x, side="right"))
        assert rec.locate(x) == (c, int(ends[c - 1]) if c else 0)


def _splice(rec: Records, ref: list[tuple[int, int]], keep: int, mid_ids: np.ndarray, mid_ends: np.ndarray,
            right_from: int, delta: int) -> list[tuple[int, int]]:
    rec.splice(keep, mid_ids, mid_ends, right_from, delta)
    return ref[:keep] + list(zip(mid_ids.tolist(), mid_ends.tolist())) + [(i, e + delta) for i, e in ref[right_from:]]


@pytest.mark.parametrize("extra_rate", [0.0, 0.02])
@pytest.mark.parametrize("seed", range(6))
def test_random_splices_match_a_plain_list(seed, extra_rate):
    rng = random.Random(seed)
    rec, ref = Records(TC), []
    for _ in range(120):
        n = len(ref)
        keep = n if rng.random() < 0.5 else rng.randint(0, n)
        kind = rng.random()
        right_from = n if kind < 0.5 else rng.randint(keep, n)      # half appends (nothing right of the window)
        start = ref[keep - 1][1] if keep else 0
        count = rng.choice([0, 1, 3, 63, 64, 65, 200]) if rng.random() < 0.7 else rng.randint(0, 400)
        mid_ids, mid_ends = _mid(rng, start, count, extra_rate)
        new_start = int(mid_ends[-1]) if count else start
        delta = 0
        if right_from < n:
            # the first right record keeps its own characters (or more: an exception) after the new middle
            old_prev = ref[right_from - 1][1] if right_from else 0
            delta = new_start - old_prev + (rng.randint(1, 2) if rng.random() < extra_rate else 0)
        ref = _splice(rec, ref, keep, mid_ids, mid_ends, right_from, delta)
        _check(rec, ref)


def test_append_kernel_runs_and_falls_back_on_an_exception(monkeypatch):
    """The one-kernel append is taken for plain appends and refused (state untouched) when the middle holds an
    exception, which the general path then records."""
    calls = []
    real = records_mod._append_tail

    def spy(*args):
        calls.append(bool(real(*args)))
        return calls[-1]

    monkeypatch.setattr(records_mod, "_append_tail", spy)
    # the JIT set, which calls the module's (spied) function: an AOT module in the cache would call its own copy
    monkeypatch.setattr(kernels, "_active", kernels.jit_kernels())
    rng = random.Random(7)
    rec, ref = Records(TC), []
    for _ in range(30):
        start = ref[-1][1] if ref else 0
        ids, ends = _mid(rng, start, rng.randint(1, 150), 0.0)
        ref = _splice(rec, ref, len(ref), ids, ends, len(ref), 0)
        _check(rec, ref)
    assert calls and all(calls)
    keep = len(ref) - 3
    ids, ends = _mid(rng, ref[keep - 1][1], 100, 0.0)
    ends[50:] += 2        # record 50 covers two dropped characters
    ref = _splice(rec, ref, keep, ids, ends, len(ref), 0)
    assert calls[-1] is False and rec.ex_i.size == 1
    _check(rec, ref)
