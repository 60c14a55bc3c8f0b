"""The seams a new runtime plugs into, as Protocols, each implemented by the runtimes named in it:
a new runtime (a cluster scheduler, another object store) is an adapter over these and the shared
core, not another copy of the loops (docs/design.md#runtimes, docs/design.md#adding-a-runtime).

The core is `SyncerHost.on_event` (diloco/runtime/host.py), which books the typed learner events
of diloco/runtime/events.py, `run_incarnation` (diloco/runtime/learner_loop.py), the one
wall-clock learner loop, whose port is `LearnerPort`, and the procs supervisor
(diloco/runtime/procs/supervisor.py), which supervises processes a `Launcher` starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from diloco.runtime.learner_loop import LearnerPort

if TYPE_CHECKING:
    from diloco.config import TrainConfig

__all__ = ["BlobStore", "Child", "Launcher", "LearnerPort", "RunSpec"]


@runtime_checkable
class BlobStore(Protocol):
    """Payloads by key (contributions, broadcasts, events, reports, control objects): the
    tensorstore kvstore of diloco/store/blobstore.py on file://, gs:// or s3:// is one."""

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None: ...

    def list(self, prefix: str = "") -> list[str]: ...

    def delete(self, key: str) -> None: ...

    def delete_prefix(self, prefix: str) -> None: ...


class RunSpec(NamedTuple):
    """What every process of a procs run is started with (Launcher.open)."""

    url: str  # the run's store, its options in the URL (diloco/store/network.py)
    cfg: TrainConfig
    cache: str | None  # the children's XLA compilation cache
    run_dir: Path | None
    want_evals: bool  # whether the syncer asks the supervisor to evaluate (it has an evaluator)


@runtime_checkable
class Child(Protocol):
    """One started learner incarnation or syncer incarnation, as the supervisor watches it: the
    surface of multiprocessing's Process it uses. A world of processes (WorldGroup) and a Ray
    actor's call (RayChild, RayWorld) are children too. `exitcode` is None while it runs, its
    exit status once it has ended: 0 done, a negative signal number or another code a death."""

    @property
    def exitcode(self) -> int | None: ...

    def terminate(self) -> None: ...  # stop at the next step boundary, saving first (SIGTERM)

    def kill(self) -> None: ...  # at once (SIGKILL)

    def join(self, timeout: float | None = None) -> None: ...


@runtime_checkable
class Launcher(Protocol):
    """Where and how the processes of a procs run start. The supervisor decides when (the first
    incarnations, a restart after a death, a resume) and this starts them: launch.Local (processes
    of this machine), standalone.External (the syncer here, learners started apart by a
    scheduler), ray_runtime.RayLauncher (Ray actors). launchers.launcher_for picks one."""

    # False: learners are started apart and claim their own incarnations; the supervisor then
    # spawns, restarts and watches only the syncer, and never writes a learner's exit notice.
    starts_learners: bool

    def open(self, run: RunSpec) -> None: ...

    def spawn_syncer(self, incarnation: int, reports_read: int, resume: dict | None) -> Child: ...

    def spawn_learner(self, m: int, incarnation: int, resumed: bool) -> Child: ...

    def wait(self, children: list[Child], timeout: float) -> None: ...

    def where(self, m: int | None, child: Child | None) -> dict: ...

    def release(self) -> None: ...
