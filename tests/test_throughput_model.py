import pytest

from tokenplane.route.throughput_model import (
    RoutingModel,
    _multinomial_outcomes,
    choose_thresholds,
    simulate,
    solve_chain,
    sweep_thresholds,
)

SMALL = lambda b: 6.0e-3 + 0.1e-3 * (b - 1)   # seed-r2r-like GPU step latencies (seconds)
LARGE = lambda b: 27.9e-3 + 0.4e-3 * (b - 1)


def test_infeasible_thresholds_rejected():
    with pytest.raises(ValueError, match=r"sum_m \(T_m - 1\) < concurrency"):
        solve_chain([3, 3], 4, 0.35, [SMALL, LARGE])
    with pytest.raises(ValueError, match=r"sum_m \(T_m - 1\) < concurrency"):
        simulate([1, 5], 4, 0.35, [SMALL, LARGE])


def test_multinomial_outcomes_sum_to_one():
    for n in range(0, 7):
        for probs in ([0.65, 0.35], [0.2, 0.5, 0.3], [1.0, 0.0], [0.0, 0.4, 0.6]):
            outs = _multinomial_outcomes(n, probs)
            assert abs(sum(p for _, p in outs) - 1.0) < 1e-12
            assert all(sum(c) == n for c, _ in outs)


def test_routing_model_rows_and_commit():
    rm = RoutingModel.r2r(0.35)
    assert rm.P == ((0.65, 0.35), (1.0, 0.0))
    assert rm.committed_fraction(0) == pytest.approx(0.65) and rm.committed_fraction(1) == 1.0
    with pytest.raises(ValueError):
        RoutingModel(((0.5, 0.4), (1.0, 0.0)), ((False, False), (False, False)))
    three = RoutingModel.coerce([0.2, 0.1])
    assert three.num_models == 3 and sum(three.P[0]) == pytest.approx(1.0)


def test_chain_is_stochastic_and_solved():
    # internal check through the public result: the stationary vector solves pi P = pi to machine precision
    r = solve_chain([1, 3], 8, 0.35, [SMALL, LARGE])
    assert r.residual < 1e-10 and r.num_states > 100


@pytest.mark.parametrize("c", [1, 3, 8])
def test_single_model_thresholds_one_is_batch_over_latency(c):
    # One model, everything committed: all c requests always form one batch, so throughput = c / L(c) exactly.
    fn = lambda b: 0.010 + 0.002 * b
    r = solve_chain([1], c, [[1.0]], [fn], quantum=0.002)
    assert r.throughput == pytest.approx(c / fn(c), rel=1e-9)
    assert r.mean_batch[0] == pytest.approx(c) and r.utilization[0] == pytest.approx(1.0)


def test_randomized_rounding_keeps_mean_latency():
    fn = lambda b: 0.0123  # 4.1 ticks of 3 ms
    r = solve_chain([1], 2, [[1.0]], [fn], quantum=0.003)
    assert r.throughput == pytest.approx(2 / 0.0123, rel=1e-9)


def test_two_models_no_switching_limit():
    # p = 0: the large model is never used, the small one runs every request every step
    r = solve_chain([1, 1], 4, 0.0, [SMALL, LARGE])
    assert r.throughput == pytest.approx(4 / SMALL(4), rel=1e-9)
    assert r.utilization[1] == 0.0


def test_dropped_tokens_not_counted():
    keep = solve_chain([1, 1], 4, RoutingModel.r2r(0.35, drop_on_switch=False), [SMALL, LARGE])
    drop = solve_chain([1, 1], 4, RoutingModel.r2r(0.35, drop_on_switch=True), [SMALL, LARGE])
    # same dynamics, so the gap is exactly the dropped small-model tokens
    assert drop.throughput < keep.throughput
    # committed = small*0.65 + large, generated = small + large; large tokens = 0.35 * small tokens in steady state
    ratio = drop.throughput / keep.throughput
    assert ratio == pytest.approx((0.65 + 0.35) / (1 + 0.35), rel=1e-6)


@pytest.mark.parametrize("c,ts", [(4, (1, 1)), (4, (1, 3)), (8, (2, 4)), (16, (1, 6))])
def test_chain_matches_discrete_event_simulation(c, ts):
    chain = solve_chain(ts, c, 0.35, [SMALL, LARGE], ticks_per_step=3)
    sim = simulate(ts, c, 0.35, [SMALL, LARGE], ticks_per_step=3, horizon_steps=20_000, seed=1)
    assert sim.throughput == pytest.approx(chain.throughput, rel=0.03)
    cont = simulate(ts, c, 0.35, [SMALL, LARGE], horizon_steps=20_000, seed=2)  # continuous latencies
    assert cont.throughput == pytest.approx(chain.throughput, rel=0.04)


def test_choose_thresholds_picks_sweep_argmax_and_delays_large_model():
    res = sweep_thresholds(8, 0.35, [SMALL, LARGE], max_t=6)
    best = max(res, key=lambda r: r.throughput)
    chosen = choose_thresholds(8, 0.35, [SMALL, LARGE], max_t=6, rel_tol=0.0)
    assert tuple(chosen) == best.thresholds
    # with a tolerance, the smallest thresholds predicted within it of the best win
    tol = choose_thresholds(8, 0.35, [SMALL, LARGE], max_t=6, rel_tol=0.05)
    near = [r for r in res if r.throughput >= 0.95 * best.throughput]
    assert sum(tol) == min(sum(r.thresholds) for r in near) and sum(tol) <= sum(chosen)
    # the large model's step barely grows with batch, so it pays to wait for more of its requests
    assert chosen[1] > 1
    assert best.throughput > next(r for r in res if r.thresholds == (1, 1)).throughput


def test_deterministic_run_lengths_simulation_runs():
    s = simulate([1, 2], 4, 0.35, [SMALL, LARGE], run_lengths="deterministic", horizon_steps=2000)
    assert s.throughput > 0 and s.committed < s.generated
