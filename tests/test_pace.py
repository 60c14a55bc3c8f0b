"""Pace (diloco/runtime/unit.py): when a wall-clock learner's step ends, by hand."""

import pytest

from diloco.runtime.pace import Pace


def test_without_a_period_a_step_ends_when_its_stretched_compute_does():
    pace = Pace(0.0)
    assert pace.end(10.0, 0.5, 1.0) == 10.5
    assert pace.end(11.0, 0.5, 3.0) == 12.5  # speed factor 3: sleeps twice the compute time
    assert pace.due is None


def test_steps_follow_the_schedule_from_the_first_step():
    pace = Pace(1.0)
    # fast steps idle to the schedule 1, 2, 3 s after the first step's start
    assert [pace.end(s, 0.1, 1.0) for s in (0.0, 1.0, 2.0)] == [1.0, 2.0, 3.0]
    # a late step (2.5 s of compute) ends late; the next ones do not idle until back on schedule
    assert pace.end(3.0, 2.5, 1.0) == 5.5
    assert pace.end(5.5, 0.2, 1.0) == pytest.approx(5.7)  # due at 5.0: behind, no idling
    assert pace.end(5.7, 0.2, 1.0) == 6.0  # caught up: due at 6.0


def test_a_slow_learner_follows_a_stretched_schedule():
    pace = Pace(0.5)
    ends = [pace.end(s, 0.1, 2.0) for s in (0.0, 1.0, 2.0)]
    assert ends == [1.0, 2.0, 3.0]  # factor 2 x period 0.5


def test_the_run_grid_puts_a_resumed_learner_in_phase():
    """rejoin_at=schedule: a learner back at clock 10.3 s with period 0.5 takes up step 20 and
    then ends its steps on the grid (10.5, 11.0, ...) as the learners that never stopped do."""
    assert Pace.grid_step(0.5, 10.3, 1.0) == 20 and Pace.grid_step(0.5, 10.3, 2.0) == 10
    pace = Pace.on_grid(0.5, 20, 1.0)
    assert [pace.end(s, 0.1, 1.0) for s in (10.3, 10.5, 11.0)] == [10.5, 11.0, 11.5]
    never_stopped = Pace.on_grid(0.5, 0, 1.0)
    assert [never_stopped.end(k * 0.5, 0.1, 1.0) for k in range(22)][-2:] == [10.5, 11.0]


def test_rejoin_at_own_keeps_the_learners_own_step_and_schedule():
    assert Pace.rejoin_step(0.5, "own", 10.3, 1.0, 300) == 0
    assert Pace.rejoin_step(0.5, "schedule", 10.3, 1.0, 300) == 20
    assert Pace.rejoin_step(0.5, "schedule", 1e6, 1.0, 300) == 300  # never past the run's last step
    assert Pace.of(0.5, "own", 20, 1.0).due is None
    assert Pace.of(0.5, "schedule", 20, 1.0).due == 10.0
