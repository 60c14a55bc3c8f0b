"""Quorum and adaptive grace on hand-built event sequences (docs/algorithm.md#grace-window, Eq. 3)."""

import pytest

from diloco.algo import quorum as q

STEP, SYNC = 1.0, 0.1  # seconds per (slowest) inner step, seconds to pull, merge, step and publish


def arrive(rnd, cfg, learner, now):
    return q.on_arrival(rnd, cfg, learner, now, STEP, SYNC)


def test_grace_window_eq3_and_its_clipping():
    cfg = q.GraceConfig(gamma=0.8, cap_steps=1.0, tau=2)
    assert q.grace_window(cfg, 1.0, 0.5, 0.25) == pytest.approx(0.8 * (2.0 - 0.75))  # 1.0, not clipped
    assert q.grace_window(cfg, 1.0, 0.0, 0.0) == 1.0  # 1.6 clipped to the cap of one step
    assert q.grace_window(cfg, 1.0, 1.5, 1.0) == 0.0  # over budget: no grace, never negative
    assert q.grace_window(cfg._replace(cap_steps=0.5), 2.0, 0.0, 0.0) == 1.0  # cap scales with step
    assert q.grace_window(cfg, 0.0, 0.0, 0.0) == 0.0  # no step time known yet
    with pytest.raises(ValueError, match="K=0"):
        q.grace_window(cfg._replace(K=0), 1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="gamma=1.5"):
        q.grace_window(cfg._replace(gamma=1.5), 1.0, 0.0, 0.0)


def test_K1_without_grace_merges_on_first_arrival():
    cfg = q.GraceConfig(K=1, gamma=0.0)
    rnd = q.open_round(3, 0.0, live=[0, 1, 2])
    rnd, d = arrive(rnd, cfg, 1, 0.4)
    assert (d.action, d.reason) == (q.MERGE, q.NO_GRACE)
    assert d.admitted == (1,) and d.missing == (0, 2) and d.fragment == 3 and d.grace == 0.0
    assert rnd.closed_at == 0.4
    rnd2, d = arrive(rnd, cfg, 0, 0.5)  # the round is over: the contribution goes to the next one
    assert (d.action, d.reason) == (q.IGNORE, q.ROUND_CLOSED) and rnd2 == rnd


def test_K_equals_M_waits_for_all():
    cfg = q.GraceConfig(K=3, gamma=0.0)
    rnd = q.open_round(0, 0.0, live=[0, 1, 2])
    rnd, d = arrive(rnd, cfg, 2, 0.1)
    assert (d.action, d.reason, d.quorum, d.missing) == (q.WAIT, q.BELOW_QUORUM, 3, (0, 1))
    rnd, d = arrive(rnd, cfg, 2, 0.2)  # a repeat counts once
    assert (d.action, d.reason) == (q.WAIT, q.REPEAT) and len(rnd.arrivals) == 1
    rnd, d = arrive(rnd, cfg, 0, 5.0)
    assert d.action == q.WAIT
    rnd, d = arrive(rnd, cfg, 1, 9.0)
    assert (d.action, d.reason, d.admitted) == (q.MERGE, q.ALL_LIVE_IN, (2, 0, 1))
    assert d.t_quorum == 9.0


def test_grace_admits_before_deadline_and_not_after():
    cfg = q.GraceConfig(K=1, gamma=0.8, cap_steps=1.0, tau=2)
    rnd = q.open_round(1, 10.0, live=[0, 1, 2])
    rnd, d = arrive(rnd, cfg, 0, 10.5)  # t_quorum 0.5: grace = 0.8 * (2 - 0.5 - 0.1) = 1.12 -> cap 1.0
    assert (d.action, d.reason) == (q.QUORUM, q.GRACE_OPEN)
    assert d.grace == pytest.approx(1.0) and d.deadline == pytest.approx(11.5) and d.t_quorum == 0.5
    rnd, d = arrive(rnd, cfg, 2, 11.2)  # inside the window
    assert (d.action, d.reason, d.admitted) == (q.WAIT, q.GRACE_OPEN, (0, 2))
    rnd, d = arrive(rnd, cfg, 1, 11.6)  # after the deadline, before the timer was handled
    assert (d.action, d.reason) == (q.MERGE, q.DEADLINE_PASSED)
    assert d.admitted == (0, 2) and d.late == (1,) and d.missing == (1,)
    rnd, d = q.on_deadline(rnd, cfg, 11.5)  # the stale timer is harmless
    assert (d.action, d.reason) == (q.IGNORE, q.ROUND_CLOSED)


