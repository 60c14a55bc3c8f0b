"""Deterministic replay of the syncer from its recorded inputs (docs/design.md#replay).

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), section 6: the syncer's event
tape allows deterministic replay of a run.

The syncer is a pure function of its inputs, so its inputs replay it: every contribution frame
with its arrival time, every grace timer that fired, every step-time observation and every change
of the live set, in the order the runtime delivered them. Feeding them to `replay` from the same
initial state rebuilds the same Theta, versions and decision records, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from diloco.algo import claims
from diloco.algo import syncer as sync


class Input(NamedTuple):
    """One syncer input. kind: contribution (data=frame bytes) | deadline (data=fragment) |
    step_time (data=(learner, seconds)) | live (data=((learner, incarnation), ...)) | lost_steps
    (data=(learner, steps): steps whose events were lost, credited to its claims only) | finished
    (data=(learner, incarnation): it finished training, every contribution of it delivered)."""

    kind: str
    at: float
    data: object


KINDS = ("contribution", "deadline", "step_time", "live", "lost_steps", "finished")


def apply(cfg: sync.Policy, st: sync.SyncerState, event: Input) -> tuple[sync.SyncerState, tuple]:
    """Deliver one input; the same call a runtime makes, so recording and replay cannot drift."""
    if event.kind == "contribution":
        return sync.on_contribution(cfg, st, event.data, event.at)
    if event.kind == "deadline":
        return sync.on_deadline(cfg, st, int(event.data), event.at)
    if event.kind == "step_time":
        learner, seconds = event.data
        return sync.observe_step_time(st, int(learner), float(seconds)), ()
    if event.kind == "lost_steps":  # no step time is known for them: the claims count them, Eq. 3 not
        learner, steps = event.data
        return st._replace(claims=claims.observe_step(st.claims, int(learner), int(steps))), ()
    if event.kind == "finished":
        learner, incarnation = event.data
        return sync.on_finished(cfg, st, int(learner), int(incarnation), event.at)
    if event.kind == "live":
        return sync.on_live_change(cfg, st, {int(m): int(i) for m, i in event.data}, event.at)
    raise ValueError(f"unknown syncer input kind {event.kind!r}; known: {KINDS}")


def replay(cfg: sync.Policy, st: sync.SyncerState, events: Iterable[Input]) -> sync.SyncerState:
    for event in events:
        st, _ = apply(cfg, st, event)
    return st
