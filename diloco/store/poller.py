"""The poller: exponential back-off between polls of the store, ended by a stop or a deadline.

Reference: docs/design.md#object-store-transport (a learner polls the pointer with back-off while
blocked). Stdlib only.
"""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class Poller:
    """Exponential back-off between polls: `min_interval` after activity, times `factor` after each
    idle poll, capped at `max_interval`; ends when `stop` is set or the clock reaches `deadline`.

    Object stores charge per request and have no notifications, so an idle syncer or learner
    backs off, and returns to fast polling as soon as something arrives. `stop` is a predicate or
    anything with `is_set` (threading / multiprocessing Event); with an Event and no `sleep`,
    sleeping waits on the Event, so a stop wakes the poller at once. `sleep` and `clock` are
    injectable so tests run instantly on a fake clock.
    """

    def __init__(self, min_interval: float, max_interval: float, *, factor: float = 2.0,
                 stop: Any = None, deadline: float | None = None,
                 sleep: Callable[[float], Any] | None = None, clock: Callable[[], float] = time.monotonic):
        if not 0 < min_interval <= max_interval or factor < 1:
            raise ValueError(f"want 0 < min_interval <= max_interval and factor >= 1, got "
                             f"{min_interval}, {max_interval}, {factor}")
        self.min_interval, self.max_interval, self.factor = min_interval, max_interval, factor
        self.deadline, self.clock = deadline, clock
        self._stop = stop.is_set if hasattr(stop, "is_set") else (stop or (lambda: False))
        self._sleep = sleep or (stop.wait if hasattr(stop, "wait") else time.sleep)
        self.interval = min_interval  # the next sleep

    def stopped(self) -> bool:
        return bool(self._stop()) or (self.deadline is not None and self.clock() >= self.deadline)

    def wait(self, active: bool) -> bool:
        """Sleep after a poll (reset to min_interval if it found something); False once stopped."""
        if active:
            self.interval = self.min_interval
        if self.stopped():
            return False
        dt = self.interval
        if self.deadline is not None:
            dt = min(dt, self.deadline - self.clock())
        if dt > 0:
            self._sleep(dt)
        self.interval = min(self.interval * self.factor, self.max_interval)
        return not self.stopped()

    def run(self, poll: Callable[[], Any]) -> None:
        """Call `poll` (truthy result = activity) until stop or deadline."""
        while self.wait(bool(poll())):
            pass

    def until(self, poll: Callable[[], T]) -> T | None:
        """Call `poll` until it returns something truthy, which is returned; None on stop or deadline."""
        while True:
            result = poll()
            if result:
                return result
            if not self.wait(False):
                return None
