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
