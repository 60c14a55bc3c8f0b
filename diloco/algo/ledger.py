"""Token, byte and time ledgers: goodput and bandwidth as outputs of a run (DESIGN.md "Ledgers").

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428): goodput, uptime and bandwidth are
the paper's headline measures, so they are booked from events, never estimated afterwards.

Every ledger is an immutable value; each `add`-style function returns a new one. Event logs grow
by whole numpy chunks plus a short tuple tail, so appending costs O(1) amortised without mutation.

Token ledger, per fragment p (every token a learner processes is processed once for every p):

    processed_p = merged_p + sum_r dropped_p[r] + lost_p + outstanding_p

* processed_p: tokens of every inner step of every learner incarnation.
* outstanding_p: tokens not yet resolved: `pending` (processed, not yet sent) plus `in_flight`
  (sent in a contribution the syncer has not yet merged or dropped).
* A contribution carries the tokens processed since the learner's previous send of p (not its
  c_tokens, which counts since the last *apply* of p and can repeat tokens of an earlier send
  still in flight); so every token is in at most one contribution.
* merged_p: in a contribution that entered a merge of p.
* dropped_p[r]: "stale" (max_staleness cut-off), "excluded" (the syncer left it out, e.g. too
  late for any round), "quarantined:<reason>" (a messages.QUARANTINE_REASONS reason), and
  "overwritten": pending when the learner applied a global version of p. The learner resets
  c_steps/c_tokens there (ALGORITHM.md section 3), so these tokens (the tau overlap steps after a
  send, with alpha = 0 also their update to p) never reach the syncer.
* lost_p: pending when the learner incarnation died, or in a contribution lost in transit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from diloco.algo.messages import QUARANTINE_REASONS

_CHUNK = 256  # tail length before it is frozen into a numpy chunk

class _Log(NamedTuple):
    """Append-only rows: frozen numpy chunks plus a tuple tail."""

    chunks: tuple[np.ndarray, ...] = ()
    tail: tuple[tuple, ...] = ()


def _append(log: _Log, row: tuple, dtype: np.dtype) -> _Log:
    tail = log.tail + (row,)
    if len(tail) < _CHUNK:
        return _Log(log.chunks, tail)
    return _Log(log.chunks + (np.array(list(tail), dtype),), ())


def _rows(log: _Log, dtype: np.dtype) -> np.ndarray:
    return np.concatenate([*log.chunks, np.array(list(log.tail), dtype)])


DROP_REASONS = ("stale", "excluded", "overwritten") + tuple(f"quarantined:{r}" for r in QUARANTINE_REASONS)

Incarnation = tuple[int, int]  # (learner, incarnation)
MessageKey = tuple[int, int, int]  # (learner, incarnation, seq)


class TokenLedger(NamedTuple):
    """Token counts per fragment (see the module docstring for the equation they satisfy)."""

    processed: tuple[int, ...]  # per fragment
    merged: tuple[int, ...]
    dropped: dict[str, tuple[int, ...]]  # reason -> per fragment
    lost: tuple[int, ...]
    pending: dict[Incarnation, tuple[int, ...]]  # processed, not yet sent, per fragment
    in_flight: dict[MessageKey, tuple[int, int]]  # sent, unresolved: (fragment, tokens)
    dead: frozenset[Incarnation]
    unmatched: int  # resolutions of messages never in flight (duplicates, forgeries): no tokens

    @property
    def num_fragments(self) -> int:
        return len(self.processed)


class LedgerError(ValueError):
    """A ledger event that contradicts earlier events, or a ledger that does not balance."""


def token_ledger(num_fragments: int) -> TokenLedger:
    zeros = (0,) * num_fragments
    return TokenLedger(zeros, zeros, {}, zeros, {}, {}, frozenset(), 0)


def _add(xs: tuple[int, ...], p: int, n: int) -> tuple[int, ...]:
    return xs[:p] + (xs[p] + n,) + xs[p + 1:]


def _plus(xs: tuple[int, ...], ys: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x + y for x, y in zip(xs, ys))


def process(led: TokenLedger, learner: int, incarnation: int, tokens: int) -> TokenLedger:
    """One inner step of `tokens` tokens: processed once for every fragment."""
    key = (learner, incarnation)
    if key in led.dead:
        raise LedgerError(f"learner {learner} incarnation {incarnation} is dead and cannot process")
    if tokens < 0:
        raise LedgerError(f"tokens must be >= 0, got {tokens}")
    step = (tokens,) * led.num_fragments
    pending = dict(led.pending)
    pending[key] = _plus(pending.get(key, (0,) * led.num_fragments), step)
    return led._replace(processed=_plus(led.processed, step), pending=pending)


def _take_pending(led: TokenLedger, learner: int, incarnation: int, fragment: int) -> tuple[int, dict]:
    if not 0 <= fragment < led.num_fragments:
        raise LedgerError(f"fragment {fragment} outside 0..{led.num_fragments - 1}")
    key = (learner, incarnation)
    row = led.pending.get(key, (0,) * led.num_fragments)
    pending = dict(led.pending)
    pending[key] = _add(row, fragment, -row[fragment])
    return row[fragment], pending


def send(led: TokenLedger, learner: int, incarnation: int, fragment: int, seq: int) -> TokenLedger:
    """The learner sent its contribution for `fragment` with sequence number `seq`."""
    key = (learner, incarnation, seq)
    if key in led.in_flight:
        raise LedgerError(f"message {key} is already in flight")
    if (learner, incarnation) in led.dead:
        raise LedgerError(f"learner {learner} incarnation {incarnation} is dead and cannot send")
    tokens, pending = _take_pending(led, learner, incarnation, fragment)
    return led._replace(pending=pending, in_flight={**led.in_flight, key: (fragment, tokens)})


def apply(led: TokenLedger, learner: int, incarnation: int, fragment: int) -> TokenLedger:
    """The learner applied a global version of `fragment`, resetting its counters for it."""
    tokens, pending = _take_pending(led, learner, incarnation, fragment)
    dropped = _dropped_plus(led, "overwritten", fragment, tokens)
    return led._replace(pending=pending, dropped=dropped)


def _dropped_plus(led: TokenLedger, reason: str, fragment: int, tokens: int) -> dict[str, tuple[int, ...]]:
    if reason not in DROP_REASONS:
        raise LedgerError(f"unknown drop reason {reason!r}; known: {DROP_REASONS}")
    row = led.dropped.get(reason, (0,) * led.num_fragments)
    return {**led.dropped, reason: _add(row, fragment, tokens)}


def resolve(led: TokenLedger, key: MessageKey, outcome: str, into: MessageKey | None = None) -> TokenLedger:
    """The fate of a sent contribution: "merged", "lost" (in transit), "carried" (a newer
    contribution `into` of the same learner holds its progress and takes its tokens), or a drop reason.

    A message that is not in flight (a duplicate delivery, or a header naming a message never sent)
    carries no tokens of its own: it only counts in `unmatched`.
    """
    if key not in led.in_flight:
        return led._replace(unmatched=led.unmatched + 1)
    fragment, tokens = led.in_flight[key]
    in_flight = {k: v for k, v in led.in_flight.items() if k != key}
    if outcome == "merged":
        return led._replace(in_flight=in_flight, merged=_add(led.merged, fragment, tokens))
    if outcome == "lost":
        return led._replace(in_flight=in_flight, lost=_add(led.lost, fragment, tokens))
    if outcome == "carried":
        if into not in in_flight or in_flight[into][0] != fragment:
            raise LedgerError(f"{key} carried into {into}, which is not in flight for fragment {fragment}")
        in_flight[into] = (fragment, in_flight[into][1] + tokens)
        return led._replace(in_flight=in_flight)
    return led._replace(in_flight=in_flight, dropped=_dropped_plus(led, outcome, fragment, tokens))


def merge(led: TokenLedger, keys: Iterable[MessageKey]) -> TokenLedger:
    """The contributions `keys` entered a merge."""
    for key in keys:
        led = resolve(led, key, "merged")
    return led


def die(led: TokenLedger, learner: int, incarnation: int) -> TokenLedger:
    """The incarnation died: what it processed and did not send is lost. Its messages in flight
    stay outstanding until the syncer merges or drops them (or `resolve(..., "lost")`)."""
    key = (learner, incarnation)
    row = led.pending.get(key, (0,) * led.num_fragments)
    pending = {k: v for k, v in led.pending.items() if k != key}
    return led._replace(pending=pending, lost=_plus(led.lost, row), dead=led.dead | {key})


def outstanding(led: TokenLedger) -> tuple[int, ...]:
    out = (0,) * led.num_fragments
    for row in led.pending.values():
        out = _plus(out, row)
    for fragment, tokens in led.in_flight.values():
        out = _add(out, fragment, tokens)
    return out


def imbalance(led: TokenLedger) -> tuple[int, ...]:
    """processed_p - (merged_p + dropped_p + lost_p + outstanding_p), per fragment; all 0 when sound."""
    accounted = _plus(_plus(led.merged, led.lost), outstanding(led))
    for row in led.dropped.values():
        accounted = _plus(accounted, row)
    return tuple(a - b for a, b in zip(led.processed, accounted))


def balance(led: TokenLedger) -> int:
    """Sum over fragments of |imbalance_p|: 0 iff every fragment balances (no cancelling out)."""
    return sum(abs(x) for x in imbalance(led))


def check_balance(led: TokenLedger) -> None:
    """Raise LedgerError with every term of each fragment that does not balance."""
    bad = [p for p, x in enumerate(imbalance(led)) if x]
    if bad:
        out = outstanding(led)
        lines = [
            f"fragment {p}: processed {led.processed[p]} != merged {led.merged[p]} + dropped "
            f"{ {r: row[p] for r, row in sorted(led.dropped.items())} } + lost {led.lost[p]} + "
            f"outstanding {out[p]} (off by {imbalance(led)[p]})"
            for p in bad
        ]
        raise LedgerError("token ledger does not balance:\n" + "\n".join(lines))


def token_totals(led: TokenLedger) -> dict[str, int]:
    """Totals over fragments, as plain ints; each fragment's share is a 1/P of a token's work."""
    out = {"processed": sum(led.processed), "merged": sum(led.merged), "lost": sum(led.lost),
           "outstanding": sum(outstanding(led)), "unmatched": led.unmatched}
    out.update({f"dropped:{r}": sum(row) for r, row in sorted(led.dropped.items())})
    return out


DIRECTIONS = ("up", "down")  # up: learner -> syncer; down: syncer -> learner
_BYTE_ROW = np.dtype([("time", "f8"), ("nbytes", "i8"), ("direction", "i1"), ("learner", "i4"),
                      ("fragment", "i4"), ("codec", "i4")])


class ByteLedger(NamedTuple):
    """Every serialized message as an event (time on the runtime's clock, virtual or wall)."""

    codecs: tuple[str, ...]  # codec specs seen; events store an index into it
    log: _Log


def byte_ledger() -> ByteLedger:
    return ByteLedger((), _Log())


def add_bytes(led: ByteLedger, time: float, nbytes: int, direction: str, learner: int,
              fragment: int, codec: str) -> ByteLedger:
    """One message of `nbytes` (the whole frame, as counted on the wire) at `time`."""
    if direction not in DIRECTIONS:
        raise LedgerError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if nbytes < 0:
        raise LedgerError(f"nbytes must be >= 0, got {nbytes}")
    codecs = led.codecs if codec in led.codecs else led.codecs + (codec,)
    row = (float(time), int(nbytes), DIRECTIONS.index(direction), learner, fragment, codecs.index(codec))
    return ByteLedger(codecs, _append(led.log, row, _BYTE_ROW))


def byte_events(led: ByteLedger, direction: str | None = None, learner: int | None = None,
                fragment: int | None = None) -> np.ndarray:
    """The events as a structured array, optionally filtered, in insertion order."""
    ev = _rows(led.log, _BYTE_ROW)
    want = {"direction": None if direction is None else DIRECTIONS.index(direction),
            "learner": learner, "fragment": fragment}
    keep = np.ones(len(ev), bool)
    for field, value in want.items():
        keep &= True if value is None else ev[field] == value
    return ev[keep]


def byte_totals(led: ByteLedger, by: Sequence[str] = ("learner", "direction")) -> dict[tuple, int]:
    """Total bytes grouped by any of "learner", "direction", "fragment", "codec"."""
    ev = _rows(led.log, _BYTE_ROW)
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


def peak_rate(led: ByteLedger, window: float, **filters: Any) -> float:
    """Most bytes in any interval [t, t + window), over the window: a sliding, not a binned, peak.

    Some busiest interval starts at an event, so trying every event's time as a start is exact.
    """
    if window <= 0:
        raise LedgerError(f"window must be > 0 seconds, got {window}")
    ev = np.sort(byte_events(led, **filters), order="time")
    if not len(ev):
        return 0.0
    cum = np.concatenate([[0], np.cumsum(ev["nbytes"])])
    last = np.searchsorted(ev["time"], ev["time"] + window, side="left")
    return float((cum[last] - cum[:-1]).max()) / window


STATES = ("compute", "stall", "down", "restarting")
UP_STATES = ("compute", "stall")  # alive: can still contribute once its fragment is back
_TIME_ROW = np.dtype([("learner", "i4"), ("state", "i1"), ("start", "f8"), ("end", "f8")])


class TimeLedger(NamedTuple):
    """Per learner, non-overlapping intervals in one of STATES; back-to-back intervals of the
    same state are coalesced, so the log grows with state changes, not with steps."""

    open: dict[int, tuple[int, float, float]]  # learner -> its latest (state, start, end)
    log: _Log  # closed intervals


def time_ledger() -> TimeLedger:
    return TimeLedger({}, _Log())


def add_time(led: TimeLedger, learner: int, state: str, start: float, end: float) -> TimeLedger:
    if state not in STATES:
        raise LedgerError(f"state must be one of {STATES}, got {state!r}")
    if end < start:
        raise LedgerError(f"learner {learner}: interval ends at {end} before it starts at {start}")
    s = STATES.index(state)
    last = led.open.get(learner)
    if last is not None and start < last[2]:
        raise LedgerError(f"learner {learner}: {state} from {start} overlaps {STATES[last[0]]} until {last[2]}")
    if last is not None and last[0] == s and start == last[2]:
        return led._replace(open={**led.open, learner: (s, last[1], end)})
    log = led.log if last is None else _append(led.log, (learner, *last), _TIME_ROW)
    return TimeLedger({**led.open, learner: (s, start, end)}, log)


def intervals(led: TimeLedger) -> np.ndarray:
    closed = _rows(led.log, _TIME_ROW)
    opened = np.array([(m, *v) for m, v in sorted(led.open.items())], _TIME_ROW)
    return np.concatenate([closed, opened])


def seconds(led: TimeLedger) -> dict[int, dict[str, float]]:
    """Per learner, seconds in each state."""
    iv = intervals(led)
    learners, idx = np.unique(iv["learner"], return_inverse=True)
    secs = np.bincount(idx * len(STATES) + iv["state"], weights=iv["end"] - iv["start"],
                       minlength=len(learners) * len(STATES)).reshape(-1, len(STATES))
    return {int(m): dict(zip(STATES, map(float, row))) for m, row in zip(learners, secs)}


def goodput(led: TimeLedger, learner: int | None = None) -> float:
    """Compute seconds over all booked seconds (all learners, or one); 0 when nothing was booked."""
    per = seconds(led)
    rows = list(per.values()) if learner is None else [per.get(learner, dict.fromkeys(STATES, 0.0))]
    total = sum(sum(r.values()) for r in rows)
    return sum(r["compute"] for r in rows) / total if total else 0.0


def uptime(led: TimeLedger, quorum: int = 1, start: float | None = None, end: float | None = None) -> float:
    """Fraction of [start, end] with at least `quorum` learners up (computing or stalled): the time
    the syncer could gather a quorum and advance the global model (section 6: zero downtime while
    one learner lives, at K = 1). Defaults to the span of all booked intervals."""
    iv = intervals(led)
    if not len(iv):
        return 0.0
    start = float(iv["start"].min()) if start is None else start
    end = float(iv["end"].max()) if end is None else end
    if end <= start:
        return 0.0
    up = iv[np.isin(iv["state"], [STATES.index(s) for s in UP_STATES])]
    times = np.concatenate([up["start"], up["end"]])
    steps = np.concatenate([np.ones(len(up), np.int64), -np.ones(len(up), np.int64)])
    order = np.argsort(times, kind="stable")
    times, count = np.clip(times[order], start, end), np.cumsum(steps[order])
    return float(np.diff(times)[count[:-1] >= quorum].sum()) / (end - start)


def summary(tokens: TokenLedger, bytes_: ByteLedger, time: TimeLedger, *, start: float, end: float,
            window: float, quorum: int = 1) -> dict[str, float]:
    """Plain numbers for the run summary; windows in seconds of the runtime's clock."""
    out: dict[str, float] = {f"tokens_{k}": v for k, v in token_totals(tokens).items()}
    out["tokens_imbalance"] = balance(tokens)
    for d in DIRECTIONS:
        out[f"bytes_{d}"] = int(byte_events(bytes_, direction=d)["nbytes"].sum())
        out[f"mean_rate_{d}"] = mean_rate(bytes_, start, end, direction=d) if end > start else 0.0
        out[f"peak_rate_{d}"] = peak_rate(bytes_, window, direction=d)
    out["goodput"] = goodput(time)
    out["uptime"] = uptime(time, quorum, start, end) if end > start else 0.0
    for m, secs in seconds(time).items():
        out.update({f"learner{m}_{s}_s": v for s, v in secs.items()})
    return out
