"""The ray runtime: Decoupled DiLoCo on a Ray cluster. Each learner is an actor in a placement group
of its own (runtime.ray.learner_resources: CPUs, GPUs or a TPU slice); the syncer is a named, detached
actor on a CPU node; this process, the driver, is the procs supervisor, and RayLauncher (a
Launcher, diloco/runtime/interfaces.py) starts its processes as actors.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), section 6; docs/cluster.md#ray.

An adapter, not a fourth runtime: the learner and syncer code is the procs children's
(diloco/runtime/procs/learner.py, syncer.py), run in an actor's process, and the supervision
(incarnations, exit notices, restarts, reports, evaluation, Ctrl-C) is the procs supervisor's
(diloco/runtime/procs/supervisor.py), whose children here are actor calls (RayChild). All traffic
goes through the same object store: file:// on one machine, gs:// or s3:// across hosts.
diloco/runtime/procs/launchers.py picks this launcher for runtime.kind=ray.

Why each piece: a placement group per learner, because a learner must fail alone (a slice of a
shared group or job fate-shares with the others); Ray restarts a dead actor (max_restarts) in its
placement group, on another node if its node is gone, and this process then starts the learner's
next incarnation on it, which rejoins. The syncer actor is detached and named so that it is one
well-known process of the run; when Ray restarts it, this process starts the next syncer
incarnation on it, which restores its newest checkpoint and journal, exactly as in procs.

A learner of several processes (runtime.world.processes_per_learner P > 1, docs/multihost.md#ray): its
placement group holds P bundles and one actor per bundle, each running one process of the
learner's jax.distributed world, and the driver holds the P as one child (RayWorld), with
world_group's rule: the world ends as a whole at its first death and comes back as a whole.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import time
import warnings
from typing import Any, Callable

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from diloco.config import TrainConfig
from diloco.runtime.interfaces import Child, RunSpec
from diloco.runtime.procs.child import child_main
from diloco.runtime.procs.learner import learner_body
from diloco.runtime.procs.supervisor import MAX_RESTARTS
from diloco.runtime.procs.syncer import syncer_body
from diloco.runtime.ray_placement import Placement, actor_options, learner_placement, slice_shape
from diloco.runtime.world import free_port
from diloco.runtime.world_group import WorldGroup, WorldSpec

log = logging.getLogger(__name__)

NAMESPACE = "diloco"
PLACE_TIMEOUT_S = 300.0  # seconds the cluster has to place a learner's bundle before the run fails
PROBE_S = 0.5  # seconds between looks at a call being joined
KILLED = -9  # the exit code a dead actor reads as: killed, as kill -9 in procs (restarted, rejoins)


@ray.remote
class Host:
    """One learner's or the syncer's process. Its body runs on a worker thread (the actor allows
    two calls at once), so `stop` reaches it there, as SIGTERM does in procs."""

    def __init__(self):
        self.rt: Any = None
        self.stopping = False

    def where(self) -> dict:
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    def coordinator(self) -> str:
        """host:port for a new learner world's coordination service, which this actor, the
        world's process 0, will host: its node's address as Ray's other nodes reach it, and a port
        free there now (a restarted world takes a new one, as in world_group)."""
        ip = ray.util.get_node_ip_address()
        return f"{ip}:{free_port(ip)}"

    def stop(self) -> None:
        self.stopping = True
        self._flag()

    def _expose(self, rt) -> None:
        self.rt = rt
        self._flag()

    def _flag(self) -> None:
        if self.rt is not None and self.stopping:
            # ProcLearner stops at `terminating`, ProcSyncer at `stopping`: each one's SIGTERM handler
            for name in ("terminating", "stopping"):
                if hasattr(self.rt, name):
                    setattr(self.rt, name, True)

    def _run(self, name: str, url: str, cfg: TrainConfig, cache: str | None, body, *args, tail=()) -> int:
        """The body's exit status; a Python error is recorded by child_main and raised to the driver.
        `tail`: the body's arguments after the exposer."""
        self.rt = None
        try:
            child_main(name, url, cfg, cache, body, *args, self._expose, *tail)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1
        return 0

    def learner(self, url, cfg, cache, run_dir, m, incarnation, resumed, spec: WorldSpec | None = None) -> int:
        """spec: this actor's place in the learner's world when it has several processes; a
        follower's error record carries its index, as procs' learner_main names it."""
        name = f"learner-{m:04d}-{incarnation:04d}" + (f"-p{spec.index}" if spec is not None and spec.index else "")
        return self._run(name, url, cfg, cache, learner_body, run_dir, m, incarnation, None, resumed, None,
                         tail=() if spec is None else (spec,))

    def syncer(self, url, cfg, cache, run_dir, want_evals, incarnation, reports_read, resume) -> int:
        return self._run("syncer", url, cfg, cache, syncer_body, run_dir, want_evals, incarnation > 0, reports_read,
                         resume)


