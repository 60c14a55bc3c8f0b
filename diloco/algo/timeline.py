"""The time ledger: per learner, intervals of compute, stall, down, restarting and degraded; goodput
and uptime are computed from it, never estimated afterwards (docs/design.md#ledgers).

Goodput counts chips, not learners: a step computed on a fraction f of the learner's slices books
f of its time as compute and the rest as "degraded" (up, so uptime counts it, but idle chips)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from diloco.algo.eventlog import LedgerError, Log, append, rows


STATES = ("compute", "stall", "down", "restarting", "degraded")  # append only: checkpoints store indices
UP_STATES = ("compute", "stall", "degraded")  # alive: can still contribute once its fragment is back
TIME_ROW = np.dtype([("learner", "i4"), ("state", "i1"), ("start", "f8"), ("end", "f8")])


class TimeLedger(NamedTuple):
    """Per learner, non-overlapping intervals in one of STATES; back-to-back intervals of the
    same state are coalesced, so the log grows with state changes, not with steps."""

    open: dict[int, tuple[int, float, float]]  # learner -> its latest (state, start, end)
    log: Log  # closed intervals


def time_ledger() -> TimeLedger:
    return TimeLedger({}, Log())


def add_time(led: TimeLedger, learner: int, state: str, start: float, end: float) -> TimeLedger:
    if state not in STATES:
        raise LedgerError(f"state must be one of {STATES}, got {state!r}")
    if end < start:
        raise LedgerError(f"learner {learner}: interval ends at {end} before it starts at {start}")
    s = STATES.index(state)
    last = led.open.get(learner)
    if last is not None and start < last[2]:
        raise LedgerError(f"learner {learner}: {state} from {start} overlaps {STATES[last[0]]} until {last[2]}")
    if last is not None and last[0] == s and start == last[2]:
        return led._replace(open={**led.open, learner: (s, last[1], end)})
    log = led.log if last is None else append(led.log, (learner, *last), TIME_ROW)
    return TimeLedger({**led.open, learner: (s, start, end)}, log)


def intervals(led: TimeLedger) -> np.ndarray:
    closed = rows(led.log, TIME_ROW)
    opened = np.array([(m, *v) for m, v in sorted(led.open.items())], TIME_ROW)
    return np.concatenate([closed, opened])


def step_split(start: float, end: float, share: float) -> float:
    """A step computed on `share` of the learner's chips is compute until the returned time and
    degraded after it (goodput counts live chips)."""
    return end if share >= 1.0 else start + max(0.0, share) * (end - start)


def seconds(led: TimeLedger) -> dict[int, dict[str, float]]:
    """Per learner, seconds in each state."""
    iv = intervals(led)
    learners, idx = np.unique(iv["learner"], return_inverse=True)
    secs = np.bincount(idx * len(STATES) + iv["state"], weights=iv["end"] - iv["start"],
                       minlength=len(learners) * len(STATES)).reshape(-1, len(STATES))
    return {int(m): dict(zip(STATES, map(float, row))) for m, row in zip(learners, secs)}


def goodput(led: TimeLedger, learner: int | None = None) -> float:
    """Compute seconds over all booked seconds (all learners, or one); 0 when nothing was booked."""
    per = seconds(led)
    rows = list(per.values()) if learner is None else [per.get(learner, dict.fromkeys(STATES, 0.0))]
    total = sum(sum(r.values()) for r in rows)
    return sum(r["compute"] for r in rows) / total if total else 0.0


def uptime(led: TimeLedger, quorum: int = 1, start: float | None = None, end: float | None = None) -> float:
    """Fraction of [start, end] with at least `quorum` learners up (computing or stalled): the time
    the syncer could gather a quorum and advance the global model (section 6: zero downtime while
    one learner lives, at K = 1). Defaults to the span of all booked intervals."""
    iv = intervals(led)
    if not len(iv):
        return 0.0
    start = float(iv["start"].min()) if start is None else start
    end = float(iv["end"].max()) if end is None else end
    if end <= start:
        return 0.0
    up = iv[np.isin(iv["state"], [STATES.index(s) for s in UP_STATES])]
    times = np.concatenate([up["start"], up["end"]])
    steps = np.concatenate([np.ones(len(up), np.int64), -np.ones(len(up), np.int64)])
    order = np.argsort(times, kind="stable")
    times, count = np.clip(times[order], start, end), np.cumsum(steps[order])
    return float(np.diff(times)[count[:-1] >= quorum].sum()) / (end - start)
