"""A process of a learner's world (diloco/runtime/world.py), spawned by tests/test_world.py; also
the loop the test's one-process reference runs, so both drive LearnerUnit the same way.

    python tests/world_child.py train <index> <processes> <port> <out_dir> <steps>
    python tests/world_child.py spin  <index> <processes> <port> <out_dir> <nap_s>
    python tests/world_child.py grain <index> <processes> <port> <out_dir> <steps>

train: ONE learner over every process's devices runs `steps` inner steps of the tiny model
(configs/model/tiny.yaml) against a K = 1 syncer that only the leader runs; the merges reach the
followers through world.mirror_frames. Each process writes p<index>.npz (losses, params, the
gathered params, every contribution frame) and p<index>.json (the broadcast check, timings).
spin: a jitted all-reduce over the world in a loop, `nap_s` between steps, each step appended to
p<index>.steps, until a peer's death ends the process (the kill test).
grain: each process reads its own part of learner 1's data=grain stream (tests/test_data_grain_world.py),
places its rows with world.global_batch, saves its position half-way (world.all_gather) and resumes
a fresh stream from it; p<index>.json has its record ids, p0.npz the gathered batches.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
BATCH, SEQ = 16, 32


def make_cfg(root: Path, steps: int):
    """The tests' tiny run (tests/conftest.py) with configs/model/tiny.yaml's model: one learner of
    8 devices, 2 fragments sent every 2 steps, tau = 1, int4 with error feedback up."""
    from conftest import tiny_cfg

    from diloco.config import ModelConfig, from_dict

    model = from_dict(ModelConfig, yaml.safe_load((ROOT / "configs/model/tiny.yaml").read_text()), "model")
    return tiny_cfg(root, "threads", model=model, data=dict(seq_len=SEQ, batch_size=BATCH), inner=dict(warmup_steps=0),
                    run=dict(steps=steps, log_every=0, eval_every=0, eval_batches=8), fragments=dict(H=2),
                    codec=dict(up="int4", error_feedback=True, zstd_level=1, down="int8"),
                    runtime=dict(learners=1, devices_per_learner=8))


def learner(cfg):
    """(setup, unit) of learner 0 on the world's global mesh (world.learner_mesh_global)."""
    from diloco.data import load_corpus
    from diloco.model import build
    from diloco.runtime import build as build_setup, world
    from diloco.runtime.unit import LearnerUnit
    from diloco.train.trainer import compile_steps

    corpus = load_corpus(cfg.data)
    model = build(cfg.model, corpus.vocab_size, cfg.run.seed)
    setup = build_setup.build(cfg, corpus, model)
    mesh = world.learner_mesh_global(cfg.runtime.devices_per_learner, cfg.data.batch_size)
    setup = setup._replace(compiled=(compile_steps(model, cfg, mesh),))
    # What build_setup.new_unit reads of a fresh syncer (version 0 of Theta_0), without the merge
    # compiles of sync.init, which only the leader, running the syncer here, needs.
    anchors = {p: (0, values) for p, values in enumerate(setup.theta0)}
    return setup, LearnerUnit(setup.spec, 0, 0, setup.compiled[0], anchors)


