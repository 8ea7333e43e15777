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


# -- the runtime's count-based "nothing else can run" (tokenplane.route.launch_gate) --------------------------------
def _status(model, active=False, ready=0, sent=(0, 0), received=(0, 0)):
    from tokenplane.route.messages import PeerStatus
    return PeerStatus(model, active, ready, list(sent), list(received))


def test_stale_idle_report_does_not_force_after_a_hand_back():
    from tokenplane.route.launch_gate import nothing_else_can_run
    # The large model (1) just handed 3 requests back to the small one (0) and kept 1 queued below T_1. Model 0's
    # latest report ("idle, received 0 from model 1") predates those handoffs: it is stale, waiting must win.
    peers = [_status(0, sent=(0, 4), received=(0, 0)), None]
    assert not nothing_else_can_run(1, 1, sent=[3, 0], received=[4, 0], peers=peers)
    # Once model 0 reports having received them (still idle, nothing ready: it launched and finished), it is current.
    peers[0] = _status(0, sent=(0, 4), received=(0, 3))
    assert nothing_else_can_run(1, 1, sent=[3, 0], received=[4, 0], peers=peers)


def test_active_or_silent_peer_or_in_flight_between_others_blocks_forcing():
    from tokenplane.route.launch_gate import nothing_else_can_run
    assert not nothing_else_can_run(1, 1, [0, 0], [0, 0], [None, None])                       # never reported
    assert not nothing_else_can_run(1, 1, [0, 0], [0, 0], [_status(0, active=True), None])    # executing
    # three models: 0 sent 2 to 2, which has only received 1 -> in flight between two peers
    peers = [_status(0, sent=(0, 0, 2), received=(0, 0, 0)), None,
             _status(2, sent=(0, 0, 0), received=(1, 0, 0))]
    assert not nothing_else_can_run(1, 1, [0, 0, 0], [0, 0, 0], peers)
    peers[2] = _status(2, sent=(0, 0, 0), received=(2, 0, 0))
    assert nothing_else_can_run(1, 1, [0, 0, 0], [0, 0, 0], peers)


def test_exactly_one_waiting_model_is_leader_on_a_consistent_cut():
    from tokenplane.route.launch_gate import nothing_else_can_run
    # both idle below their thresholds, nothing in flight (a drained workload): the one with more ready launches,
    # ties go to the lower index, so the two never both wait and never both force
    for r0, r1 in [(2, 1), (1, 2), (2, 2), (0, 3)]:
        s0 = _status(0, ready=r0, sent=(0, 5), received=(0, 5))
        s1 = _status(1, ready=r1, sent=(5, 0), received=(5, 0))
        a = nothing_else_can_run(0, r0, [0, 5], [0, 5], [None, s1]) if r0 else False
        b = nothing_else_can_run(1, r1, [5, 0], [5, 0], [s0, None])
        assert a + b == 1, (r0, r1, a, b)


def _gate(model: int, num_models: int = 2, policy=None):
    """A LaunchGate over an Outbox without sockets (the tests set counts and queued messages by hand)."""
    from tokenplane.route.launch_gate import LaunchGate
    from tokenplane.route.outbox import Outbox
    gate = LaunchGate(model, num_models, Outbox(model, num_models, None, None))
    gate.policy = policy
    return gate


def test_idle_report_rides_behind_the_handoffs_it_counts():
    """An idle model's PeerStatus goes in the same frame as this turn's handoffs (queued behind them) and its counts
    already include them, so a peer reading both in one drain finds a consistent cut with no extra round trip; an
    "active" report goes out at once. Exercised on LaunchGate.publish with the outbox's sends replaced."""
    from tokenplane.route.batching import BatchPolicy
    from tokenplane.route.messages import HandoffMsg, PeerStatus

    frames: list[list] = []
    direct: list = []
    gate = _gate(0, policy=BatchPolicy([1, 3], 8))
    out = gate.out
    out.sent, out.received = [0, 3], [0, 2]
    out.final_sent, out.final_received = [0, 1], [0, 1]   # final deliveries never create work: not counted
    out.peers = {1: object()}
    handoff = object.__new__(HandoffMsg)
    final = object.__new__(HandoffMsg)
    final.final = True
    out.queued = {1: [handoff, final, handoff]}
    out.flush = lambda: (frames.append(out.queued.get(1, [])), setattr(out, "queued", {}))
    out.send_now = lambda dest, msg: direct.append(msg) or True
    gate.publish(False, 1)
    assert len(frames) == 1 and frames[0][:3] == [handoff, final, handoff]
    st = frames[0][3]
    assert isinstance(st, PeerStatus)
    assert not st.active and st.ready == 1 and st.sent == [0, 4] and st.received == [0, 1] and st.at > 0
    out.sent, out.final_sent = [0, 6], [0, 2]
    gate.publish(False, 1)   # unchanged state: nothing new to say
    assert frames[-1] == [] and not direct
    gate.publish(True, 2)
    assert len(direct) == 1 and direct[0].active


def test_a_final_delivery_in_flight_does_not_hold_a_forced_launch():
    """Model 1 delivered a finished request to the home model (a final HandoffMsg): model 0's idle report cannot
    count it yet, but it can never create work, so model 1 need not wait for that acknowledgement round trip."""
    gate = _gate(1)
    out = gate.out
    out.sent, out.received, out.final_sent, out.final_received = [3, 0], [4, 0], [1, 0], [0, 0]
    # model 0: idle, sent 4 to model 1, acknowledged 2 from it (the 2 that carried work)
    gate.peer_status = [_status(0, sent=(0, 4), received=(0, 2)), None]
    assert gate.nothing_else_can_run(1)
    out.final_sent = [0, 0]   # were the third one a hand-back with work, model 0 might still launch: wait
    assert not gate.nothing_else_can_run(1)


def test_own_unflushed_hand_back_blocks_forcing():
    """Model 1's step just handed two requests back to model 0; the messages still sit in its outbox (they leave
    with the next flush). Model 0's idle report cannot know them, so it is stale: model 1 must wait, or it forces a
    launch right after every hand-back, before the batch its threshold waits for can form (measured: at C = 8,
    thresholds (1, 7) ran exactly like (1, 1))."""
    from tokenplane.route.messages import HandoffMsg
    gate = _gate(1)
    out = gate.out
    out.sent, out.received, out.final_sent, out.final_received = [3, 0], [3, 0], [0, 0], [0, 0]
    gate.peer_status = [_status(0, sent=(0, 3), received=(0, 3)), None]
    assert gate.nothing_else_can_run(1)          # everything delivered and acknowledged
    out.queued = {0: [object.__new__(HandoffMsg), object.__new__(HandoffMsg)]}
    assert not gate.nothing_else_can_run(1)      # dispatched, not yet flushed: model 0 is about to get work
