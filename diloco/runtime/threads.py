"""The threads runtime: the wall clock, one thread per learner on its own device sub-mesh, a syncer
thread and bounded in-memory queues, driving the learner and syncer state machines as sim does.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428); DESIGN.md "Runtimes".

Ownership, so that only the queues are shared: learner m's thread owns LearnerUnit m (its params,
device_put/device_get, codec state); the syncer thread owns the SyncerState, the grace deadlines
and all three ledgers; the main thread evaluates and supervises. Learners book nothing: they send
small events (apply, step, done) through one FIFO queue `up`, which the syncer books as sim does,
in each learner's order. Their stalls (for an overdue fragment, or for room on a full `up`) ride
on the next step or done event. Merged fragments go down through one mailbox per learner, which
never blocks the syncer: a learner that falls behind gets a full copy instead of a backlog.

Shutdown: a learner done with run.steps sends `done` and keeps receiving. When all are done, the
syncer has booked everything (FIFO), fires the pending grace deadlines as they fall due, publishes
those merges and closes the inboxes. Ctrl-C or an exception in any thread sets a stop event that
every blocking call polls; the main thread joins all threads and re-raises the first error.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from diloco import report
from diloco.algo import ledger, quorum, timeline, traffic
from diloco.algo import syncer as sync
from diloco.algo.replay import Input, apply as deliver
from diloco.config import TrainConfig
from diloco.data import batch_at
from diloco.runtime.mailbox import Mailbox
from diloco.runtime.setup import Setup, new_unit
from diloco.runtime.summary import run_summary
from diloco.runtime.tape import InputLog, run_outputs, write_decisions
from diloco.runtime.unit import LearnerUnit

POLL = 0.05  # seconds: the longest any thread blocks before looking at the stop event again
JOIN_TIMEOUT = 30.0  # seconds the main thread waits for stopped threads before reporting them stuck


class _Stopped(Exception):
    """Raised inside a worker thread when the run is stopping; ends the thread quietly."""


class Threads:
    """One run on the wall clock; `run` drives it to the end. Holds no module-level state.

    Each attribute has one writer: units[m] learner m; syncer, tokens, bytes, time, stalls, inputs,
    finished_at, end and deadlines the syncer thread; evals the main thread. Read them after `run`.
    """

    def __init__(self, cfg: TrainConfig, setup: Setup, writer: report.MetricsWriter | None,
                 evaluate: Callable[[dict], float] | None, inputs: InputLog | None = None):
        self.cfg, self.setup, self.evaluate = cfg, setup, evaluate
        self.inputs = inputs  # every syncer input, in delivery order, with its wall-clock time
        self.writer, self._write_lock = writer, threading.Lock()  # learners and main thread write
        r = cfg.runtime
        self.M = r.learners
        self.speeds = list(r.speeds) or [1.0] * self.M
        self.syncer = sync.init(setup.policy, setup.fragments, setup.theta0, {m: 0 for m in range(self.M)})
        self.initial = self.syncer  # every learner starts from Theta_0, never from its own init
        # Each learner thread builds its own unit (device_put of its params) from this initial state.
        self.units: list[LearnerUnit | None] = [None] * self.M
        self.tokens = ledger.token_ledger(len(setup.fragments))
        self.bytes = traffic.byte_ledger()
        self.time = timeline.time_ledger()
        self.stalls = 0
        self.evals: list[tuple[float, int, float]] = []
        self.finished_at: dict[int, float] = {}  # learner -> clock time of its `done`
        self.end = 0.0  # clock time when the syncer published its last merge
        self.deadlines: list[tuple[float, int, int]] = []  # grace timers (at, order, fragment), a heap
        self._order = itertools.count()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._error_lock = threading.Lock()
        self.up: queue.Queue = queue.Queue(maxsize=r.queue_size)
        self.inboxes = [Mailbox(r.queue_size) for _ in range(self.M)]
        self.eval_requests: queue.Queue = queue.Queue(maxsize=r.queue_size)
        # Learners compile before the clock starts; the last one to arrive starts it.
        self.ready = threading.Barrier(self.M, action=self._start_clock)
        self.t0 = time.monotonic()
        bodies = [(f"diloco-learner-{m}", self._learner, (m,)) for m in range(self.M)]
        self.threads = [threading.Thread(target=self._guard, args=(body, *args), name=name, daemon=False)
                        for name, body, args in bodies + [("diloco-syncer", self._syncer_loop, ())]]

    def clock(self) -> float:
        return time.monotonic() - self.t0

    def _start_clock(self) -> None:
        self.t0 = time.monotonic()

    # --- supervision (main thread) ------------------------------------------------------------
    def run(self) -> dict:
        try:
            for t in self.threads:
                t.start()
            self._supervise()
        except BaseException as e:  # Ctrl-C, or an error in `evaluate`: stop everything, then re-raise
            self._fail(e)
        finally:
            self._join()
        if self.error is not None:
            raise self.error
        return self.summary()

    def _supervise(self) -> None:
        while not self.stop.is_set():
            alive = any(t.is_alive() for t in self.threads)
            try:
                request = self.eval_requests.get(timeout=POLL)
            except queue.Empty:
                if not alive:  # checked before the get, so a last request is never left behind
                    return
                continue
            self._eval(*request)

    def _guard(self, body: Callable, *args: Any) -> None:
        try:
            body(*args)
        except (_Stopped, threading.BrokenBarrierError):  # only raised once the stop is set
            pass
        except BaseException as e:
            self._fail(e)

    def _fail(self, error: BaseException) -> None:
        with self._error_lock:
            if self.error is None:
                error.add_note(f"raised in thread {threading.current_thread().name} of the threads runtime")
                self.error = error
        self.stop.set()
        self.ready.abort()  # learners still compiling or waiting for the others get out too

    def _join(self) -> None:
        limit = time.monotonic() + JOIN_TIMEOUT
        for t in self.threads:
            while t.ident is not None and t.is_alive() and time.monotonic() < limit:
                try:
                    t.join(max(0.0, limit - time.monotonic()))
                except KeyboardInterrupt as e:  # another Ctrl-C: keep waiting for the stopping threads
                    self._fail(e)
        stuck = [t.name for t in self.threads if t.is_alive()]
        if stuck:
            message = f"threads {stuck} still running {JOIN_TIMEOUT:.0f} s after the stop"
            if self.error is None:
                self.error = RuntimeError(message)
            else:
                self.error.add_note(message)

    # --- learners -----------------------------------------------------------------------------
    def _learner(self, m: int) -> None:
        r, steps = self.cfg.runtime, self.cfg.run.steps
        unit = self.units[m] = new_unit(self.setup, m, 0, self.initial)
        _warm_up(unit)
        self.ready.wait()
        rng = np.random.default_rng([r.seed, 7, m])
        times = quorum.StepTimes()  # this learner's step-time EMA, for its stall limit
        stall_start: float | None = None
        limit: tuple[int, float] | None = None  # (seq waited for, clock time to give up)
        stalls: list[tuple[float, float]] = []  # booked with the next step (or done) event
        while True:
            self._drain(m)
            ready = unit.apply_due()
            if ready:
                waited = self._emit(m, ("apply", m, unit.ls.incarnation, tuple(q.fragment for q in ready)))
                if waited is not None and stall_start is None:  # inside a stall it is part of it
                    stalls.append(waited)
            blocked = unit.blocking()
            if blocked is not None:
                now = self.clock()
                if stall_start is None:
                    stall_start = now
                if limit is None or limit[0] != blocked.seq:  # each overdue send gets its own limit
                    limit = (blocked.seq, now + r.stall_limit_steps * quorum.slowest_step_time(times, [m]))
                if now >= limit[1]:
                    unit.give_up(blocked.fragment)
                else:
                    self._receive(m, min(POLL, limit[1] - now))
                continue
            if stall_start is not None:
                stalls.append((stall_start, self.clock()))
                stall_start = limit = None
            if unit.ls.step >= steps:
                break
            start = self.clock()
            log = report.due(unit.ls.step + 1, self.cfg.run.log_every, steps)
            result = unit.step(fetch_loss=log)
            jax.block_until_ready(unit.state)  # dispatch is asynchronous: time the step, not its launch
            compute = self.clock() - start
            # A learner with speed factor s sleeps (s - 1) x its compute time (x jitter), so a
            # heterogeneous run works on one real clock; factors below 1 cannot speed a step up.
            factor = self.speeds[m] * max(0.1, 1.0 + r.jitter * rng.standard_normal())
            self._idle(m, start + factor * compute)
            end = self.clock()
            times = quorum.observe_step_time(times, m, end - start)
            event = ("step", m, unit.ls.incarnation, unit.ls.step, start, end, result.tokens, result.sends,
                     result.frames, tuple(stalls))
            stalls.clear()
            waited = self._emit(m, event)
            if waited is not None:
                stalls.append(waited)
            if log:
                self._write({"kind": "train", "learner": m, "step": unit.ls.step, "time": end,
                             "tokens": unit.ls.step * result.tokens, "loss": result.loss})
        if self.cfg.fragments.final_sync:
            result = unit.flush()
            self._emit(m, ("flush", m, unit.ls.incarnation, self.clock(), result.sends, result.frames))
        self._emit(m, ("done", m, self.clock(), tuple(stalls)))
        while self._receive(m, POLL):  # broadcasts keep coming until the syncer closes the inbox
            pass

    def _receive(self, m: int, timeout: float) -> bool:
        """Take at most one frame from learner m's inbox; False once the syncer has closed it."""
        if self.stop.is_set():
            raise _Stopped
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

    def _idle(self, m: int, until: float) -> None:
        """The artificial slowdown: wait until `until`, receiving broadcasts as they come."""
        while (left := until - self.clock()) > 0:
            self._receive(m, min(POLL, left))

    def _emit(self, m: int, event: tuple) -> tuple[float, float] | None:
        """Put an event on the bounded `up` queue; returns the (start, end) of the wait if it was
        full, which the learner books as a stall (it cannot go on until the syncer catches up).
        While it waits it keeps taking broadcasts, so they do not pile up into catch-up copies."""
        try:
            self.up.put_nowait(event)
            return None
        except queue.Full:
            start = self.clock()
        while True:
            if self.stop.is_set():
                raise _Stopped
            self._drain(m)
            try:
                self.up.put(event, timeout=POLL)
                return start, self.clock()
            except queue.Full:
                pass

    # --- syncer -------------------------------------------------------------------------------
    def _syncer_loop(self) -> None:
        deadlines, done = self.deadlines, set()
        while True:
            if self.stop.is_set():
                raise _Stopped
            now = self.clock()
            while deadlines and deadlines[0][0] <= now:
                _, _, p = heapq.heappop(deadlines)
                self._deliver(Input("deadline", now, p))
            if len(done) == self.M and not deadlines and self.up.empty():
                break  # `done` is each learner's last event, so everything has been booked
            wait = POLL if not deadlines else min(POLL, max(0.0, deadlines[0][0] - now))
            try:
                event = self.up.get(timeout=wait) if wait > 0 else self.up.get_nowait()
            except queue.Empty:
                continue
            self._on_event(event, done)
        self.end = self.clock()
        for inbox in self.inboxes:
            inbox.close()

    def _on_event(self, event: tuple, done: set[int]) -> None:
        kind = event[0]
        if kind == "step":
            _, m, inc, step, start, end, tokens, sends, frames, stalls = event
            self._book_stalls(m, stalls)
            self.time = timeline.add_time(self.time, m, "compute", start, end)
            self.tokens = ledger.process(self.tokens, m, inc, tokens)
            self._deliver(Input("step_time", self.clock(), (m, end - start)))
            if m == 0 and self.evaluate is not None and report.due(step, self.cfg.run.eval_every,
                                                                   self.cfg.run.steps):
                # As in sim: the global model as it stood when learner 0 finished the step.
                self._put(self.eval_requests, (end, step, sync.theta(self.syncer),
                                               int(self.tokens.processed[0]), self.syncer.merges))
            self._ship(m, inc, end, sends, frames)
        elif kind == "flush":
            _, m, inc, at, sends, frames = event
            self._ship(m, inc, at, sends, frames)
        elif kind == "apply":
            _, m, inc, fragments = event
            for p in fragments:
                self.tokens = ledger.apply(self.tokens, m, inc, p)
        elif kind == "done":
            _, m, at, stalls = event
            self._book_stalls(m, stalls)
            done.add(m)
            self.finished_at[m] = at
        else:
            raise ValueError(f"unknown event {kind!r} from a learner")

    def _ship(self, m: int, inc: int, at: float, sends: tuple, frames: tuple) -> None:
        for send, frame in zip(sends, frames):
            self.tokens = ledger.send(self.tokens, m, inc, send.fragment, send.seq)
            self.bytes = traffic.add_bytes(self.bytes, at, len(frame), "up", m, send.fragment,
                                          self.setup.spec.up_spec)
            self._deliver(Input("contribution", self.clock(), bytes(frame)))

    def _deliver(self, event: Input) -> None:
        if self.inputs is not None:
            self.inputs.append(event)
        self.syncer, actions = deliver(self.setup.policy, self.syncer, event)
        self._act(actions)

    def _book_stalls(self, m: int, stalls: tuple[tuple[float, float], ...]) -> None:
        for start, end in stalls:
            self.time = timeline.add_time(self.time, m, "stall", start, end)
            self.stalls += 1

    def _act(self, actions: tuple) -> None:
        for a in actions:
            if isinstance(a, sync.SetDeadline):
                heapq.heappush(self.deadlines, (a.at, next(self._order), a.fragment))
            elif isinstance(a, sync.Outcome) and a.key is not None:
                self.tokens = ledger.resolve(self.tokens, a.key, a.outcome, a.into)
            elif isinstance(a, sync.Publish):
                now = self.clock()
                for m, frame in sorted(a.frames.items()):
                    codec = "fp32" if m in a.full else self.setup.policy.down_spec
                    self.bytes = traffic.add_bytes(self.bytes, now, len(frame), "down", m, a.fragment, codec)
                    extra = self.inboxes[m].put(a.fragment, frame, self._catch_up)
                    if extra:  # a learner behind: its queued deltas became one full copy
                        self.bytes = traffic.add_bytes(self.bytes, now, extra, "down", m, a.fragment, "fp32")

    def _catch_up(self, p: int, merged: tuple) -> bytes:
        return sync.full_frame(self.syncer, p, merged)

    def _put(self, q: queue.Queue, item: Any) -> None:
        while True:
            if self.stop.is_set():
                raise _Stopped
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

    def _eval(self, t: float, step: int, theta: dict, tokens: int, merges: int) -> None:
        theta = {path: np.array(x, copy=True) for path, x in theta.items()}  # copy on receive
        loss = self.evaluate(theta)
        self.evals.append((t, step, loss))
        self._write({"kind": "eval", "step": step, "time": t, "tokens": tokens,
                           "eval_loss": loss, "merges": merges})

    def summary(self) -> dict:
        # Peak rates over windows of one (slowest measured) step, as sim uses its modelled step time.
        window = quorum.slowest_step_time(self.syncer.step_times) or self.cfg.runtime.step_time
        return run_summary(self.syncer, self.tokens, self.bytes, self.time, clock="wall",
                           end=self.end, window=window, stalls=self.stalls)


