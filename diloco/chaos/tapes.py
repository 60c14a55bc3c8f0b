"""Failure tapes: the slice failures, stragglers and scavenged learners a training runtime replays.

A tape is a pure function of (ChaosConfig, learners, horizon): the same seed gives the same tape,
so elastic data parallel and Decoupled DiLoCo can be run against identical failures
(docs/experiments.md#t2-chip-failures). It is a frozen value with a JSON form; it reads and writes no files. Times
are seconds: the sim runtime reads them as virtual seconds, wall-clock runtimes scale them.

Learner state at time t is the state after every event at a time <= t.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from diloco.chaos.failures import FailureModel, sample_outages
from diloco.config import ChaosConfig

KINDS = ("learner_add", "slice_down", "slice_up", "learner_remove")  # order of events at equal times
FORMAT = "diloco.chaos.tape/1"


@dataclass(frozen=True)
class Event:
    time: float
    kind: str  # one of KINDS
    learner: int
    slice: int = -1  # the learner's own slice index, 0 .. slices_per_learner - 1; -1 for learner events


@dataclass(frozen=True)
class Tape:
    """Events sorted by (time, KINDS order, learner, slice), plus per-learner step-time factors."""

    learners: int  # base learners, present from t = 0; scavenged ones have ids from here on
    slices_per_learner: int
    horizon_s: float
    speeds: tuple[float, ...]  # step-time factor of every learner, base and scavenged
    jitter: float  # relative std of each step time
    seed: int  # for the runtime's jitter draws
    events: tuple[Event, ...] = ()

    @property
    def total_learners(self) -> int:
        return len(self.speeds)


def _key(e: Event) -> tuple:
    return (e.time, KINDS.index(e.kind), e.learner, e.slice)


def _slice_events(outages, owners: np.ndarray, spl: int, offset: float, stop: float) -> list[Event]:
    """slice_down/slice_up events of sampled outages shifted by `offset`, cut at `stop`; sampled
    slice s is slice s % spl of learner owners[s]."""
    events = []
    for s, down, up in zip(outages.slice_id.tolist(), outages.down_s.tolist(), outages.up_s.tolist()):
        learner, local = int(owners[s]), s % spl
        events.append(Event(offset + down, "slice_down", learner, local))
        if offset + up < stop:
            events.append(Event(offset + up, "slice_up", learner, local))
    return events


def generate(cfg: ChaosConfig, learners: int, horizon_s: float) -> Tape:
    """The tape of `learners` base learners plus one per scavenge window over [0, horizon_s).

    With cfg.enabled false the tape has no events and every speed is 1.0, so a runtime can always
    replay a tape. A scavenged learner starts with all slices up at its window's start and its
    failures are sampled on its own clock, so adding a window leaves the others' failures alone.
    """
    if learners < 1 or horizon_s < 0:
        raise ValueError(f"learners={learners} must be >= 1 and horizon_s={horizon_s} >= 0")
    windows = cfg.scavenge if cfg.enabled else ()
    total = learners + len(windows)
    if not cfg.enabled:
        return Tape(learners, cfg.slices_per_learner, float(horizon_s), (1.0,) * total, 0.0, cfg.seed)
    speeds = tuple(float(cfg.speeds[i % len(cfg.speeds)]) if cfg.speeds else 1.0 for i in range(total))
    model = FailureModel(chips_per_slice=cfg.chips_per_slice, mtbi_s=cfg.mtbi_s, repair=cfg.repair,
                         repair_mean_s=cfg.repair_mean_s, repair_sigma=cfg.repair_sigma)
    spl = cfg.slices_per_learner
    # One stream for the base learners and one per scavenged learner, all from cfg.seed.
    rng = np.random.default_rng([cfg.seed, 0])
    out = sample_outages(model, learners * spl, horizon_s, rng)
    events = _slice_events(out, np.arange(learners * spl) // spl, spl, 0.0, horizon_s)
    for i, (start, stop) in enumerate(windows):
        lid = learners + i
        if start >= horizon_s:
            continue
        stop = min(stop, horizon_s)
        out = sample_outages(model, spl, stop - start, np.random.default_rng([cfg.seed, 1 + i]))
        events += _slice_events(out, np.full(spl, lid), spl, start, stop)
        events.append(Event(float(start), "learner_add", lid))
        if stop < horizon_s:
            events.append(Event(float(stop), "learner_remove", lid))
    events.sort(key=_key)
    return Tape(learners, spl, float(horizon_s), speeds, float(cfg.jitter), cfg.seed, tuple(events))


def to_json(tape: Tape) -> str:
    """JSON text of a tape; from_json(to_json(t)) == t (floats round-trip exactly)."""
    return json.dumps({
        "format": FORMAT, "learners": tape.learners, "slices_per_learner": tape.slices_per_learner,
        "horizon_s": tape.horizon_s, "speeds": list(tape.speeds), "jitter": tape.jitter,
        "seed": tape.seed,
        "events": [[e.time, e.kind, e.learner, e.slice] for e in tape.events],
    })


def from_json(text: str) -> Tape:
    """Parse and check a tape's JSON text; malformed tapes raise ValueError naming the problem."""
    raw = json.loads(text)
    if raw.get("format") != FORMAT:
        raise ValueError(f"not a chaos tape: format={raw.get('format')!r}, expected {FORMAT!r}")
    events = []
    for i, item in enumerate(raw["events"]):
        if len(item) != 4 or item[1] not in KINDS:
            raise ValueError(f"tape event {i}={item!r} is not "
                             f"[time, kind in {'|'.join(KINDS)}, learner, slice]")
        events.append(Event(float(item[0]), item[1], int(item[2]), int(item[3])))
    if any(_key(a) > _key(b) for a, b in zip(events, events[1:])):
        raise ValueError("tape events are not sorted by time")
    return Tape(int(raw["learners"]), int(raw["slices_per_learner"]), float(raw["horizon_s"]),
                tuple(float(x) for x in raw["speeds"]), float(raw["jitter"]), int(raw["seed"]),
                tuple(events))


