"""Learners and the syncer started apart by whatever supervises processes on a cluster (a
Kubernetes restartPolicy, Slurm --requeue, systemd, a person with a shell), coupled only through
the run's object store and its config: scripts/learner.py and scripts/syncer.py.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), section 6 (learners fail and
rejoin independently); docs/cluster.md#learners-and-syncer-started-apart.

What the procs supervisor (diloco/runtime/procs/supervisor.py) does for its children, each process
does here for itself, through the same control objects:

* Incarnations: a learner claims the next incarnation of its index (`ctl/claim/<m>`). A claim with
  a predecessor writes that predecessor's exit notice (`ctl/died/<m>/<inc>`) unless the
  predecessor wrote one on its way out: a process killed by -9, the OOM killer or a lost node left
  none, so the syncer learns of the death from the successor, books it after the predecessor's last
  event, and lets the successor rejoin. A learner that ends in order (done, its chaos tape down,
  SIGTERM) writes its own notice.
* Fencing: a claim carries a random token. A learner that finds another token on its index (the
  scheduler started a second copy, or replaced one it only thought dead) exits at its next step
  boundary without a notice (EXIT_SUPERSEDED), so one process at most writes under a live
  incarnation; what the stale one wrote after its successor's claim is never booked (the syncer's
  admission check drops an old incarnation's traffic).
* The syncer host (scripts/syncer.py) is the procs supervisor with the External launcher below,
  which starts no learners: it spawns and restarts the syncer process, reads its reports,
  evaluates, writes metrics.jsonl and the summary. Started again after kill -9 it continues as
  the next syncer incarnation (checkpoint + journal, diloco/runtime/procs/recovery.py) from the
  reports its predecessor had read (`ctl/reports`); at the end it writes `ctl/finished`, so a
  learner started after that exits (Procs._start_apart in diloco/runtime/procs/supervisor.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import time
from pathlib import Path

from diloco import store as bs
from diloco.algo.auth import Secret
from diloco.config import ConfigError, TrainConfig, legacy, to_dict
from diloco.config.checks_runtime import WORLD_ADDRESS
from diloco.config.convert import options_by_path
from diloco.runtime.build import auth_secret
from diloco.runtime.interfaces import Child, RunSpec
from diloco.runtime.procs.child import EXIT_SUPERSEDED, POLL_MIN, child_main, died
from diloco.runtime.procs.launch import Local
from diloco.runtime.procs.learner import learner_body
from diloco.runtime.world import free_port
from diloco.runtime.world_group import WorldSpec
from diloco.store import network

log = logging.getLogger(__name__)

# Keys that may differ between the processes of one run: where each keeps its own files and how it
# is watched, and which learner it is. Everything else must be the syncer's (same model, data, rules).
PER_PROCESS = {("run", "out_dir"), ("run", "resume"), ("run", "progress"), ("run", "tensorboard"),
               ("run", "wandb"), ("run", "wandb_project"), ("run", "plot"), ("runtime", "learner_index"),
               ("runtime", "world", "process_index"),
               ("runtime", "world", "address")}


def store_url(cfg: TrainConfig) -> str:
    """The run's store as every process of it opens it: runtime.store.url, else <run.out_dir>/store
    (one machine, or a shared file system), with the S3 options in the URL."""
    root = Path(cfg.run.out_dir).absolute()
    return network.run_store_url(cfg.runtime, f"file://{root / 'store'}")


def run_clock(store: bs.BlobStore, secret: Secret | None = None) -> float:
    """The syncer's clock now (0 before it has started it, or if its start record is unreadable or,
    with the run `secret`, unauthenticated): when a notice says a process died."""
    start = bs.read_trusted(store, "start", secret, None, {"t0": (int, float)})
    return 0.0 if start is None else time.time() - float(start["t0"])


def read_claim(store: bs.BlobStore, m: int, secret: Secret | None) -> dict | None:
    """Learner m's newest claim; None if there is none, or it is malformed or (with the run
    `secret`) not sealed under m's key: a forger can neither supersede a learner nor fence it."""
    return bs.read_trusted(store, f"claim/{m:04d}", secret, {}, {"incarnation": int, "token": str})


