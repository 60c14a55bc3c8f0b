"""The procs runtime: one OS process per learner (spawned, not forked), a syncer process, and this
process as their supervisor, restarting learners that die; all traffic goes through an object
store (diloco/store/): file:// by default, gs:// or s3:// by `runtime.store_url`.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), section 6 (a failed learner is
absent from quorums while the global model advances; it rejoins from the syncer's state);
docs/design.md#procs (real kill -9 fault tests; multi-host over a shared bucket).

Who does what: learner m's process (diloco/runtime/procs/learner.py) trains on its own device
sub-mesh and writes contributions and an event stream; the syncer process
(diloco/runtime/procs/syncer.py) books the events, merges and publishes; this process starts
them, evaluates the global model when the syncer asks, writes metrics.jsonl, and watches exits.
A child rebuilds its Setup from the config (spawned processes share no jitted functions) and
checks that it got this process's Theta_0.

Failures: a learner process that exits with a signal (kill -9, the OOM killer) or an unexplained
code is restarted under incarnation + 1 after `ctl/died/...` tells the syncer, which books the
death once it has booked every event of the dead process; messages of the old incarnation are
then dropped by the syncer's admission check. A syncer process that dies the same way is restarted
as the next syncer incarnation, which restores the latest syncer checkpoint and re-executes its
predecessor's journal after it (diloco/runtime/procs/recovery.py), so no version is applied twice or
skipped; the learners train on meanwhile, stalling only at their tau bound. That needs a run
directory and run.checkpoint_every > 0 (merges between syncer checkpoints); without them a dead
syncer fails the run. A learner or syncer that raises a Python error fails the run, as an exception
in any thread fails a threads run.

SIGINT or SIGTERM here (docs/design.md#stopping-a-run): the learners get SIGTERM, each checkpoints
at its next step boundary and exits; then the syncer gets it, books what they wrote, saves a final
checkpoint and reports its partial summary; this process writes each learner's exit notice and
`ctl/stopped` (the clock and the reports read) and raises RunStopped. A second signal kills every
child at once. `run.resume=true` starts the next syncer incarnation on the store as after a crash
(checkpoint + journal), which buries the stopped incarnations, and each learner not done as its
next incarnation, which rejoins; the clock continues where the stopped run ended.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import os
import signal
import tempfile
import time
from multiprocessing.connection import wait as wait_for_exit
from pathlib import Path
from typing import Any, Callable

import numpy as np

from diloco import report
from diloco import store as bs
from diloco import watch as run_watch
from diloco.config import ConfigError, TrainConfig
from diloco.runtime.procs.child import EXIT_DOWN, died, fingerprint
from diloco.runtime.procs.learner import learner_main
from diloco.runtime.procs.recovery import restartable
from diloco.runtime.procs.syncer import rep_key, syncer_main, unpack_theta
from diloco.runtime.runlog import learner_rates
from diloco.runtime import build as build_setup
from diloco.runtime.build import Setup
from diloco.runtime.stop import RunStopped, sigint_ignored, signals_as_interrupt
from diloco.runtime.walltape import run_tape
from diloco.runtime.world_group import WorldGroup
from diloco.store import network

log = logging.getLogger(__name__)

POLL = 0.05  # seconds the supervisor waits for a process exit before reading reports again
JOIN_TIMEOUT = 30.0  # seconds a stopping child gets before it is killed
# A stopping syncer books what the learners wrote, saves its final checkpoint and reports: on a
# loaded machine that took more than JOIN_TIMEOUT once, and the stop lost its partial summary.
SYNCER_STOP_TIMEOUT = 120.0
MAX_RESTARTS = 10  # per learner, and for the syncer: one killed this often is not coming back
_PREFIXES = ("up/", "down/", "ack/", "ctl/", "ev/", "rep/")  # every key scheme of a procs run
SECRET_FILE = "auth_secret"  # <run>/auth_secret: the run secret a resume needs (mode 0600)


# What each kind of report must hold (diloco/runtime/procs/syncer.py writes them).
_REPORT_FIELDS = {
    "train": {"learner", "step", "time", "tokens", "loss"},
    "rejoin": {"time", "learner", "incarnation", "step"},
    "eval": {"step", "time", "tokens", "merges", "paths"},
    "merge": {"time", "merges", "tokens", "quorum", "bytes_up", "bytes_down", "stalls", "quarantined", "goodput"},
    "end": {"time", "summary", "steps", "tokens", "dead", "finished_at", "merges", "processed0", "complete",
            "paths"},
}


class Procs:
    """The supervisor of one run; `run` drives it to the end. Read the attributes after it:
    summary, theta (final global model), evals, rejoins, exits ((name, incarnation, exit code)
    of every child that ended), finished (the syncer's end record)."""

    def __init__(self, cfg: TrainConfig, setup: Setup, run_dir: Path | None,
                 evaluate: Callable[[dict], float] | None, writer: report.MetricsWriter | None, store_url: str,
                 cache: str | None = None):
        self.cfg, self.setup, self.run_dir, self.evaluate, self.writer = cfg, setup, run_dir, evaluate, writer
        self.url, self.cache = store_url, cache  # cache: the children's XLA compilation cache
        self.store = bs.BlobStore(store_url, sync=False)  # atomic either way; fsync guards only power loss
        self.ctx = mp.get_context("spawn")  # fork would copy jax's threads and devices
        self.M = cfg.runtime.learners
        self.syncer: mp.process.BaseProcess | None = None
        self.learners: dict[int, mp.process.BaseProcess] = {}
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

    def clock(self) -> float:
        """The syncer's clock (0 until it has started it)."""
        if self.t0 is None:
            self.t0 = (bs.read_control(self.store, "start") or {}).get("t0")
        return 0.0 if self.t0 is None else time.time() - self.t0

    def run(self) -> dict:
        """To the end; a failed child fails the run, a Ctrl-C or SIGTERM raises RunStopped once
        the stop is saved (a second one forces it)."""
        with signals_as_interrupt():
            stopping = False
            try:
                self._start()
                self._supervise()
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
                    self._read_reports(evaluate=False)
                raise self._stopped() from None
        return self.summary

    def _start(self) -> None:
        # The run secret into this process's environment before any child is spawned, so the syncer
        # and every learner derive the same keys (a setup built under another runtime made none).
        keep_secret(self.cfg, self.run_dir)
        if self.cfg.run.resume:
            return self._resume()
        for prefix in _PREFIXES:  # a store left by an earlier run into the same directory
            self.store.delete_prefix(prefix)
        bs.write_control(self.store, "run", {"theta0": fingerprint(self.setup.theta0), "learners": self.M})
        self._spawn_syncer(0)
        for m in range(self.M):
            self._spawn(m, 0)

    def _resume(self) -> None:
        """Continue a stopped run on its store: the next syncer incarnation restores the newest
        syncer checkpoint and journal and buries the stopped incarnations (their exit notices were
        written at the stop); every learner not done comes back as its next incarnation."""
        stopped, procs = bs.read_control(self.store, "stopped"), bs.read_control(self.store, "procs")
        if not (isinstance(stopped, dict) and isinstance(procs, dict)):
            raise ConfigError(f"run.resume=true but the store {self.url} holds no stopped procs run (no "
                              "ctl/stopped): a procs run records one when Ctrl-C or SIGTERM stops it; this "
                              "one finished, or its supervisor was killed")
        if not restartable(self.cfg, self.run_dir):
            raise ConfigError("run.resume=true with runtime.kind=procs needs run.checkpoint_every > 0: the "
                              "syncer's checkpoints and journal are what it resumes from")
        for m in range(self.M):
            self.incarnation[m] = int(procs["learners"][str(m)]["incarnation"])
            notice = bs.read_control(self.store, died(m, self.incarnation[m]))
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
        self._spawn_syncer(int(procs["syncer_incarnation"]) + 1)
        for m in back:
            self._spawn(m, self.incarnation[m] + 1)

    def _spawn_syncer(self, incarnation: int) -> None:
        """A restarted one skips the reports read so far (every one its predecessor finished)."""
        p = self.ctx.Process(target=syncer_main, name=f"diloco-syncer-{incarnation}", daemon=True,
                             args=(self.url, self.cfg, self.cache, self.run_dir, self.evaluate is not None,
                                   incarnation, self.reports, self.resume))
        with sigint_ignored():
            p.start()
        self.syncer, self.syncer_incarnation = p, incarnation  # only started processes are watched
        self._write_procs()

    def resumed(self, m: int, incarnation: int) -> bool:
        """Whether learner m's `incarnation` is its first of a resumed run (it comes back from the
        stop, not from a crash: no restart time, no steps skipped)."""
        return self.resume is not None and self.resume["incarnations"].get(m) == incarnation

    def _spawn(self, m: int, incarnation: int) -> None:
        """Learner m's next incarnation: one process, or with runtime.processes_per_learner > 1 a
        world of that many on a fresh coordinator port (docs/multihost.md#supervisor), which ends
        as a whole with one exit code and is restarted as a whole."""
        name = f"diloco-learner-{m}-{incarnation}"
        args = (self.url, self.cfg, self.cache, self.run_dir, m, incarnation, os.getpid(), self.resumed(m, incarnation))
        P = self.cfg.runtime.processes_per_learner
        if P > 1:
            p = WorldGroup(learner_main, args, P, name=name, ctx=self.ctx)
        else:
            p = self.ctx.Process(target=learner_main, name=name, daemon=True, args=args)
        with sigint_ignored():
            p.start()
        self.learners[m], self.incarnation[m] = p, incarnation
        self._write_procs()

    def _write_procs(self) -> None:
        """Who runs where, for operators and fault tests (kill -9 a process by its pid); a learner
        that was done before a resume has no process (pid null)."""
        bs.write_control(self.store, "procs", {
            "supervisor": os.getpid(), "syncer": self.syncer.pid, "syncer_incarnation": self.syncer_incarnation,
            "learners": {str(k): self._where(k) for k in range(self.M)}})

    def _where(self, m: int) -> dict:
        """Learner m's incarnation and pid (a world's leader), and a world's every pid."""
        p = self.learners.get(m)
        out = {"incarnation": self.incarnation[m], "pid": None if p is None else p.pid}
        if isinstance(p, WorldGroup):
            out["pids"] = p.pids
        return out

    def _supervise(self) -> None:
        while True:
            code = self.syncer.exitcode  # read first: every report it wrote before exiting is there
            self._read_reports()
            if code is not None:
                if self.finished is not None and (code == 0 or not self._error("syncer")):
                    return  # killed after its end report, if at all: the result is in
                self._restart_syncer(code)
            for m in range(self.M):
                self._watch(m)
            self._wait([p for m, p in self.learners.items() if m not in self.done] + [self.syncer], POLL)

    def _wait(self, children: list, timeout: float) -> None:
        """Until one of `children` exits, or `timeout` s. A child is anything with the surface of
        multiprocessing's Process that this class uses (exitcode, pid, terminate, kill, join):
        the Ray runtime's actors (diloco/runtime/ray_runtime.py) wrap themselves so."""
        # A world's every member: a follower's death wakes this loop at once, not at its leader's abort.
        wait_for_exit([s for p in children for s in getattr(p, "sentinels", [p.sentinel])], timeout=timeout)

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
        if m in self.done:
            return
        p, inc = self.learners[m], self.incarnation[m]
        if p.exitcode is None:
            return
        self.exits.append((f"learner-{m}", inc, p.exitcode))
        if p.exitcode == 0:
            self.done.add(m)
            # The syncer books it done from its Done event; should that event be lost, from this.
            bs.write_control(self.store, died(m, inc), {"at": self.clock(), "exitcode": 0})
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
        bs.write_control(self.store, died(m, inc), {"at": self.clock(), "exitcode": p.exitcode})
        self._spawn(m, inc + 1)

    def _error(self, name: str) -> str:
        found = bs.read_control(self.store, f"error/{name}")
        return "" if found is None else f"; its traceback:\n{found['traceback']}"

    def _read_reports(self, evaluate: bool = True) -> None:
        """The syncer's reports, in order: metrics records, eval requests, the end. A malformed one
        (not JSON, too large, fields or Theta not what its kind needs) is logged and skipped. How
        many were read is kept in the store (`ctl/reports`), for a syncer restarted by a process
        that did not spawn its predecessor: scripts/syncer.py started again, a Ray actor."""
        start = self.reports
        while True:
            key = rep_key(self.reports, "json")
            try:
                record = bs.read_json(self.store, key, finite=False)  # a loss may be NaN
                if record is None:
                    if self.reports > start:
                        bs.write_control(self.store, "reports", {"read": self.reports})
                    return
                theta = self._report_theta(record)
            except ValueError as e:
                log.error("report %d skipped: %s", self.reports, e)
            else:
                self._take(record, theta, evaluate)
            self.store.delete(key)
            self.store.delete(rep_key(self.reports, "npz"))
            self.reports += 1

    def _report_theta(self, record: Any) -> dict | None:
        """The Theta a report carries (eval, end), checked against the run's shapes; ValueError if
        the record is not a report of its kind or its Theta is unreadable."""
        kind = record.get("kind") if isinstance(record, dict) else None
        if not (isinstance(kind, str) and _REPORT_FIELDS.get(kind, {None}) <= set(record)):
            raise ValueError(f"not a report: {str(record)[:200]}")
        numbers = [record[k] for k in _REPORT_FIELDS[kind] & {"time", "step", "merges", "processed0"}]
        if kind in ("train", "eval", "merge"):
            numbers.append(record["tokens"])
        if not all(type(x) in (int, float) and math.isfinite(x) for x in numbers):
            raise ValueError(f"a {record['kind']} report with a field that is not a finite number")
        if record["kind"] == "end" and not (isinstance(record["summary"], dict) and isinstance(record["steps"], dict)
                                            and type(record["steps"].get("0")) is int):
            raise ValueError("an end report without its summary or steps")
        if record["kind"] not in ("eval", "end"):
            return None
        want = {path: x.shape for frag in self.setup.theta0 for path, x in frag.items()}
        paths = record.pop("paths", None)
        if not (isinstance(paths, list) and all(isinstance(q, list) and all(isinstance(x, str) for x in q)
                                                for q in paths)):
            raise ValueError(f"a {record['kind']} report without the paths of its Theta")
        limit = sum(4 * int(np.prod(shape)) + 4096 for shape in want.values()) + 65536  # npz: float32 + headers
        try:
            blob = self.store.get(rep_key(self.reports, "npz"), limit)
            theta = None if blob is None else unpack_theta(paths, blob)
        except Exception as e:  # noqa: BLE001 - np.load of damaged bytes raises many kinds; all mean "unreadable"
            raise ValueError(f"its Theta is unreadable ({type(e).__name__}: {e})") from None
        if theta is None or {p: (x.shape, x.dtype) for p, x in theta.items()} != {
                p: (shape, np.float32) for p, shape in want.items()}:
            raise ValueError("its Theta is missing or not the run's paths and float32 shapes")
        return theta

    def _take(self, record: dict, theta: dict | None, evaluate: bool) -> None:
        kind = record["kind"]
        if kind == "end":
            self.finished, self.summary, self.theta = record, record["summary"], theta
        elif kind == "eval":
            if evaluate and self.evaluate is not None:
                self._eval(record["time"], record["step"], theta, record["tokens"], record["merges"])
        else:  # train, rejoin, merge
            if kind == "rejoin":
                self.rejoins.append(record)
            self._write(record)

    def _eval(self, t: float, step: int, theta: dict, tokens: int, merges: int) -> None:
        loss = self.evaluate(theta)
        self.evals.append((t, step, loss))
        self._write({"kind": "eval", "step": step, "time": t, "tokens": tokens, "eval_loss": loss,
                     "merges": merges})

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
            self._read_reports(evaluate=False)
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
                bs.write_control(self.store, died(m, self.incarnation[m]),
                                 {"at": at, "exitcode": -signal.SIGTERM if p.exitcode is None else p.exitcode})
        reports = self.reports - (self.finished is not None)
        tokens = (self.summary or {}).get("tokens_processed", 0)  # none if the syncer died first
        bs.write_control(self.store, "stopped", {"at": at, "reports": reports, "forced": self.forced,
                                                 "tokens": tokens})
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


def keep_secret(cfg: TrainConfig, run_dir: Path | None) -> None:
    """The run secret (runtime.auth) into this process's environment, where every child reads it.
    A run with a directory and no runtime.auth_secret_file keeps it in <run>/auth_secret (0600),
    so that a resume verifies what the learners sealed before the stop with the same keys."""
    r = cfg.runtime
    path = None if run_dir is None or r.auth_secret_file else Path(run_dir) / SECRET_FILE
    if cfg.run.resume and path is not None and path.is_file():
        os.environ[r.auth_secret_env] = path.read_text().strip()
    if build_setup.auth_secret(cfg) is None or path is None or cfg.run.resume:
        return
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.environ[r.auth_secret_env])


