"""The learner side of the threads runtime: what runs on learner m's thread (its incarnations one
after another, a crash and the comeback through the rejoin rule, its inbox of broadcasts and its
events on the `up` queue), and the port the shared wall-clock loop (diloco/runtime/learner_loop.py)
drives it through.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428); docs/design.md#threads.

LearnerThreads is a part of diloco.runtime.threads.runtime.Threads, which holds the attributes these
methods read and write (units, inboxes, up, stop, tape, host, ...): learner m's thread alone writes
units[m], and it shares only the queues, the mailboxes and the stop event with the others.
"""

from __future__ import annotations

import queue

from diloco.runtime import events as ev
from diloco.runtime.build import new_unit
from diloco.runtime.crew import Stopped
from diloco.runtime.learner_loop import run_incarnation
from diloco.runtime.pace import Pace, StallWatch
from diloco.runtime.rejoin import LearnerCheckpoints, rejoin_unit
from diloco.runtime.unit import LearnerUnit
from diloco.train import profile

POLL = 0.05  # seconds: the longest any thread blocks before looking at the stop event again


class _Killed(Exception):
    """Raised inside learner m's thread after `kill(m)`: the learner crashes at once."""


class LearnerThreads:
    """Learner m's thread of Threads (diloco/runtime/threads/runtime.py)."""

    def _learner(self, m: int) -> None:
        """Learner m's thread: its incarnations one after another, each until done or killed; in a
        resumed run it first comes back as after a crash, from the restored syncer's Theta."""
        r = self.cfg.runtime
        ckpts = LearnerCheckpoints(self.checkpoint_dir, r.learner_checkpoint_every, lock=self._ckpt_lock,
                                   fail_s=self.cfg.run.checkpoint_fail_s)
        plan = self.comeback.get(m)
        unit = self.units[m] = new_unit(self.setup, m, 0 if plan is None else plan.incarnation, self.initial)
        unit.warm_up(*(() if self.tape is None else self.tape.smaller_batches(m)))
        self.ready.wait()
        try:
            if plan is not None:  # no runtime.restart_s: the real restart happened off the clock
                unit = self._come_back(m, plan.incarnation, plan.step, ckpts, plan.died_at, 0.0, resumed=True)
            while True:
                try:
                    return self._incarnation(m, unit, ckpts)
                except _Killed as killed:
                    unit = self._restart(m, unit, ckpts, killed.args[0])
        finally:
            if isinstance(self.crew.error, KeyboardInterrupt):  # Ctrl-C / SIGTERM: a final checkpoint
                ckpts.maybe_save(self.units[m], final=True)
            ckpts.close()

    def _restart(self, m: int, dead: LearnerUnit, ckpts: LearnerCheckpoints, stalls: tuple) -> LearnerUnit:
        """The crash and the restart, as the syncer sees them: `died`, down, restarting, `rejoin`."""
        self.kills.discard(m)
        died_at = self.clock()
        self._emit(m, ev.Died(m, dead.ls.incarnation, died_at, stalls))
        return self._come_back(m, dead.ls.incarnation + 1, dead.ls.step, ckpts, died_at, self.cfg.runtime.restart_s)

    def _come_back(self, m: int, incarnation: int, stopped_at: int, ckpts: LearnerCheckpoints, died_at: float,
                   restart_s: float, resumed: bool = False) -> LearnerUnit:
        """Learner m back as `incarnation` through the rejoin rule (after a crash, or in a resumed
        run): down until its tape gives a slice back, restarting for `restart_s`, then `rejoin`."""
        restart_at = died_at  # in a kill drill the devices are back at once: restarting, never down
        if self.tape is not None:  # down until the tape gives a slice back
            restart_at = self._sleep(self.tape.back_at(m, died_at))
        self._sleep(restart_at + restart_s)
        r = self.cfg.runtime
        at_least = Pace.rejoin_step(r.step_period_s, r.rejoin_at, self.clock(), self.speeds[m], self.cfg.run.steps,
                                    resumed)
        unit, how = rejoin_unit(self.setup, m, incarnation, self.host.state, ckpts,
                                r.max_rejoin_staleness, stopped_at, at_least)
        self.units[m] = unit
        self.rejoins.append(how)
        self._emit(m, ev.Rejoined(m, how.incarnation, died_at, restart_at, self.clock(), how._asdict()))
        self._write({"kind": "rejoin", "time": self.clock(), **how._asdict()})
        return unit

    def _sleep(self, until: float) -> float:
        while (left := until - self.clock()) > 0:
            if self.stop.wait(min(POLL, left)):
                raise Stopped
        return self.clock()

    def _incarnation(self, m: int, unit: LearnerUnit, ckpts: LearnerCheckpoints) -> None:
        try:
            with profile.for_run(self.cfg, self.run_dir, m) as trace:  # learner 0's, docs/design.md#profiling-a-run
                run_incarnation(_ThreadPort(self, m), unit, self.cfg, self.speeds[m], self.jitter, self.tape, ckpts,
                                trace)
        finally:  # an incarnation that ends early (an error, a kill) leaves no frame thread running
            unit.drain()
        while self._receive(m, POLL):  # broadcasts keep coming until the syncer closes the inbox
            pass

    def _receive(self, m: int, timeout: float) -> bool:
        """Take at most one frame from learner m's inbox; False once the syncer has closed it."""
        if self.stop.is_set():
            raise Stopped
        frame = self.inboxes[m].get(timeout)
        if frame is False:
            return True
        if frame is None:  # closed: the syncer has published its last merge
            return False
        # Copy on receive: bytes(frame) is the frame itself when it is bytes (immutable, nothing
        # to copy) and a real copy of a bytearray/memoryview. A runtime handing over numpy arrays
        # would have to np.array(x, copy=True) here, since the sender may reuse its buffers.
        self.units[m].receive(bytes(frame))
        return True

    def _drain(self, m: int) -> None:
        while not self.inboxes[m].empty():
            self._receive(m, 0.0)

    def _emit(self, m: int, event: ev.Event) -> tuple[float, float] | None:
        """Put an event on the bounded `up` queue; returns the (start, end) of the wait if it was
        full, which the learner books as a stall (it cannot go on until the syncer catches up).
        While it waits it keeps taking broadcasts, so they do not pile up into catch-up copies.
        Once the run is stopping the event is left for the main thread to book (`_stopped`)."""
        if self.stop.is_set():
            self.leftover.append(event)
            raise Stopped
        try:
            self.up.put_nowait(event)
            return None
        except queue.Full:
            start = self.clock()
        while True:
            if self.stop.is_set():
                self.leftover.append(event)
                raise Stopped
            self._drain(m)
            try:
                self.up.put(event, timeout=POLL)
                return start, self.clock()
            except queue.Full:
                pass


class _ThreadPort:
    """Learner m's side of the threads runtime, for the shared loop (diloco/runtime/learner_loop.py)."""

    leader = True  # a threads learner is one thread of this process

    def __init__(self, rt, m: int):
        """rt: the Threads runtime (diloco/runtime/threads/runtime.py) learner m runs in."""
        self.rt, self.m = rt, m

    def agree(self, decision: dict | None) -> dict:
        return decision

    def clock(self) -> float:
        return self.rt.clock()

    def poll(self, unit: LearnerUnit) -> None:
        self.rt._drain(self.m)

    def wait(self, unit: LearnerUnit, until: float) -> None:
        self.rt._receive(self.m, max(0.0, min(POLL, until - self.clock())))

    def emit(self, event: ev.Event) -> tuple[float, float] | None:
        return self.rt._emit(self.m, event)

    def check(self, unit: LearnerUnit, watch: StallWatch) -> bool:
        rt, m = self.rt, self.m
        if m in rt.kills or (rt.tape is not None and not rt.tape.alive(m, rt.clock())):
            raise _Killed(watch.take(rt.clock()))
        return False

    def log(self, record: dict) -> None:
        self.rt._write(record)
