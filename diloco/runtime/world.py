"""A learner's process world: one learner spanning several processes (hosts), which form one
`jax.distributed` world whose devices are that learner's global mesh.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428): a learner is an ordinary SPMD
trainer on its own devices (docs/algorithm.md#roles), so a learner too large for one host is a
multi-controller JAX program, and the unit of failure is then that program's whole world. What was
measured on CPU over gloo, and how the procs runtime uses this module, is in
docs/multihost.md.

Roles. Process 0 of a world is its leader: the only one that talks to the syncer (reads the
store's broadcasts, writes contributions and events, decides at the wall clock when to give up on
a blocked fragment or stop). The followers run the same LearnerUnit on the same global mesh and
mirror the leader's decisions, which reach them through `agree` and `mirror_frames` at each step
boundary. Every process computes the same batches (the data position is a pure function of
(learner, step), docs/design.md#checkpoints), so nothing but those decisions has to travel; with
data=grain each process reads and packs only its own rows of them (docs/data.md#sharding), and a
checkpoint gathers every process's stream position (`all_gather`).

Failure. If any process of a world dies, the others fail fast rather than hang, as measured in
docs/multihost.md#what-a-dead-peer-does-to-the-others: a survivor in a collective aborts as soon
as gloo finds the peer's socket broken, if it does, and any survivor, idle or waiting, once the
coordination service misses the dead process's heartbeats (`heartbeat_s`); every process aborts
within a second of process 0 (which hosts the coordination service) going away. They abort
(SIGABRT: exit code 134, or -6 from subprocess and multiprocessing), so no Python `finally` runs.
Whoever supervises the world treats any member's non-zero exit as the death of the whole learner
incarnation, kills what is left, and starts a new world (a fresh coordinator port) as
incarnation + 1, which rejoins as a one-process learner does.

Collective calls. A multi-controller program must launch the same device programs in the same
order on every process, or its collectives mismatch (gloo then aborts with "Is there a
distributed collective mismatch in your code?"). These LearnerUnit (diloco/runtime/unit.py) calls
run jitted programs over the global mesh and must run on every process in the same order:
`LearnerUnit(...)` (the state's init), `warm_up`, `step` (the inner step: its gradient all-reduce
crosses processes); so must this module's `global_batch`, `host_batch`, `gather_to_leader`,
`broadcast_from_leader`, `all_gather`, `agree`, `mirror_frames` and `leave_world` (a barrier),
and so must rejoin.LearnerCheckpoints.maybe_save (an Orbax save, and with data=grain the gather of
every process's stream position into its meta). A program on one local device (the leader's own
syncer merges in tests/world_child.py, a jnp op on a host array) involves no other process and may
run on one alone. The unit's host-side work (`apply_due`, `_encode` inside
`step`/`finish`/`flush`, `receive`, `give_up`, `blocking`) runs no cross-process program as long as
each process holds whole copies of the params, which `learner_mesh_global` guarantees (its fsdp
axis stays inside a process), so `jax.device_get` of a param is local. It must still run on every
process with the same inputs in the same order, because it decides the values the next `step`
starts from (applied merges, rebases, error-feedback residuals): followers therefore encode the
same frames as the leader, which costs them host time in parallel with the leader's, not wall time,
and keeps `sent_local` and the codec states identical everywhere. Only the leader ships them.
"""

from __future__ import annotations

import json
import socket
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from diloco.config import ConfigError, MeshConfig
from diloco.train.mesh import make_mesh

# Seconds. The defaults bound how long a survivor of a dead peer can idle before it is told: the
# coordination service declares a process dead after `heartbeat_s` without a heartbeat (measured
# here: 2.3 s at 2, 3.3 s at 4, 9.4 s at 10; docs/multihost.md#what-a-dead-peer-does-to-the-others).
# jax's own default is 100 s, which would leave a hung learner holding its devices that long.
HEARTBEAT_S = 5
# How long `jax.distributed.initialize` waits for every process to register: a world whose peer
# never starts (a host that did not come up) fails after this instead of jax's 300 s.
JOIN_TIMEOUT_S = 60
# How long a process that finished waits at shutdown for the others to finish too.
SHUTDOWN_S = 30
_LEN = np.int64  # the dtype of broadcast_from_leader's length word


