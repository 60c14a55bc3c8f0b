"""The runtime section of the run configuration: RuntimeConfig and its subsections store, auth,
world and ray (docs/design.md#runtimes). diloco/config/schema.py re-exports them; as there, each
field's comment is its meaning, which `--describe` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StoreConfig:
    """The object store of a procs or ray run's traffic (docs/design.md#object-store-transport).
    Credentials come from the environment, never the config."""

    url: str = ""  # gs://..., s3://...; "" = <run dir>/store (file://)
    # s3:// url: an S3-compatible server's http(s)://host:port ("" = AWS_ENDPOINT_URL_S3 or
    # AWS_ENDPOINT_URL, else AWS)
    endpoint: str = ""
    region: str = ""  # s3:// url: the S3 region ("" = AWS_REGION, else us-east-1 with an endpoint)
    # s3:// and gs://: seconds a store operation is retried through an outage before the run fails
    retry_s: float = 60.0


@dataclass(frozen=True)
class AuthConfig:
    """Learner authentication (docs/algorithm.md#authenticated-learners): each contribution carries
    an HMAC tag under its learner's key, derived from a run secret, which is never logged."""

    # auto = on where frames cross a process boundary (procs, ray), off in-process (sim, threads)
    mode: str = "auto"  # auto | on | off
    # the environment variable holding the run secret, read if secret_file is ""; with neither set a
    # random one is made for the run (one host only: hosts of a cluster must share it)
    secret_env: str = "DILOCO_AUTH_SECRET"
    secret_file: str = ""  # a file holding the run secret; "" = secret_env's


@dataclass(frozen=True)
class WorldConfig:
    """A learner spanning several processes (hosts), one jax.distributed world whose devices are its
    global mesh (docs/multihost.md); procs and ray only."""

    # processes of each learner's world; runtime.devices_per_learner stays the learner's device
    # count, each process contributing devices_per_learner / processes_per_learner
    processes_per_learner: int = 1
    # heartbeat period of a learner's world: it bounds how long a world's survivors run on after
    # one of its processes died
    heartbeat_s: float = 5.0
    # scripts/learner.py with processes_per_learner > 1 (docs/cluster.md#a-learner-of-several-hosts):
    # which process of the learner's world this is (0 leads: it claims the incarnation and serves
    # the world's coordination service)
    process_index: int = 0
    # the address the world's leader advertises for that service: "" = its host name's address and
    # a free port, "host" = that host and a free port, "host:port"
    address: str = ""


@dataclass(frozen=True)
class RayConfig:
    """Where the ray runtime places the learners and the syncer (docs/cluster.md)."""

    # the cluster to join: "" = start one on this machine; "auto" or host:port = a running one
    address: str = ""
    # each learner's placement group bundle (Ray resources: CPU, GPU, TPU, ...)
    learner_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    syncer_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})  # the syncer actor's (a CPU node)
    # on TPUs: each learner one whole slice of this topology (e.g. "4x4"), reserved through
    # ray.util.tpu (docs/cluster.md#tpu-slices-on-ray): its placement group holds one bundle per
    # host of that slice, learner_resources are added to each, and world.processes_per_learner
    # must be the slice's host count. "" = the bundles of learner_resources.
    tpu_topology: str = ""
    tpu_version: str = ""  # the slices' TPU generation, e.g. v6e, v5p, v4 (with tpu_topology)


@dataclass(frozen=True)
class RuntimeConfig:
    """Who runs the learners and how time passes: sim (virtual clock, modelled link), threads, procs
    or ray (docs/design.md#runtimes); store, auth, world and ray configure the process-based ones."""

    kind: str = "sim"  # sim | threads | procs | ray (docs/design.md#runtimes)
    learners: int = 4  # M
    devices_per_learner: int = 2  # devices each learner's mesh spans
    step_time: float = 1.0  # modelled seconds per inner step at speed 1 (sim)
    speeds: tuple[float, ...] = ()  # per learner step-time factor; () = all 1.0
    # Rows per step of each learner (docs/algorithm.md#unequal-hardware): () = data.batch_size each;
    # [b_0, ..., b_{M-1}]; auto = M x data.batch_size shared in proportion to 1 / speed (runtime.speeds,
    # or chaos.speeds under a tape), so every learner's step takes about as long. sim models a step
    # of b rows as taking b / data.batch_size of one at data.batch_size
    learner_batch: tuple[int, ...] | str = ()
    jitter: float = 0.0  # relative std of each step time
    # sim: learners whose steps fall within one step of each other take them as one vmapped step
    # over a learner axis (docs/design.md#sim). auto: on an accelerator; off on the CPU, where
    # the stacked step costs what the separate ones do
    batch_learners: str = "auto"  # auto | on | off
    # threads/procs: a learner's steps end at least this many wall seconds apart, on a schedule from
    # its first step (diloco/runtime/pace.py Pace); keeps learners in phase on a shared machine
    step_period_s: float = 0.0
    # threads/procs: where a restarted learner resumes. own: its checkpoint's step (or where it
    # stopped), redoing the steps since; schedule (needs step_period_s): the step the run's paced
    # schedule is at, in phase with the other learners, skipping the steps it missed while down
    rejoin_at: str = "own"
    bandwidth: float = 1e8  # bytes/s per learner link, each direction (sim)
    latency: float = 0.01  # seconds per message (sim)
    stall_limit_steps: float = 8.0  # a learner waits at most this many step times for a fragment
    seed: int = 0  # jitter and other runtime randomness
    queue_size: int = 16  # threads: capacity of each bounded queue (learners -> syncer, syncer -> each learner)
    # Rejoin after a failure (docs/algorithm.md#failures-and-rejoin): a restarted learner keeps its own last
    # checkpoint's optimizer state if no fragment moved more than this many versions since, and
    # otherwise starts fresh; either way its parameters are the syncer's current Theta.
    max_rejoin_staleness: int = 4
    restart_s: float = 5.0  # seconds from a learner's slices returning to its first step again
    learner_checkpoint_every: int = 50  # inner steps between a learner's own checkpoints; 0 = never
    # Beyond one machine (docs/cluster.md). procs: local = this process spawns the syncer and every
    # learner and restarts them; external = it hosts the syncer only (scripts/syncer.py) and each
    # learner is started apart by a scheduler (scripts/learner.py), coupled through the store.
    launch: str = "local"
    learner_index: int = -1  # scripts/learner.py: the learner this process runs, 0..learners-1
    # procs and ray: the object store carrying the run's traffic (docs/design.md#object-store-transport)
    store: StoreConfig = field(default_factory=StoreConfig)
    # learner authentication (docs/algorithm.md#authenticated-learners)
    auth: AuthConfig = field(default_factory=AuthConfig)
    # procs and ray: a learner spanning several processes (docs/multihost.md)
    world: WorldConfig = field(default_factory=WorldConfig)
    # ray: the cluster, each learner's placement and the syncer actor's (docs/cluster.md)
    ray: RayConfig = field(default_factory=RayConfig)

    @property
    def shares_mesh(self) -> bool:
        """Whether every learner runs on one sub-mesh with one compiled step: sim steps them in turn
        (docs/design.md#runtimes); the wall-clock runtimes step them at once, on devices of their own."""
        return self.kind == "sim"
