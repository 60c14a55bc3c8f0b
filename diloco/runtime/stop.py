"""How a run stopped by Ctrl-C or SIGTERM ends (docs/design.md#stopping-a-run): the runtime saves
what a resume needs and raises `RunStopped`, and the entry point prints `stop_message` (the
partial summary and the one command line that resumes the run) instead of a traceback.

A second signal while the first stop is still saving forces the stop: the runtime stops waiting
for its workers and ends with what is saved (`RunStopped.forced`); a resume then starts from the
newest checkpoints that were complete.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import threading
from pathlib import Path

from diloco import report

EXIT_STATUS = 130  # 128 + SIGINT, what a shell reports for a job ended by Ctrl-C
_OURS = ("run.resume", "run.out_dir")  # the overrides a resume line sets itself


class RunStopped(KeyboardInterrupt):
    """A run stopped by a signal, after saving what it could. A KeyboardInterrupt, so code that
    treats Ctrl-C as such still does; `summary` is the partial summary (None if the ledgers could
    not give one), `resumable` whether `run.resume=true run.out_dir=<run_dir>` continues it."""

    def __init__(self, run_dir: Path | None, summary: dict | None, resumable: bool, forced: bool = False,
                 why_not: str = ""):
        super().__init__(f"run stopped{' (forced)' if forced else ''}")
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.summary, self.resumable, self.forced = summary, resumable and run_dir is not None, forced
        self.why_not = why_not or ("it has no run directory" if run_dir is None else "no checkpoint to resume from was saved")


def resume_hint(run_dir: Path | str, overrides: list[str] | tuple[str, ...]) -> str:
    """The one line that resumes a stopped run: its own command-line overrides (Hydra's
    `HydraConfig.get().overrides.task`), without any run.resume or run.out_dir of theirs, then
    `run.resume=true run.out_dir=<run_dir>`. Each override is shell-quoted where it needs it and
    the whole escaped for the double quotes of ARGS."""
    kept = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in _OURS]
    words = [*kept, "run.resume=true", f"run.out_dir={run_dir}"]
    args = " ".join(shlex.quote(w) for w in words)
    for c in '\\"$`':  # special inside the double quotes of ARGS="..."
        args = args.replace(c, "\\" + c)
    return f'resume with: make train ARGS="{args}"'


def stop_message(stopped: RunStopped, overrides: list[str] | tuple[str, ...]) -> str:
    """What the entry point prints for a stopped run: the partial summary, then the resume line
    (or why there is none)."""
    lines = []
    if stopped.summary:
        title = f"run {stopped.run_dir} stopped; partial summary" if stopped.run_dir else "run stopped; partial summary"
        lines.append(report.render_summary(stopped.summary, title))
    if stopped.resumable:
        lines.append(resume_hint(stopped.run_dir, overrides))
    else:
        lines.append(f"stopped; this run cannot be resumed: {stopped.why_not}")
    return "\n".join(lines)


@contextlib.contextmanager
def signals_as_interrupt():
    """SIGTERM (a process manager stopping the job) raises KeyboardInterrupt as Ctrl-C does, in the
    main thread only; the previous handlers are back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.default_int_handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextlib.contextmanager
def sigint_ignored():
    """SIGINT ignored while a child process is spawned: an ignored signal stays ignored across
    exec, so a Ctrl-C to the process group cannot raise in the child's start-up before its own
    handlers are set (it would print a traceback). Main thread only; a no-op elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
