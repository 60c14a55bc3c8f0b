"""What crosses between a learner's devices and its host, beside the step: a fragment's values
held on the devices and read on the host only when needed, the host copy of an array whose
shards this process holds, and a send's byte work on a thread of its own
(docs/design.md#encoding-on-the-device).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import jax
import numpy as np

from diloco.algo.fragments import Path


class DeviceValues(Mapping):
    """A fragment's values (path -> array) held on the learner's devices: a broadcast decoded
    there. Read on the host (a snapshot, a rebase, the host encoder), they come over in one
    transfer, once (docs/design.md#encoding-on-the-device)."""

    def __init__(self, leaves: dict[Path, jax.Array]):
        self.leaves = leaves
        self._host: dict | None = None

    def __getitem__(self, path: Path) -> np.ndarray:
        if self._host is None:
            self._host = {k: np.asarray(v, np.float32) for k, v in jax.device_get(self.leaves).items()}
        return self._host[path]

    def __iter__(self):
        return iter(self.leaves)

    def __len__(self) -> int:
        return len(self.leaves)


def host_copy(x: jax.Array) -> np.ndarray:
    """x on the host. A learner of several processes holds a whole replica of its params in each
    (its fsdp axis stays within a process: diloco/runtime/world.py), so the shards this process
    holds make up the whole array, and no collective is needed."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    out = np.empty(x.shape, x.dtype)
    covered = np.zeros(x.shape, bool)
    for shard in x.addressable_shards:
        out[shard.index] = np.asarray(jax.device_get(shard.data))
        covered[shard.index] = True
    if not covered.all():  # a learner whose fsdp axis spans processes: refused, never half-sent
        raise ValueError(f"this process holds only part of a {x.shape} array ({x.sharding}); "
                         "a learner's fsdp axis must stay within one process")
    return out


class FrameJob:
    """A send's byte work (collect, zstd, checksum, HMAC, frame) on a thread of its own, begun
    when its step is dispatched: it waits for the payload's copy and never holds the step's path
    (zstd and the hashes release the GIL). The thread ends with its job."""

    def __init__(self, fn: Callable[[], tuple[bytes, int]]):
        self._out: tuple[bytes, int] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="diloco-frame", daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._out = fn()
        except BaseException as e:  # raised again, where the frame is asked for
            self._error = e

    def wait(self) -> None:
        self._thread.join()

    def result(self) -> tuple[bytes, int]:
        self.wait()
        if self._error is not None:
            raise self._error
        return self._out
