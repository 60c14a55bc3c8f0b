"""The byte ledger: every serialized message as an event, so bandwidth is an output of a run
(docs/design.md#ledgers); totals by learner, direction, fragment and codec, mean and peak rates."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from diloco.algo.eventlog import LedgerError, Log, append, rows


DIRECTIONS = ("up", "down")  # up: learner -> syncer; down: syncer -> learner
BYTE_ROW = np.dtype([("time", "f8"), ("nbytes", "i8"), ("direction", "i1"), ("learner", "i4"),
                      ("fragment", "i4"), ("codec", "i4")])


class ByteLedger(NamedTuple):
    """Every serialized message as an event (time on the runtime's clock, virtual or wall)."""

    codecs: tuple[str, ...]  # codec specs seen; events store an index into it
    log: Log


def byte_ledger() -> ByteLedger:
    return ByteLedger((), Log())


def add_bytes(led: ByteLedger, time: float, nbytes: int, direction: str, learner: int,
              fragment: int, codec: str) -> ByteLedger:
    """One message of `nbytes` (the whole frame, as counted on the wire) at `time`."""
    if direction not in DIRECTIONS:
        raise LedgerError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if nbytes < 0:
        raise LedgerError(f"nbytes must be >= 0, got {nbytes}")
    codecs = led.codecs if codec in led.codecs else led.codecs + (codec,)
    row = (float(time), int(nbytes), DIRECTIONS.index(direction), learner, fragment, codecs.index(codec))
    return ByteLedger(codecs, append(led.log, row, BYTE_ROW))


def byte_events(led: ByteLedger, direction: str | None = None, learner: int | None = None,
                fragment: int | None = None) -> np.ndarray:
    """The events as a structured array, optionally filtered, in insertion order."""
    ev = rows(led.log, BYTE_ROW)
    want = {"direction": None if direction is None else DIRECTIONS.index(direction),
            "learner": learner, "fragment": fragment}
    keep = np.ones(len(ev), bool)
    for field, value in want.items():
        keep &= True if value is None else ev[field] == value
    return ev[keep]


class Sent(NamedTuple):
    """Bytes per direction over the frozen chunks of a byte ledger counted so far (`sent`)."""

    chunks: int = 0
    last: Any = None  # the last chunk counted: a ledger restored since holds other arrays
    up: int = 0
    down: int = 0


def sent(led: ByteLedger, counted: Sent = Sent()) -> tuple[int, int, Sent]:
    """(bytes up, bytes down, what to pass next time): each frozen chunk is summed once, so a
    total per merge costs the chunks since the last one, not the whole run's messages."""
    chunks = led.log.chunks
    if counted.chunks > len(chunks) or (counted.chunks and chunks[counted.chunks - 1] is not counted.last):
        counted = Sent()
    up, down = counted.up, counted.down
    for c in chunks[counted.chunks:]:
        upward = c["direction"] == DIRECTIONS.index("up")
        up, down = up + int(c["nbytes"][upward].sum()), down + int(c["nbytes"][~upward].sum())
    counted = Sent(len(chunks), chunks[-1] if chunks else None, up, down)
    for row in led.log.tail:  # BYTE_ROW order: time, nbytes, direction, ...
        up, down = (up + row[1], down) if row[2] == DIRECTIONS.index("up") else (up, down + row[1])
    return up, down, counted


def byte_totals(led: ByteLedger, by: Sequence[str] = ("learner", "direction")) -> dict[tuple, int]:
    """Total bytes grouped by any of "learner", "direction", "fragment", "codec"."""
    ev = rows(led.log, BYTE_ROW)
    if not len(ev):
        return {}
    keys, group = np.unique(np.stack([ev[f].astype(np.int64) for f in by], 1), axis=0, return_inverse=True)
    sums = np.bincount(group.reshape(-1), weights=ev["nbytes"]).astype(np.int64)
    names = {"direction": DIRECTIONS, "codec": led.codecs}
    return {tuple(names[f][k] if f in names else int(k) for f, k in zip(by, key)): int(n)
            for key, n in zip(keys, sums)}


def window_rates(led: ByteLedger, window: float, start: float = 0.0, end: float | None = None,
                 **filters: Any) -> np.ndarray:
    """Bytes per second in windows [start + k w, start + (k+1) w) up to `end` (default: the
    window holding the last event)."""
    if window <= 0:
        raise LedgerError(f"window must be > 0 seconds, got {window}")
    ev = byte_events(led, **filters)
    if end is None:
        n = int((ev["time"].max() - start) // window) + 1 if len(ev) else 1
    else:
        n = max(1, int(np.ceil((end - start) / window)))
    inside = (ev["time"] >= start) & (ev["time"] < start + n * window)
    k = ((ev["time"][inside] - start) // window).astype(np.int64)
    return np.bincount(k, weights=ev["nbytes"][inside], minlength=n)[:n] / window


def mean_rate(led: ByteLedger, start: float, end: float, **filters: Any) -> float:
    """Bytes per second over [start, end)."""
    if end <= start:
        raise LedgerError(f"empty interval [{start}, {end})")
    ev = byte_events(led, **filters)
    inside = (ev["time"] >= start) & (ev["time"] < end)
    return float(ev["nbytes"][inside].sum()) / (end - start)


def without_last_sends(ev: np.ndarray) -> np.ndarray:
    """The events before each learner's last one in time. A learner's final sync sends every
    fragment at once, as its last messages: leaving them out gives the rate while training."""
    last = np.full(int(ev["learner"].max()) + 1 if len(ev) else 0, -np.inf)
    np.maximum.at(last, ev["learner"], ev["time"])
    return ev[ev["time"] < last[ev["learner"]]]


def peak_rate(led: ByteLedger, window: float, skip_last: bool = False, **filters: Any) -> float:
    """Most bytes in any interval [t, t + window), over the window: a sliding, not a binned, peak;
    `skip_last` leaves out each learner's last send (without_last_sends).

    Some busiest interval starts at an event, so trying every event's time as a start is exact.
    """
    if window <= 0:
        raise LedgerError(f"window must be > 0 seconds, got {window}")
    ev = byte_events(led, **filters)
    ev = np.sort(without_last_sends(ev) if skip_last else ev, order="time")
    if not len(ev):
        return 0.0
    cum = np.concatenate([[0], np.cumsum(ev["nbytes"])])
    last = np.searchsorted(ev["time"], ev["time"] + window, side="left")
    return float((cum[last] - cum[:-1]).max()) / window
