"""The run's JSON store objects (pointer, acks, control, events, reports): how they are read and written.

Reference: docs/design.md#damage-in-the-store. A reader bounds what it reads: the size before it
is read, the nesting while it is parsed, and (unless told otherwise) no NaN or infinity; every
failure is a ValueError naming the key, which the readers' damage paths take.
"""

from __future__ import annotations

import json
import math
from typing import Any

from diloco.algo import messages
from diloco.algo.bounds import loads_json
from diloco.store.blobstore import BlobStore, TooLarge

# Pointers, acks and control objects nest a few levels; json.loads alone would raise RecursionError
# on a small object nested 1,000 deep (docs/algorithm.md#bounds-on-what-a-frame-can-claim).
_MAX_DEPTH = 64
# Every JSON object of a run (pointer, acks, control, events, reports) is far below this; a larger
# one is damage, refused before it is read into memory.
MAX_JSON_BYTES = 16 << 20
# Every counter a store object holds (versions, seqs, steps) is below this, as in a frame's header.
MAX_COUNT = messages.MAX_COUNT


def _not_allowed(constant: str) -> Any:
    raise ValueError(f"{constant} is not a value a store object holds")


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):  # "1e400" parses to inf
        raise ValueError(f"{text[:40]} is not a finite number")
    return x


def loads_object(raw: bytes, where: str, finite: bool = True) -> Any:
    """One store object's JSON, nesting bounded; `finite`: NaN, Infinity and numbers that
    overflow to inf are refused too. Every failure is a ValueError naming `where`."""
    kw = dict(parse_constant=_not_allowed, parse_float=_finite) if finite else {}
    try:
        return loads_json(raw, _MAX_DEPTH, **kw)
    except ValueError as e:  # UnicodeDecodeError, a nesting too deep, an int of 5,000 digits too
        raise ValueError(f"{where}: not UTF-8 JSON ({e}): {bytes(raw[:80])!r}") from None


def read_json(store: BlobStore, key: str, finite: bool = True, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON object under `key`, None if there is none; ValueError naming the key if it is
    larger than `max_bytes` (then it is not read), or not JSON (see loads_object)."""
    try:
        raw = store.get(key, max_bytes)
    except TooLarge as e:
        raise ValueError(f"{store.url} {e}") from None
    return None if raw is None else loads_object(raw, f"{store.url} {key}", finite)


def put_json(store: BlobStore, key: str, obj: Any) -> None:
    """`obj` written compact with sorted keys, so equal objects are equal bytes."""
    store.put(key, json.dumps(obj, separators=(",", ":"), sort_keys=True).encode())


def is_count(x: Any) -> bool:
    """A counter as store objects hold them (versions, seqs, steps): an int in [0, MAX_COUNT)."""
    return type(x) is int and 0 <= x < MAX_COUNT
