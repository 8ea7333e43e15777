"""The routing signals' compiled paths: R-Stitch's entropy kernel (route/entropy.py) and R2R's top-k logits
(route/top_values.py) against float64 / torch references, and independent of batch and thread count."""

from __future__ import annotations

import math

import pytest
import torch

from tokenplane.route.api import StepResult
from tokenplane.route.entropy import entropy, normalized_entropy
from tokenplane.route.top_values import top_values


def _f64_entropy(x: torch.Tensor) -> float:
    lp = torch.log_softmax(x.double(), -1)
    p = lp.exp()
    return float(-(p * torch.where(p > 0, lp, torch.zeros_like(lp))).sum())


def _rows(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    v = 151936
    tied = torch.randn(v, generator=g) * 0.01 - 3
    tied[:1000] = 5.0
    masked = torch.randn(v, generator=g)
    masked[::3] = -math.inf
    return {"near_uniform": torch.randn(v, generator=g) * 0.05, "scaled": torch.randn(v, generator=g) * 3,
            "peaked": torch.randn(v, generator=g) * 10, "tied_maxima": tied, "masked": masked,
            "odd_length": torch.randn(1000 + 37, generator=g), "short": torch.randn(5, generator=g)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_entropy_matches_float64(dtype: torch.dtype) -> None:
    for name, x in _rows(0).items():
        x = x.to(dtype)
        want = _f64_entropy(x)
        got = entropy(x)
        # float32 rows: float32 exponentials (within 4e-9 normalized here, far inside the logits' own rounding);
        # float64 rows: float64 exponentials
        tol = 2e-7 if dtype == torch.float32 else 1e-11
        assert abs(got - want) <= tol * max(1.0, abs(want)), (name, got, want)
        assert normalized_entropy(x) == got / math.log(x.shape[0])


def test_entropy_float32_every_tail_length() -> None:
    """The float32 kernel runs 8 logits a step and the last n % 8 from a copy padded with -inf: every residue, with
    the maximum and masked logits inside the tail, agrees with float64."""
    g = torch.Generator().manual_seed(3)
    for n in range(1, 41):
        x = torch.randn(n, generator=g) * 4
        for variant in (x, torch.cat([x[:-1], x.max().reshape(1) + 2]), x.masked_fill(torch.arange(n) % 5 == 4,
                                                                                      -math.inf)):
            want = _f64_entropy(variant)
            assert abs(entropy(variant) - want) <= 2e-7 * max(1.0, abs(want)), (n, want)


def test_entropy_closed_forms() -> None:
    assert math.isclose(entropy(torch.zeros(16)), math.log(16), rel_tol=1e-14)
    assert normalized_entropy(torch.tensor([0.0, 50.0, 0.0, 0.0], dtype=torch.float64)) < 1e-15
    p = torch.softmax(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), -1)
    want = float(-(p * p.log()).sum())
    assert math.isclose(entropy(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)), want, rel_tol=1e-12)
    assert math.isclose(entropy(torch.tensor([1.0, 2.0, 3.0])), want, rel_tol=1e-7)
    assert math.isnan(entropy(torch.tensor([0.0, math.nan, 1.0])))
    assert math.isnan(entropy(torch.tensor([0.0, math.inf, 1.0])))
    assert math.isnan(entropy(torch.full((4,), -math.inf)))
    assert entropy(torch.tensor([0.0, -math.inf, 0.0])) == pytest.approx(math.log(2), rel=1e-14)
    with pytest.raises(ValueError):
        entropy(torch.zeros(2, 3))


def test_entropy_same_bits_solo_batched_threads() -> None:
    """A row's value depends on its logits only: a view inside a batch, a copy, another dtype path, any thread
    count (what lets the runtime's batched rows and the sequential reference decide from the same bits)."""
    g = torch.Generator().manual_seed(1)
    batch = torch.randn(6, 151936, generator=g) * 0.05
    solo = [entropy(batch[i].clone()) for i in range(6)]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert [entropy(batch[i]) for i in range(6)] == solo
    finally:
        torch.set_num_threads(before)
    assert StepResult("r", 0, 0, 0, batch[2]).normalized_entropy() == solo[2] / math.log(151936)
    assert entropy(batch[0].to(torch.bfloat16)) == entropy(batch[0].to(torch.bfloat16).float())


def test_entropy_noncontiguous_row() -> None:
    x = torch.randn(2000, 3)[:, 1]
    assert not x.is_contiguous()
    assert entropy(x) == entropy(x.contiguous())


def test_top_values_equal_torch_topk() -> None:
    g = torch.Generator().manual_seed(2)
    v = 151936
    cases = {"randn": torch.randn(9, v, generator=g), "small": torch.randn(9, v, generator=g) * 0.05,
             "ties": torch.randint(0, 5, (9, v), generator=g).float(), "constant": torch.zeros(9, v),
             "odd_length": torch.randn(9, 1000 + 37, generator=g), "shorter_than_k_blocks": torch.randn(9, 300),
             "float64": torch.randn(9, v, generator=g, dtype=torch.float64)}
    masked = torch.randn(9, v, generator=g)
    masked[:, :100000] = -math.inf
    cases["masked"] = masked
    for name, x in cases.items():
        got = top_values([x[i] for i in range(x.shape[0])], 100)
        assert torch.equal(got, torch.topk(x, 100).values), name


def test_top_values_nan_rows_follow_torch() -> None:
    x = torch.randn(3, 151936)
    x[1, 77] = math.nan
    got = top_values([x[i] for i in range(3)], 100)
    want = torch.topk(x, 100).values
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got[~torch.isnan(got)], want[~torch.isnan(want)])
