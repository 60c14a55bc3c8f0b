"""The procs runtime: a process per learner and the syncer over an object store, supervised, started
by a launcher (docs/design.md#procs, docs/design.md#adding-a-runtime)."""

from diloco.runtime.procs.launchers import launcher_for, run
from diloco.runtime.procs.supervisor import MAX_RESTARTS, Procs

__all__ = ["MAX_RESTARTS", "Procs", "launcher_for", "run"]
