"""What a learner tells the syncer's host, as typed events: one vocabulary for every runtime.

sim builds them in its event loop, threads puts them on a queue, procs writes them to the object
store as JSON (`to_json` / `from_json`, contributions travelling separately under their own keys);
`SyncerHost.on_event` (diloco/runtime/host.py) books every one of them the same way.

`fetched` lists the broadcasts a learner pulled itself since its previous event, as
[time, fragment, bytes, codec]: in procs learners fetch from the store, so the down bytes are
booked from what they report; where the syncer pushes broadcasts (sim, threads) it is empty.
`stalls` are (start, end) waits the learner ended since its previous event.
"""

from __future__ import annotations

from typing import Any, NamedTuple

Stalls = tuple[tuple[float, float], ...]
Fetched = tuple[tuple[float, int, int, str], ...]


class StepDone(NamedTuple):
    learner: int
    incarnation: int
    step: int  # the step count after this step
    start: float
    end: float
    tokens: int  # trained on: fewer when slices were down; of fine-tuning rows, the assistant's
    sends: tuple[tuple[int, int], ...]  # (fragment, seq) of each contribution this step sends
    frames: tuple[bytes | None, ...] = ()  # their wire frames (None: lost before the syncer got it)
    stalls: Stalls = ()
    loss: float | None = None
    fetched: Fetched = ()
    # batch rows computed, fewer than data.batch_size when slices were down; 0 = the full batch.
    # The time ledger's share of live chips, which `tokens` no longer gives once a fine-tuning
    # batch trains on only its assistant tokens.
    rows: int = 0


class Flushed(NamedTuple):
    """The final sync: every fragment with unsent progress, sent at once after the last step."""

    learner: int
    incarnation: int
    at: float
    sends: tuple[tuple[int, int], ...]
    frames: tuple[bytes | None, ...] = ()
    fetched: Fetched = ()


class Applied(NamedTuple):
    learner: int
    incarnation: int
    fragments: tuple[int, ...]
    fetched: Fetched = ()


class Died(NamedTuple):
    learner: int
    incarnation: int
    at: float
    stalls: Stalls = ()


class Rejoined(NamedTuple):
    """Incarnation `incarnation` is back: down from died_at to down_until, restarting until at."""

    learner: int
    incarnation: int
    died_at: float
    down_until: float
    at: float
    rejoin: dict | None = None  # diloco/runtime/rejoin.py Rejoin as a dict, for the log
    fetched: Fetched = ()


class Done(NamedTuple):
    """The learner finished run.steps (and its final sync): its last event."""

    learner: int
    incarnation: int
    at: float
    stalls: Stalls = ()
    fetched: Fetched = ()


Event = StepDone | Flushed | Applied | Died | Rejoined | Done
KINDS: dict[str, type] = {t.__name__: t for t in (StepDone, Flushed, Applied, Died, Rejoined, Done)}


def pairs(sends) -> tuple[tuple[int, int], ...]:
    """(fragment, seq) of each learner Send (diloco/algo/learner.py), as events carry them."""
    return tuple((s.fragment, s.seq) for s in sends)


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


_APART = frozenset({"frames"})  # contributions travel under their own keys, never in the JSON


def to_json(event: Event) -> dict:
    """The event as JSON-ready data, without frames (those travel under their own keys)."""
    fields = {k: v for k, v in event._asdict().items() if k not in _APART}
    return {"kind": type(event).__name__, **fields}


def json_fields(kind: type) -> frozenset[str]:
    """The keys `to_json` writes for an event of `kind`: the schema a reader of the JSON checks."""
    return frozenset({"kind", *kind._fields}) - _APART


def from_json(data: dict, frames: tuple[bytes | None, ...] = ()) -> Event:
    kind = KINDS.get(data.get("kind"))
    if kind is None:
        raise ValueError(f"unknown learner event {data.get('kind')!r}")
    fields = {k: (v if k == "rejoin" else _tuples(v)) for k, v in data.items() if k != "kind"}
    if "frames" in kind._fields:
        fields["frames"] = frames
    return kind(**fields)
