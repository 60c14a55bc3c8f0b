"""The sim runtime's entry: a run set up (its snapshots, resumed from the latest or started afresh),
driven by Sim (diloco/runtime/sim/runtime.py) with SIGINT and SIGTERM turned into a final snapshot,
evaluated once more at the end, and its decision records and summary written."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path
from typing import Callable

from diloco import watch as run_watch
from diloco.config import TrainConfig
from diloco.runtime.build import Setup
from diloco.runtime.rejoin import LearnerCheckpoints
from diloco.runtime.runlog import close_run, learner_rates, run_outputs
from diloco.runtime.sim.runtime import Sim
from diloco.runtime.sim.snapshots import SimSnapshots, restore
from diloco.runtime.walltape import run_tape
from diloco.train.profile import for_run as trace_for

log = logging.getLogger(__name__)


@contextlib.contextmanager
def interruptible(sim: Sim):
    """SIGINT or SIGTERM (main thread only) lets the sim finish the step in progress, save a final
    snapshot and raise KeyboardInterrupt; `run.resume=true` continues from it bit-identically.
    A second signal interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if sim.interrupted:
            raise KeyboardInterrupt
        log.warning("signal %d: stopping after the current step with a final snapshot", signum)
        sim.interrupted = True

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run(cfg: TrainConfig, setup: Setup, run_dir: Path | None, evaluate: Callable[[dict], float] | None,
        stop: Callable[[Sim], bool] | None = None) -> tuple[Sim, dict | None]:
    """Run Decoupled DiLoCo in virtual time; returns the finished Sim (for its state) and a summary
    (None if `stop` ended it early). With run.resume it continues from the run's latest snapshot."""
    every = cfg.run.checkpoint_every * cfg.runtime.learners
    snapshots = SimSnapshots(None if run_dir is None else run_dir / "sim", every, cfg.run.keep_checkpoints,
                             cfg.run.checkpoint_fail_s)
    found = snapshots.latest() if cfg.run.resume else None
    try:
        # The input log restarts from the snapshot: inputs after it are delivered again.
        with run_outputs(run_dir, run_watch.for_run(cfg, run_dir, "virtual"), learner_rates(cfg, setup, "virtual"),
                         found[1]["inputs_seen"] if found else None) as (writer, inputs), \
                trace_for(cfg, run_dir) as trace:
            tape = run_tape(cfg, run_dir)
            # Only a rejoin reads a learner checkpoint, and without a failure tape no sim learner
            # dies (a resume restores every learner from the run's snapshot), so none are written.
            every = cfg.runtime.learner_checkpoint_every if tape is not None else 0
            ckpts = LearnerCheckpoints(None if run_dir is None else run_dir / "learners", every,
                                       cfg.run.keep_checkpoints, fail_s=cfg.run.checkpoint_fail_s)
            sim = Sim(cfg, setup, writer, evaluate, inputs, tape, ckpts, trace)
            with interruptible(sim):
                if found is None:
                    start, summary = 0, sim.run(snapshots, stop)
                else:
                    restore(sim, *found)
                    start, summary = int(sim.tokens.processed[0]), sim.loop(snapshots, stop)
            if summary is None:
                return sim, None

            def last_eval() -> float:
                sim._eval(sim.now, final=True)
                return sim.evals[-1][2]

            return sim, close_run(run_dir, writer, summary, start, last_eval if evaluate is not None else None,
                                  sim.syncer.decisions)
    finally:
        snapshots.close()
