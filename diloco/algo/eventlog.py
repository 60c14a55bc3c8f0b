"""Append-only event logs for the ledgers: frozen numpy chunks plus a short tuple tail, so appending
is O(1) amortised while every ledger stays an immutable value."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class LedgerError(ValueError):
    """A ledger event that contradicts earlier events, or a ledger that does not balance."""


_CHUNK = 256  # tail length before it is frozen into a numpy chunk

class Log(NamedTuple):
    """Append-only rows: frozen numpy chunks plus a tuple tail."""

    chunks: tuple[np.ndarray, ...] = ()
    tail: tuple[tuple, ...] = ()


def append(log: Log, row: tuple, dtype: np.dtype) -> Log:
    tail = log.tail + (row,)
    if len(tail) < _CHUNK:
        return Log(log.chunks, tail)
    return Log(log.chunks + (np.array(list(tail), dtype),), ())


def rows(log: Log, dtype: np.dtype) -> np.ndarray:
    return np.concatenate([*log.chunks, np.array(list(log.tail), dtype)])


class Records:
    """An immutable, append-only sequence of records (the syncer's decisions): frozen tuple chunks
    plus a short tail, so `add` is O(1) amortised where `records + (r,)` copied all n every time.
    Reads like a tuple: len, iteration, indexing, slicing (a tuple), equality with a tuple."""

    __slots__ = ("_chunks", "_tail", "_len")

    def __init__(self, items=(), *, _chunks: tuple = (), _tail: tuple = ()):
        if items:
            items = tuple(items)
            _chunks = tuple(items[i:i + _CHUNK] for i in range(0, len(items) - len(items) % _CHUNK, _CHUNK))
            _tail = items[len(items) - len(items) % _CHUNK:]
        self._chunks, self._tail = _chunks, _tail
        self._len = len(_chunks) * _CHUNK + len(_tail)

    def add(self, record) -> Records:
        tail = self._tail + (record,)
        if len(tail) < _CHUNK:
            return Records(_chunks=self._chunks, _tail=tail)
        return Records(_chunks=self._chunks + (tail,), _tail=())

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        for chunk in self._chunks:
            yield from chunk
        yield from self._tail

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self)[index]
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("record index out of range")
        chunk, offset = divmod(index, _CHUNK)
        return self._chunks[chunk][offset] if chunk < len(self._chunks) else self._tail[offset]

    def __eq__(self, other) -> bool:
        if isinstance(other, (Records, tuple, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # records are dicts: unhashable, like a tuple of dicts

    def __repr__(self) -> str:
        return f"Records({len(self)} records)"


RING = 64  # refusal records a syncer state keeps (docs/design.md#damage-in-the-store)


class Refusals(NamedTuple):
    """The syncer's refused frames, bounded whatever a sender does: exact counts per (reason,
    learner), learner None for a frame that could not be attributed, and the RING latest records,
    oldest first. `total` numbers them, so a reader that saw n can take the total - n newest."""

    counts: dict[tuple[str, int | None], int] = {}
    latest: tuple[dict, ...] = ()
    total: int = 0


def refuse(r: Refusals, record: dict, reason: str, learner: int | None) -> Refusals:
    """r with one more refusal of `reason` by `learner`, its record the newest kept."""
    key = (reason, learner)
    return Refusals({**r.counts, key: r.counts.get(key, 0) + 1}, (r.latest + (record,))[-RING:], r.total + 1)


def newest(r: Refusals, seen: int) -> tuple[dict, ...]:
    """The records of refusals after the first `seen` (those still kept: at most RING)."""
    return r.latest[len(r.latest) - min(r.total - seen, len(r.latest)):] if r.total > seen else ()
