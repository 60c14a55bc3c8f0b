"""The threads runtime: the wall clock, one thread per learner on its own device sub-mesh, a syncer
thread and bounded in-memory queues, driving the learner and syncer state machines as sim does.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428); docs/design.md#threads.

Ownership, so that only the queues are shared: learner m's thread owns LearnerUnit m (its params,
device_put/device_get, codec state); the syncer thread owns the SyncerState, the grace deadlines
and all three ledgers; the main thread evaluates and supervises. Learners book nothing: they send
small events (apply, step, done) through one FIFO queue `up`, which the syncer books as sim does,
in each learner's order. Their stalls (for an overdue fragment, or for room on a full `up`) ride
on the next step or done event. Merged fragments go down through one mailbox per learner, which
never blocks the syncer: a learner that falls behind gets a full copy instead of a backlog.

Shutdown: a learner done with run.steps sends `done` and keeps receiving. When all are done, the
syncer has booked everything (FIFO), fires the pending grace deadlines as they fall due, publishes
those merges and closes the inboxes. An exception in any thread sets a stop event that every
blocking call polls; the main thread joins all threads and re-raises the first error.

Ctrl-C or SIGTERM stops the same way, then saves the run so it can resume (StopAndResume,
diloco/runtime/threads/stopping.py). `run` (diloco/runtime/threads/driver.py) sets a run up and
writes its outputs.

The learner threads' side (LearnerThreads, and the port the shared learner loop drives) is in
diloco/runtime/threads/learners.py; here are the set-up, the syncer thread and the supervision.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from diloco import report
from diloco.algo import quorum
from diloco.algo import syncer as sync
from diloco.algo.replay import Input
from diloco.chaos import tapes
from diloco.config import TrainConfig
from diloco.evaluation import during_run
from diloco.runtime import events as ev
from diloco.runtime.crew import Crew, Stopped
from diloco.runtime import keepup
from diloco.runtime.host import HostedRuntime, SyncerHost
from diloco.runtime.stop import signals_as_interrupt
from diloco.runtime.syncer_ckpt import SyncerCheckpoints
from diloco.runtime.threads.learners import POLL, LearnerThreads
from diloco.runtime.threads.mailbox import Mailbox
from diloco.runtime.threads.stopping import ComeBack, StopAndResume
from diloco.runtime.rejoin import Rejoin
from diloco.runtime.build import Setup
from diloco.runtime.runlog import InputLog
from diloco.runtime.unit import LearnerUnit
from diloco.runtime.walltape import WallTape

log = logging.getLogger(__name__)

JOIN_TIMEOUT = 30.0  # seconds the main thread waits for stopped threads before reporting them stuck


class Threads(StopAndResume, LearnerThreads, HostedRuntime):
    """One run on the wall clock; `run` drives it to the end. Holds no module-level state.

    Each attribute has one writer: units[m] learner m; syncer, tokens, bytes, time, stalls, inputs,
    finished_at, steps, died_at, end and deadlines the syncer thread (the main thread once it has
    ended, at a stop); evals the main thread. Read them after `run`.

    syncer_ckpts: where a stop saves the final syncer checkpoint (None: nowhere, not resumable);
    restored: (state, arrays, meta) of a syncer checkpoint to resume from (`latest_stop`).
    """

    def __init__(self, cfg: TrainConfig, setup: Setup, writer: report.MetricsWriter | None,
                 evaluate: Callable[[dict], float] | None, inputs: InputLog | None = None,
                 checkpoint_dir: Path | None = None, tape: tapes.Tape | None = None,
                 syncer_ckpts: SyncerCheckpoints | None = None, restored: tuple | None = None,
                 run_dir: Path | None = None):
        self.cfg, self.setup, self.evaluate = cfg, setup, evaluate
        self.writer, self._write_lock = writer, threading.Lock()  # learners and main thread write
        r = cfg.runtime
        self.M = r.learners
        self.speeds = list(r.speeds) or [1.0] * self.M
        # A failure tape replayed on the wall clock (chaos.wall_scale wall seconds per tape second):
        # slices lost shrink the batch, a learner with none left crashes and restarts once its
        # slices are back. Its speeds and jitter replace the runtime's, as in sim.
        self.tape = WallTape.of(cfg, tape)
        self.jitter = r.jitter if tape is None else tape.jitter
        if tape is not None:
            self.speeds = list(tape.speeds[:self.M])
        self.host = SyncerHost(setup, {m: 0 for m in range(self.M)}, inputs, on_deadline=self._arm,
                               transport=self._transmit, on_step=self._on_step, pace=keepup.plan(cfg),
                               on_merge=self._write, log_refusals=cfg.run.log_refusals)
        self.run_dir, self.syncer_ckpts = run_dir, syncer_ckpts
        # Each learner thread builds its own unit (device_put of its params) from this initial state.
        self.units: list[LearnerUnit | None] = [None] * self.M
        self.checkpoint_dir = checkpoint_dir  # learner checkpoints, one Orbax manager per thread
        self.kills: set[int] = set()  # learners asked to crash (tests, fault drills)
        self._ckpt_lock = threading.Lock()
        self.rejoins: list[Rejoin] = []
        self.evals: list[tuple[float, int, float]] = []
        self.steps = dict.fromkeys(range(self.M), 0)  # learner -> its last step booked
        self.died_at: dict[int, float] = {}  # learner -> clock time of its last death booked
        self.offset = 0.0  # the clock when the learners start: where a resumed run's stopped one ended
        self.stopped_at = 0.0  # the clock when a signal (or an error) stopped the run
        self.end = 0.0  # clock time when the syncer published its last merge (or the run stopped)
        self.deadlines: list[tuple[float, int, int]] = []  # grace timers (at, order, fragment), a heap
        self._order = 0
        self.comeback: dict[int, ComeBack] = {}
        self.up: queue.Queue = queue.Queue(maxsize=r.queue_size)
        self.leftover: list[ev.Event] = []  # events learners could not queue once the stop was set
        self._booking_stop = False  # the main thread books what is left: no eval requests then
        self.inboxes = [Mailbox(r.queue_size) for _ in range(self.M)]
        self.eval_requests: queue.Queue = queue.Queue(maxsize=r.queue_size)
        if restored is not None:
            self._restore(*restored)
        self.initial = self.host.state  # every learner starts from the syncer's Theta, never its own init
        learners = [m for m in range(self.M) if m not in self.host.done]
        # Learners compile before the clock starts; the last one to arrive starts it.
        self.ready = threading.Barrier(len(learners), action=self._start_clock) if learners else None
        self.t0 = time.monotonic() - self.offset
        # learners still compiling or waiting for the others at the barrier get out on a stop too
        self.crew = Crew(on_stop=self.ready.abort if self.ready else lambda: None, join_timeout=JOIN_TIMEOUT)
        self.stop = self.crew.stop
        for m in learners:
            self.crew.add(f"diloco-learner-{m}", self._learner, m)
        self.crew.add("diloco-syncer", self._syncer_loop)
        self._syncer_thread = self.crew.threads[-1]

    @property
    def finished_at(self) -> dict[int, float]:
        """learner -> clock time of its `done`."""
        return self.host.finished_at

    def clock(self) -> float:
        return time.monotonic() - self.t0

    def kill(self, m: int) -> None:
        """Crash learner m at its next check (thread-safe): everything it has not sent is lost; it
        restarts after runtime.restart_s as a new incarnation, from the syncer's current Theta."""
        self.kills.add(m)

    def _start_clock(self) -> None:
        self.t0 = time.monotonic() - self.offset

    # --- supervision (main thread) ------------------------------------------------------------
    def run(self) -> dict:
        """To the end; an error in any thread is re-raised, a Ctrl-C or SIGTERM raises RunStopped
        once the stop is saved. A second one while stopping forces it (crew.py)."""
        with signals_as_interrupt():
            try:
                if self.ready is None:  # every learner was done before a resume: only the syncer runs
                    self._start_clock()
                self.crew.start()
                self._supervise()
            except BaseException as e:  # Ctrl-C/SIGTERM, or an error in `evaluate`: stop all, re-raise
                self.stopped_at = self.clock()
                self.crew.fail(e)
            finally:
                self.crew.join([self._syncer_thread])  # first: it ends within a poll, and owns the host
                self.crew.join()
            if isinstance(self.crew.error, KeyboardInterrupt):
                raise self._stopped() from None
        if self.crew.error is not None:
            raise self.crew.error
        return self.summary()

    def _supervise(self) -> None:
        while not self.stop.is_set():
            alive = self.crew.alive()
            try:
                request = self.eval_requests.get(timeout=POLL)
            except queue.Empty:
                if not alive:  # checked before the get, so a last request is never left behind
                    return
                continue
            self._eval(*request)

    # --- syncer -------------------------------------------------------------------------------
    def _syncer_loop(self) -> None:
        deadlines, done = self.deadlines, self.host.done
        while True:
            if self.stop.is_set():
                raise Stopped
            now = self.clock()
            while deadlines and deadlines[0][0] <= now:
                _, _, p = heapq.heappop(deadlines)
                self.host.deliver(Input("deadline", now, p))
            if len(done) == self.M and not deadlines and self.up.empty():
                break  # `done` is each learner's last event, so everything has been booked
            wait = POLL if not deadlines else min(POLL, max(0.0, deadlines[0][0] - now))
            try:
                event = self.up.get(timeout=wait) if wait > 0 else self.up.get_nowait()
            except queue.Empty:
                continue
            self._on_event(event, self.clock())
        self.end = self.clock()
        for inbox in self.inboxes:
            inbox.close()

    def _on_event(self, event: ev.Event, now: float) -> None:
        """Book one learner event (the host's rules) at `now`, and where each learner stopped or died."""
        self.host.on_event(event, now)
        if isinstance(event, ev.StepDone):
            self.steps[event.learner] = max(self.steps[event.learner], event.step)
        elif isinstance(event, ev.Rejoined):
            self.steps[event.learner] = event.rejoin["step"]
        elif isinstance(event, ev.Died):
            self.died_at[event.learner] = event.at

    def _on_step(self, e: ev.StepDone) -> None:
        if self._booking_stop:  # the supervisor is gone: nobody evaluates any more
            return
        if e.learner == 0 and self.evaluate is not None and report.due(e.step, self.cfg.run.eval_every,
                                                                       self.cfg.run.steps):
            # As in sim: the global model as it stood when learner 0 finished the step.
            host = self.host
            self._put(self.eval_requests, (e.end, e.step, sync.theta(host.state),
                                           int(host.tokens.processed[0]), host.state.merges))

    def _arm(self, p: int, at: float) -> None:
        heapq.heappush(self.deadlines, (at, self._order, p))
        self._order += 1

    def _transmit(self, m: int, frame: bytes, p: int, full: bool) -> None:
        extra = self.inboxes[m].put(p, frame, self._catch_up)
        if extra:  # a learner behind: its queued deltas became one full copy
            self.host.extra_down(m, self.clock(), extra, p)

    def _catch_up(self, p: int, merged: tuple) -> bytes:
        return sync.full_frame(self.host.state, p, merged)

    def _put(self, q: queue.Queue, item: Any) -> None:
        while True:
            if self.stop.is_set():
                raise Stopped
            try:
                q.put(item, timeout=POLL)
                return
            except queue.Full:
                pass

    # --- outputs ------------------------------------------------------------------------------
    def _write(self, record: dict) -> None:
        if self.writer is not None:
            with self._write_lock:
                self.writer.write(record)

    def _eval(self, t: float, step: int, theta: dict, tokens: int, merges: int, final: bool = False) -> None:
        theta = {path: np.array(x, copy=True) for path, x in theta.items()}  # copy on receive
        loss = self.evaluate(theta)
        self.evals.append((t, step, loss))
        self._write({"kind": "eval", "step": step, "time": t, "tokens": tokens,
                     "eval_loss": loss, "merges": merges, **during_run.fields(self.evaluate, theta, step, final)})

    def summary(self) -> dict:
        # Peak rates over windows of one (slowest measured) step, as sim uses its modelled step time.
        window = quorum.slowest_step_time(self.syncer.step_times) or self.cfg.runtime.step_time
        tape = {} if self.tape is None else {"tape": self.tape.tape, "scale": self.tape.scale}
        return self.host.summary(clock="wall", end=self.end, window=window, **tape)
