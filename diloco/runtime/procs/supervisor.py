"""The procs runtime's supervisor: learner processes and a syncer process, started by a Launcher
(diloco/runtime/interfaces.py), and this process supervising them: incarnations and restarts,
the syncer's reports, evaluation, stop and resume. All traffic goes through an object store
(diloco/store/): file:// by default, gs:// or s3:// by `runtime.store.url`.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), section 6 (a failed learner is
absent from quorums while the global model advances; it rejoins from the syncer's state);
docs/design.md#procs (real kill -9 fault tests; multi-host over a shared bucket).

Who does what: learner m's process (procs/learner.py) trains on its own device sub-mesh and
writes contributions and an event stream; the syncer process (procs/syncer.py) books the events,
merges and publishes; this process writes Theta_0 and the run control (procs/theta0.py), has its
launcher start the children (procs/launch.py on this machine, ray_runtime.py as Ray actors,
procs/standalone.py for learners a scheduler starts), evaluates the global model when the syncer
asks, writes metrics.jsonl, and watches exits: a learner or syncer that dies by a signal comes
back as its next incarnation (the syncer from its checkpoint and journal, procs/recovery.py), a
Python error in one fails the run. SIGINT or SIGTERM stops every child at its next step boundary
and `run.resume=true` continues the run. The rules, and why: docs/design.md#procs and
docs/design.md#stopping-a-run.

Past 400 lines on purpose: one class whose start paths, restarts, report reading and stop all
read and change the same incarnation, report and stop state; split apart they would pass the
whole supervisor around.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Callable

from diloco import report
from diloco import store as bs
from diloco.config import ConfigError, TrainConfig, to_dict
from diloco.evaluation import during_run
from diloco.runtime.interfaces import Child, Launcher, RunSpec
from diloco.runtime.procs.child import EXIT_DOWN, PREFIXES, buried, died, keep_secret, note_ignored
from diloco.runtime.procs import theta0
from diloco.runtime.procs.recovery import restartable
from diloco.runtime.procs.reports import Unauthenticated, read_report, rep_key, report_theta, verified_after
from diloco.runtime.build import Setup, auth_secret
from diloco.runtime.stop import RunStopped, signals_as_interrupt
from diloco.store import network

log = logging.getLogger(__name__)

POLL = 0.05  # seconds the supervisor waits for a process exit before reading reports again
JOIN_TIMEOUT = 30.0  # seconds a stopping child gets before it is killed
# A stopping syncer books what the learners wrote, saves its final checkpoint and reports: on a
# loaded machine that took more than JOIN_TIMEOUT once, and the stop lost its partial summary.
SYNCER_STOP_TIMEOUT = 120.0
MAX_RESTARTS = 10  # per learner, and for the syncer: one killed this often is not coming back


class Procs:
    """The supervisor of one run; `run` drives it to the end. Read the attributes after it:
    summary, theta (final global model), evals, rejoins, exits ((name, incarnation, exit code)
    of every child that ended), finished (the syncer's end record). `launcher` starts the
    processes; one with starts_learners False leaves the learners to a scheduler, and this
    supervisor then spawns, restarts and watches only the syncer."""

    def __init__(self, cfg: TrainConfig, setup: Setup, run_dir: Path | None,
                 evaluate: Callable[[dict], float] | None, writer: report.MetricsWriter | None, store_url: str,
                 launcher: Launcher, cache: str | None = None):
        self.cfg, self.setup, self.run_dir, self.evaluate, self.writer = cfg, setup, run_dir, evaluate, writer
        self.url, self.cache = store_url, cache  # cache: the children's XLA compilation cache
        self.launcher = launcher
        self.store = bs.BlobStore(store_url, sync=False)  # atomic either way; fsync guards only power loss
        self.M = cfg.runtime.learners
        self.syncer: Child | None = None
        self.learners: dict[int, Child] = {}
        self.incarnation = dict.fromkeys(range(self.M), 0)
        self.restarts = dict.fromkeys(range(self.M), 0)
        self.syncer_incarnation = 0
        self.done: set[int] = set()  # learners whose process exited 0
        self.exits: list[tuple[str, int, int]] = []
        self.reports = 0
        self.evals: list[tuple[float, int, float]] = []
        self.rejoins: list[dict] = []
        self.finished: dict | None = None
        self.summary: dict | None = None
        self.theta: dict | None = None
        self.t0: float | None = None
        self.forced = False  # a second signal while stopping: every child was killed
        self.resume: dict | None = None  # a resumed run: the stop's clock and the learners restarted
        self.tokens_at_start = 0  # a resumed run's: the tokens its stopped run had trained
        self.secret = None  # the run secret, once in this process's environment (_start)
        self.notices: dict[tuple[int, int], dict] = {}  # exit notices written, not yet buried (_renotice)
        self.renoticed = 0.0
        # Store objects this process ignored as unauthenticated or malformed, name -> why (each
        # logged once); the summary counts them with the syncer's and the learners'.
        self.ignored: dict[str, str] = {}
        self.noted = 0  # how many of them the store's record of them lists

    def clock(self) -> float:
        """The syncer's clock (0 until it has started it)."""
        if self.t0 is None:
            self.t0 = (bs.read_trusted(self.store, "start", self.secret, None, {"t0": (int, float)}) or {}).get("t0")
        return 0.0 if self.t0 is None else time.time() - self.t0

    def run(self) -> dict:
        """To the end; a failed child fails the run, a Ctrl-C or SIGTERM raises RunStopped once
        the stop is saved (a second one forces it). The launcher is released either way."""
        try:
            self.launcher.open(RunSpec(self.url, self.cfg, self.cache, self.run_dir, self.evaluate is not None))
            return self._run()
        finally:
            self.launcher.release()

    def _run(self) -> dict:
        with signals_as_interrupt():
            stopping = False
            try:
                self._start()
                self._supervise()
                if not self.launcher.starts_learners:  # a learner started after this has nothing to do
                    bs.write_control(self.store, "finished", {"at": self.clock()}, self.secret)
            except KeyboardInterrupt:
                stopping = True
                self._stop(clean=True)
            except BaseException:
                self._stop(clean=False)
                raise
            finally:
                self._join()
            if stopping:
                if self.summary is None:  # a syncer that reported only after the wait above
                    self._read_reports(evaluate=False, exited=True)
                raise self._stopped() from None
        return self.summary

    def _start(self) -> None:
        if not self.launcher.starts_learners:
            return self._start_apart()
        # The run secret into this process's environment before any child is spawned, so the syncer
        # and every learner derive the same keys (a setup built under another runtime made none).
        keep_secret(self.cfg, self.run_dir)
        self.secret = auth_secret(self.cfg)  # control objects sealed under it (diloco/store/control.py)
        if self.cfg.run.resume:
            return self._resume()
        for prefix in PREFIXES:  # a store left by an earlier run into the same directory
            self.store.delete_prefix(prefix)
        self._announce({})
        self._spawn_syncer(0)
        for m in range(self.M):
            self._spawn(m, 0)

    def _announce(self, extra: dict) -> None:
        """Theta_0 into the store, then the run control naming its fingerprint: a child that finds
        the run control finds Theta_0 (procs/theta0.py)."""
        theta0.publish(self.store, self.setup.theta0)
        bs.write_control(self.store, "run", {"theta0": theta0.fingerprint(self.setup.theta0), "learners": self.M,
                                             **extra}, self.secret)

    def _start_apart(self) -> None:
        """The syncer of learners started apart: a new run on a store that holds no other run's
        traffic (learners may have claimed their incarnations already, so control objects stay),
        or, started again on its store, the next syncer incarnation (checkpoint + journal) from
        the reports its predecessor had read (`ctl/reports`)."""
        self.secret = auth_secret(self.cfg)  # as the learners started apart take it
        procs = bs.read_trusted(self.store, "procs", self.secret, self.ignored, {"syncer_incarnation": int})
        if procs is None:
            used = [p for p in PREFIXES if p != "ctl/" and self.store.list(p)]
            if used:
                raise ConfigError(f"the store {network.redacted(self.url)} holds another run's objects "
                                  f"({', '.join(used)}) but no record of its syncer: give each run its own "
                                  "runtime.store.url")
            self._announce({"config": to_dict(self.cfg)})  # each learner checks its own against it
            return self._spawn_syncer(0)
        if not restartable(self.cfg, self.run_dir):
            raise ConfigError("the store holds this run's syncer already; starting it again restores its "
                              f"checkpoints and journal, kept only with run.checkpoint_every > 0 (got "
                              f"{self.cfg.run.checkpoint_every})")
        self.reports = (bs.read_trusted(self.store, "reports", self.secret, self.ignored, {"read": int})
                        or {"read": 0})["read"]
        theta0.publish(self.store, self.setup.theta0)  # a store written before Theta_0 was kept there
        self._spawn_syncer(int(procs["syncer_incarnation"]) + 1)

    def _resume(self) -> None:
        """Continue a stopped run on its store: the next syncer incarnation restores the newest
        syncer checkpoint and journal and buries the stopped incarnations (their exit notices were
        written at the stop); every learner not done comes back as its next incarnation."""
        stopped = bs.read_trusted(self.store, "stopped", self.secret, self.ignored,
                                  {"at": (int, float), "reports": int})
        procs = bs.read_trusted(self.store, "procs", self.secret, self.ignored,
                                {"syncer_incarnation": int, "learners": dict})
        if stopped is None or procs is None:
            raise ConfigError(f"run.resume=true but the store {self.url} holds no stopped procs run (no "
                              "ctl/stopped): a procs run records one when Ctrl-C or SIGTERM stops it; this "
                              "one finished, or its supervisor was killed")
        if not restartable(self.cfg, self.run_dir):
            raise ConfigError("run.resume=true with runtime.kind=procs needs run.checkpoint_every > 0: the "
                              "syncer's checkpoints and journal are what it resumes from")
        for m in range(self.M):
            self.incarnation[m] = int(procs["learners"][str(m)]["incarnation"])
            notice = bs.read_trusted(self.store, died(m, self.incarnation[m]), self.secret, self.ignored)
            if isinstance(notice, dict) and notice.get("exitcode") == 0:
                self.done.add(m)  # it had finished: its successor would have nothing to do
        # What the stopped run's supervisor had not read is made again by the replay, and a stale
        # start or ready record would start the new clock before the new learners have compiled.
        self.store.delete_prefix("rep/")
        self.store.delete_prefix("ctl/ready/")
        for name in ("start", "stopped"):
            self.store.delete(f"ctl/{name}")
        self.reports = int(stopped["reports"])
        self.tokens_at_start = int(stopped.get("tokens", 0))
        back = [m for m in range(self.M) if m not in self.done]
        self.resume = {"at": float(stopped["at"]), "learners": back,
                       "incarnations": {m: self.incarnation[m] + 1 for m in back}}
        theta0.publish(self.store, self.setup.theta0)  # a store written before Theta_0 was kept there
        self._spawn_syncer(int(procs["syncer_incarnation"]) + 1)
        for m in back:
            self._spawn(m, self.incarnation[m] + 1)

    def _spawn_syncer(self, incarnation: int) -> None:
        """A restarted one skips the reports read so far (every one its predecessor finished)."""
        self.syncer = self.launcher.spawn_syncer(incarnation, self.reports, self.resume)
        self.syncer_incarnation = incarnation  # only started processes are watched
        self._write_procs()

    def resumed(self, m: int, incarnation: int) -> bool:
        """Whether learner m's `incarnation` is its first of a resumed run (it comes back from the
        stop, not from a crash: no restart time, no steps skipped)."""
        return self.resume is not None and self.resume["incarnations"].get(m) == incarnation

    def _spawn(self, m: int, incarnation: int) -> None:
        """Learner m's next incarnation: one child, a world of processes too
        (docs/multihost.md#supervisor), which ends as a whole and is restarted as a whole."""
        self.learners[m] = self.launcher.spawn_learner(m, incarnation, self.resumed(m, incarnation))
        self.incarnation[m] = incarnation
        self._write_procs()

    def _write_procs(self) -> None:
        """Who runs where (`ctl/procs`), for operators, fault tests (kill -9 a process by its pid,
        an actor by its name) and a resume; a learner that was done before a resume has no
        process. The learners started apart are not listed: each claims its own incarnation."""
        learners = {} if not self.launcher.starts_learners else {
            str(k): {"incarnation": self.incarnation[k], **self.launcher.where(k, self.learners.get(k))}
            for k in range(self.M)}
        bs.write_control(self.store, "procs", {
            "supervisor": os.getpid(), **self.launcher.where(None, self.syncer),
            "syncer_incarnation": self.syncer_incarnation, "learners": learners}, self.secret)

    def _supervise(self) -> None:
        while True:
            code = self.syncer.exitcode  # read first: every report it wrote before exiting is there
            self._read_reports(exited=code is not None)
            if code is not None:
                if self.finished is not None and (code == 0 or not self._error("syncer")):
                    return  # killed after its end report, if at all: the result is in
                self._restart_syncer(code)
            for m in range(self.M):
                self._watch(m)
            self._renotice()
            if len(self.ignored) != self.noted:  # for the syncer's summary (intake.gathered_ignored)
                note_ignored(self.store, self.ignored, self.secret)
                self.noted = len(self.ignored)
            self.launcher.wait([p for m, p in self.learners.items() if m not in self.done] + [self.syncer], POLL)

    def _restart_syncer(self, code: int) -> None:
        inc = self.syncer_incarnation
        self.exits.append(("syncer", inc, code))
        error = self._error("syncer")
        if code == 0 or error or not restartable(self.cfg, self.run_dir):
            why = "" if error else " without a readable end report (see the log)" if code == 0 else (
                " and cannot be restarted: that needs a run directory and "
                f"run.checkpoint_every > 0, got {self.cfg.run.checkpoint_every}")
            raise RuntimeError(f"the syncer process exited with code {code}{why}{error}")
        if inc >= MAX_RESTARTS:
            raise RuntimeError(f"the syncer died {inc + 1} times (last exit code {code}); not restarting it again")
        self._spawn_syncer(inc + 1)

    def _watch(self, m: int) -> None:
        if m in self.done or not self.launcher.starts_learners:  # apart: its own notice, or its successor's
            return
        p, inc = self.learners[m], self.incarnation[m]
        if p.exitcode is None:
            return
        self.exits.append((f"learner-{m}", inc, p.exitcode))
        if p.exitcode == 0:
            self.done.add(m)
            # The syncer books it done from its Done event; should that event be lost, from this.
            self._notice(m, inc, {"at": self.clock(), "exitcode": 0})
            return
        name = f"learner-{m:04d}-{inc:04d}"
        error = self._error(name)
        for i in range(1, getattr(p, "processes", 1)):  # a world's followers record theirs under their index
            error = error or self._error(f"{name}-p{i}")
        if error:  # a Python error is a bug to report, not a failure to ride out
            raise RuntimeError(f"learner {m} incarnation {inc} failed (exit code {p.exitcode}){error}")
        if p.exitcode != EXIT_DOWN:  # a chaos tape's failures are planned, not a crash loop
            if self.restarts[m] >= MAX_RESTARTS:
                raise RuntimeError(f"learner {m} died {self.restarts[m] + 1} times (last exit code "
                                   f"{p.exitcode}); not restarting it again")
            self.restarts[m] += 1
        self._notice(m, inc, {"at": self.clock(), "exitcode": p.exitcode})
        self._spawn(m, inc + 1)

    def _notice(self, m: int, inc: int, notice: dict) -> None:
        """The exit notice of (m, inc), sealed; kept, so that one written over it is made again."""
        self.notices[(m, inc)] = notice
        bs.write_control(self.store, died(m, inc), notice, self.secret)

    def _renotice(self) -> None:
        """Once a second: each exit notice the syncer has not buried yet that no longer reads back
        as written (damaged, or a forger's written over it) is written again, so that a dead learner
        is buried and its successor starts; the syncer ignores one it cannot authenticate."""
        if time.monotonic() - self.renoticed < 1.0:
            return
        self.renoticed = time.monotonic()
        for (m, inc), notice in list(self.notices.items()):
            if bs.read_trusted(self.store, buried(m, inc), self.secret, self.ignored) is not None:
                del self.notices[(m, inc)]
            else:
                bs.keep_control(self.store, died(m, inc), notice, self.secret, self.ignored)

    def _error(self, name: str) -> str:
        # sealed by the process that failed: a forged traceback fails no one (docs/design.md#damage-in-the-store)
        found = bs.read_trusted(self.store, f"error/{name}", self.secret, self.ignored, {"traceback": str})
        return "" if found is None else f"; its traceback:\n{found['traceback']}"

    def _read_reports(self, evaluate: bool = True, exited: bool = False) -> None:
        """The syncer's reports, in order: metrics records, eval requests, the end. A malformed one
        (not JSON, too large, fields or Theta not what its kind needs) is logged and skipped. One
        not sealed under the runtime's key (runtime.auth) is ignored and read again, as the syncer's
        may land on its key later, until a later report verifies or the syncer has `exited`: then
        it was damage, and is skipped. How many were read is kept in the store (`ctl/reports`), for
        a syncer restarted by a process that did not spawn its predecessor: scripts/syncer.py
        started again, a Ray actor."""
        start = self.reports
        while True:
            key = rep_key(self.reports, "json")
            try:
                record = read_report(self.store, self.reports, self.secret)
                if record is None:
                    if self.reports > start:
                        bs.write_control(self.store, "reports", {"read": self.reports}, self.secret)
                    return
                theta = report_theta(self.store, self.reports, record, self.setup.theta0, self.secret)
            except Unauthenticated as e:
                if key not in self.ignored:
                    log.error("report %d ignored until the syncer writes it: %s", self.reports, e)
                    self.ignored[key] = str(e)[:200]
                if not (exited or verified_after(self.store, self.reports, self.secret)):
                    return
                log.error("report %d skipped: a later one verifies, or the syncer has exited", self.reports)
            except ValueError as e:
                log.error("report %d skipped: %s", self.reports, e)
            else:
                self._take(record, theta, evaluate)
            # counted before its objects go: a stop's KeyboardInterrupt between the two would end
            # every later read at the deleted key (the stop's end report never read)
            n, self.reports = self.reports, self.reports + 1
            self.store.delete(key)
            self.store.delete(rep_key(n, "npz"))

    def _take(self, record: dict, theta: dict | None, evaluate: bool) -> None:
        kind = record["kind"]
        if kind == "end":
            self.finished, self.summary, self.theta = record, record["summary"], theta
        elif kind == "eval":
            if evaluate and self.evaluate is not None:
                self.record_eval(record["time"], record["step"], theta, record["tokens"], record["merges"])
        else:  # train, rejoin, merge
            if kind == "rejoin":
                self.rejoins.append(record)
            self._write(record)

    def record_eval(self, t: float, step: int, theta: dict, tokens: int, merges: int, final: bool = False) -> None:
        """Evaluate Theta as of (t, step) and write its eval record."""
        loss = self.evaluate(theta)
        self.evals.append((t, step, loss))
        self._write({"kind": "eval", "step": step, "time": t, "tokens": tokens, "eval_loss": loss,
                     "merges": merges, **during_run.fields(self.evaluate, theta, step, final)})

    def _write(self, record: dict) -> None:
        if self.writer is not None:
            self.writer.write(record)

    def _stop(self, clean: bool) -> None:
        """Interrupted (`clean`) or failed: SIGTERM to the learners (each checkpoints at its next
        step boundary and exits), and once they are gone (at once if failed) to the syncer, which
        books what they wrote, saves a final checkpoint and reports its partial summary (printed
        here for a failed run; a stopped one carries it in RunStopped). A second signal while
        stopping kills every child at once."""
        try:
            for p in self.learners.values():
                if p.exitcode is None:
                    p.terminate()
            if clean:
                limit = time.monotonic() + JOIN_TIMEOUT
                for p in self.learners.values():
                    p.join(max(0.0, limit - time.monotonic()))
            if self.syncer is None or self.syncer.exitcode is not None:
                return
            self.syncer.terminate()
            self.syncer.join(SYNCER_STOP_TIMEOUT)
            self._read_reports(evaluate=False, exited=self.syncer.exitcode is not None)
        except KeyboardInterrupt:
            self.forced = True
            for p in [self.syncer, *self.learners.values()]:
                if p is not None and p.exitcode is None:
                    p.kill()
            return
        if self.summary is not None and not clean:
            print(report.format_table(self.summary.items(), title="procs run stopped; partial summary"))

    def _stopped(self) -> RunStopped:
        """Every child is gone: the exit notice of each learner not done (its successor in a
        resumed run waits for the syncer to bury it), and what a resume needs to know of this
        process: its clock at the stop and the reports it read (the syncer's end report, the last,
        not counted: a resumed syncer makes its next report under that number)."""
        # the syncer's clock when it ended, after booking every event the learners wrote; the
        # seconds its process took to exit afterwards are not the run's (a resumed clock starts here)
        at = self.finished["time"] if self.finished is not None else self.clock()
        for m, p in self.learners.items():
            if m not in self.done:
                self._notice(m, self.incarnation[m],
                             {"at": at, "exitcode": -signal.SIGTERM if p.exitcode is None else p.exitcode})
        reports = self.reports - (self.finished is not None)
        tokens = (self.summary or {}).get("tokens_processed", 0)  # none if the syncer died first
        bs.write_control(self.store, "stopped", {"at": at, "reports": reports, "forced": self.forced,
                                                 "tokens": tokens}, self.secret)
        return RunStopped(self.run_dir, self.summary, restartable(self.cfg, self.run_dir), self.forced,
                          "" if self.run_dir is None else "a procs run resumes from its syncer's checkpoints and "
                          f"journal, kept only with run.checkpoint_every > 0 (got {self.cfg.run.checkpoint_every})")

    def _join(self) -> None:
        children = [p for p in [self.syncer, *self.learners.values()] if p is not None]
        limit = time.monotonic() + JOIN_TIMEOUT
        try:
            for p in children:
                p.join(max(0.0, limit - time.monotonic()))
        except KeyboardInterrupt:  # a second signal while stopping: no more waiting
            self.forced = True
            for p in children:
                if p.exitcode is None:
                    p.kill()
        for p in children:
            if p.exitcode is None:  # stuck: escalate
                p.terminate()
                p.join(5.0)
            if p.exitcode is None:
                p.kill()
                p.join()
        for m, p in self.learners.items():  # the last incarnations, ended after the supervision
            if m not in self.done:
                self.exits.append((f"learner-{m}", self.incarnation[m], p.exitcode))
