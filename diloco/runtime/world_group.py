"""The processes of one learner world (diloco/runtime/world.py) as one child of a supervisor: it
starts them on a fresh coordinator port, and ends as a whole, with one exit code, when any of them
dies. The supervisor's half of multi-host learners (docs/multihost.md#supervisor).

It has the surface of multiprocessing's Process that the procs supervisor and its local launcher
use of a child (`start`, `pid`, `exitcode`, `sentinel`, `terminate`, `kill`, `join`, `name`; see
Child in diloco/runtime/interfaces.py and diloco/runtime/procs/launch.py), so the supervisor can
hold a WorldGroup where it holds a learner's process, and restart the whole world as
incarnation + 1 by making a new one.

Why the whole world: a process of a world that loses a peer aborts by itself, at once or within
the world's heartbeat timeout (docs/multihost.md#what-a-dead-peer-does-to-the-others), so no part
of a world outlives its first death for long anyway. The group kills the rest as soon as it sees
that death rather than waiting for them, and reports the first death's exit code, the cause: the
others' SIGABRT (-6) is its effect. Nothing here starts a jax backend in the supervisor.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from typing import Any, Callable, NamedTuple, Sequence

from diloco.runtime.world import free_port


class WorldSpec(NamedTuple):
    """What a member passes to world.join_world: `join_world(*spec)`."""

    coordinator: str  # host:port of process 0's coordination service
    processes: int
    index: int


class WorldGroup:
    """The `processes` members of one learner world; member i runs `target(*args, WorldSpec)`.
    Not thread-safe (one supervisor loop watches it)."""

    def __init__(self, target: Callable, args: Sequence[Any], processes: int, name: str = "world",
                 host: str = "127.0.0.1", ctx: Any = None, port: int | None = None):
        """host: the address of the member that will be process 0, as every member reaches it
        (loopback when the supervisor spawns every member on its own host). port: None = a free
        one now; a restarted world must not reuse its predecessor's (it may be in TIME_WAIT)."""
        ctx = ctx or mp.get_context("spawn")  # fork would copy jax's threads and devices
        self.name, self.processes = name, processes
        self.coordinator = f"{host}:{free_port(host) if port is None else port}"
        self.members = [ctx.Process(target=target, args=(*args, WorldSpec(self.coordinator, processes, i)),
                                    name=f"{name}-p{i}", daemon=True) for i in range(processes)]
        self.exits: list[tuple[int, int]] = []  # (member, exit code) in the order seen
        self.cause: tuple[int, int] | None = None  # (member, code) of the first death

    def start(self) -> None:
        for p in self.members:
            p.start()

    @property
    def pid(self) -> int | None:
        """The leader's pid (the one a fault test or an operator names the learner by)."""
        return self.members[0].pid

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.members]

    @property
    def sentinel(self) -> int:
        """The leader's sentinel: the leader ends within the heartbeat timeout of any member's
        death, so waiting on it alone bounds a supervisor's wait; `sentinels` has them all."""
        return self.members[0].sentinel

    @property
    def sentinels(self) -> list[int]:
        return [p.sentinel for p in self.members]

    def _observe(self) -> None:
        seen = {i for i, _ in self.exits}
        new = [(i, p.exitcode) for i, p in enumerate(self.members) if i not in seen and p.exitcode is not None]
        if self.cause is None:
            failed = [(i, c) for i, c in new if c != 0]
            # Deaths seen at the same look: an abort (-6, or 134 through a shell) is what a member does
            # when it loses a peer, so another code is more likely the cause.
            failed.sort(key=lambda e: e[1] in (-signal.SIGABRT, 128 + signal.SIGABRT))
            if failed:
                self.cause = failed[0]
        self.exits += new

    @property
    def exitcode(self) -> int | None:
        """None while the world runs (or its members wait for each other at a clean shutdown); 0
        once every member exited 0; else the first death's code, and every other member is killed
        the moment that death is seen."""
        self._observe()
        if self.cause is not None:
            for p in self.members:
                if p.exitcode is None:
                    p.kill()
            return self.cause[1]
        return 0 if len(self.exits) == self.processes else None

    def is_alive(self) -> bool:
        return self.exitcode is None

    def terminate(self) -> None:
        """SIGTERM to every member still running: a stop. Followers are to ignore it and stop when
        the leader's agreed decision says so (docs/multihost.md#learner-process), so that the whole
        world stops at one step boundary."""
        for p in self.members:
            if p.exitcode is None:
                p.terminate()

    def kill(self) -> None:
        for p in self.members:
            if p.exitcode is None:
                p.kill()

    def join(self, timeout: float | None = None) -> None:
        """Until every member has exited, or `timeout` seconds in all."""
        end = None if timeout is None else time.monotonic() + timeout
        for p in self.members:
            p.join(None if end is None else max(0.0, end - time.monotonic()))
        self._observe()
