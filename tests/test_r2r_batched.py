"""R2R's router run once per step for the whole batch (prepare_step) decides exactly as the router run row by row.

The batched GEMMs sum in another order than one-row ones, so values differ in the last bits; the gap is measured
here against BATCH_MARGIN (the margin must be far above it), and a batched value within the margin of the threshold
must be recomputed for its row alone.
"""
from __future__ import annotations

import pytest
import torch

from tokenplane.route.algorithms import make_algorithm
from tokenplane.route.algorithms.r2r import BATCH_MARGIN
from tokenplane.route.api import StepResult


def rows(n: int, hidden: int = 64, vocab: int = 1000, seed: int = 0, model: int = 0) -> list[StepResult]:
    g = torch.Generator().manual_seed(seed)
    return [StepResult(f"r{i}", model, i, int(torch.randint(0, vocab, (1,), generator=g)),
                       torch.randn(vocab, generator=g) * 3, torch.randn(hidden, generator=g))
            for i in range(n)]


def one_row(alg, result: StepResult) -> float:
    alg._step = {}   # nothing batched: the row alone, as the reference router computes it
    return alg.divergence(result)


@pytest.mark.parametrize("dim,blocks,n", [(256, 2, 2), (256, 2, 16), (1024, 6, 8)])
def test_batched_gap_is_far_below_the_margin(dim, blocks, n):
    alg = make_algorithm("r2r", mode="signal", router_dim=dim, router_blocks=blocks, seed=3)
    res = rows(n, seed=dim + n)
    alg.prepare_step(res)
    batched = [alg._step[id(r)] for r in res]
    single = [one_row(alg, r) for r in res]
    gap = max(abs(a - b) for a, b in zip(batched, single))
    assert gap < BATCH_MARGIN / 100, gap


def test_every_decision_is_the_one_row_decision_even_at_the_threshold():
    alg = make_algorithm("r2r", mode="signal", router_dim=256, router_blocks=2, seed=5)
    res = rows(12, seed=7)
    single = [one_row(alg, r) for r in res]
    # thresholds at a row's own value, and just either side of it: the hardest cases for a batched value
    for t in (single[4], single[4] - 1e-7, single[4] + 1e-7, sorted(single)[6]):
        alg.thresholds["switch"] = t
        alg.prepare_step(res)
        assert [alg.divergence(r) > t for r in res] == [s > t for s in single]


def test_a_batched_value_near_the_threshold_is_recomputed_alone():
    alg = make_algorithm("r2r", mode="signal", router_dim=64, router_blocks=1, seed=2)
    res = rows(4, seed=1)
    alone = one_row(alg, res[2])
    alg.thresholds["switch"] = alone
    alg.prepare_step(res)
    alg._step[id(res[2])] = alone + BATCH_MARGIN / 2     # a batched value on the wrong side, within the margin
    assert alg.divergence(res[2]) == alone
    far = alg._step[id(res[0])] = 2.0                    # outside the margin: the batched value is used
    assert alg.divergence(res[0]) == far


def test_prepare_step_batches_only_the_small_models_signal_rows():
    alg = make_algorithm("r2r", mode="signal", router_dim=32, router_blocks=1, seed=1)
    small, large = rows(3, seed=2), rows(3, seed=3, model=1)
    alg.prepare_step(small[:2] + large)
    assert set(alg._step) == {id(small[0]), id(small[1])}
    alg.prepare_step(small[:1])                          # one row: nothing to batch
    assert alg._step == {}
    synthetic = make_algorithm("r2r", mode="synthetic", rates={"switch": 0.3}, router_dim=32, router_blocks=1)
    synthetic.prepare_step(small)
    assert synthetic._step == {}


def test_streamed_router_equals_the_plain_one_and_ignores_the_batch(one_thread):
    from tokenplane.route.algorithms.r2r import StreamedLinear
    alg = make_algorithm("r2r", mode="signal", router_dim=256, router_blocks=2, seed=4)
    res = rows(12, seed=11)     # more rows than cpu_small_gemm.MAX_ROWS
    single = [one_row(alg, r) for r in res]     # builds the cast router: its linears stream
    router, _ = next(iter(alg._cast.values()))
    streamed = [m for m in router.modules() if isinstance(m, StreamedLinear)]
    assert streamed and all(m.panels is not None for m in streamed)
    alg.prepare_step(res)
    assert max(abs(alg._step[id(r)] - v) for r, v in zip(res, single)) < BATCH_MARGIN / 100
    for m in streamed:
        m.panels = None                                      # the plain F.linear router
    plain = [one_row(alg, r) for r in res]
    assert max(abs(a - b) for a, b in zip(single, plain)) < 1e-5


def test_router_reads_the_subservers_top_logits_as_it_reads_the_logits():
    """A sub-server on the greedy screen hands R2R each row's top logits (StepResult.top_logits) and defers the full
    projection: the router's values are the same, batched and alone, and no row's logits are projected."""
    alg = make_algorithm("r2r", mode="signal", router_dim=64, router_blocks=1, seed=5)
    assert not alg.uses_logits(0) and alg.top_logits(0) == 100 and alg.top_logits(1) == 0
    assert make_algorithm("r2r", mode="synthetic", rates={"switch": 0.1}).top_logits(0) == 0
    full = rows(6, seed=9)
    projected: list[int] = []

    def lazy(r: StepResult) -> StepResult:
        def project(r=r) -> torch.Tensor:
            projected.append(r.position)
            return r.logits
        return StepResult.deferred(r.request_id, 0, r.position, r.token, project, r.hidden,
                                   torch.topk(r.logits, 100).values)
    screened = [lazy(r) for r in full]
    alg.prepare_step(full)
    want = [alg._step[id(r)] for r in full]
    alg.prepare_step(screened)
    assert [alg._step[id(r)] for r in screened] == want
    assert [one_row(alg, r) for r in screened] == [one_row(alg, r) for r in full]
    assert projected == []
