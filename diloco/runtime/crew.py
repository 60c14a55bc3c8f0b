"""A crew of worker threads that live and die together: the first error (or Ctrl-C) in any of them
sets one stop event, every blocking call in the workers polls it, and the crew is joined with a
timeout that names the threads that did not stop. A second Ctrl-C while joining forces the stop
(docs/design.md#stopping-a-run): the join gives up on the workers still running."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


class Stopped(Exception):
    """Raised inside a worker when the crew is stopping; ends that worker quietly."""


class Crew:
    def __init__(self, on_stop: Callable[[], None] = lambda: None, join_timeout: float = 30.0):
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.threads: list[threading.Thread] = []
        self.forced = False  # a second interrupt while joining: the workers still running are left
        self._lock = threading.Lock()
        self._on_stop = on_stop  # e.g. abort a barrier the workers may be waiting at
        self.join_timeout = join_timeout

    def add(self, name: str, body: Callable, *args: Any) -> None:
        # daemon: a forced stop leaves workers that are still inside a long step or save, and the
        # interpreter must not wait for them at exit; an unforced stop joins every one.
        self.threads.append(threading.Thread(target=self._guard, args=(body, *args), name=name, daemon=True))

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def _guard(self, body: Callable, *args: Any) -> None:
        try:
            body(*args)
        except (Stopped, threading.BrokenBarrierError):  # only raised once the stop is set
            pass
        except BaseException as e:
            self.fail(e)

    def fail(self, error: BaseException) -> None:
        """Record the first error and stop everyone."""
        with self._lock:
            if self.error is None:
                error.add_note(f"raised in thread {threading.current_thread().name} of the threads runtime")
                self.error = error
        self.stop.set()
        self._on_stop()

    def join(self, threads: list[threading.Thread] | None = None) -> None:
        """Wait for `threads` (all by default) to end, at most join_timeout. A KeyboardInterrupt
        while waiting stops the crew if it was running, and forces the stop if it was stopping
        already: the join returns at once, leaving the threads still running."""
        limit = time.monotonic() + self.join_timeout
        which = self.threads if threads is None else threads
        for t in which:
            while t.ident is not None and t.is_alive() and time.monotonic() < limit and not self.forced:
                try:
                    t.join(max(0.0, min(0.1, limit - time.monotonic())))
                except KeyboardInterrupt as e:
                    if self.stop.is_set():
                        self.forced = True
                    else:
                        self.fail(e)
        stuck = [t.name for t in which if t.is_alive()]
        if stuck and not self.forced:
            message = f"threads {stuck} still running {self.join_timeout:.0f} s after the stop"
            if self.error is None:
                self.error = RuntimeError(message)
            else:
                self.error.add_note(message)
