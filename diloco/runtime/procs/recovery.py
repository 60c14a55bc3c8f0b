"""How the procs syncer survives kill -9: a write-ahead journal of what its loop does, an Orbax
checkpoint of its whole state every `run.checkpoint_every` merges, and the rule for when the
object store may forget what a restarted syncer would need again.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), section 6 (the syncer restarts
from its latest checkpoint while learners keep training); docs/design.md#checkpoints.

The syncer's loop is a sequence of journal entries: book event n of (learner, incarnation), fire
the earliest grace deadline, or book a death. Each entry carries the syncer clock `t` it ran at,
and every syncer input it delivers is stamped with that `t`, so executing the same entries on the
same state makes the same merges, versions, broadcasts and reports, bit for bit. An entry is in the
journal file (flushed to the OS, which keeps it through kill -9) before it has any effect.

A checkpoint (`<run_dir>/syncer/`, atomic: Orbax renames a finished step into place) holds the
SyncerState, the three ledgers, this module's bookkeeping (event cursors, armed deadlines, report
counter, dead incarnations not yet collected, what was delivered) and the journal and input-log
offsets. A restarted syncer restores the newest one (or starts from Theta_0 without one),
truncates both logs to those offsets and re-executes the journal after them: it arrives at the
state its predecessor died in, having re-published nothing (a version the store already has is
skipped: it is that same version) and re-reported nothing the supervisor read. Then it goes on.

That needs every event and contribution the replay reads still in the store, and the replay may
start from any checkpoint kept: a torn or unreadable newest one falls back to an older one. So the
syncer deletes booked events, acks contributions (gc deletes acked ones) and removes dead
incarnations' objects only as far as the *oldest* checkpoint kept covers them (`Covered`).
Contributions are thus re-sent in the object-store sense: a learner's contribution object stays
until every checkpoint kept has taken it in, and a restarted syncer reads it again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

from diloco.config import TrainConfig
from diloco.runtime.syncer_ckpt import SYNCER_DIR, SyncerCheckpoints, host_in, host_out, pairs
from diloco.runtime.runlog import InputLog

JOURNAL, INPUTS, CHECKPOINTS = "syncer_journal.jsonl", "syncer_inputs.bin", SYNCER_DIR
# The run's clock (t0) as the syncer started it, beside its journal: a restarted syncer whose
# ctl/start is gone or forged keeps its learners' clock (docs/design.md#damage-in-the-store).
CLOCK = "syncer_clock.json"


class Journal:
    """Appends one JSON line per loop entry, flushed before the entry runs."""

    def __init__(self, path: Path, keep: int | None = None):
        self.path = Path(path)
        self._file = self.path.open("wb" if keep is None else "r+b")
        if keep is not None:
            self._file.truncate(keep)
            self._file.seek(keep)

    def append(self, entry: dict) -> None:
        self._file.write(json.dumps(entry, separators=(",", ":")).encode() + b"\n")
        self._file.flush()  # to the OS: survives kill -9 (not power loss; nor does the store, sync=False)

    def offset(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        self._file.close()


def read_journal(path: Path, offset: int) -> tuple[list[dict], int]:
    """The entries from byte `offset` on, and the byte just past the last whole one. A last line
    without its newline was cut by the kill before it was flushed whole, so it never ran."""
    blob = Path(path).read_bytes()[offset:] if Path(path).exists() else b""
    whole = blob[:blob.rfind(b"\n") + 1]
    return [json.loads(line) for line in whole.splitlines()], offset + len(whole)


class Covered(NamedTuple):
    """What a checkpoint took in: the store may drop events before `cursor` of the `current`
    incarnations, contributions up to `delivered`, and every object of the `graves`."""

    current: dict[int, int]
    cursor: dict[int, int]
    delivered: dict[tuple[int, int], int]
    graves: frozenset[tuple[int, int]]


def covered_now(rt) -> Covered:
    return Covered(dict(rt.current), dict(rt.cursor), dict(rt.delivered), frozenset(rt.graves))


def bookkeeping_out(rt) -> tuple[dict, dict]:
    """(arrays, meta) of a ProcSyncer's host (ledgers, learners) and loop state at an entry boundary."""
    arrays, meta = host_out(rt.host)
    meta.update({
        "current": pairs(rt.current), "cursor": pairs(rt.cursor), "steps": pairs(rt.steps),
        "died_at": pairs(rt.died_at), "delivered": sorted([m, i, s] for (m, i), s in rt.delivered.items()),
        "graves": sorted(list(g) for g in rt.graves), "deadlines": [list(d) for d in rt.deadlines],
        "order": rt.order, "reports": rt.reports,
    })
    return arrays, meta


def bookkeeping_in(rt, state, arrays: dict, meta: dict) -> None:
    host_in(rt.host, state, arrays, meta)
    rt.current, rt.cursor, rt.steps = (dict(meta[k]) for k in ("current", "cursor", "steps"))
    rt.died_at = dict(meta["died_at"])
    rt.delivered = {(m, i): s for m, i, s in meta["delivered"]}
    rt.graves = {tuple(g) for g in meta["graves"]}
    rt.deadlines = [tuple(d) for d in meta["deadlines"]]  # saved in heap order: still a heap
    rt.order, rt.reports = meta["order"], meta["reports"]


