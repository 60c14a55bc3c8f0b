"""When the syncer merges a fragment round: quorum K plus the adaptive grace window (docs/algorithm.md#grace-window, Eq. 3).

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), section 4.

A round is a value; each event (`on_arrival`, `on_deadline`, `on_live_change`) returns the new round
and a `Decision` record saying what to do, who is in, who is missing or late, and why. The syncer
acts on the decision (arm a timer at `deadline`, merge `admitted`) and appends it to its decision records.
Times are seconds on whatever clock the runtime uses (virtual or wall).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

# Actions.
WAIT = "wait"  # nothing to do yet
QUORUM = "quorum_reached"  # K are in: arm a timer at decision.deadline, keep admitting until then
MERGE = "merge_now"  # merge decision.admitted; the round is closed
IGNORE = "ignore"  # the event does not belong to this round (closed round, stale timer)

# Reasons.
BELOW_QUORUM = "below_quorum"  # fewer than K contributions are in
GRACE_OPEN = "grace_open"  # quorum reached, the grace deadline has not passed
NO_GRACE = "no_grace"  # quorum reached and the grace window is 0
ALL_LIVE_IN = "all_live_in"  # every live learner contributed: waiting gains nothing
DEADLINE_PASSED = "deadline_passed"  # the grace deadline passed
REPEAT = "repeat"  # a learner already in sent again; counted once, the syncer keeps the newer payload
ROUND_CLOSED = "round_closed"  # the round already merged; route the contribution to the next round
NO_DEADLINE = "no_deadline"  # a timer fired for a round without a deadline
BEFORE_DEADLINE = "before_deadline"  # a timer fired early


class GraceConfig(NamedTuple):
    K: int = 1  # minimum quorum; clamped to the number of live learners
    gamma: float = 0.8  # safety factor < 1 of Eq. 3 [unsure: value not public]
    cap_steps: float = 1.0  # grace never exceeds this many (slowest) step times
    tau: int = 2  # overlap steps: the learner wants the merged fragment back within tau steps


def check_grace(cfg: GraceConfig) -> None:
    """Raise ValueError naming the offending value."""
    if not isinstance(cfg.K, int) or cfg.K < 1:
        raise ValueError(f"quorum K={cfg.K!r} must be a positive integer")
    if not 0.0 <= cfg.gamma <= 1.0:
        raise ValueError(f"grace gamma={cfg.gamma} must lie in [0, 1]")
    if cfg.cap_steps < 0:
        raise ValueError(f"grace cap_steps={cfg.cap_steps} must be non-negative")
    if not isinstance(cfg.tau, int) or cfg.tau < 0:
        raise ValueError(f"overlap tau={cfg.tau!r} must be a non-negative integer")


def grace_window(cfg: GraceConfig, step_time: float, t_quorum: float, t_sync: float) -> float:
    """Eq. 3: clip(gamma * (tau * step_time - t_quorum - t_sync), 0, cap_steps * step_time).

    The learner expects the merged fragment tau steps after sending it; the grace window spends
    a fraction gamma of what is left of that budget after reaching quorum and syncing.
    """
    check_grace(cfg)
    budget = cfg.gamma * (cfg.tau * step_time - t_quorum - t_sync)
    return min(max(budget, 0.0), cfg.cap_steps * step_time)


class Round(NamedTuple):
    """One merge of one fragment, from its first expected contribution to the merge."""

    fragment: int
    opened_at: float  # the round's clock starts here; t_quorum = quorum_at - opened_at
    live: tuple[int, ...]  # learners expected to contribute
    arrivals: tuple[tuple[int, float], ...] = ()  # admitted (learner, time), in arrival order
    late: tuple[tuple[int, float], ...] = ()  # refused (learner, time): arrived after the deadline
    quorum_at: float | None = None
    grace: float | None = None  # seconds, fixed when the quorum is reached
    deadline: float | None = None  # quorum_at + grace
    closed_at: float | None = None  # when the merge fired


class Decision(NamedTuple):
    """What the syncer should do after an event, and why: one line of the event tape."""

    action: str  # WAIT | QUORUM | MERGE | IGNORE
    reason: str  # one of the reason codes above
    fragment: int
    at: float
    admitted: tuple[int, ...]  # learners in, in arrival order; the merge set S when action == MERGE
    missing: tuple[int, ...]  # live learners not in
    late: tuple[int, ...]  # learners refused for arriving after the deadline
    quorum: int  # effective K
    t_quorum: float | None
    grace: float | None
    deadline: float | None


def open_round(fragment: int, now: float, live: Iterable[int]) -> Round:
    """A fresh round for `fragment`; the syncer opens it when the previous one merged or at the
    first contribution (then t_quorum measures only the wait for the other K - 1)."""
    return Round(fragment, float(now), tuple(sorted(set(live))))


def _admitted(rnd: Round) -> tuple[int, ...]:
    return tuple(dict.fromkeys(m for m, _ in rnd.arrivals))


def _quorum(cfg: GraceConfig, rnd: Round) -> int:
    # K larger than the live set would wait forever for dead learners; the syncer never blocks on
    # a dead learner (section 1), so K = M means "all live learners".
    return max(1, min(cfg.K, len(rnd.live)))


def _decide(rnd: Round, cfg: GraceConfig, action: str, reason: str, now: float) -> Decision:
    admitted = _admitted(rnd)
    t_quorum = None if rnd.quorum_at is None else rnd.quorum_at - rnd.opened_at
    return Decision(
        action, reason, rnd.fragment, float(now), admitted,
        tuple(m for m in rnd.live if m not in admitted), tuple(m for m, _ in rnd.late),
        _quorum(cfg, rnd), t_quorum, rnd.grace, rnd.deadline,
    )


def _close(rnd: Round, cfg: GraceConfig, reason: str, now: float) -> tuple[Round, Decision]:
    rnd = rnd._replace(closed_at=float(now))
    return rnd, _decide(rnd, cfg, MERGE, reason, now)


def _evaluate(rnd: Round, cfg: GraceConfig, now: float, step_time: float,
              t_sync: float) -> tuple[Round, Decision]:
    """The policy: merge once >= K are in and either the grace deadline passed or all live are in."""
    admitted = set(_admitted(rnd))
    all_in = set(rnd.live) <= admitted
    if rnd.quorum_at is None:
        if len(admitted) < _quorum(cfg, rnd):
            return rnd, _decide(rnd, cfg, WAIT, BELOW_QUORUM, now)
        grace = grace_window(cfg, step_time, now - rnd.opened_at, t_sync)
        rnd = rnd._replace(quorum_at=float(now), grace=grace, deadline=float(now) + grace)
        if all_in:
            return _close(rnd, cfg, ALL_LIVE_IN, now)
        if grace <= 0.0:
            return _close(rnd, cfg, NO_GRACE, now)
        return rnd, _decide(rnd, cfg, QUORUM, GRACE_OPEN, now)
    if all_in:
        return _close(rnd, cfg, ALL_LIVE_IN, now)
    return rnd, _decide(rnd, cfg, WAIT, GRACE_OPEN, now)


def on_arrival(rnd: Round, cfg: GraceConfig, learner: int, now: float, step_time: float,
               t_sync: float) -> tuple[Round, Decision]:
    """A contribution for this round's fragment arrived from `learner` at time `now`.

    `step_time` is the slowest live learner's step time estimate (see `slowest_step_time`) and
    `t_sync` the expected time to pull, merge, step and publish; both only matter when this
    arrival completes the quorum. Admission is inclusive: one arriving exactly at the deadline
    is in. One arriving after it is refused (listed in `late`, to be carried to the next round)
    and fires the merge that the deadline timer would have fired.
    """
    if rnd.closed_at is not None:
        return rnd, _decide(rnd, cfg, IGNORE, ROUND_CLOSED, now)
    if rnd.deadline is not None and now > rnd.deadline:
        return _close(rnd._replace(late=rnd.late + ((learner, float(now)),)), cfg, DEADLINE_PASSED, now)
    if learner in _admitted(rnd):
        return rnd, _decide(rnd, cfg, WAIT, REPEAT, now)
    rnd = rnd._replace(arrivals=rnd.arrivals + ((learner, float(now)),))
    return _evaluate(rnd, cfg, now, step_time, t_sync)


def on_deadline(rnd: Round, cfg: GraceConfig, now: float) -> tuple[Round, Decision]:
    """The grace timer fired. Stale timers (round closed, or not yet due) are ignored, so a runtime
    never needs to cancel one."""
    if rnd.closed_at is not None:
        return rnd, _decide(rnd, cfg, IGNORE, ROUND_CLOSED, now)
    if rnd.deadline is None:
        return rnd, _decide(rnd, cfg, IGNORE, NO_DEADLINE, now)
    if now < rnd.deadline:
        return rnd, _decide(rnd, cfg, WAIT, BEFORE_DEADLINE, now)
    return _close(rnd, cfg, DEADLINE_PASSED, now)


def on_live_change(rnd: Round, cfg: GraceConfig, live: Iterable[int], now: float, step_time: float,
                   t_sync: float) -> tuple[Round, Decision]:
    """The learners the round waits for changed (a failure, a rejoin, or a learner that finished
    training): re-evaluate, since a death or a finish can complete the quorum (K clamped to the
    live count) or leave only learners already in."""
    rnd = rnd._replace(live=tuple(sorted(set(live))))
    if rnd.closed_at is not None:
        return rnd, _decide(rnd, cfg, IGNORE, ROUND_CLOSED, now)
    return _evaluate(rnd, cfg, now, step_time, t_sync)


class StepTimes(NamedTuple):
    """Per-learner exponential moving averages of the inner step time, in seconds."""

    decay: float = 0.9
    estimates: tuple[tuple[int, float], ...] = ()  # (learner, seconds), sorted by learner


def observe_step_time(st: StepTimes, learner: int, seconds: float) -> StepTimes:
    """Fold one observed step time in; a learner's first observation is taken as is."""
    if not seconds >= 0.0:
        raise ValueError(f"step time of learner {learner} must be non-negative, got {seconds}")
    current = dict(st.estimates)
    old = current.get(learner)
    current[learner] = float(seconds) if old is None else st.decay * old + (1.0 - st.decay) * seconds
    return st._replace(estimates=tuple(sorted(current.items())))


def slowest_step_time(st: StepTimes, live: Iterable[int] | None = None) -> float:
    """The slowest estimate among `live` learners (all if None): Eq. 3 budgets for the slowest.

    0.0 when nothing is known yet, which makes the grace window 0 until a step time is observed.
    """
    keep = None if live is None else set(live)
    values = [s for m, s in st.estimates if keep is None or m in keep]
    return max(values, default=0.0)