def run(cfg: TrainConfig, setup: Setup, run_dir: Path | None,
        evaluate: Callable[[dict], float] | None, supervisor: type[Procs] | None = None) -> tuple[Procs, dict]:
    """Run Decoupled DiLoCo as supervised processes; returns the finished supervisor (for its
    records) and a summary with the same keys as sim's and threads'. `supervisor`: Procs, or a
    subclass that starts the processes elsewhere (the syncer host of learners started apart,
    diloco/runtime/procs/standalone.py; Ray actors, diloco/runtime/ray_runtime.py)."""
    if supervisor is None:
        from diloco.runtime.procs.standalone import SyncerOnly as External
        supervisor = External if cfg.runtime.launch == "external" else Procs
    with contextlib.ExitStack() as stack:
        if run_dir is None:  # the store and nothing else
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="diloco-procs-")))
        else:
            run_dir = root = Path(run_dir).absolute()  # children may resolve paths elsewhere
        url = network.run_store_url(cfg.runtime, f"file://{root / 'store'}")  # options ride in the URL
        writer = None
        if run_dir is not None:
            writer = report.MetricsWriter(run_dir / "metrics.jsonl", run_watch.for_run(cfg, run_dir, "wall"),
                                         learner_rates(cfg, setup, "wall"))
            stack.callback(writer.close)
        run_tape(cfg, run_dir)  # for the record: every learner process derives the same tape
        rt = supervisor(cfg, setup, run_dir, evaluate, writer, url, str(root / "xla_cache"))
        summary = rt.run()
        if evaluate is not None:
            rt._eval(rt.finished["time"], rt.finished["steps"]["0"], rt.theta, rt.finished["processed0"],
                     rt.finished["merges"])
            summary["eval_loss"] = rt.evals[-1][2]
        summary["tokens_at_start"] = rt.tokens_at_start  # a resumed run's rates are its own (run.py)
        if writer is not None:
            writer.summary(summary)
        return rt, summary
