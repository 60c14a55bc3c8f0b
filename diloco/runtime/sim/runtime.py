"""The sim runtime: a virtual clock, modelled learner speeds and links, real JAX steps run one after
another. Deterministic given the config's seeds, so experiments and tests replay exactly.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428); docs/design.md#sim.

Each event is (time, order, kind, data) on a heap. A learner's step takes its modelled time
(step_time x speed x jitter; x rows / data.batch_size for a learner of its own runtime.learner_batch);
a message takes latency + bytes / bandwidth on its learner's link, one message at a time per
direction. The syncer merges in zero virtual time.

With `chaos.enabled`, a failure tape (diloco/chaos/tapes.py) drives the learners in virtual time:
a learner with some slices down steps with a proportionally smaller batch; one with none left (or
removed) dies: what it had not sent is lost, the syncer drops it from the live set and later drops
its old incarnation's messages. When its slices return it restarts for `runtime.restart_s`, rejoins
under a new incarnation from the syncer's current Theta (diloco/runtime/rejoin.py) and fetches a
full copy of every fragment. Scavenged learners are added and removed the same way. A failure
takes effect at the learner's next step boundary: the step in progress finishes.

The entry, `run` (a run's snapshots, outputs and signals), is diloco/runtime/sim/driver.py.
"""

from __future__ import annotations

import heapq
import logging
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from diloco import report
from diloco.algo import hostpool
from diloco.algo import syncer as sync
from diloco.algo.replay import Input
from diloco.chaos import tapes
from diloco.config import TrainConfig
from diloco.evaluation import during_run
from diloco.runtime import events as ev
from diloco.algo.eventlog import LedgerError
from diloco.runtime import keepup
from diloco.runtime.host import HostedRuntime, SyncerHost
from diloco.runtime.stop import RunStopped
from diloco.runtime.rejoin import LearnerCheckpoints, Rejoin, rejoin_unit
from diloco.runtime.build import Setup, new_unit
from diloco.runtime.sim import batched
from diloco.runtime.runlog import InputLog
from diloco.train.profile import Trace

log = logging.getLogger(__name__)