def outcome(ref) -> int:
    """The exit status of a finished call: its return value; KILLED if its actor died under it
    (killed, its node lost); 1 for a Python error (its traceback is in the store)."""
    try:
        return int(ray.get(ref))
    except RayActorError:
        return KILLED
    except RayTaskError:
        return 1


class RayChild:
    """An incarnation on an actor, as a Child (diloco/runtime/interfaces.py) of the supervisor.

    It starts with a probe: an actor Ray is restarting (killed, its node lost) fails the calls
    that reach it before it is back, and such a call is no incarnation, so the body is submitted
    only once the actor answers; a probe that fails is asked again, for up to PLACE_TIMEOUT_S."""

    pid = None  # the driver never signals an actor's process: it calls stop or ray.kill

    def __init__(self, actor, call: Callable[[], Any], restart: bool = False):
        """restart: `kill` lets Ray restart the actor (a member of a world that ended, whose next
        incarnation runs on the same actors), and a member killed before its call began never
        begins."""
        self.actor, self.call, self.restart = actor, call, restart
        self.probe, self.ref = actor.where.remote(), None
        self.deadline = time.monotonic() + PLACE_TIMEOUT_S
        self._code: int | None = None
        self.stopped = False

    @property
    def pending(self):
        """What to wait on: the body's call once submitted, else the probe."""
        return self.probe if self.ref is None else self.ref

    def _advance(self) -> None:
        if self.ref is not None or not ray.wait([self.probe], timeout=0)[0]:
            return
        try:
            ray.get(self.probe)
        except RayActorError:
            if time.monotonic() > self.deadline:
                self._code = KILLED  # never came back: counted as a death, as in procs
            else:  # it reached the actor as it died; Ray queues the next one until it is back
                self.probe = self.actor.where.remote()
            return
        if self.stopped:  # stopped before it began: nothing to save
            self._code = 128 + signal.SIGTERM
        else:
            self.ref = self.call()

    @property
    def exitcode(self) -> int | None:
        if self._code is None:
            self._advance()
        if self._code is None and self.ref is not None and ray.wait([self.ref], timeout=0)[0]:
            self._code = outcome(self.ref)
        return self._code

    def join(self, timeout: float | None = None) -> None:
        limit = None if timeout is None else time.monotonic() + timeout
        while self.exitcode is None and (limit is None or time.monotonic() < limit):
            left = None if limit is None else max(0.0, limit - time.monotonic())
            ray.wait([self.pending], timeout=PROBE_S if left is None else min(left, PROBE_S))

    def terminate(self) -> None:
        self.stopped = True
        self.actor.stop.remote()

    def kill(self) -> None:
        if self.restart:
            self.stopped = True
        ray.kill(self.actor, no_restart=not self.restart)


