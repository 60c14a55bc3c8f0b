"""The default launcher of a procs run (diloco/runtime/interfaces.py Launcher): every process
spawned on this machine by the supervisor, spawn not fork (fork would copy jax's threads and
devices); a learner of runtime.world.processes_per_learner > 1 is a world of that many processes on a
fresh coordinator port (diloco/runtime/world_group.py), one child that ends and restarts as a whole.

Reference: docs/design.md#procs; docs/multihost.md#supervisor.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.connection import wait as wait_for_exit

from diloco.runtime.interfaces import Child, RunSpec
from diloco.runtime.procs.learner import learner_main
from diloco.runtime.procs.syncer import syncer_main
from diloco.runtime.stop import sigint_ignored
from diloco.runtime.world_group import WorldGroup


class Local:
    """Processes of this machine, children of the supervisor: each watched through its sentinel,
    named by its pid in `ctl/procs`, stopped by a signal."""

    starts_learners = True

    def __init__(self):
        self.ctx = mp.get_context("spawn")
        self.run: RunSpec | None = None

    def open(self, run: RunSpec) -> None:
        self.run = run

    def spawn_syncer(self, incarnation: int, reports_read: int, resume: dict | None) -> Child:
        r = self.run
        p = self.ctx.Process(target=syncer_main, name=f"diloco-syncer-{incarnation}", daemon=True,
                             args=(r.url, r.cfg, r.cache, r.run_dir, r.want_evals, incarnation, reports_read, resume))
        with sigint_ignored():  # Ctrl-C is the supervisor's to act on, not the children's
            p.start()
        return p

    def spawn_learner(self, m: int, incarnation: int, resumed: bool) -> Child:
        r = self.run
        name = f"diloco-learner-{m}-{incarnation}"
        # os.getpid(): the supervisor, whose death its children notice (child.orphaned)
        args = (r.url, r.cfg, r.cache, r.run_dir, m, incarnation, os.getpid(), resumed)
        P = r.cfg.runtime.world.processes_per_learner
        if P > 1:
            p = WorldGroup(learner_main, args, P, name=name, ctx=self.ctx)
        else:
            p = self.ctx.Process(target=learner_main, name=name, daemon=True, args=args)
        with sigint_ignored():
            p.start()
        return p

    def wait(self, children: list[Child], timeout: float) -> None:
        # A world's every member: a follower's death wakes the supervisor at once, not at its leader's abort.
        wait_for_exit([s for p in children for s in getattr(p, "sentinels", [p.sentinel])], timeout=timeout)

    def where(self, m: int | None, child: Child | None) -> dict:
        """The syncer's pid (m None), or learner m's (a world's leader's) and a world's every pid."""
        if m is None:
            return {"syncer": child.pid}
        out = {"pid": None if child is None else child.pid}
        if isinstance(child, WorldGroup):
            out["pids"] = child.pids
        return out

    def release(self) -> None:
        pass  # every child has been joined by the supervisor
