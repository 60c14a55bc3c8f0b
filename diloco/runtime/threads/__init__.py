"""The threads runtime: the wall clock, a thread per learner, bounded queues (docs/design.md#threads)."""

from diloco.runtime.threads.driver import run
from diloco.runtime.threads.runtime import Threads

__all__ = ["Threads", "run"]
