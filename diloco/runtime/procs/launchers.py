"""A procs run from end to end: its store, metrics writer and supervisor, with the launcher its
config picks (the one place that choice is made): Ray actors for runtime.kind=ray
(diloco/runtime/ray_runtime.py, imported only then), the syncer alone for runtime.launch=external
(learners started apart, diloco/runtime/procs/standalone.py), else processes of this machine
(diloco/runtime/procs/launch.py).

Reference: docs/design.md#procs; docs/design.md#adding-a-runtime.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Callable

from diloco import report
from diloco import watch as run_watch
from diloco.config import TrainConfig
from diloco.evaluation import during_run
from diloco.runtime.build import Setup
from diloco.runtime.interfaces import Launcher
from diloco.runtime.procs.launch import Local
from diloco.runtime.procs.standalone import External
from diloco.runtime.procs.supervisor import Procs
from diloco.runtime.runlog import learner_rates
from diloco.runtime.walltape import run_tape
from diloco.store import network


def launcher_for(cfg: TrainConfig) -> Launcher:
    """The launcher of cfg's run."""
    if cfg.runtime.kind == "ray":
        from diloco.runtime.ray_runtime import RayLauncher  # an optional extra: imported only when asked for
        return RayLauncher()
    return External() if cfg.runtime.launch == "external" else Local()


def run(cfg: TrainConfig, setup: Setup, run_dir: Path | None,
        evaluate: Callable[[dict], float] | None, launcher: Launcher | None = None) -> tuple[Procs, dict]:
    """Run Decoupled DiLoCo as supervised processes; returns the finished supervisor (for its
    records) and a summary with the same keys as sim's and threads'. `launcher`: launcher_for(cfg)
    unless given."""
    launcher = launcher_for(cfg) if launcher is None else launcher
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
        rt = Procs(cfg, setup, run_dir, evaluate, writer, url, launcher, str(root / "xla_cache"))
        if not cfg.run.resume and during_run.scores_tasks(evaluate):  # the base model's task scores
            rt.record_eval(0.0, 0, {path: x for frag in setup.theta0 for path, x in frag.items()}, 0, 0)
        summary = rt.run()
        if evaluate is not None:
            rt.record_eval(rt.finished["time"], rt.finished["steps"]["0"], rt.theta, rt.finished["processed0"],
                           rt.finished["merges"], final=True)
            summary["eval_loss"] = rt.evals[-1][2]
        summary["tokens_at_start"] = rt.tokens_at_start  # a resumed run's rates are its own (run.py)
        if writer is not None:
            writer.summary(summary)
        return rt, summary