class RayWorld(WorldGroup):
    """An incarnation of a learner of P processes on its P actors (docs/multihost.md#ray): one
    child to the supervisor, as a WorldGroup is in procs, whose exit rule (`exitcode`: the first death's
    code, the rest killed on sight) it inherits. Its members are RayChilds, started once the
    leader's actor has answered with the world's coordinator address, which every member is given;
    the survivors of a death are killed with restart, so that Ray brings each actor back for the
    next incarnation."""

    pid = None  # as RayChild: the driver never signals an actor's process

    def __init__(self, actors: list, submit: Callable[[Any, WorldSpec], Any], name: str = "world"):
        """submit(actor, spec): the body's call on one member's actor."""
        self.name, self.processes, self.actors, self.submit = name, len(actors), actors, submit
        self.members: list[RayChild] = []  # none until the coordinator is known
        self.exits: list[tuple[int, int]] = []
        self.cause: tuple[int, int] | None = None
        self.coordinator: str | None = None
        self.ask = actors[0].coordinator.remote()  # also the leader's probe, as in RayChild
        self.deadline = time.monotonic() + PLACE_TIMEOUT_S
        self._code: int | None = None  # a world that ended before its members began
        self.stopped = False

    def _begin(self) -> None:
        if self.members or self._code is not None or not ray.wait([self.ask], timeout=0)[0]:
            return
        try:
            self.coordinator = ray.get(self.ask)
        except RayActorError:  # the leader's actor is being restarted: as RayChild's probe
            if time.monotonic() > self.deadline:
                self._code = KILLED
            else:
                self.ask = self.actors[0].coordinator.remote()
            return
        if self.stopped:
            self._code = 128 + signal.SIGTERM
            return
        P = self.processes
        self.members = [RayChild(a, (lambda a=a, i=i: self.submit(a, WorldSpec(self.coordinator, P, i))),
                                 restart=True) for i, a in enumerate(self.actors)]

    @property
    def pending(self) -> list:
        """What to wait on: the coordinator's answer, then every running member's call or probe."""
        if not self.members:
            return [self.ask]
        return [p.pending for p in self.members if p._code is None] or [self.members[0].pending]

    @property
    def pids(self) -> list:
        return [None] * self.processes

    @property
    def exitcode(self) -> int | None:
        self._begin()
        if not self.members:
            return self._code
        return super().exitcode

    def terminate(self) -> None:
        """A stop reaches the leader only: the followers stop at its agreed decision, at the same
        step boundary (docs/multihost.md#learner-process), as they ignore SIGTERM in procs."""
        self.stopped = True
        for i, p in enumerate(self.members):
            if i == 0:
                p.terminate()
            else:
                p.stopped = True

    def kill(self) -> None:
        self.stopped = True
        for p in self.members:
            p.stopped = True
        for a in self.actors:
            ray.kill(a, no_restart=True)

    def join(self, timeout: float | None = None) -> None:
        limit = None if timeout is None else time.monotonic() + timeout
        while self.exitcode is None and (limit is None or time.monotonic() < limit):
            left = PROBE_S if limit is None else min(PROBE_S, max(0.0, limit - time.monotonic()))
            ray.wait(self.pending, num_returns=1, timeout=left)


def connect(cfg: TrainConfig, M: int) -> bool:
    """Ray for a run of M learners: the cluster at runtime.ray.address, else a cluster of this
    machine with the logical CPUs the actors ask for; whether this process started it (and so
    stops it). Nothing if Ray is up already."""
    r = cfg.runtime
    if ray.is_initialized():
        return False
    # The actors' lines reach this console with a "(Host pid=...)" prefix, uncoloured: Ray's
    # colour codes are escape sequences wherever the output is not a terminal (a log file, CI).
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    with warnings.catch_warnings():
        # Ray starts its own processes (GCS, raylet) by fork and exec with a pre-exec function
        # that only masks SIGINT; JAX, initialised in this process by then, warns at every fork
        # that a forked child may deadlock. The child runs no JAX, so the warning is not ours.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        if r.ray.address:
            ray.init(address=r.ray.address, namespace=NAMESPACE, log_to_driver=True)
            return False
        need = M * r.world.processes_per_learner * r.ray.learner_resources.get("CPU", 0.0) + r.ray.syncer_resources.get("CPU", 0.0)
        # "local": a new cluster of its own, even where another is running on this machine
        # (without an address Ray joins the newest one it finds, and refuses num_cpus there)
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(need + 0.999)),
                 namespace=NAMESPACE, include_dashboard=False, log_to_driver=True)
        return True


