"""Learner checkpoints and the rejoin rule (docs/design.md#checkpoints, docs/algorithm.md#failures-and-rejoin).

A learner checkpoints its own train state (params, inner optimizer state, step) with Orbax every
`runtime.learner_checkpoint_every` steps, with its incarnation and the fragment versions it held as
JSON metadata. The data position is a pure function of (learner, step); data=grain also saves its
iterator's state there (meta "data"), which a rejoin restores so the stream resumes without being
read again from its start (docs/data.md#resume).

When a learner comes back it always takes the syncer's current Theta as its parameters: a crashed
learner's own weights are at best a few merges old, and a brand-new one must never seed the global
model. What a checkpoint is worth keeping is the inner optimizer's state (AdamW moments): it is kept
when no fragment has moved more than `max_rejoin_staleness` versions since the checkpoint, and reset
otherwise. Either way the learner resumes at the step where the dead incarnation stopped (its
learning-rate schedule and data position): the steps that incarnation trained after its
checkpoint were sent and merged, or booked lost, so training their samples again would put them
into Theta twice (docs/algorithm.md#failures-and-rejoin).

A checkpoint is used only if it verifies (diloco/checkpoint.py), has every field, and is from this
learner's past: written by an earlier incarnation of it, at or before the step where the dead one
stopped, holding no version the syncer has not made yet. Anything else (damage, a field missing, a
checkpoint left by another run into the same directory) is skipped with a warning, and with none
left the learner rejoins fresh from the syncer's Theta: a bad checkpoint never stops a rejoin
(docs/design.md#checkpoint-integrity).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, NamedTuple

import jax

from diloco import checkpoint
from diloco.algo import syncer as sync
from diloco.data.stream import restore_position, saved_position
from diloco.runtime import world
from diloco.runtime.build import Setup, new_unit
from diloco.runtime.unit import LearnerUnit

log = logging.getLogger(__name__)


class Rejoin(NamedTuple):
    """How a learner came back: for the log and the tests."""

    learner: int
    incarnation: int
    step: int  # the step it resumes at: where the dead incarnation stopped, or the schedule's
    restored_from: int | None  # checkpoint step whose optimizer state it kept; None = fresh
    staleness: int  # most versions any fragment moved since that checkpoint (-1 without one)


class LearnerCheckpoints:
    """One Orbax manager per learner under `root/learner-<m>`; not thread-safe (one per runtime
    thread that owns the learner, or one for a sequential runtime)."""

    def __init__(self, root: Path | None, every: int, keep: int = 2, lock=None, primary: bool = True,
                 fail_s: float = 0.0):
        """primary: this process clears torn saves when it opens a learner's directory; False in
        the followers of a learner's world, whose leader does it (docs/multihost.md). fail_s:
        run.checkpoint_fail_s (a failed save is logged and retried, checkpoint.Saves)."""
        self.root, self.every, self.keep, self.primary, self.fail_s = root, every, keep, primary, fail_s
        self._managers: dict[int, object] = {}
        self._saves: dict[int, checkpoint.Saves] = {}
        # Orbax managers saving at the same moment from several threads race on their temporary
        # directories (seen on orbax-checkpoint 0.12.8), so threaded learners share a lock and
        # save synchronously; a sequential runtime passes none and saves asynchronously.
        self._lock = lock

    @property
    def enabled(self) -> bool:
        return self.root is not None and self.every > 0

    def _manager(self, m: int):
        if m not in self._managers:
            self._managers[m] = checkpoint.open_manager(self.root / f"learner-{m}", self.keep,
                                                        async_save=self._lock is None, clean=self.primary)
            self._saves[m] = checkpoint.Saves(self._managers[m], f"learner {m} checkpoint", self.fail_s)
        return self._managers[m]

    def maybe_save(self, unit: LearnerUnit, final: bool = False) -> bool:
        """Save after every `every`-th step of the unit, or now if `final` (a learner stopped by a
        signal) unless this step is saved already; True if a save started."""
        step = unit.ls.step
        if not self.enabled or step == 0 or (step % self.every and not final):
            return False
        if final and step in self._manager(unit.learner).all_steps():
            return False
        meta = {"learner": unit.learner, "incarnation": unit.ls.incarnation, "step": step,
                "versions": list(unit.ls.versions)}
        # in a learner's world every process's data=grain position, gathered (all save, in step)
        meta.update(saved_position(unit.spec.train, unit.learner, unit.spec.num_learners, step, world.all_gather))
        self._manager(unit.learner)
        if self._lock is None:
            return self._saves[unit.learner].save(step, unit.state, meta)
        with self._lock:
            return self._saves[unit.learner].save(step, unit.state, meta)

    def latest(self, m: int, target, check: Callable[[int, object, dict], None] | None = None
               ) -> tuple[int, object, dict] | None:
        """The newest of learner m's checkpoints that verifies and that `check(step, state, meta)`
        accepts (it raises for one it does not), or None."""
        if not self.enabled or not (self.root / f"learner-{m}").exists():
            return None
        manager = self._manager(m)
        self._saves[m].settle(fatal=False)
        return checkpoint.restore_latest(manager, target, check)

    def close(self) -> None:
        for saves in self._saves.values():
            saves.close()
        self._managers.clear()
        self._saves.clear()


def staleness(syncer_state: sync.SyncerState, versions: list[int]) -> int:
    """Most versions any fragment has moved past the ones a checkpoint held."""
    return max(fs.version - v for fs, v in zip(syncer_state.fragments, versions))


def usable(m: int, incarnation: int, syncer_state: sync.SyncerState, stopped_at: int
           ) -> Callable[[int, object, dict], None]:
    """A check for `LearnerCheckpoints.latest`: raise `checkpoint.Damaged` for a checkpoint of
    learner m that lacks a field, `checkpoint.Newer` for one not from its past as the syncer knows it."""
    def check(step: int, state, meta: dict) -> None:
        def field(name, kind=int):
            value = meta.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise checkpoint.Damaged(f"meta field {name!r} is {value!r}, not a {kind.__name__}")
            return value

        versions = field("versions", list)
        if len(versions) != len(syncer_state.fragments) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in versions):
            raise checkpoint.Damaged(f"meta field 'versions' is {versions!r}, not "
                                     f"{len(syncer_state.fragments)} fragment versions")
        if field("learner") != m:
            raise checkpoint.Damaged(f"written by learner {meta['learner']}, not {m}")
        if field("step") != step or int(jax.device_get(state.step)) != step:
            raise checkpoint.Damaged(f"saved as step {step}, but its meta says {meta['step']} and its "
                                     f"state {int(jax.device_get(state.step))}")
        # Newer than this learner's past as the syncer knows it: one a stop saved after the last
        # step the syncer booked, one left by a stretch of this run that a resume undid, or one
        # of another run in the same directory. Skipped, and said as information.
        if field("incarnation") >= incarnation:
            raise checkpoint.Newer(f"written by incarnation {meta['incarnation']}, and incarnation "
                                   f"{incarnation} is the one rejoining")
        if step > stopped_at:
            raise checkpoint.Newer(f"it is past step {stopped_at}, where the syncer knows the learner stopped")
        ahead = [(p, v, fs.version) for p, (fs, v) in enumerate(zip(syncer_state.fragments, versions))
                 if v > fs.version]
        if ahead:
            p, v, now = ahead[0]
            raise checkpoint.Newer(f"it holds version {v} of fragment {p}, and the syncer is at {now}")

    return check


def rejoin_unit(setup: Setup, m: int, incarnation: int, syncer_state: sync.SyncerState,
                checkpoints: LearnerCheckpoints, max_staleness: int, fallback_step: int,
                at_least: int = 0) -> tuple[LearnerUnit, Rejoin]:
    """A restarted learner m under `incarnation` at `fallback_step` (where the dead incarnation
    stopped): parameters from the syncer's current Theta; the inner optimizer state from its newest
    checkpoint if fresh enough, else a fresh optimizer. `at_least` moves the step
    forward (runtime.rejoin_at=schedule: take up the step the other learners are at, skipping the
    steps missed while down, so the fragment schedule is in phase with theirs again). A checkpoint
    that cannot be used is skipped (see `usable`); this never raises for one."""
    target = setup.compiled[m % len(setup.compiled)].abstract_state
    resume = max(fallback_step, at_least)
    try:
        found = checkpoints.latest(m, target, usable(m, incarnation, syncer_state, fallback_step))
    except Exception as err:  # noqa: BLE001 - an unreadable directory must not stop the rejoin
        log.warning("learner %d: its checkpoints cannot be read (%s: %s); rejoining fresh from the "
                    "syncer's Theta", m, type(err).__name__, err)
        found = None
    if found is not None:
        step, state, meta = found
        stale = staleness(syncer_state, meta["versions"])
        if stale <= max_staleness:
            # the stream's saved position at the checkpoint; it is taken up from there to `resume`
            restore_position(setup.spec.train, m, setup.spec.num_learners, step, meta)
            unit = new_unit(setup, m, incarnation, syncer_state, resume)
            unit.state = state.replace(params=unit.state.params, step=unit.state.step)
            return unit, Rejoin(m, incarnation, resume, step, stale)
    else:
        stale = -1
    return new_unit(setup, m, incarnation, syncer_state, resume), Rejoin(m, incarnation, resume, None, stale)