class Sim(HostedRuntime):
    """Event loop state; `run` drives it to the end. One object per run, closed over nothing global."""

    def __init__(self, cfg: TrainConfig, setup: Setup, writer: report.MetricsWriter | None,
                 evaluate: Callable[[dict], float] | None, inputs: InputLog | None = None,
                 tape: tapes.Tape | None = None, checkpoints: LearnerCheckpoints | None = None,
                 trace: Trace | None = None):
        self.cfg, self.writer, self.evaluate = cfg, writer, evaluate
        self.trace = trace or Trace(None, None)  # run.profile: every learner's steps in learner 0's window
        self.tape = tape
        self.checkpoints = checkpoints or LearnerCheckpoints(None, 0)
        r = cfg.runtime
        self.M = r.learners if tape is None else tape.total_learners
        if self.M != r.learners:  # scavenged learners read their own data shards
            setup = setup._replace(spec=setup.spec._replace(num_learners=self.M))
        self.setup = setup
        speeds = list(r.speeds) or [1.0] * r.learners
        self.speeds = list(tape.speeds) if tape is not None else speeds
        self.jitter = tape.jitter if tape is not None else r.jitter
        self.rng = np.random.default_rng([r.seed, 7])
        # learners in step take one vmapped step (docs/design.md#sim); auto: not on the CPU
        self.batched = r.batch_learners == "on" or (r.batch_learners == "auto" and jax.default_backend() != "cpu")
        self.heap: list = []
        self.order = 0
        base = range(r.learners)
        self.host = SyncerHost(setup, {m: 0 for m in base}, inputs,
                               on_deadline=lambda p, at: self.push(at, "deadline", p), transport=self._transmit,
                               pace=keepup.plan(cfg), on_merge=writer.write if writer is not None else None,
                               log_refusals=cfg.run.log_refusals)
        self.units = [new_unit(setup, m, 0, self.host.state) if m in base else None for m in range(self.M)]
        self.alive = {m: m in base for m in range(self.M)}
        self.died_at: dict[int, tuple[float, int]] = {}  # dead learner -> (time, step it stopped at)
        self.rejoins: list[Rejoin] = []
        self.link_up = [0.0] * self.M
        self.link_down = [0.0] * self.M
        self.stalled_since: dict[int, float] = {}
        self.stall_armed: dict[int, int] = {}
        self.waking: set[int] = set()  # learners with a step event on the heap
        self.restarting: set[int] = set()  # learners with a rejoin event on the heap
        self.removed: set[int] = set()  # scavenged learners taken out of the run (not "down")
        self.flushed: set[int] = set()  # learners that sent their final contributions
        self.now = 0.0
        self.steps_done = 0  # inner steps over all learners: when snapshots fall due
        self.interrupted = False  # set by a signal (run()): save a final snapshot, then stop
        self.evals: list[tuple[float, int, float]] = []

    def push(self, t: float, kind: str, *data: Any) -> None:
        self.order += 1  # ties break in push order; a plain int, so snapshots can carry it
        heapq.heappush(self.heap, (t, self.order, kind, data))

    def run(self, snapshots=None, stop: Callable[["Sim"], bool] | None = None) -> dict | None:
        """From the start: the base model's task scores at step 0 (run.eval_tasks), wake every
        learner, queue the tape, then `loop`."""
        if during_run.scores_tasks(self.evaluate) and self.units[0] is not None:
            self._eval(0.0)
        for m in range(self.M):
            if self.alive[m]:
                self._wake(m, 0.0)
        if self.tape is not None:
            for e in self.tape.events:
                self.push(e.time, "chaos", e.learner)
        return self.loop(snapshots, stop)

    def loop(self, snapshots=None, stop: Callable[["Sim"], bool] | None = None) -> dict | None:
        """Process events to the end (a restored sim resumes here). `snapshots` saves the whole
        run now and then; `stop(sim)` after any event ends it early, as a crash would (None)."""
        while self.heap and not (self.heap[0][2] == "chaos" and self._finished()):
            self.now, _, kind, data = heapq.heappop(self.heap)
            if kind == "step":
                self.trace.at(self.units[0].ls.step, [u.state for u in self.units if u is not None])
            getattr(self, f"_on_{kind}")(*data)
            if kind == "step" and snapshots is not None:
                snapshots.maybe_save(self, final=self.interrupted)
            if kind == "step" and self.interrupted:  # Ctrl-C / SIGTERM, at a step boundary
                self.checkpoints.close()
                raise self._stopped(snapshots)
            if stop is not None and stop(self):
                self.checkpoints.close()
                return None
        for m, (at, _) in self.died_at.items():  # still down at the end
            if m in self.removed:
                continue
            self.host.book_time(m, "down", at, max(at, self.now))
        self.checkpoints.close()
        return self.summary()

    def _finished(self) -> bool:
        """Only tape events are left, and none of them can bring back a learner with steps to do:
        the rest of the tape falls after training (a learner not yet added stays out)."""
        if self.restarting or any(k != "chaos" for _, _, k, _ in self.heap):
            return False
        steps = self.cfg.run.steps
        return not any(u is not None and not self.alive[m] and u.ls.step < steps
                       and tapes.next_change(self.tape, m, self.now) < float("inf")
                       for m, u in enumerate(self.units))

    # --- failures (chaos tape) ------------------------------------------------------------------
    def rows_at(self, m: int, t: float | None = None) -> int:
        """Batch rows for learner m's live slices at t (default now; rows of dead slices are
        simply not computed)."""
        b = self.setup.spec.rows_of(m)
        if self.tape is None:
            return b
        return tapes.batch_rows(self.tape, m, self.now if t is None else t, b, self.cfg.runtime.devices_per_learner)

    def _on_chaos(self, m: int) -> None:
        unit = self.units[m]
        if unit is not None and self.alive[m] and unit.ls.step >= self.cfg.run.steps:
            return  # done training: a failure now costs nothing
        live = tapes.is_alive(self.tape, m, self.now)
        if self.alive[m] and not live and m not in self.waking:
            self._kill(m)  # stalled or done: nothing in progress to finish first
        elif not self.alive[m] and live and m not in self.restarting:
            self.restarting.add(m)
            if m in self.died_at and m not in self.removed:  # a scavenged learner was never up
                self.host.book_time(m, "down", self.died_at[m][0], self.now)
            self.removed.discard(m)
            self.push(self.now + self.cfg.runtime.restart_s, "rejoin", m)

    def _kill(self, m: int) -> None:
        unit = self.units[m]
        self.alive[m] = False
        self.died_at[m] = (self.now, unit.ls.step)
        stalls = ((self.stalled_since.pop(m), self.now),) if m in self.stalled_since else ()
        self.stall_armed.pop(m, None)
        if _removed(self.tape, m, self.now):  # scavenging over: gone, not down
            self.removed.add(m)
        self.host.on_event(ev.Died(m, unit.ls.incarnation, self.now, stalls), self.now)

    def _on_rejoin(self, m: int) -> None:
        self.restarting.discard(m)
        start = self.now - self.cfg.runtime.restart_s
        if not tapes.is_alive(self.tape, m, self.now):  # failed again while restarting
            self.host.book_time(m, "restarting", start, self.now)
            self.died_at[m] = (self.now, self.died_at.get(m, (0.0, 0))[1])
            return
        old = self.units[m]
        incarnation = 0 if old is None else old.ls.incarnation + 1
        _, step = self.died_at.pop(m, (0.0, 0))
        unit, how = rejoin_unit(self.setup, m, incarnation, self.host.state, self.checkpoints,
                                self.cfg.runtime.max_rejoin_staleness, step)
        self.units[m], self.alive[m] = unit, True
        self.rejoins.append(how)
        # Its down time was booked when the tape gave its slices back (_on_chaos); restarting since.
        self.host.on_event(ev.Rejoined(m, incarnation, start, start, self.now, how._asdict()), self.now)
        if self.writer is not None:
            self.writer.write({"kind": "rejoin", "time": self.now, **how._asdict()})
        self._wake(m, self.now)

    # --- learners -----------------------------------------------------------------------------
    def _wake(self, m: int, t: float) -> None:
        """Schedule learner m's next step unless one is already scheduled (a fragment arrival and a
        stall limit can fall on the same instant; the learner must still step only once)."""
        if m not in self.waking:
            self.waking.add(m)
            self.push(t, "step", m)

    def _on_step(self, m: int) -> None:
        self.waking.discard(m)
        unit, r = self.units[m], self.cfg.runtime
        if not self.alive[m]:
            return
        if self.tape is not None and not tapes.is_alive(self.tape, m, self.now):
            self._kill(m)
            return
        for q in unit.apply_due():
            self.host.on_event(ev.Applied(m, unit.ls.incarnation, (q.fragment,)), self.now)
        blocked = unit.blocking()
        if blocked is not None:
            if m not in self.stalled_since:
                self.stalled_since[m] = self.now
            if self.stall_armed.get(m) != blocked.seq:  # one limit per blocking send
                self.stall_armed[m] = blocked.seq
                limit = r.stall_limit_steps * r.step_time * self.speeds[m % len(self.speeds)] * self.row_scale(m)
                self.push(self.now + limit, "stall_limit", m, blocked.fragment, blocked.seq)
            return
        if m in self.stalled_since:
            self.host.stalled(m, self.stalled_since.pop(m), self.now)
        if unit.ls.step >= self.cfg.run.steps:
            if self.cfg.fragments.final_sync and m not in self.flushed:
                self.flushed.add(m)
                result = unit.flush()
                self.host.on_event(ev.Flushed(m, unit.ls.incarnation, self.now, ev.pairs(result.sends),
                                              result.frames), self.now, deliver=False)
                self._send(m, unit.ls.incarnation, self.now, result.sends, result.frames)
            self._maybe_finish(m)
            return
        rows = self.rows_at(m)
        steps = [(m, self.now, self.log_due(m), self.duration(m))]
        if self.batched:
            steps += batched.in_step(self, rows, self.now + steps[0][3])
        if len(steps) == 1:
            results = [unit.step(fetch_loss=steps[0][2], rows=rows)]
        else:
            results = batched.step_together([self.units[k] for k, *_ in steps], rows, [lg for _, _, lg, _ in steps])
        for (k, start, lg, duration), result in zip(steps, results):
            self.now = start
            self._stepped(k, result, rows, lg, duration)

    def log_due(self, m: int) -> bool:
        return report.due(self.units[m].ls.step + 1, self.cfg.run.log_every, self.cfg.run.steps)

    def row_scale(self, m: int) -> float:
        """Learner m's step time over that of a step of data.batch_size rows: its rows over those
        (runtime.learner_batch; docs/algorithm.md#unequal-hardware), 1.0 with equal batches."""
        s = self.setup.spec
        return s.rows_of(m) / s.batch_size

    def duration(self, m: int) -> float:
        r = self.cfg.runtime
        return (r.step_time * self.speeds[m % len(self.speeds)] * self.row_scale(m)
                * max(0.1, 1.0 + self.jitter * self.rng.standard_normal()))

    def _stepped(self, m: int, result, rows: int, log: bool, duration: float) -> None:
        """Book learner m's step that began at self.now and send what it sent."""
        unit = self.units[m]
        self.steps_done += 1
        hostpool.release_freed()  # resident memory flat over the run (docs/design.md#syncer-memory)
        self.checkpoints.maybe_save(unit)
        inc = unit.ls.incarnation
        end = self.now + duration
        step = ev.StepDone(m, inc, unit.ls.step, self.now, end, result.tokens, ev.pairs(result.sends),
                           result.frames, loss=result.loss, rows=rows)
        self.host.on_event(step, self.now, deliver=False)  # the modelled link delivers them
        self._send(m, inc, end, result.sends, result.frames)
        if log and self.writer is not None:
            self.writer.write({"kind": "train", "learner": m, "step": unit.ls.step, "time": end,
                               "tokens": unit.ls.step * result.tokens, "loss": result.loss})
        if m == 0 and self.evaluate is not None and report.due(unit.ls.step, self.cfg.run.eval_every,
                                                               self.cfg.run.steps):
            self._eval(end)
        self._wake(m, end)

    def _send(self, m: int, inc: int, end: float, sends, frames) -> None:
        """Ship a step's (or the final flush's) contributions over learner m's link, each with the
        key of its send, so a frame damaged on the way still resolves it."""
        r = self.cfg.runtime
        for (_, seq), frame in zip(ev.pairs(sends), frames):
            start = max(end, self.link_up[m])
            self.link_up[m] = start + len(frame) / r.bandwidth
            self.push(self.link_up[m] + r.latency, "contribution", frame, [m, inc, seq])

    def _maybe_finish(self, m: int) -> None:
        """Tell the syncer learner m finished once it has trained, is not stalled waiting for an
        answer (a broadcast is what wakes it), has flushed and none of its contributions is still on
        its link (the threads and procs runtimes do so on its Done)."""
        unit = self.units[m]
        if (unit is None or not self.alive[m] or unit.ls.step < self.cfg.run.steps or m in self.syncer.finished
                or m in self.stalled_since or (self.cfg.fragments.final_sync and m not in self.flushed)):
            return
        if any(kind == "contribution" and len(data) > 1 and data[1] is not None and data[1][0] == m
               for _, _, kind, data in self.heap):
            return
        self.host.finish(m, unit.ls.incarnation, self.now)

    def _on_stall_limit(self, m: int, fragment: int, seq: int) -> None:
        unit = self.units[m]
        if not self.alive[m]:
            return
        blocked = unit.blocking()
        if m in self.stalled_since and blocked is not None and blocked.seq == seq:
            unit.give_up(fragment)
            self._wake(m, self.now)

    def _on_fragment(self, m: int, frame: bytes) -> None:
        if not self.alive[m]:
            return  # its chips are down; the next incarnation starts from a full copy
        self.units[m].receive(frame)
        if m in self.stalled_since and self.units[m].blocking() is None:
            self._wake(m, self.now)

    # --- syncer -------------------------------------------------------------------------------
    def _on_contribution(self, frame: bytes, sent=None) -> None:
        # sent: a list once through a snapshot's JSON; None in a heap saved before keys travelled
        self.host.deliver(Input("contribution", self.now, frame), sent=None if sent is None else tuple(sent))
        if sent is not None:
            self._maybe_finish(int(sent[0]))

    def _on_deadline(self, p: int) -> None:
        self.host.deliver(Input("deadline", self.now, p))

    def _transmit(self, m: int, frame: bytes, fragment: int, full: bool) -> None:
        """A broadcast leaves over learner m's down link."""
        r = self.cfg.runtime
        start = max(self.now, self.link_down[m])
        self.link_down[m] = start + len(frame) / r.bandwidth
        self.push(self.link_down[m] + r.latency, "fragment", m, frame)

    # --- outputs ------------------------------------------------------------------------------
    def _eval(self, t: float, final: bool = False) -> None:
        theta = sync.theta(self.syncer)
        loss = self.evaluate(theta)
        step = self.units[0].ls.step
        self.evals.append((t, step, loss))
        scores = during_run.fields(self.evaluate, theta, step, final)  # run.eval_tasks, when due
        if self.writer is not None:
            tokens = int(self.tokens.processed[0])
            self.writer.write({"kind": "eval", "step": step, "time": t, "tokens": tokens,
                               "eval_loss": loss, "merges": self.syncer.merges, **scores})

    def summary(self) -> dict:
        return self.host.summary(clock="virtual", end=self.now, window=self.cfg.runtime.step_time, tape=self.tape)

    def _stopped(self, snapshots) -> RunStopped:
        """What an interrupted sim raises: its partial summary, resumable if a final snapshot was
        saved (docs/design.md#stopping-a-run)."""
        try:
            summary = self.summary()
        except LedgerError:  # cannot happen at a step boundary; a stop still must not traceback
            summary = None
        saved = snapshots is not None and snapshots.manager is not None
        run_dir = Path(snapshots.manager.directory).parent if saved else None
        return RunStopped(run_dir, summary, resumable=saved, why_not="" if saved else "it saves no snapshots "
                          "(run.checkpoint_every=0 or no run directory)")


def _removed(tape: tapes.Tape, m: int, t: float) -> bool:
    """Learner m's last tape event by time t took it out of the run (as opposed to failing it)."""
    last = [e.kind for e in tape.events if e.learner == m and e.time <= t]
    return bool(last) and last[-1] == "learner_remove"
