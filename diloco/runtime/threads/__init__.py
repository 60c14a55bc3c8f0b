"""The threads runtime: the wall clock, a thread per learner, bounded queues (docs/design.md#threads)."""

from diloco.runtime.threads.runtime import Threads, run

__all__ = ["Threads", "run"]