class World(NamedTuple):
    """This process's place in its learner's world."""

    index: int  # jax.process_index()
    processes: int  # jax.process_count()
    coordinator: str  # host:port of process 0's coordination service ("" for a world of one)

    @property
    def leader(self) -> bool:
        return self.index == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, for a new world's coordinator: a restarted world takes a new
    one, since its dead predecessor's port may linger in TIME_WAIT."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join_world(coordinator: str, processes: int, index: int, timeout_s: float = JOIN_TIMEOUT_S,
               heartbeat_s: float = HEARTBEAT_S, shutdown_s: float = SHUTDOWN_S,
               cpu_devices: int | None = None, local_device_ids: Sequence[int] | None = None) -> World:
    """Make this process `index` of a world of `processes` whose process 0 serves the coordination
    service at `coordinator` ("host:port"). Must run before anything starts a jax backend
    (jax.devices(), a device_put, a jit call). `cpu_devices`: the CPU devices this process
    contributes (jax_num_cpu_devices), with cross-process CPU collectives over gloo, the
    implementation this jax (0.10.2) builds into its CPU client; on accelerators leave it None (the
    backend's own collectives, NCCL or ICI, carry the steps). `local_device_ids`: restrict this
    process to those accelerators (several processes per host). A world of one process starts no
    service: it is an ordinary one-process learner."""
    if processes < 1 or not 0 <= index < processes:
        raise ConfigError(f"a learner world needs 0 <= index < processes, got index={index} of {processes}")
    if cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    if processes == 1:
        return World(0, 1, "")
    # gloo is this version's default already; named so a changed default cannot silently turn the
    # cross-process CPU all-reduce into an error at the first step.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # The timeouts are whole seconds in the coordination service; below 1 s it would not run.
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=processes, process_id=index,
                               local_device_ids=None if local_device_ids is None else list(local_device_ids),
                               initialization_timeout=max(1, round(timeout_s)),
                               heartbeat_timeout_seconds=max(1, round(heartbeat_s)),
                               shutdown_timeout_seconds=max(1, round(shutdown_s)))
    return World(jax.process_index(), jax.process_count(), coordinator)


def leave_world() -> None:
    """A finished process's clean exit: waits (up to join_world's `shutdown_s`) for every other
    process to leave too. A world of one has nothing to leave."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


def world_devices() -> list:
    """Every device of the world, process by process (then by id): a process's devices are
    consecutive, so each process's batch rows are one contiguous block (`local_rows`)."""
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def learner_mesh_global(devices_per_learner: int, batch_size: int, fsdp: int = 1) -> Mesh:
    """The learner's (data, fsdp) mesh over every process's devices (diloco/train/mesh.py's axes;
    build.learner_meshes gives a one-process learner fsdp = 1). The world is the learner, so it
    holds exactly `devices_per_learner` devices. The fsdp axis must stay inside a process (fsdp
    divides the local device count): then every process holds whole copies of the params and
    LearnerUnit's host reads of them (apply_due, the encode) stay local, with no collective."""
    devices, local = world_devices(), jax.local_device_count()
    if len(devices) != devices_per_learner:
        raise ConfigError(f"this learner's world has {len(devices)} devices ({jax.process_count()} processes x "
                          f"{local}), but runtime.devices_per_learner={devices_per_learner}")
    counts = {d.process_index for d in devices}
    if len(devices) != local * len(counts):
        raise ConfigError("every process of a learner's world must contribute the same number of devices, got "
                          f"{len(devices)} over {len(counts)} processes with {local} here")
    if fsdp < 1 or local % fsdp:
        raise ConfigError(f"fsdp={fsdp} must divide the {local} devices of each process of a learner's world, so "
                          "that every process holds whole copies of the params")
    cfg = MeshConfig(data=devices_per_learner // fsdp, fsdp=fsdp, devices=devices_per_learner)
    return make_mesh(cfg, batch_size, devices)


def _row_block(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
    """The rows of a [B, ...] array that this process's devices hold, as one slice."""
    spans = sorted({(idx[0].start or 0, shape[0] if idx[0].stop is None else idx[0].stop)
                    for idx in sharding.addressable_devices_indices_map(shape).values()})
    start, stop = spans[0][0], spans[-1][1]
    if sum(b - a for a, b in spans) != stop - start and len(spans) > 1:
        raise ValueError(f"this process's rows of a {shape} batch are not one block: {spans}")
    return slice(start, stop)


def local_rows(batch: Any, sharding: Any) -> Any:
    """This process's share of a learner's batch (a [B, L + 1] array, or a dict of [B, ...] arrays
    with a sharding each, as Compiled.batch_sharding is for fine-tuning rows): the rows its devices
    hold. Host work only."""
    return jax.tree.map(lambda x, s: np.asarray(x)[_row_block(s, np.shape(x))], batch, sharding)


def global_batch(local: Any, sharding: Any, rows: int) -> Any:
    """The learner's global batch of `rows` rows from each process's `local` share (its rows in
    order, `local_rows`): jax.make_array_from_process_local_data, so a process need only have
    loaded or cut its own rows. Every process calls it (it builds one global array)."""
    shape = lambda x: (rows, *np.shape(x)[1:])  # noqa: E731 - the global shape of each leaf
    return jax.tree.map(lambda x, s: jax.make_array_from_process_local_data(s, np.asarray(x), shape(x)),
                        local, sharding)


def host_batch(batch: Any, sharding: Any) -> Any:
    """The global array of a batch every process holds in full (train_batch is a pure function of
    (learner, step)): each process places only its own rows. Equivalent to jax.device_put(batch,
    sharding), which LearnerUnit.step uses and which also works across processes."""
    rows = jax.tree.leaves(batch)[0].shape[0]
    return global_batch(local_rows(batch, sharding), sharding, rows)


def gather_to_leader(tree: Any, leader_only: bool = True) -> Any:
    """Host values of a tree of (possibly sharded) global arrays: on the leader, and also on the
    followers unless `leader_only` (they get None). A leaf this process holds in full is read
    locally; one spread over processes is gathered (multihost_utils.process_allgather, a
    collective), so every process must call this with the same tree. For a LearnerUnit on
    learner_mesh_global every param is local, so this is how a leader on any mesh reads a
    fragment to compute and encode its pseudo-gradient (anchor - local)."""
    def value(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x)
        if _holds_all(x):  # replicas across processes: each reads its own, no collective
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    out = jax.tree.map(value, tree)
    return out if jax.process_index() == 0 or not leader_only else None


def _holds_all(x: jax.Array) -> bool:
    """Whether every process's shards of x cover all of x (the sharding replicates it across
    processes). Read from the global device-to-index map, which every process knows alike, so every
    process takes the same branch: one taken on some processes only would launch the gather on the
    others alone."""
    shape = x.shape if x.ndim else (1,)
    covered: dict[int, np.ndarray] = {}
    for device, idx in x.sharding.devices_indices_map(x.shape).items():
        mask = covered.setdefault(device.process_index, np.zeros(shape, bool))
        mask[idx if x.ndim else ...] = True
    return all(mask.all() for mask in covered.values())


def broadcast_from_leader(payload: bytes | None) -> bytes:
    """The leader's `payload` on every process (followers pass anything, None say). Two
    collectives (multihost_utils.broadcast_one_to_all needs one shape on every process): the
    length, then the bytes padded to a power of two, so each size bucket compiles once. A world of
    one returns the payload as it is."""
    leader = jax.process_index() == 0
    if jax.process_count() == 1:
        return bytes(payload or b"")
    data = bytes(payload or b"") if leader else b""
    n = int(multihost_utils.broadcast_one_to_all(np.asarray([len(data)], _LEN))[0])
    if n == 0:
        return b""
    size = max(256, 1 << (n - 1).bit_length())
    buf = np.zeros(size, np.uint8)
    if leader:
        buf[:n] = np.frombuffer(data, np.uint8)
    return multihost_utils.broadcast_one_to_all(buf)[:n].tobytes()


def all_gather(payload: bytes) -> list[bytes]:
    """Every process's `payload`, in process order, on every process (each process's data=grain
    position for the checkpoint's meta, docs/data.md#resume). Two all-gathers, as in
    broadcast_from_leader: the lengths, then the bytes padded to the longest's power of two. A
    world of one returns [payload]."""
    if jax.process_count() == 1:
        return [bytes(payload)]
    data = np.frombuffer(bytes(payload), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([len(data)], _LEN))).reshape(-1)
    size = max(256, 1 << (int(lengths.max()) - 1).bit_length())
    buf = np.zeros(size, np.uint8)
    buf[:len(data)] = data
    rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(lengths), size)
    return [rows[i, :int(n)].tobytes() for i, n in enumerate(lengths)]


