"""The procs runtime: a process per learner and the syncer over an object store (docs/design.md#procs)."""

from diloco.runtime.procs.supervisor import MAX_RESTARTS, Procs, run

__all__ = ["MAX_RESTARTS", "Procs", "run"]
