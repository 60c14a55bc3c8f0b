"""The one wall-clock learner loop, shared by the threads and procs runtimes, over a small port.

Each pass: take what has arrived, apply the fragments that are due, wait (or give up at the stall
limit) while a fragment the schedule needs is overdue, step, pace the step, and report it as a
typed event (diloco/runtime/events.py). A runtime supplies the port: how time is read, how
broadcasts are taken, how events leave, and when the incarnation must end (docs/design.md).
sim drives the same LearnerUnit from its event heap instead, on a virtual clock.

A learner may be a world of several processes (docs/multihost.md), each running this loop on the
same unit over the learner's global mesh. Then every process must make the same passes and launch
the same device programs in the same order, so each wall-clock decision (give up on a fragment,
the rows a chaos tape leaves) is the leader's, taken by every process through `port.agree`, and
only the leader paces its steps (the followers then wait for it in the next pass's collectives).
"""

from __future__ import annotations

from typing import Protocol

import jax
import numpy as np

from diloco import report
from diloco.algo import hostpool
from diloco.config import TrainConfig
from diloco.runtime import events as ev
from diloco.runtime.rejoin import LearnerCheckpoints
from diloco.runtime.pace import Pace, StallWatch
from diloco.runtime.unit import LearnerUnit
from diloco.runtime.walltape import WallTape
from diloco.train.profile import Trace


class LearnerPort(Protocol):
    """What the loop needs from a runtime."""

    leader: bool  # the process whose clock decides (in a learner of one process, always)

    def agree(self, decision: dict | None) -> dict:
        """The leader's `decision` on every process of the learner (followers pass theirs, which
        is ignored); the decision itself where the learner is one process."""

    def clock(self) -> float:
        """Seconds on the run's shared wall clock."""

    def poll(self, unit: LearnerUnit) -> None:
        """Take every broadcast that has arrived, without waiting."""

    def wait(self, unit: LearnerUnit, until: float) -> None:
        """Take broadcasts as they arrive, returning by `until` (earlier once one came)."""

    def emit(self, event: ev.Event) -> tuple[float, float] | None:
        """Send an event to the syncer; the (start, end) of a wait for room, if it had to wait."""

    def check(self, unit: LearnerUnit, watch: StallWatch) -> bool:
        """Between steps: raise to end the incarnation at once (a kill, the chaos tape taking its
        last slice); True to stop it gracefully (SIGTERM), False to go on."""

    def log(self, record: dict) -> None:
        """A train record for the run's metrics."""


def run_incarnation(port: LearnerPort, unit: LearnerUnit, cfg: TrainConfig, speed: float, jitter: float,
                    tape: WallTape | None, checkpoints: LearnerCheckpoints, trace: Trace | None = None) -> bool:
    """Train `unit` to run.steps, then the final sync and Done; False if `port.check` stopped it.
    `trace` (run.profile, learner 0's: train/profile.py) is told the steps done before each step."""
    trace = trace or Trace(None, None)
    r, steps = cfg.runtime, cfg.run.steps
    m, inc = unit.learner, unit.ls.incarnation
    rng = np.random.default_rng([r.seed, 7, m, inc])
    watch = StallWatch(m, r.stall_limit_steps)
    pace = Pace.of(r.step_period_s, r.rejoin_at, unit.ls.step, speed)

    def emit(event: ev.Event, overlapped: bool = False) -> None:
        waited = port.emit(event)
        # Inside a stall a wait for room is part of the stall; while a step runs (`overlapped`)
        # it is inside that step's interval, which the step's end already covers.
        if waited is not None and watch.since is None and not overlapped:
            watch.done.append(waited)

    # A step's contributions are encoded after the next step is dispatched, so the host work runs
    # while the devices compute (docs/design.md#deferred-encode). `held` is the previous step's
    # StepDone awaiting its frames, then the events that came after it (kept in order); `release`
    # sends them, and runs wherever the loop would otherwise wait or end.
    held: list = []

    def release(overlapped: bool = False) -> None:
        if held:
            done, log = held[0]
            frames, loss = unit.finish()
            emit(done._replace(frames=frames, loss=loss), overlapped)
            if log:
                port.log({"kind": "train", "learner": m, "step": done.step, "time": done.end,
                          "tokens": done.step * done.tokens, "loss": loss})
            for event in held[1:]:
                emit(event, overlapped)
            held.clear()

    def send(event: ev.Event) -> None:
        if held:
            held.append(event)
        else:
            emit(event)

    while True:
        try:
            stopping = port.check(unit, watch)
        except BaseException:  # killed at this step boundary: the step before it was reported, as
            release()          # it would have been without deferral
            raise
        if stopping:
            release()
            return False
        port.poll(unit)
        ready = unit.apply_due()
        if ready:
            send(ev.Applied(m, inc, tuple(q.fragment for q in ready)))
        blocked = unit.blocking()
        if blocked is not None:
            release()  # the syncer may be waiting for these very frames
            now = port.clock()
            give_up = watch.blocked(blocked.seq, now)
            if port.agree({"give_up": now >= give_up})["give_up"]:
                unit.give_up(blocked.fragment)
            else:
                port.wait(unit, give_up)
            continue
        watch.unblocked(port.clock())
        if unit.ls.step >= steps:
            break
        start = port.clock()
        rows = None
        if tape is not None:
            # slices lost: a smaller batch; all lost since the check (a loaded machine): the check ends it
            alive = tape.alive(m, start)
            taped = port.agree({"alive": alive, "rows": tape.rows(m, start) if alive else None})
            if not taped["alive"]:
                continue
            rows = taped["rows"]
        log = report.due(unit.ls.step + 1, cfg.run.log_every, steps)
        trace.at(unit.ls.step, unit.state)
        result = unit.step(fetch_loss=log, rows=rows, defer=True)
        release(overlapped=True)  # the previous step's frames, while this one runs
        # Broadcasts that came during the step are taken while it runs too: their checksums,
        # checks and transfers overlap the devices' work. What they schedule is applied before
        # the next step, as when the next pass's poll takes them (which takes any later ones).
        port.poll(unit)
        jax.block_until_ready(unit.state)  # dispatch is asynchronous: time the step, not its launch
        compute = port.clock() - start
        factor = speed * max(0.1, 1.0 + jitter * rng.standard_normal())
        until = pace.end(start, compute, factor)  # the speed factor and runtime.step_period_s
        while port.leader and port.clock() < until:  # the artificial slowdown, taking broadcasts as they come
            port.wait(unit, until)
        end = port.clock()
        watch.observe(end - start)
        hostpool.release_freed()  # resident memory flat over the run (docs/design.md#syncer-memory)
        held.append((ev.StepDone(m, inc, unit.ls.step, start, end, result.tokens, ev.pairs(result.sends),
                                 (), watch.take(), None, rows=rows or 0), log))
        # A checkpoint is never ahead of the steps the syncer has heard of: this step's event
        # leaves as soon as its (asynchronous) save starts, after the pacing wait, not before it.
        if checkpoints.maybe_save(unit):
            release()
    trace.at(unit.ls.step, unit.state)
    release()
    if cfg.fragments.final_sync:
        result = unit.flush()
        emit(ev.Flushed(m, inc, port.clock(), ev.pairs(result.sends), result.frames))
    checkpoints.close()  # every checkpoint complete before the syncer hears the learner is done
    emit(ev.Done(m, inc, port.clock(), watch.take()))
    return True
