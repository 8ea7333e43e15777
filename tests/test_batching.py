import numpy as np
import pytest

from tokenplane.route.batching import BatchPolicy, feasible_thresholds, is_feasible


def test_all_ones_always_feasible():
    for m in (1, 2, 3):
        for c in (1, 4, 16):
            BatchPolicy([1] * m, c)


def test_deadlock_threshold_rejected_with_inequality_in_message():
    # (3-1) + (3-1) = 4 >= 4: four requests can sit 2 + 2 below both thresholds
    with pytest.raises(ValueError, match=r"sum_m \(T_m - 1\) < concurrency") as err:
        BatchPolicy([3, 3], 4)
    assert "4 >= 4" in str(err.value)
    BatchPolicy([3, 2], 4)  # 2 + 1 = 3 < 4


@pytest.mark.parametrize("bad", [[0, 1], [-2, 1]])
def test_threshold_below_one_rejected(bad):
    with pytest.raises(ValueError, match="T_m >= 1"):
        BatchPolicy(bad, 8)


@pytest.mark.parametrize("bad", [[1.5, 1], [True, 1], ["2", 1]])
def test_non_integer_threshold_rejected(bad):
    with pytest.raises(ValueError, match="integer"):
        BatchPolicy(bad, 8)


def test_numpy_ints_accepted():
    p = BatchPolicy(list(np.array([2, 3])), np.int64(8))
    assert p.thresholds == [2, 3] and type(p.thresholds[0]) is int


def test_empty_and_bad_concurrency():
    with pytest.raises(ValueError):
        BatchPolicy([], 4)
    with pytest.raises(ValueError, match="concurrency"):
        BatchPolicy([1], 0)


def test_should_launch_rules():
    p = BatchPolicy([1, 4], 8)
    assert p.should_launch(0, 1, False)
    assert not p.should_launch(0, 0, True)           # nothing to run
    assert not p.should_launch(1, 3, False)          # below threshold: wait
    assert p.should_launch(1, 4, False)
    assert p.should_launch(1, 2, True)               # fallback: waiting could only deadlock
    assert p.forced_launches == [0, 1] and p.launches == [1, 2]
    assert p.should_launch(1, 2, False, num_live=2)  # only two requests can ever arrive
    assert not p.should_launch(1, 2, False, num_live=3)
    with pytest.raises(ValueError):
        p.should_launch(2, 1, False)


def test_feasible_set_matches_pigeonhole_bruteforce():
    # A threshold tuple is deadlock-free iff no placement of C requests into queues has every queue below threshold.
    def can_deadlock(ts, c):
        from itertools import product
        return any(sum(q) == c for q in product(*[range(t) for t in ts]))

    for m in (1, 2, 3):
        for c in (1, 2, 4, 5):
            got = set(feasible_thresholds(m, c, max_t=c + 1))
            from itertools import product
            want = {ts for ts in product(range(1, c + 1), repeat=m) if not can_deadlock(ts, c)}
            assert got == want, (m, c)
            assert all(is_feasible(ts, c) for ts in got)


def test_feasible_thresholds_bounds():
    fs = feasible_thresholds(2, 4)
    assert fs[0] == (1, 1) and (4, 1) in fs and (2, 3) in fs and (3, 3) not in fs and (4, 2) not in fs
    assert max(max(t) for t in feasible_thresholds(2, 16, max_t=5)) == 5
    with pytest.raises(ValueError):
        feasible_thresholds(0, 4)