def _warm_up(unit: LearnerUnit) -> None:
    """Compile the inner step before the clock starts, on a copy of the state (the step donates
    its input), so step times, speed factors and the time ledger measure steps, not XLA."""
    c, s = unit.compiled, unit.spec
    state = jax.device_put(unit.state, c.state_sharding, may_alias=False)
    batch = batch_at(s.train_tokens, seed=s.seed, learner=unit.learner, num_learners=s.num_learners,
                     step=0, batch_size=s.batch_size, seq_len=s.seq_len)
    jax.block_until_ready(c.train_step(state, jax.device_put(batch, c.batch_sharding)))


def run(cfg: TrainConfig, setup: Setup, run_dir: Path | None,
        evaluate: Callable[[dict], float] | None) -> tuple[Threads, dict]:
    """Run Decoupled DiLoCo on the wall clock; returns the finished runtime (for its state) and a
    summary with the same keys as sim's."""
    with run_outputs(run_dir) as (writer, inputs):
        rt = Threads(cfg, setup, writer, evaluate, inputs)
        summary = rt.run()  # every thread has been joined when it returns or raises
        if evaluate is not None:
            rt._eval(rt.end, rt.units[0].ls.step, sync.theta(rt.syncer), int(rt.tokens.processed[0]),
                     rt.syncer.merges)
            summary["eval_loss"] = rt.evals[-1][2]
        if run_dir is not None:
            write_decisions(run_dir / "tape.jsonl", rt.syncer.tape)
        return rt, summary
