"""Theta_0 through the store: the supervisor, which has the run's inputs anyway, writes every
fragment's full copy at version 0 under `init/` before the run control that children wait for; the
syncer and the learners read it there instead of each loading and dequantising the checkpoint (or
drawing the random init) again, and check it against the fingerprint the run control carries.

Reference: docs/design.md#procs (how a child starts).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from diloco import store as bs
from diloco.algo import codec_specs, messages, payloads
from diloco.algo.syncer_publish import frame, unpack_full_copy


class Theta0Error(RuntimeError):
    """The run's Theta_0 in the store is missing, unreadable, or not the one the run control names."""


def fingerprint(theta0: tuple[dict, ...]) -> str:
    """A hash of Theta_0: what every process starts from, named in the run control."""
    h = hashlib.sha256()
    for frag in theta0:
        for path in sorted(frag):
            h.update(json.dumps(path).encode())
            h.update(memoryview(np.ascontiguousarray(frag[path], np.float32)).cast("B"))  # no copy
    return h.hexdigest()[:16]


def publish(store: bs.BlobStore, theta0: tuple[dict, ...]) -> None:
    """Write each fragment's full copy at version 0 where it is absent (a resumed run's store has
    them from its start: objects are never rewritten)."""
    fp32, there = codec_specs.codec_from_spec("fp32"), set(store.list("init/"))
    for p, values in enumerate(theta0):
        key = bs.theta0_key(p)
        if key not in there:
            tensors, payload, _ = payloads.pack_fragment(values, fp32)
            store.put(key, frame(p, 0, None, "fp32", tensors, payload))


def read(store: bs.BlobStore, shapes: tuple[dict, ...], want: str | None, max_bytes: int) -> tuple[dict, ...]:
    """The run's Theta_0 from the store, per fragment path -> float32 array of the shape `shapes`
    gives (a Setup's theta0 built around abstract params); Theta0Error unless every fragment is
    there, readable, and all of them together have the fingerprint `want` of the run control."""
    theta0 = []
    for p, frag in enumerate(shapes):
        key = bs.theta0_key(p)
        try:
            raw = store.get(key, max_bytes)
        except bs.TooLarge as e:
            raise Theta0Error(f"{key}: {e}") from None
        if raw is None:
            raise Theta0Error(f"{key} is missing: the supervisor writes Theta_0 before the run control")
        expected = {path: (tuple(x.shape), np.float32) for path, x in frag.items()}
        try:
            theta0.append(unpack_full_copy(raw, p, 0, expected))
        except messages.MessageError as e:
            raise Theta0Error(f"{key} is unreadable: {e}") from None
    got = fingerprint(tuple(theta0))
    if got != want:
        raise Theta0Error(f"Theta_0 in the store has fingerprint {got}, the run control names {want}: the "
                          "store was changed, or holds another run")
    return tuple(theta0)
