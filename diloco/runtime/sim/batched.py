"""sim's batched learners (runtime.batch_learners, docs/design.md#sim): which learners' steps
can be taken together with the one due now, and taking them as one vmapped step.
"""

from __future__ import annotations

import heapq

import jax

from diloco.algo import learner as lsm
from diloco.chaos import tapes
from diloco.runtime import events as ev
from diloco.runtime.unit import LearnerUnit, StepResult


def in_step(sim, rows: int, end: float) -> list[tuple[int, float, bool, float]]:
    """The learners whose steps come next on the heap and can be taken with this one, as one
    batched step (runtime.batch_learners, docs/design.md#sim): each starts before any of the
    steps taken with it ends (so nothing it could receive comes first), steps at once (no
    stall, no flush, no failure) and with the same rows. Their events are taken off the heap
    in order and everything before their step is done as at their own turn; each is
    (learner, start, log loss, duration), the durations drawn in the same order as one by one."""
    out = []
    while sim.heap and sim.heap[0][2] == "step" and sim.heap[0][0] < end:
        t, k = sim.heap[0][0], sim.heap[0][3][0]
        if not steps_at(sim, k, t, rows):
            break
        heapq.heappop(sim.heap)
        sim.now = t
        sim.waking.discard(k)
        unit = sim.units[k]
        for q in unit.apply_due():
            sim.host.on_event(ev.Applied(k, unit.ls.incarnation, (q.fragment,)), sim.now)
        if k in sim.stalled_since:
            sim.host.stalled(k, sim.stalled_since.pop(k), sim.now)
        out.append((k, t, sim.log_due(k), sim.duration(k)))
        end = min(end, t + out[-1][3])
    return out


def steps_at(sim, k: int, t: float, rows: int) -> bool:
    """Whether learner k's step event at t would step at once, with `rows` rows (nothing changes)."""
    unit = sim.units[k]
    if unit is None or not sim.alive[k] or (sim.tape is not None and not tapes.is_alive(sim.tape, k, t)):
        return False
    schedule = unit.spec.schedule
    ls, _ = lsm.to_apply(unit.ls, schedule)
    return lsm.blocking(ls, schedule) is None and ls.step < sim.cfg.run.steps and sim.rows_at(k, t) == rows


def step_together(units: list[LearnerUnit], rows: int | None, fetch_loss: list[bool]) -> list[StepResult]:
    """One inner step of each unit, as one vmapped step over a leading learner axis: units that
    share one compiled step and mesh (sim) and take batches of the same rows. Each keeps its own
    data, state, counters and sends; the results are each unit's `step` (docs/design.md#sim)."""
    compiled = units[0].compiled
    assert all(u.compiled is compiled for u in units), "units stepped together must share their compiled step"
    batches = [u.batch(rows) for u in units]
    placed = tuple(jax.device_put(b, compiled.batch_sharding) for b in batches)
    out = compiled.train_many(len(units))(tuple(u.state for u in units), placed)
    results = []
    for u, b, (state, metrics), fetch in zip(units, batches, out, fetch_loss):
        u.state = state
        results.append(u.stepped(b, metrics, fetch, False))
    return results
