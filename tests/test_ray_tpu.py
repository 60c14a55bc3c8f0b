"""TPU slices on Ray (runtime.ray.tpu_topology, diloco/runtime/ray_placement.py): each learner reserves
one whole slice through ray.util.tpu's SlicePlacementGroup, one bundle and one world process per
host of that slice.

No TPU here, so the cluster pretends: two "slices" of TPU v4 2x2x2 (8 chips, 2 hosts of 4), each
host a local Ray node with `TPU: 4`, the labels Ray's TPU nodes carry (`ray.io/tpu-slice-name`,
`ray.io/tpu-worker-id`, `ray.io/tpu-pod-type`), the head resource on worker 0 (`TPU-v4-16-head`),
and TPU_NAME in the node's environment, where Ray's TPU manager reads a slice's name on GKE. The
learners' JAX runs on 4 CPU devices per process in place of the 4 chips. What this checks is
Ray's slice reservation as the runtime uses it (both hosts of one slice per learner, no slice
shared, a restarted world back on its own slice), not TPU execution."""

import time
from dataclasses import replace

import pytest

pytest.importorskip("ray")

import ray  # noqa: E402
from conftest import diloco_world  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from test_procs import make_cfg  # noqa: E402
from test_ray import actor_nodes, balanced, loopback, run_with, trained, variant  # noqa: E402

from diloco import store as bs  # noqa: E402
from diloco.config import (ConfigError, RayConfig, RuntimeConfig, TrainConfig, WorldConfig,  # noqa: E402
                           from_dict, validate)
from diloco.runtime import ray_runtime  # noqa: E402
from diloco.runtime.ray_placement import slice_shape  # noqa: E402

SLICES = ("slice-a", "slice-b")
TPU = {"ray": {"tpu_topology": "2x2x2", "tpu_version": "v4"}, "world": {"processes_per_learner": 2},
       "devices_per_learner": 8}


def tpu_runtime(ray=None, world=None, **changes) -> RuntimeConfig:
    """A ray runtime of learners on one v4 2x2x2 slice each (TPU), with the fields of its ray and world
    sections and its own that `ray`, `world` and `changes` name changed."""
    return from_dict(RuntimeConfig, {"kind": "ray", **TPU, **changes, "ray": {**TPU["ray"], **(ray or {})},
                                     "world": {**TPU["world"], **(world or {})}}, "runtime")


@pytest.mark.parametrize("runtime, message", [
    (dict(world={"processes_per_learner": 1}), "has 2 host.*processes_per_learner=2 \\(got 1\\)"),
    (dict(devices_per_learner=4), "holds 8 TPU devices .*devices_per_learner=8 \\(got 4\\)"),
    (dict(ray={"tpu_topology": "4x4", "tpu_version": "v6e"}, devices_per_learner=16), "v6e slice of 4x4 has 4 host"),
    (dict(ray={"learner_resources": {"CPU": 1.0, "TPU": 3.0}}), "not divisible"),
])
def test_a_slice_the_learners_world_does_not_fit_is_a_config_error(runtime, message):
    with pytest.raises(ConfigError, match=message):
        slice_shape(tpu_runtime(**runtime))


def test_a_slice_is_one_bundle_per_host_with_the_learners_resources_added():
    assert slice_shape(tpu_runtime()) == (2, {"CPU": 1.0, "TPU": 4})
    r = tpu_runtime(ray={"learner_resources": {"CPU": 8.0, "memory": 1e9}})
    assert slice_shape(r) == (2, {"CPU": 8.0, "memory": 1e9, "TPU": 4})


@pytest.mark.parametrize("ray, kind, message", [
    ({"tpu_topology": "4x4"}, "ray", "set both"),
    ({"tpu_topology": "four", "tpu_version": "v6e"}, "ray", "runtime.ray.tpu_topology='four' is not a TPU topology"),
    ({"tpu_topology": "4x4", "tpu_version": "v6e"}, "procs", "needs runtime.kind=ray"),
])
def test_tpu_settings_are_checked_at_start_up(ray, kind, message):
    with pytest.raises(ConfigError, match=message):
        validate(TrainConfig(runtime=RuntimeConfig(kind=kind, ray=RayConfig(**ray))))