def drive(setup, unit, steps: int, leader: bool, mirror) -> dict:
    """`steps` passes of the wall-clock loop's order (docs/design.md#deferred-encode aside): take
    the broadcasts, apply the due ones, step. Only the leader runs the syncer on its contributions,
    and its unit takes each broadcast as it is published, alone, as a procs world's leader takes
    them from the store between boundaries (docs/multihost.md#learner-process); the followers' units
    take the same frames at the next pass, through mirror(frames) (the leader's, everywhere)."""
    from diloco.algo import syncer as sync

    state = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0}) if leader else None
    pending: list[bytes] = []
    losses, frames, received = [], [], []
    for i in range(steps):
        got = mirror(pending if leader else None)
        pending = []
        received.append(len(got))
        for frame in got if not leader else ():
            unit.receive(frame)
        unit.apply_due()
        result = unit.step(fetch_loss=True)
        losses.append(result.loss)
        if i == 0:  # before any merge: the inner step alone
            first = unit.params_host()
        frames += list(result.frames)
        if leader:
            state = sync.observe_step_time(state, 0, 1.0)  # a runtime reports the step before its frames
            for frame in result.frames:
                state, actions = sync.on_contribution(setup.policy, state, frame, float(i))
                for published in (a.frames[0] for a in actions if isinstance(a, sync.Publish)):
                    unit.receive(published)  # the leader alone: host work only (a collective here hangs)
                    pending.append(published)
    return {"losses": losses, "frames": frames, "received": received, "first": first,
            "versions": [unit.anchors[p][0] for p in range(len(setup.fragments))]}