def test_deadline_timer_fires_the_merge():
    cfg = q.GraceConfig(K=2, gamma=0.5, cap_steps=1.0, tau=2)
    rnd = q.open_round(0, 0.0, live=[0, 1, 2, 3])
    rnd, d = q.on_deadline(rnd, cfg, 0.1)
    assert (d.action, d.reason) == (q.IGNORE, q.NO_DEADLINE)
    rnd, _ = arrive(rnd, cfg, 3, 0.2)
    rnd, d = arrive(rnd, cfg, 1, 0.4)  # grace = 0.5 * (2 - 0.4 - 0.1) = 0.75
    assert d.action == q.QUORUM and d.grace == pytest.approx(0.75)
    rnd, d = q.on_deadline(rnd, cfg, 1.0)
    assert (d.action, d.reason) == (q.WAIT, q.BEFORE_DEADLINE)
    rnd, d = q.on_deadline(rnd, cfg, 1.2)
    assert (d.action, d.reason, d.admitted, d.missing) == (q.MERGE, q.DEADLINE_PASSED, (3, 1), (0, 2))


def test_all_live_in_fires_immediately_inside_the_window():
    cfg = q.GraceConfig(K=1)
    rnd = q.open_round(0, 0.0, live=[0, 1])
    rnd, d = arrive(rnd, cfg, 1, 0.0)
    assert d.action == q.QUORUM and d.deadline == pytest.approx(1.0)
    rnd, d = arrive(rnd, cfg, 0, 0.3)
    assert (d.action, d.reason, d.admitted) == (q.MERGE, q.ALL_LIVE_IN, (1, 0)) and rnd.closed_at == 0.3
    # a single live learner never waits, whatever the grace
    rnd = q.open_round(0, 0.0, live=[5])
    _, d = arrive(rnd, cfg, 5, 0.0)
    assert (d.action, d.reason) == (q.MERGE, q.ALL_LIVE_IN)


def test_a_death_can_complete_the_round():
    cfg = q.GraceConfig(K=3, gamma=0.0)
    rnd = q.open_round(0, 0.0, live=[0, 1, 2])
    rnd, _ = arrive(rnd, cfg, 0, 0.1)
    rnd, d = arrive(rnd, cfg, 1, 0.2)
    assert d.reason == q.BELOW_QUORUM
    rnd, d = q.on_live_change(rnd, cfg, [0, 1], 0.3, STEP, SYNC)  # learner 2 died: K clamps to 2
    assert (d.action, d.reason, d.quorum, d.missing) == (q.MERGE, q.ALL_LIVE_IN, 2, ())


def test_step_time_ema_takes_the_slowest_live_learner():
    st = q.StepTimes(decay=0.5)
    assert q.slowest_step_time(st) == 0.0
    st = q.observe_step_time(st, 0, 1.0)
    st = q.observe_step_time(st, 1, 2.0)
    st = q.observe_step_time(st, 1, 4.0)  # 0.5 * 2 + 0.5 * 4
    assert dict(st.estimates) == {0: 1.0, 1: 3.0}
    assert q.slowest_step_time(st) == 3.0 and q.slowest_step_time(st, live=[0]) == 1.0
    with pytest.raises(ValueError, match="learner 2"):
        q.observe_step_time(st, 2, -1.0)
