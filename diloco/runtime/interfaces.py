"""The interfaces a runtime implements, named: a new runtime (Ray, a cluster scheduler) is an
adapter over these and the shared core, not another copy of the loops (docs/design.md#runtimes).

The core is `SyncerHost.on_event` (diloco/runtime/host.py), which books the typed learner events
of diloco/runtime/events.py, and `run_incarnation` (diloco/runtime/learner_loop.py), the one
wall-clock learner loop, whose port is `LearnerPort`. What is left to a runtime is below.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from diloco.runtime.learner_loop import LearnerPort

__all__ = ["BlobStore", "Channel", "Clock", "LearnerPort", "Lifecycle"]


@runtime_checkable
class Clock(Protocol):
    """The run's one time axis: virtual seconds in sim, wall seconds from a shared t0 elsewhere."""

    def clock(self) -> float: ...


@runtime_checkable
class BlobStore(Protocol):
    """Payloads by key (contributions, broadcasts, reports): diloco/store/blobstore.py's
    tensorstore kvstore on file://, gs:// or s3:// is one."""

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def list(self, prefix: str = "") -> list[str]: ...

    def delete(self, key: str) -> None: ...

    def delete_prefix(self, prefix: str) -> None: ...


@runtime_checkable
class Channel(Protocol):
    """Small control messages by name, the last write winning (start barrier, deaths, burials)."""

    def write(self, name: str, message: Any) -> None: ...

    def read(self, name: str) -> Any: ...


@runtime_checkable
class Lifecycle(Protocol):
    """Starting, watching and stopping a run's workers (threads' Crew; procs' supervisor loop)."""

    def start(self) -> None: ...

    def alive(self) -> bool: ...

    def fail(self, error: BaseException) -> None: ...

    def join(self) -> None: ...