def flat(tree) -> dict[str, np.ndarray]:
    import jax

    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def train(index: int, processes: int, port: int, out: Path, steps: int) -> None:
    from diloco.runtime import world

    t0 = time.perf_counter()
    w = world.join_world(f"127.0.0.1:{port}", processes, index, timeout_s=60, heartbeat_s=5,
                         cpu_devices=8 // processes)  # 8 devices in all: one process is the reference
    joined = time.perf_counter() - t0
    setup, unit = learner(make_cfg(out.parent, steps))
    t1 = time.perf_counter()
    done = drive(setup, unit, steps, w.leader, world.mirror_frames)
    t2 = time.perf_counter()
    gathered = world.gather_to_leader(unit.state.params, leader_only=False)
    message = f"decided by the leader: {'x' * 300}".encode()
    got = world.broadcast_from_leader(message if w.leader else b"a follower's bytes, never sent")
    t3 = time.perf_counter()
    agreed = world.agree({"give_up": [1], "stop": False} if w.leader else None)
    t4 = time.perf_counter()
    # A batch fed by rows: each process places only its own, and the gather (across processes:
    # the batch is split over all 8 devices) gives back the whole batch, as device_put placed it.
    import jax
    from diloco.data import train_batch
    s, sharding = setup.spec, setup.compiled[0].batch_sharding
    batch = train_batch(s.train, seed=s.seed, learner=0, num_learners=1, step=0, batch_size=s.batch_size,
                        seq_len=s.seq_len, shard_block=s.shard_block)
    mine = world.local_rows(batch, sharding)
    back = world.gather_to_leader({"rows": world.global_batch(mine, sharding, len(batch)),
                                   "put": jax.device_put(batch, sharding)}, leader_only=not w.leader)
    share = len(batch) // processes
    np.savez(out / f"p{index}.npz", losses=np.asarray(done["losses"]),
             **{f"param{k}": v for k, v in flat(unit.params_host()).items()},
             **{f"gathered{k}": v for k, v in flat(gathered).items()},
             **{f"first{k}": v for k, v in flat(done["first"]).items()},
             **{f"frame{i}": np.frombuffer(f, np.uint8) for i, f in enumerate(done["frames"])})
    (out / f"p{index}.json").write_text(json.dumps({
        "broadcast_ok": got == message, "agreed": agreed, "received": done["received"],
        "versions": done["versions"], "join_s": joined, "steps_s": t2 - t1, "broadcast_s": t3 - t2,
        "agree_s": t4 - t3, "dropped": unit.dropped_frames, "device_decode": unit.device_decode,
        "rows_ok": bool(np.array_equal(mine, batch[index * share:(index + 1) * share])),
        "gathered_batch_ok": None if back is None else all(np.array_equal(v, batch) for v in back.values())}))
    world.leave_world()


def spin_steps(coordinator: str, processes: int, index: int, log_path: Path, nap: float, steps: int,
               heartbeat_s: float = 3) -> None:
    """`steps` (or endless: 0) jitted all-reduces over the world, `nap` s apart, each appended to
    `log_path`; then a clean leave."""
    from diloco.runtime import world

    world.join_world(coordinator, processes, index, timeout_s=60, heartbeat_s=heartbeat_s, shutdown_s=10,
                     cpu_devices=4)
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    assert jax.local_device_count() == 4 and jax.device_count() == 4 * processes
    mesh = world.learner_mesh_global(jax.device_count(), BATCH)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    step = jax.jit(lambda w, x: w - 0.01 * jnp.mean(x * w), out_shardings=NamedSharding(mesh, P()))
    w = jax.device_put(np.ones((), np.float32), NamedSharding(mesh, P()))
    x = world.host_batch(np.ones((BATCH, 4), np.float32), rows)
    with open(log_path, "a") as log:
        i = 0
        while not steps or i < steps:
            w = step(w, x)
            jax.block_until_ready(w)
            log.write(f"{i} {time.time()}\n")
            log.flush()
            i += 1
            time.sleep(nap)
    world.leave_world()


def spin(index: int, processes: int, port: int, out: Path, nap: float) -> None:
    spin_steps(f"127.0.0.1:{port}", processes, index, out / f"p{index}.steps", nap, 0)


def grain(index: int, processes: int, port: int, out: Path, steps: int) -> None:
    from diloco.runtime import world

    world.join_world(f"127.0.0.1:{port}", processes, index, timeout_s=60, heartbeat_s=5, cpu_devices=8 // processes)
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from test_data_grain import grain_cfg

    from diloco.data import load_corpus
    from diloco.data.stream import for_process, restore_position, saved_position

    cfg = grain_cfg(out.parent, ["d.jsonl", "d.parquet"], too_long="split", batch_size=8)
    stream = lambda: for_process(load_corpus(cfg).train, jax.process_index(), jax.process_count())  # noqa: E731
    train, cut = stream(), steps // 2
    sharding = dict.fromkeys(("tokens", "segments", "positions", "targets"),
                             NamedSharding(world.learner_mesh_global(8, 8), P(("data", "fsdp"))))
    records, gathered, meta = [], {}, None
    for s in range(steps):
        local = train.batch_at(learner=1, num_learners=2, step=s, batch_size=8)
        back = world.gather_to_leader(world.global_batch(local, sharding, 8))
        records.append(train.records(learner=1, num_learners=2, step=s).tolist())
        gathered.update({f"{k}{s}": v for k, v in (back or {}).items()})
        if s + 1 == cut:  # a checkpoint at step `cut`: every process's position, on every process
            meta = saved_position(train, 1, 2, cut, world.all_gather)
    again = stream()
    restore_position(again, 1, 2, cut, meta)
    resumed = [again.records(learner=1, num_learners=2, step=s).tolist() for s in range(cut, steps)]
    if gathered:
        np.savez(out / f"p{index}.npz", **gathered)
    (out / f"p{index}.json").write_text(json.dumps({
        "records": records, "resumed": resumed, "meta": meta, "rows": len(local["tokens"]),
        "taken_up": min(again._feeds[(1, 2, index)].made) == cut}))
    world.leave_world()


def member(out: str, learner: int, incarnation: int, steps: int, nap: float, spec) -> None:
    """A member of learner `learner`'s world (world_group.WorldGroup's target): its steps go to
    l<learner>-i<incarnation>-p<index>.steps under `out`."""
    sys.path.insert(0, str(ROOT))
    path = Path(out) / f"l{learner}-i{incarnation}-p{spec.index}.steps"
    spin_steps(spec.coordinator, spec.processes, spec.index, path, nap, steps)


if __name__ == "__main__":
    mode, index, processes, port, out, arg = sys.argv[1:7]
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    {"train": train, "spin": spin, "grain": grain}[mode](int(index), int(processes), int(port), Path(out),
                                                         (float if mode == "spin" else int)(arg))