def claim(store: bs.BlobStore, m: int, token: str, world: dict | None = None, secret: Secret | None = None) -> int:
    """Claim learner m's next incarnation under `token`, writing the predecessor's exit notice if
    it left none (it was killed); the incarnation claimed. world: {coordinator, processes} of the
    world its leader is about to serve, for the followers (await_world)."""
    held = read_claim(store, m, secret)
    if held is not None:
        inc = held["incarnation"] + 1
    elif f"claim/{m:04d}" not in bs.list_control(store, "claim/"):
        inc = 0
    else:  # unreadable or forged: one past the newest incarnation the store shows
        keys = bs.list_control(store, f"died/{m:04d}/") + store.list(f"ev/{m:04d}/")
        inc = max((int(k.split("/")[2]) for k in keys if k.split("/")[2].isdigit()), default=-1) + 1
    bs.write_control(store, f"claim/{m:04d}", {"incarnation": inc, "token": token, "host": socket.gethostname(),
                                               "pid": os.getpid(), "at": time.time(), "world": world},
                     secret, learner=m)
    # one unreadable or unauthenticated is written over: the syncer would never bury its predecessor
    if inc > 0 and bs.read_trusted(store, died(m, inc - 1), secret) is None:
        bs.write_control(store, died(m, inc - 1), {"at": run_clock(store, secret), "exitcode": -signal.SIGKILL},
                         secret, learner=m)
    return inc


def config_diff(mine: dict, theirs: dict) -> list[str]:
    """The options, outside PER_PROCESS, whose values differ between two resolved configs."""
    here = options_by_path(mine, TrainConfig)
    return [f"{'.'.join(key)}: {here.get(key)!r} here, {v!r} in the run"
            for key, v in options_by_path(legacy.upgraded(theirs), TrainConfig).items()
            if len(key) > 1 and here.get(key) != v and key not in PER_PROCESS]


def wait_for_run(store: bs.BlobStore, cfg: TrainConfig, url: str, secret: Secret | None = None) -> None:
    """Until the syncer host has written the run record (sealed under the runtime's key with the
    run `secret`: a forged one is ignored); ConfigError if this process's config is not the run's
    (it would rebuild another Theta_0, or book by other rules)."""
    ignored: dict = {}
    record = bs.Poller(POLL_MIN, 1.0).until(lambda: bs.read_trusted(store, "run", secret, ignored, {"theta0": str}))
    diff = config_diff(to_dict(cfg), record.get("config", {}))
    if diff:
        raise ConfigError(f"this learner's config is not the run's in {network.redacted(url)}:\n  " + "\n  ".join(diff))


def finished(cfg: TrainConfig, secret: Secret | None = None) -> bool:
    """Whether the run of `cfg`'s store has finished: a process started again after that (a
    Kubernetes Deployment restarts even a process that exited 0) has nothing to do. With the run
    `secret`, only the supervisor's sealed record says so."""
    return bs.read_trusted(bs.BlobStore(store_url(cfg), sync=False), "finished", secret, {}) is not None


def run_learner(cfg: TrainConfig) -> int:
    """Run learner runtime.learner_index as its next incarnation until it is done, stopped or
    superseded; its exit status (0 done, 75 its chaos tape down, 143 SIGTERM, 76 superseded). With
    runtime.world.processes_per_learner > 1 this process is runtime.world.process_index of the learner's world:
    the leader (0) claims the incarnation and alone writes exit notices, a follower joins the world
    of the newest claim it has not joined before."""
    r = cfg.runtime
    m, i, P = r.learner_index, r.world.process_index, r.world.processes_per_learner
    if m < 0:
        raise ConfigError(f"scripts/learner.py needs runtime.learner_index in 0..{r.learners - 1}, "
                          f"got {m} (e.g. runtime.learner_index=$SLURM_PROCID)")
    run_dir = Path(cfg.run.out_dir).absolute()
    url = store_url(cfg)
    store = bs.BlobStore(url, sync=False)
    secret = auth_secret(cfg)  # exit notices sealed under this learner's key (diloco/store/control.py)
    if finished(cfg, secret):
        log.info("the run in %s has finished; learner %d has nothing to do", network.redacted(url), m)
        return 0
    if i == 0:
        token = secrets.token_hex(8)
        world = None if P == 1 else {"coordinator": world_coordinator(r.world.address), "processes": P}
        inc = claim(store, m, token, world, secret)
        log.info("learner %d: incarnation %d, waiting for the syncer's run record", m, inc)
    else:
        held = await_world(store, m, i, P, secret)
        if held is None:
            log.info("the run in %s has finished; learner %d process %d has nothing to do", network.redacted(url), m, i)
            return 0
        token, inc, world = held["token"], int(held["incarnation"]), held["world"]
        log.info("learner %d process %d: joining incarnation %d's world at %s", m, i, inc, world["coordinator"])
    wait_for_run(store, cfg, url, secret)
    superseded = lambda: (read_claim(store, m, secret) or {"token": token})["token"] != token  # noqa: E731
    spec = None if world is None else WorldSpec(world["coordinator"], P, i)
    name = f"learner-{m:04d}-{inc:04d}" + (f"-p{i}" if i else "")
    try:
        child_main(name, url, cfg, str(run_dir / "xla_cache"), learner_body, run_dir, m, inc, None, False,
                   superseded if i == 0 else None, None, spec)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int):
            log.error("learner %d incarnation %d: %s", m, inc, e.code)
    except BaseException:
        if i == 0:
            bs.write_control(store, died(m, inc), {"at": run_clock(store, secret), "exitcode": 1}, secret, learner=m)
        raise
    # A follower writes nothing: its leader's notice is the world's. A superseded leader's successor
    # wrote its notice already.
    if i == 0 and code != EXIT_SUPERSEDED:
        bs.write_control(store, died(m, inc), {"at": run_clock(store, secret), "exitcode": code}, secret, learner=m)
    return code


