"""A jax.profiler trace of a window of training steps (run.profile), docs/design.md#profiling-a-run.

One trace per process (jax.profiler traces every device the process drives): the data-parallel
trainer traces its steps, a Decoupled DiLoCo run learner 0's, and with them whatever else that
process runs in the window (sim's other learners, the threads runtime's learner threads).
"""

from __future__ import annotations

from pathlib import Path

import jax


def action(done: int, window: tuple[int, ...] | None, running: bool) -> str | None:
    """What to do once `done` steps have finished: "start" a trace not `running` at window[0] (or
    later inside the window: a resumed run, a rejoined learner), "stop" a running one at
    window[1], else None. A whole trace covers steps window[0] + 1 .. window[1] (1-based)."""
    if not window:
        return None
    start, stop = window
    if running:
        return "stop" if done >= stop else None
    return "start" if start <= done < stop else None


class Trace:
    """Starts and stops the trace as `at` is told the steps done; `close` (or leaving a `with`)
    stops one still running, so a run that ends or fails inside the window leaves a whole trace.
    Without a window or a directory it does nothing."""

    def __init__(self, window: tuple[int, ...] | None, directory: Path | None):
        self.window = tuple(window) if window and directory is not None else None
        self.directory = directory
        self.running = False

    def at(self, done: int, pending=None) -> None:
        """`done` steps have finished, their device work maybe still queued: `pending` (arrays) is
        waited for before a stop, so the window's steps are inside the trace."""
        what = action(done, self.window, self.running)
        if what == "start":
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.running = True
        elif what == "stop":
            jax.block_until_ready(pending)
            self.close()

    def close(self) -> None:
        if self.running:
            self.running = False
            jax.profiler.stop_trace()

    def __enter__(self) -> "Trace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def for_run(cfg, run_dir: Path | None, learner: int = 0, leader: bool = True) -> Trace:
    """The trace of a run of config `cfg` into <run_dir>/profile: the data-parallel trainer's, or
    learner 0's (`leader`: the process of its world that traces, docs/multihost.md); a Trace that
    does nothing for any other learner or process, and without run.profile or a run directory."""
    traced = learner == 0 and leader and run_dir is not None
    return Trace(cfg.run.profile if traced else None, Path(run_dir) / "profile" if traced else None)