def _history(tape: Tape, learner: int, t: float):
    """(present, slices down) of a learner after every event at a time <= t."""
    present, down = learner < tape.learners, set()
    for e in tape.events:
        if e.time > t:
            break
        if e.learner != learner:
            continue
        if e.kind == "learner_add":
            present, down = True, set()
        elif e.kind == "learner_remove":
            present = False
        elif e.kind == "slice_down":
            down.add(e.slice)
        else:
            down.discard(e.slice)
    return present, down


def live_slices(tape: Tape, learner: int, t: float) -> int:
    """How many of the learner's slices are up at time t (0 while it is not part of the run)."""
    present, down = _history(tape, learner, t)
    return tape.slices_per_learner - len(down) if present else 0


def is_alive(tape: Tape, learner: int, t: float) -> bool:
    """A learner runs when it is part of the run and has at least one live slice."""
    return live_slices(tape, learner, t) > 0


def batch_rows(tape: Tape, learner: int, t: float, batch_size: int, devices: int) -> int:
    """Batch rows a learner computes at time t: its live slices' share, whole rows per device
    (at least one per device; rows of dead slices are simply not computed)."""
    return _rows(live_slices(tape, learner, t), tape.slices_per_learner, batch_size, devices)


def rows_options(tape: Tape, batch_size: int, devices: int) -> tuple[int, ...]:
    """Every batch_rows value a live learner can have (1 .. all slices up)."""
    return tuple(_rows(k, tape.slices_per_learner, batch_size, devices)
                 for k in range(1, tape.slices_per_learner + 1))


def _rows(live: int, slices: int, batch_size: int, devices: int) -> int:
    return max(devices, batch_size * live // slices // devices * devices)


def injected(tape: Tape, until: float) -> dict[str, int]:
    """What the tape did to the run up to tape time `until`: slice failures (slice_down events) and
    learner outages (a slice failure that took a present learner's last live slice, which is what
    ends an incarnation; a failure short of that shrinks the learner's batch instead)."""
    slices = outages = 0
    down: dict[int, set] = {}
    present = set(range(tape.learners))
    for e in tape.events:
        if e.time > until:
            break
        if e.kind == "learner_add":
            present.add(e.learner)
            down[e.learner] = set()
        elif e.kind == "learner_remove":
            present.discard(e.learner)
        elif e.kind == "slice_down":
            slices += 1
            lost = down.setdefault(e.learner, set())
            before = len(lost)
            lost.add(e.slice)
            outages += e.learner in present and before < tape.slices_per_learner == len(lost)
        else:
            down.setdefault(e.learner, set()).discard(e.slice)
    return {"slice_failures": slices, "learner_outages": outages}


def back_at(tape: Tape, learner: int, t: float) -> float:
    """The first time >= t at which the learner is alive again (inf if never)."""
    while not is_alive(tape, learner, t):
        t = next_change(tape, learner, t)
        if math.isinf(t):
            return t
    return t


def next_change(tape: Tape, learner: int, t: float) -> float:
    """Time of the learner's first event strictly after t; inf if there is none."""
    for e in tape.events:
        if e.time > t and e.learner == learner:
            return e.time
    return math.inf