def world_coordinator(address: str) -> str:
    """host:port of the coordination service a world's leader is about to serve, as its followers
    reach it: runtime.world.address, with the host name's address for a missing host and a port
    free now for a missing port (a restarted leader's predecessor may hold its old one in TIME_WAIT)."""
    host, port = WORLD_ADDRESS.fullmatch(address).groups()  # checked at start-up
    host = host or socket.gethostbyname(socket.gethostname())
    return f"{host}:{port or free_port(host.strip('[]'))}"


def joined(m: int, incarnation: int, index: int) -> str:
    """The control name a follower writes before it joins a world: started again (its world lost a
    process, or it did), it waits for the next claim rather than joining a dead coordinator."""
    return f"world/{m:04d}/{incarnation:04d}/{index:03d}"


def await_world(store: bs.BlobStore, m: int, index: int, processes: int, secret: Secret | None = None) -> dict | None:
    """The newest claim of learner m that follower `index` has not joined, once its leader has
    made it, recorded as joined; None once the run has finished. ConfigError if the claim's world
    has another number of processes (its leader runs another config)."""
    def poll():
        if bs.read_trusted(store, "finished", secret, {}) is not None:
            return {"finished": True}
        held = read_claim(store, m, secret)
        # a join record sealed under learner m's key: a forged one makes no follower skip a world
        if held is None or bs.read_trusted(store, joined(m, held["incarnation"], index), secret, {}) is not None:
            return None
        return held

    held = bs.Poller(POLL_MIN, 1.0).until(poll)
    if "finished" in held:
        return None
    world = held.get("world") or {}
    if world.get("processes") != processes:
        raise ConfigError(f"learner {m}'s leader claimed incarnation {held['incarnation']} for a world of "
                          f"{world.get('processes', 1)} process(es); this process has runtime.world.processes_per_learner={processes}")
    bs.write_control(store, joined(m, int(held["incarnation"]), index),
                     {"host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}, secret, learner=m)
    return held


class External:
    """The launcher of a syncer host (scripts/syncer.py): the syncer is spawned on this machine as
    launch.Local spawns it; the learners are started apart by a scheduler (run_learner), each
    claiming its own incarnation and writing its own exit notice, so the supervisor leaves them
    alone (starts_learners False)."""

    starts_learners = False

    def __init__(self):
        self.local = Local()

    def open(self, run: RunSpec) -> None:
        self.local.open(run)

    def spawn_syncer(self, incarnation: int, reports_read: int, resume: dict | None) -> Child:
        return self.local.spawn_syncer(incarnation, reports_read, resume)

    def spawn_learner(self, m: int, incarnation: int, resumed: bool) -> Child:
        raise AssertionError("learners are started apart (scripts/learner.py)")

    def wait(self, children: list[Child], timeout: float) -> None:
        self.local.wait(children, timeout)

    def where(self, m: int | None, child: Child | None) -> dict:
        """The syncer's pid, and that this run's learners are started apart (ctl/procs lists none)."""
        return {**self.local.where(m, child), "launch": "external"}

    def release(self) -> None:
        self.local.release()