def agree(decision: dict | None) -> dict:
    """The leader's decision at a step boundary (a JSON-able dict: e.g. the fragments to give up
    on, whether to stop, the rows a chaos tape leaves), as every process sees it; followers pass
    None. One broadcast of its JSON."""
    mine = json.dumps(decision, sort_keys=True).encode() if jax.process_index() == 0 else None
    raw = broadcast_from_leader(mine)
    return json.loads(raw.decode()) if raw else {}


def pack_frames(frames: Sequence[bytes]) -> bytes:
    """Frames as one payload: uint32 little-endian count, then each frame's uint32 length and
    bytes (frames stay opaque; LearnerUnit.receive validates each one)."""
    parts = [len(frames).to_bytes(4, "little")]
    for f in frames:
        parts += [len(f).to_bytes(4, "little"), bytes(f)]
    return b"".join(parts)


def unpack_frames(raw: bytes) -> list[bytes]:
    """The frames of pack_frames; ValueError if `raw` is not such a payload."""
    if len(raw) < 4:
        raise ValueError("a frame list needs at least its count")
    count, at, out = int.from_bytes(raw[:4], "little"), 4, []
    for _ in range(count):
        if at + 4 > len(raw):
            raise ValueError("a frame list ends inside a length")
        n = int.from_bytes(raw[at:at + 4], "little")
        at += 4
        if at + n > len(raw):
            raise ValueError("a frame list ends inside a frame")
        out.append(raw[at:at + n])
        at += n
    if at != len(raw):
        raise ValueError(f"{len(raw) - at} bytes after the last frame")
    return out


def mirror_frames(frames: Sequence[bytes] | None) -> list[bytes]:
    """The broadcasts the leader took at this step boundary (in the order it gives them to
    LearnerUnit.receive), on every process; followers pass None and then receive the same frames in
    the same order, so their learner state machines schedule the same applies at the same steps.
    The bytes travel, not store keys: the leader holds them already, a follower then never races
    the store's gc for an object the leader read, and only the leader's store reads are booked as
    the learner's down bytes (the `fetched` of its events, docs/design.md#learner-events)."""
    raw = broadcast_from_leader(pack_frames(frames or ()) if jax.process_index() == 0 else None)
    return unpack_frames(raw) if raw else []
