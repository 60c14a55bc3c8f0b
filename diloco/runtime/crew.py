"""A crew of worker threads that live and die together: the first error (or Ctrl-C) in any of them
sets one stop event, every blocking call in the workers polls it, and the crew is joined with a
timeout that names the threads that did not stop."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any, Callable


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM (a process manager stopping the job) raises KeyboardInterrupt as Ctrl-C does, in the
    main thread only; the previous handler is back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Stopped(Exception):
    """Raised inside a worker when the crew is stopping; ends that worker quietly."""


class Crew:
    def __init__(self, on_stop: Callable[[], None] = lambda: None, join_timeout: float = 30.0):
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._on_stop = on_stop  # e.g. abort a barrier the workers may be waiting at
        self.join_timeout = join_timeout

    def add(self, name: str, body: Callable, *args: Any) -> None:
        self.threads.append(threading.Thread(target=self._guard, args=(body, *args), name=name, daemon=False))

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

    def join(self) -> None:
        limit = time.monotonic() + self.join_timeout
        for t in self.threads:
            while t.ident is not None and t.is_alive() and time.monotonic() < limit:
                try:
                    t.join(max(0.0, limit - time.monotonic()))
                except KeyboardInterrupt as e:  # another Ctrl-C: keep waiting for the stopping threads
                    self.fail(e)
        stuck = [t.name for t in self.threads if t.is_alive()]
        if stuck:
            message = f"threads {stuck} still running {self.join_timeout:.0f} s after the stop"
            if self.error is None:
                self.error = RuntimeError(message)
            else:
                self.error.add_note(message)