class RayLauncher:
    """The procs supervisor's launcher on Ray (see the module docstring): this process is the
    driver; each learner's actors live in a placement group of their own, kept across its
    incarnations; the syncer is a detached named actor."""

    starts_learners = True

    def __init__(self):
        self.run: RunSpec | None = None
        self.hosts: dict[int, list] = {}  # learner -> its actors (one a world process), kept across incarnations
        self.groups: dict[int, Placement] = {}  # learner -> its placement group
        self.syncer_host = None
        self.owns_ray = False  # this process started Ray (runtime.ray.address=""), and stops it
        self.prefix = ""

    def open(self, run: RunSpec) -> None:
        """Ray connected (or started); a TPU slice the learner's world does not fit fails first."""
        self.run = run
        # actor names of this run's store: the same from any driver process
        self.prefix = f"diloco-{hashlib.sha256(run.url.encode()).hexdigest()[:8]}"
        if run.cfg.runtime.ray.tpu_topology:
            slice_shape(run.cfg.runtime)
        self.owns_ray = connect(run.cfg, run.cfg.runtime.learners)

    def _env(self) -> dict:
        """What every actor's process needs of this one's environment: the run secret, the simulated
        CPU device count, JAX's settings and tensorstore's (TENSORSTORE_GCS_HTTP_URL names the gs://
        server), which a Ray worker does not inherit from the driver."""
        keep = {self.run.cfg.runtime.auth.secret_env}
        env = {k: v for k, v in os.environ.items() if k in keep or k.startswith(("JAX_", "XLA_", "TENSORSTORE_"))}
        return {"env_vars": env}

    def spawn_syncer(self, incarnation: int, reports_read: int, resume: dict | None) -> Child:
        r = self.run
        if self.syncer_host is None:
            name = f"{self.prefix}-syncer"
            try:  # a syncer left by an earlier driver of this store (detached actors outlive it)
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            except ValueError:
                pass
            self.syncer_host = Host.options(
                name=name, namespace=NAMESPACE, lifetime="detached", max_restarts=MAX_RESTARTS, max_task_retries=0,
                max_concurrency=2, runtime_env=self._env(), **actor_options(r.cfg.runtime.ray.syncer_resources)).remote()
        host, args = self.syncer_host, (r.url, r.cfg, r.cache, r.run_dir, r.want_evals, incarnation, reports_read,
                                         resume)
        return RayChild(host, lambda: host.syncer.remote(*args))

    def _actor(self, m: int, i: int = 0) -> str:
        """Learner m's actor of world process i (the leader's name is a one-process learner's)."""
        return f"{self.prefix}-learner-{m}" + (f"-p{i}" if i else "")

    def spawn_learner(self, m: int, incarnation: int, resumed: bool) -> Child:
        r = self.run
        P = r.cfg.runtime.world.processes_per_learner
        if m not in self.hosts:
            place = self.groups[m] = learner_placement(r.cfg.runtime, m, f"{self.prefix}-learner-{m}",
                                                       PLACE_TIMEOUT_S)
            # max_restarts=-1: Ray always brings a learner's process back; how often it may die is
            # the supervisor's rule (MAX_RESTARTS, not counting a chaos tape's planned downs).
            self.hosts[m] = [Host.options(
                name=self._actor(m, i), namespace=NAMESPACE, max_restarts=-1, max_task_retries=0,
                max_concurrency=2, runtime_env=self._env(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(place.group, placement_group_bundle_index=i),
                **actor_options(place.bundle)).remote() for i in range(P)]
        args = (r.url, r.cfg, r.cache, r.run_dir, m, incarnation, resumed)
        if P == 1:
            [host] = self.hosts[m]
            return RayChild(host, lambda: host.learner.remote(*args))
        return RayWorld(self.hosts[m], lambda a, spec: a.learner.remote(*args, spec), name=f"learner-{m}-{incarnation}")

    def wait(self, children: list[Child], timeout: float) -> None:
        # a world's every member: a follower's death wakes the supervisor at once, as in procs
        refs = [r for p in children for r in (p.pending if isinstance(p, RayWorld) else [p.pending])]
        ray.wait(refs, num_returns=1, timeout=timeout)

    def where(self, m: int | None, child: Child | None) -> dict:
        """The actors' names (ray.get_actor(name, namespace="diloco")), for operators and fault
        tests: the syncer's (m None), or learner m's (a world's leader's) and a world's every one."""
        if m is None:
            return {"syncer": None, "syncer_actor": f"{self.prefix}-syncer", "namespace": NAMESPACE}
        out = {"pid": None, "actor": self._actor(m)}
        P = self.run.cfg.runtime.world.processes_per_learner
        if P > 1:
            out["actors"] = [self._actor(m, i) for i in range(P)]
        return out

    def release(self) -> None:
        """Every actor and placement group of the run, the detached syncer too; Ray itself if this
        process started it."""
        if not ray.is_initialized():
            return
        for actor in [self.syncer_host, *(a for actors in self.hosts.values() for a in actors)]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        for place in self.groups.values():
            place.release()
        if self.owns_ray:
            ray.shutdown()
