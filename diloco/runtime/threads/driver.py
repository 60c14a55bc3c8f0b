"""The threads runtime's entry: a run set up (its syncer checkpoints, resumed from a stop or
started afresh), driven by Threads (diloco/runtime/threads/runtime.py), evaluated once more at the
end, and its decision records and summary written."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from diloco import watch as run_watch
from diloco.algo import syncer as sync
from diloco.config import TrainConfig
from diloco.evaluation import during_run
from diloco.runtime.build import Setup
from diloco.runtime.runlog import close_run, learner_rates, run_outputs, write_decisions
from diloco.runtime.stop import RunStopped
from diloco.runtime.syncer_ckpt import SYNCER_DIR, SyncerCheckpoints
from diloco.runtime.threads.runtime import Threads
from diloco.runtime.threads.stopping import latest_stop
from diloco.runtime.walltape import run_tape


def run(cfg: TrainConfig, setup: Setup, run_dir: Path | None,
        evaluate: Callable[[dict], float] | None) -> tuple[Threads, dict]:
    """Run Decoupled DiLoCo on the wall clock; returns the finished runtime (for its state) and a
    summary with the same keys as sim's. With run.resume it continues the run a stop saved in
    run_dir; a Ctrl-C or SIGTERM raises RunStopped (the partial decision records written)."""
    ckpts, found = None, None
    if run_dir is not None:
        if not cfg.run.resume:  # a new run must never resume from an earlier run's syncer
            shutil.rmtree(run_dir / SYNCER_DIR, ignore_errors=True)
        ckpts = SyncerCheckpoints(run_dir / SYNCER_DIR, 0, cfg.run.keep_checkpoints, async_save=False,
                                  fail_s=cfg.run.checkpoint_fail_s)
    try:
        if cfg.run.resume and ckpts is not None:
            found = latest_stop(cfg, setup, ckpts, run_dir)
        # The input log continues from the checkpoint: inputs after it (a forced stop) are dropped.
        with run_outputs(run_dir, run_watch.for_run(cfg, run_dir, "wall"), learner_rates(cfg, setup, "wall"),
                         found[2]["inputs_seen"] if found else None) as (writer, inputs):
            rt = Threads(cfg, setup, writer, evaluate, inputs,
                         None if run_dir is None else run_dir / "learners", run_tape(cfg, run_dir),
                         syncer_ckpts=ckpts, restored=found, run_dir=run_dir)
            start = int(rt.tokens.processed[0])  # a resumed run's, from its checkpoint
            if found is None and during_run.scores_tasks(evaluate):  # the base model's task scores
                rt._eval(0.0, 0, sync.theta(rt.syncer), 0, 0)
            try:
                summary = rt.run()  # every thread has been joined when it returns or raises
            except RunStopped:
                if run_dir is not None:
                    write_decisions(run_dir / "decisions.jsonl", rt.syncer.decisions)
                raise

            def last_eval() -> float:
                rt._eval(rt.end, rt.steps[0], sync.theta(rt.syncer), int(rt.tokens.processed[0]), rt.syncer.merges,
                         final=True)
                return rt.evals[-1][2]

            return rt, close_run(run_dir, writer, summary, start, last_eval if evaluate is not None else None,
                                 rt.syncer.decisions)
    finally:
        if ckpts is not None:
            ckpts.close()
