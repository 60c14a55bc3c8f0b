"""A wall-clock learner's pacing: its stall bookkeeping (`StallWatch`) and when each of its steps
ends (`Pace`). Shared by the threads and procs learner loops (diloco/runtime/learner_loop.py).

Reference: docs/design.md#what-the-runtimes-share.
"""

from __future__ import annotations

from diloco.algo import quorum


class StallWatch:
    """A wall-clock learner's stall bookkeeping: when a stall began, the give-up time armed for the
    overdue send (one limit per send), its step-time estimate, and the finished stall intervals
    waiting to ride on its next event. Shared by the threads and procs learner loops."""

    def __init__(self, learner: int, stall_limit_steps: float):
        self.learner, self.limit_steps = learner, stall_limit_steps
        self.times = quorum.StepTimes()  # this learner's step-time EMA, for its stall limit
        self.since: float | None = None
        self.limit: tuple[int, float] | None = None  # (seq waited for, clock time to give up)
        self.done: list[tuple[float, float]] = []  # booked with the next step (or done) event

    def blocked(self, seq: int, now: float) -> float:
        """Blocked on send `seq` at `now`: the time to give up on it."""
        if self.since is None:
            self.since = now
        if self.limit is None or self.limit[0] != seq:
            self.limit = (seq, now + self.limit_steps * quorum.slowest_step_time(self.times, [self.learner]))
        return self.limit[1]

    def unblocked(self, now: float) -> None:
        if self.since is not None:
            self.done.append((self.since, now))
            self.since = self.limit = None

    def observe(self, seconds: float) -> None:
        self.times = quorum.observe_step_time(self.times, self.learner, seconds)

    def take(self, now: float | None = None) -> tuple[tuple[float, float], ...]:
        """The finished stalls (and, given `now`, the open one up to now), cleared."""
        out = tuple(self.done) + (((self.since, now),) if now is not None and self.since is not None else ())
        self.done.clear()
        return out


class Pace:
    """When a wall-clock learner's step ends. A speed factor s stretches the step to s x its
    compute time (a heterogeneous run on one real clock; factors below 1 cannot speed a step up).
    With runtime.step_period_s > 0 a step also ends no earlier than the learner's schedule, which
    advances s x period per step from its first step: learners sharing a machine drift apart by
    whole steps otherwise (the operating system gives them unequal shares), so a K = 1 syncer
    merges them one at a time, and a step that ran late is made up by not idling after the next
    ones, keeping equal-speed learners in phase as they are on hardware of their own."""

    def __init__(self, period: float, due: float | None = None):
        self.period = period
        self.due = due  # when the schedule says the last step should have ended (None: at the next start)

    @classmethod
    def on_grid(cls, period: float, step: int, speed: float) -> "Pace":
        """The schedule of a learner at `step` on the run's grid (step k ends at k x speed x
        period on the clock that starts with the run), as if it had never stopped."""
        return cls(period, step * speed * period)

    @staticmethod
    def grid_step(period: float, now: float, speed: float) -> int:
        """The step a learner on the run's grid is at, at `now`."""
        return int(now // (speed * period))

    @classmethod
    def of(cls, period: float, rejoin_at: str, step: int, speed: float) -> "Pace":
        """A learner's schedule from `step`: on the run's grid with runtime.rejoin_at=schedule
        (every incarnation in phase), else from its first step."""
        return cls.on_grid(period, step, speed) if rejoin_at == "schedule" else cls(period)

    @classmethod
    def rejoin_step(cls, period: float, rejoin_at: str, now: float, speed: float, steps: int,
                    resumed: bool = False) -> int:
        """The least step a learner restarting at `now` resumes at: the grid's with
        rejoin_at=schedule, else 0 (its own checkpoint's or stopping step decides). A learner
        coming back in a resumed run missed no steps (the whole run stopped with it, and the
        stopped interval is on no clock): 0, so it trains every token an uninterrupted run
        would (docs/design.md#rejoin)."""
        return min(cls.grid_step(period, now, speed), steps) if rejoin_at == "schedule" and not resumed else 0

    def end(self, start: float, compute: float, factor: float) -> float:
        natural = start + factor * compute
        if self.period <= 0:
            return natural
        self.due = (start if self.due is None else self.due) + factor * self.period
        return max(natural, self.due)
