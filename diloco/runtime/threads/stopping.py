"""Stopping and resuming a threads run (docs/design.md#stopping-a-run): what the main thread saves
after a Ctrl-C or SIGTERM, and how a resumed run takes it up.

Ctrl-C or SIGTERM stops the threads as an error does (diloco/runtime/threads/runtime.py), then:
each learner saves a final checkpoint where it stopped, the main thread (the host's owner once the
syncer thread has ended) books the events still queued, saves a final syncer checkpoint
(diloco/runtime/syncer_ckpt.py: the syncer state, the ledgers, the host's and this runtime's
bookkeeping) and raises RunStopped with the partial summary. `run.resume=true` restores that checkpoint, books every learner still
live dead at the stop, and brings each learner not done back as its next incarnation through the
rejoin rule, on a clock that continues where the stopped run ended.
"""

from __future__ import annotations

import logging
import queue
from pathlib import Path
from typing import NamedTuple

from diloco.config import ConfigError, TrainConfig
from diloco.runtime import events as ev
from diloco.runtime.build import Setup
from diloco.runtime.stop import RunStopped
from diloco.runtime.syncer_ckpt import SYNCER_DIR, SyncerCheckpoints, host_in, host_out, pairs

log = logging.getLogger(__name__)


class ComeBack(NamedTuple):
    """How learner m comes back in a resumed run: as `incarnation`, its predecessor having stopped
    at `step` (as the syncer booked it) and died at `died_at` (the stop, on the run's clock)."""

    incarnation: int
    step: int
    died_at: float


class StopAndResume:
    """The stop and resume of diloco.runtime.threads.runtime.Threads, which holds the attributes
    these methods read and write (host, steps, died_at, deadlines, clock, ...)."""

    def _restore(self, state, arrays: dict, meta: dict) -> None:
        """Take up a stopped run: its syncer and ledgers as saved, every learner still live booked
        dead at the stop, and a plan for each one not done to come back as its next incarnation."""
        extra = meta["extra"]
        host_in(self.host, state, arrays.get("extra", {}), extra)
        self.steps.update(dict(extra["steps"]))
        self.died_at = dict(extra["died_at"])
        self.deadlines = [tuple(d) for d in extra["deadlines"]]  # saved in heap order: still a heap
        self._order = extra["order"]
        self.offset = self.end = extra["clock"]
        for m in sorted(self.host.alive - self.host.done):  # before any thread runs: the host is ours
            self._on_event(ev.Died(m, self.host.incarnations[m], self.offset), self.offset)
        self.comeback = {m: ComeBack(self.host.incarnations[m] + 1, self.steps[m], self.died_at.get(m, self.offset))
                         for m in range(self.M) if m not in self.host.done}

    def _stopped(self) -> RunStopped:
        """After a Ctrl-C / SIGTERM, every thread joined (or a forced stop): book what the learners
        emitted, save the final syncer checkpoint, and the partial summary."""
        forced = self.crew.forced
        if self._syncer_thread.is_alive():  # it still owns the host: nothing can be saved safely
            return RunStopped(self.run_dir, None, self._resumable(), forced=True)
        self._booking_stop = True
        while True:
            try:
                self._on_event(self.up.get_nowait(), self.clock())
            except queue.Empty:
                break
        for event in list(self.leftover):  # after the queued ones: each learner's order holds
            self._on_event(event, self.clock())
        # The run ends where the signal came or its last booked interval does, whichever is later;
        # saving the checkpoints afterwards is not the run's time (a resumed clock starts here).
        self.end = max([self.end, self.stopped_at, *(v[2] for v in self.host.time.open.values())])
        saved = self._save_stop()
        try:
            summary = self.summary()
        except Exception as err:  # noqa: BLE001 - the stop must still end cleanly and say how to resume
            log.error("no partial summary: %s: %s", type(err).__name__, err)
            summary = None
        return RunStopped(self.run_dir, summary, saved or self._resumable(), forced=forced)

    def _save_stop(self) -> bool:
        if self.syncer_ckpts is None:
            return False
        arrays, meta = host_out(self.host)
        meta.update({"steps": pairs(self.steps), "died_at": pairs(self.died_at),
                     "deadlines": [list(d) for d in self.deadlines], "order": self._order, "clock": self.end})
        with self._ckpt_lock:  # learners of a forced stop may still be saving theirs
            return self.syncer_ckpts.save(self.host.state, self.host.inputs_seen, extra=(arrays, meta))

    def _resumable(self) -> bool:
        return self.syncer_ckpts is not None and bool(self.syncer_ckpts.manager.all_steps())


def latest_stop(cfg: TrainConfig, setup: Setup, ckpts: SyncerCheckpoints, run_dir: Path) -> tuple:
    """(state, arrays, meta) of the newest usable syncer checkpoint a stop saved in `run_dir`;
    ConfigError if there is none (a run that finished, or was killed before it could save one)."""
    found = ckpts.latest_raw(setup.policy, setup.fragments)
    if found is None or "extra" not in found[2]:
        raise ConfigError(f"run.resume=true but {run_dir / SYNCER_DIR} holds no usable syncer checkpoint: "
                          "a threads run saves one when Ctrl-C or SIGTERM stops it; this one finished "
                          "or was killed before it could")
    return found
