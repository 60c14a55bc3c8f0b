"""The three ledgers (tokens, bytes, time) as checkpoint data: numpy columns for Orbax and a JSON
document for the rest; shared by the sim snapshots and the procs syncer's checkpoints.

Reference: docs/design.md#ledgers and docs/design.md#checkpoints (the syncer checkpoint holds the ledgers, so a
restored run's summary counts what happened before the restore exactly once).
"""

from __future__ import annotations

import numpy as np

from diloco.algo.eventlog import Log, rows
from diloco.algo.ledger import TokenLedger
from diloco.algo.timeline import TIME_ROW, TimeLedger
from diloco.algo.traffic import BYTE_ROW, ByteLedger


def keyed(pairs) -> list:
    """[[key, value], ...] with tuples as lists: JSON keeps no tuples and no non-str keys."""
    return [[list(k) if isinstance(k, tuple) else k, list(v) if isinstance(v, tuple) else v] for k, v in pairs]


def _rows_out(table: np.ndarray) -> dict:
    return {name: np.asarray(table[name]) for name in table.dtype.names} if len(table) else {}


def _rows_in(saved: dict, dtype: np.dtype) -> Log:
    if not saved:  # Orbax may not keep an empty subtree at all
        return Log()
    table = np.zeros(len(next(iter(saved.values()))), dtype)
    for name in dtype.names:
        table[name] = saved[name]
    return Log((table,), ())


def ledgers_out(tokens: TokenLedger, bytes_: ByteLedger, time: TimeLedger) -> tuple[dict, dict]:
    """(arrays, meta) of the three ledgers."""
    t = tokens
    meta = {
        "tokens": {"processed": list(t.processed), "merged": list(t.merged), "lost": list(t.lost),
                   "dropped": {k: list(v) for k, v in t.dropped.items()}, "pending": keyed(t.pending.items()),
                   "in_flight": keyed(t.in_flight.items()), "dead": sorted(list(k) for k in t.dead),
                   "unmatched": t.unmatched},
        "byte_codecs": list(bytes_.codecs),
        "time_open": {str(m): list(v) for m, v in time.open.items()},
    }
    arrays = {"bytes": _rows_out(rows(bytes_.log, BYTE_ROW)), "time": _rows_out(rows(time.log, TIME_ROW))}
    return arrays, meta


def ledgers_in(arrays: dict, meta: dict) -> tuple[TokenLedger, ByteLedger, TimeLedger]:
    """The ledgers `ledgers_out` saw."""
    t = meta["tokens"]
    tokens = TokenLedger(
        tuple(t["processed"]), tuple(t["merged"]), {k: tuple(v) for k, v in t["dropped"].items()},
        tuple(t["lost"]), {tuple(k): tuple(v) for k, v in t["pending"]},
        {tuple(k): tuple(v) for k, v in t["in_flight"]}, frozenset(tuple(k) for k in t["dead"]), t["unmatched"])
    bytes_ = ByteLedger(tuple(meta["byte_codecs"]), _rows_in(arrays.get("bytes", {}), BYTE_ROW))
    time = TimeLedger({int(m): (v[0], v[1], v[2]) for m, v in meta["time_open"].items()},
                      _rows_in(arrays.get("time", {}), TIME_ROW))
    return tokens, bytes_, time