class Recovery:
    """Checkpoints, journal and input log of one syncer process. Off without a run directory or
    with run.checkpoint_every = 0: then nothing is journaled, the store forgets what is booked at
    once, and a syncer death fails the run."""

    def __init__(self, cfg: TrainConfig, run_dir: Path | None):
        self.run_dir, self.every = run_dir, cfg.run.checkpoint_every
        self.enabled = restartable(cfg, run_dir)
        self.keep, self.fail_s = cfg.run.keep_checkpoints, cfg.run.checkpoint_fail_s
        self.ckpts: SyncerCheckpoints | None = None
        self.journal: Journal | None = None
        self.saved_merges = 0
        self.pending: tuple[int, Covered] | None = None  # a save in flight and what it covers
        # What each completed checkpoint of this process covers, by step; None for one a
        # predecessor wrote, whose cover this process does not know (it keeps everything for it).
        self.covers: dict[int, Covered | None] = {}

    def open(self, rt, restart: bool) -> list[dict]:
        """Set up the logs of `rt` (a fresh ProcSyncer); after a restart, restore it from the newest
        checkpoint and return the journal entries to execute again."""
        if self.run_dir is None:
            return []
        if not self.enabled:
            rt.host.inputs = InputLog(self.run_dir / INPUTS)
            return []
        directory = self.run_dir / CHECKPOINTS
        if not restart:  # a run into a used directory must never restore the earlier run's syncer
            shutil.rmtree(directory, ignore_errors=True)
        self.ckpts = SyncerCheckpoints(directory, self.every, self.keep, fail_s=self.fail_s)
        if not restart:
            rt.host.inputs, self.journal = InputLog(self.run_dir / INPUTS), Journal(self.run_dir / JOURNAL)
            return []
        found = self.ckpts.latest_raw(rt.setup.policy, rt.setup.fragments)
        offsets = {"journal": 0, "inputs": 0}  # no checkpoint yet: Theta_0 and the whole journal
        if found is not None:
            state, arrays, meta = found
            bookkeeping_in(rt, state, arrays.get("extra", {}), meta["extra"])
            offsets = meta["extra"]["offsets"]
            self.saved_merges = state.merges
            self.covers[offsets["journal"]] = covered_now(rt)  # its step is its journal offset
        entries, end = read_journal(self.run_dir / JOURNAL, offsets["journal"])
        rt.host.inputs = InputLog(self.run_dir / INPUTS, keep=offsets["inputs"])
        self.journal = Journal(self.run_dir / JOURNAL, keep=end)
        return entries

    def log(self, entry: dict) -> None:
        if self.journal is not None:
            self.journal.append(entry)

    def maybe_save(self, rt, final: bool = False) -> None:
        """At an entry boundary, every `every` merges (or at any new merge if `final`: a syncer
        stopped by SIGTERM): an async checkpoint of everything."""
        due = rt.host.state.merges - self.saved_merges >= (1 if final else self.every)
        if self.ckpts is None or not due:
            return
        self._promote()  # Orbax finishes the previous save before it starts this one
        arrays, meta = bookkeeping_out(rt)
        meta["offsets"] = {"journal": self.journal.offset(), "inputs": rt.host.inputs.offset()}
        step = meta["offsets"]["journal"]  # grows with every entry, so never a step used before
        if self.ckpts.save(rt.host.state, rt.host.inputs_seen, step=step, extra=(arrays, meta)):
            self.pending = (step, covered_now(rt))
        self.saved_merges = rt.host.state.merges

    def covered(self, rt, final: bool = False) -> Covered:
        """What the store may forget: all that is booked when recovery is off or the run's result
        is out (`final`), else what the oldest checkpoint on disk covers (nothing before one, nor
        while it is one a predecessor wrote): a restore may fall back to any of them."""
        if not self.enabled or final:
            return covered_now(rt)
        self._promote()
        kept = self._steps()
        self.covers = {step: c for step, c in self.covers.items() if step in kept}  # Orbax kept the last k
        oldest = self.covers.get(min(kept)) if kept else None
        return oldest or Covered({}, {}, {}, frozenset())

    def _steps(self) -> set[int]:
        """The steps of the checkpoints on disk; a save in progress has a temporary name."""
        directory = self.run_dir / CHECKPOINTS
        return {int(d.name) for d in directory.iterdir() if d.name.isdigit()} if directory.is_dir() else set()

    def _promote(self) -> None:
        if self.pending is not None and (self.run_dir / CHECKPOINTS / str(self.pending[0])).is_dir():
            self.covers[self.pending[0]] = self.pending[1]
            self.pending = None

    def keep_clock(self, t0: float) -> None:
        """Record the run's clock beside the journal (written whole: a temporary file renamed)."""
        if self.enabled:
            tmp = self.run_dir / f"{CLOCK}.tmp"
            tmp.write_text(json.dumps({"t0": t0}))
            tmp.replace(self.run_dir / CLOCK)

    def kept_clock(self) -> float | None:
        """The clock keep_clock recorded, None if none (or it is unreadable)."""
        try:
            t0 = json.loads((self.run_dir / CLOCK).read_text())["t0"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return float(t0) if self.enabled and type(t0) in (int, float) else None

    def close(self, rt) -> None:
        for f in (rt.host.inputs, self.journal):
            if f is not None:
                f.close()
        if self.ckpts is not None:
            self.ckpts.close()


def restartable(cfg: TrainConfig, run_dir: Path | None) -> bool:
    """Whether a syncer of this run can be restarted: it journals and checkpoints itself."""
    return run_dir is not None and cfg.run.checkpoint_every > 0
