"""A learner's inbox of broadcasts that never blocks the syncer.

A bounded queue would make the syncer wait for its slowest learner, which is exactly what
Decoupled DiLoCo must never do. Instead, when a learner falls `capacity` frames behind, the queued
frames of the fragment just published collapse into one full FP32 copy of its newest version
(deltas chain, so dropping one would strand every later delta); the copy lists every contribution
the collapsed merges took in, so the learner still sees its own sends answered.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

from diloco.algo import messages

Key = tuple[int, int, int]
CatchUp = Callable[[int, tuple[Key, ...]], bytes]  # (fragment, merged keys) -> full frame


class Mailbox:
    """Thread-safe FIFO of (fragment, frame); one writer (the syncer), one reader (the learner)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: deque[tuple[int, bytes]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.collapsed = 0  # frames replaced by catch-up copies

    def put(self, fragment: int, frame: bytes, catch_up: CatchUp) -> int:
        """Queue a broadcast; never blocks. Returns the bytes of any catch-up copy it had to build."""
        with self._cond:
            if self._closed:
                raise RuntimeError("put on a closed mailbox")
            self._items.append((fragment, frame))
            extra = 0
            if len(self._items) > self.capacity:
                mine = [f for p, f in self._items if p == fragment]
                merged = tuple(sorted(set().union(
                    *(messages.merged_keys(messages.decode(f).header) for f in mine))))
                copy = catch_up(fragment, merged)
                self._items = deque(x for x in self._items if x[0] != fragment)
                self._items.append((fragment, copy))
                self.collapsed += len(mine)
                extra = len(copy)
            self._cond.notify()
            return extra

    def close(self) -> None:
        """No more broadcasts; the reader gets None once the queue is empty."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def get(self, timeout: float) -> bytes | None | bool:
        """The next frame; False if none came within `timeout`; None once closed and empty."""
        with self._cond:
            if not self._items and not self._closed:
                self._cond.wait(timeout)
            if self._items:
                return self._items.popleft()[1]
            return None if self._closed else False

    def empty(self) -> bool:
        with self._cond:
            return not self._items
