"""The syncer's reports to the supervisor of a procs run: `rep/<n>.json` in order (train, rejoin
and merge records, eval requests, the end), an eval's or the end's Theta beside it as
`rep/<n>.npz`; how they are keyed and packed, and the check a report passes before the supervisor
takes it.

Reference: docs/design.md#procs; docs/design.md#damage-in-the-store (a malformed report is skipped;
with runtime.auth both objects are sealed under the runtime's key, and one that does not verify is
ignored until the syncer's lands on its key or a later report proves it never will).
"""

from __future__ import annotations

import io
import json
import math
from typing import Any

import numpy as np

from diloco import store as bs
from diloco.algo import auth
from diloco.store.control import opened

# What each kind of report must hold (diloco/runtime/procs/syncer.py writes them).
FIELDS = {
    "train": {"learner", "step", "time", "tokens", "loss"},
    "rejoin": {"time", "learner", "incarnation", "step"},
    "eval": {"step", "time", "tokens", "merges", "paths"},
    "merge": {"time", "merges", "tokens", "quorum", "bytes_up", "bytes_down", "stalls", "quarantined", "goodput"},
    "refusal": {"time", "reason", "key"},  # run.log_refusals
    "end": {"time", "summary", "steps", "tokens", "dead", "finished_at", "merges", "processed0", "complete",
            "paths"},
}


def rep_key(n: int, ext: str) -> str:
    return f"rep/{n:012d}.{ext}"


def pack_theta(theta: dict) -> tuple[list, bytes]:
    """Theta as npz bytes (arrays by position) and the JSON list of their paths; no pickle."""
    paths = sorted(theta)
    buf = io.BytesIO()
    np.savez(buf, *[np.asarray(theta[p], np.float32) for p in paths])
    return [list(p) for p in paths], buf.getvalue()


class Unauthenticated(ValueError):
    """A report object not sealed under the runtime's key: forged, or damaged."""


def _writers(secret: auth.Secret | None) -> dict[str, bytes] | None:
    return None if secret is None else {"the runtime": secret.runtime_key()}


def write_report(store: bs.BlobStore, n: int, record: dict, theta: dict | None, secret: auth.Secret | None) -> None:
    """Report n: its Theta's payload first, then the record that names it; sealed under the
    runtime's key with the run `secret`. A loss may be NaN, so the record is not strict JSON."""
    def put(key: str, data: bytes) -> None:
        store.put(key, data if secret is None else auth.seal(secret.runtime_key(), key, data))

    if theta is not None:
        record["paths"], blob = pack_theta(theta)
        put(rep_key(n, "npz"), blob)
    put(rep_key(n, "json"), json.dumps(record).encode())


def read_report(store: bs.BlobStore, n: int, secret: auth.Secret | None) -> Any:
    """Report n's record as stored (None if absent); Unauthenticated if, with the run `secret`, it
    is not sealed under the runtime's key; ValueError if it is not JSON."""
    key = rep_key(n, "json")
    try:
        raw = store.get(key, bs.MAX_JSON_BYTES + auth.MAC_HEX + 1)
    except bs.TooLarge as e:
        raise ValueError(f"{store.url} {e}") from None
    if raw is None:
        return None
    try:
        data = opened(raw, key, _writers(secret))
    except ValueError as e:
        raise Unauthenticated(str(e)) from None
    return bs.loads_object(data, f"{store.url} {key}", finite=False)  # a loss may be NaN


def verified_after(store: bs.BlobStore, n: int, secret: auth.Secret | None) -> bool:
    """Whether a report after n is there and verifies: the syncer writes its reports in order,
    each whole before the next, so then report n was written, and is damaged or written over."""
    later = sorted(int(k[4:16]) for k in store.list("rep/") if k.endswith(".json") and k[4:16].isdigit())
    for k in (k for k in later if k > n):
        try:
            if read_report(store, k, secret) is not None:
                return True
        except ValueError:
            continue
    return False


def unpack_theta(paths: list, blob: bytes) -> dict:
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
        return {tuple(p): z[f"arr_{i}"] for i, p in enumerate(paths)}


def report_theta(store: bs.BlobStore, n: int, record: Any, theta0: tuple[dict, ...],
                 secret: auth.Secret | None = None) -> dict | None:
    """The Theta report n carries (eval, end), checked against the run's shapes (theta0's); pops
    the record's `paths`. ValueError if the record is not a report of its kind or its Theta is
    unreadable or, with the run `secret`, not sealed under the runtime's key."""
    kind = record.get("kind") if isinstance(record, dict) else None
    if not (isinstance(kind, str) and FIELDS.get(kind, {None}) <= set(record)):
        raise ValueError(f"not a report: {str(record)[:200]}")
    numbers = [record[k] for k in FIELDS[kind] & {"time", "step", "merges", "processed0"}]
    if kind in ("train", "eval", "merge"):
        numbers.append(record["tokens"])
    if not all(type(x) in (int, float) and math.isfinite(x) for x in numbers):
        raise ValueError(f"a {record['kind']} report with a field that is not a finite number")
    if record["kind"] == "end" and not (isinstance(record["summary"], dict) and isinstance(record["steps"], dict)
                                        and type(record["steps"].get("0")) is int):
        raise ValueError("an end report without its summary or steps")
    if record["kind"] not in ("eval", "end"):
        return None
    want = {path: x.shape for frag in theta0 for path, x in frag.items()}
    paths = record.pop("paths", None)
    if not (isinstance(paths, list) and all(isinstance(q, list) and all(isinstance(x, str) for x in q)
                                            for q in paths)):
        raise ValueError(f"a {record['kind']} report without the paths of its Theta")
    limit = sum(4 * int(np.prod(shape)) + 4096 for shape in want.values()) + 65536  # npz: float32 + headers
    try:
        blob = store.get(rep_key(n, "npz"), limit + auth.MAC_HEX + 1)
        theta = None if blob is None else unpack_theta(paths, opened(blob, rep_key(n, "npz"), _writers(secret)))
    except Exception as e:  # noqa: BLE001 - np.load of damaged bytes raises many kinds; all mean "unreadable"
        raise ValueError(f"its Theta is unreadable ({type(e).__name__}: {e})") from None
    if theta is None or {p: (x.shape, x.dtype) for p, x in theta.items()} != {
            p: (shape, np.float32) for p, shape in want.items()}:
        raise ValueError("its Theta is missing or not the run's paths and float32 shapes")
    return theta