@pytest.fixture(scope="module")
def slices():
    """A head of 1 CPU (the syncer) and two fake v4 2x2x2 slices of 2 hosts each."""
    with pytest.MonkeyPatch.context() as mp:
        loopback(mp)
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        for name in SLICES:
            for worker in range(2):
                # A node's raylet and workers inherit this process's environment when it starts.
                mp.setenv("TPU_NAME", name)
                mp.setenv("TPU_WORKER_ID", str(worker))
                c.add_node(num_cpus=2, resources={"TPU": 4, **({"TPU-v4-16-head": 1} if worker == 0 else {})},
                           labels={"ray.io/tpu-slice-name": name, "ray.io/tpu-worker-id": str(worker),
                                   "ray.io/tpu-pod-type": "v4-16", "ray.io/accelerator-type": "TPU-V4"})
        mp.delenv("TPU_NAME")
        mp.delenv("TPU_WORKER_ID")
        yield c
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


@pytest.mark.slow  # 60 s: a 5-node cluster and 4 world processes on 2 cores
def test_each_learner_runs_on_one_whole_slice_and_comes_back_on_it(slices, tmp_path):
    """2 learners, each a world of 2 processes on the 2 hosts of one slice. Learner 0's follower
    actor is killed mid-run: Ray restarts it in its group, which the slice's label keeps on the same
    slice; the world rejoins as incarnation 1 and the run ends balanced."""
    cfg = make_cfg(tmp_path / "base")
    cfg = validate(replace(cfg, run=replace(cfg.run, checkpoint_every=2), runtime=replace(
        cfg.runtime, kind="ray", learners=2, learner_checkpoint_every=4, restart_s=0.0, step_period_s=0.25,
        devices_per_learner=8, world=WorldConfig(processes_per_learner=2, heartbeat_s=3.0),
        ray=RayConfig(address=slices.address, tpu_topology="2x2x2", tpu_version="v4"))))
    _, _, setup, _, _ = diloco_world(cfg)
    cfg, setup, _, run_dir = variant((cfg, setup, None), tmp_path)
    placed: list[dict] = []  # learner -> its actors' nodes: before the kill, and once it is back

    def where(store) -> dict:
        return {m: actor_nodes(store, m, timeout=60) for m in (0, 1)}

    def kill(store):
        if not placed and trained(run_dir, 0, 5):
            placed.append(where(store))
            actor = bs.read_control(store, "procs")["learners"]["0"]["actors"][1]
            ray.kill(ray.get_actor(actor, namespace="diloco"), no_restart=False)
        elif len(placed) == 1 and bs.read_control(store, "procs")["learners"]["0"]["incarnation"] == 1:
            try:
                placed.append(where(store))  # the restarted actor answers once Ray has placed it again
            except ray.exceptions.RayError:  # still restarting
                return None
            return "killed"

    t0 = time.perf_counter()
    rt, summary, done = run_with(cfg, setup, None, run_dir, kill)
    wall = time.perf_counter() - t0
    assert done == ["killed"]
    assert ("learner-0", 0, ray_runtime.KILLED) in rt.exits and ("learner-0", 1, 0) in rt.exits, rt.exits
    assert [(r["learner"], r["incarnation"]) for r in rt.rejoins] == [(0, 1)]
    balanced(rt, summary, run_dir, learners=2)
    slice_of = {n["NodeID"]: n["Labels"].get("ray.io/tpu-slice-name") for n in ray.nodes()}
    before, after = placed
    assert all(len(set(ns)) == 2 for ns in before.values()), before  # one process on each host
    used = [{slice_of[n] for n in ns} for ns in before.values()]
    assert all(len(u) == 1 for u in used) and used[0] != used[1], used  # a whole slice each, none shared
    assert {slice_of[n] for n in after[0]} == used[0], (before, after)  # back on its own slice
    print(f"\nray tpu slices: 2 learners x a 2-host slice, a follower actor killed, {wall:.1f} s")
