"""The procs runtime with learners that span several processes (docs/multihost.md): 2 learners,
each a jax.distributed world of 2 processes x 4 CPU devices over loopback (gloo collectives),
against one syncer that only each world's leader talks to. kill -9 of a follower of learner 0
mid-run ends learner 0's whole world; it comes back as incarnation 1, a new world on a new port,
and rejoins, while learner 1 trains on; the run completes with its ledger balanced."""

import json
import os
import signal
import threading
import time

from dataclasses import replace

import pytest
from conftest import load_scaled, override
from test_procs import STEPS, make_cfg, merge_versions, variant, world  # noqa: F401 - world is a fixture

from diloco import store as bs
from diloco.config import ConfigError, WorldConfig, validate
from diloco.runtime import procs

M, PROCESSES, DEVICES = 2, 2, 8  # 8 devices a learner: 4 in each of its 2 processes


def world_variant(world, tmp_path, **runtime):  # noqa: F811 - the fixture's value
    return variant(world, tmp_path, devices_per_learner=DEVICES,
                   world=WorldConfig(processes_per_learner=PROCESSES, heartbeat_s=3.0), **runtime)


def train_times(run_dir, m: int) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["time"] for r in records if r["kind"] == "train" and r["learner"] == m]


@pytest.mark.parametrize("runtime, message", [
    ({"world": {"processes_per_learner": 0}}, "runtime.world.processes_per_learner=0 must be >= 1"),
    ({"world": {"processes_per_learner": 2}, "kind": "threads"},
     "runtime.world.processes_per_learner=2 needs runtime.kind=procs or ray"),
    ({"world": {"processes_per_learner": 2, "process_index": 2}}, "runtime.world.process_index=2 must be in 0..1"),
    ({"world": {"processes_per_learner": 2, "process_index": 1}},
     "runtime.world.process_index=1 needs runtime.launch=external"),
    ({"world": {"address": "host name"}}, "runtime.world.address='host name' is not host, host:port or empty"),
    ({"world": {"processes_per_learner": 3}, "devices_per_learner": 4},
     "runtime.devices_per_learner=4 is not divisible by runtime.world.processes_per_learner=3"),
    ({"world": {"processes_per_learner": 2}, "devices_per_learner": 6}, "data.batch_size=16 is not divisible by "
     "runtime.devices_per_learner=6"),
    ({"world": {"processes_per_learner": 2, "heartbeat_s": 0.5}}, "runtime.world.heartbeat_s=0.5 must be >= 1"),
])
def test_learner_world_settings_are_checked(tmp_path, runtime, message):
    cfg = make_cfg(tmp_path)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        override(cfg, runtime=runtime)


@pytest.mark.slow  # 40 s; the world's building blocks are in tests/test_world.py's default tests
def test_two_learner_worlds_train_merge_and_balance(world, tmp_path):  # noqa: F811
    """No failure: each learner's world of 2 processes trains as one learner; only its leader's
    events and contributions reach the syncer (every step booked once), and both worlds end 0."""
    _, _, evaluate_global, initial = world
    cfg, setup, run_dir = world_variant(world, tmp_path)
    steps = STEPS // 2  # every step costs about 0.5 s on the loaded 2-core machine: half the module's
    cfg = validate(replace(cfg, run=replace(cfg.run, steps=steps)))
    t0 = time.perf_counter()
    rt, summary = procs.run(cfg, setup, run_dir, evaluate_global)
    wall = time.perf_counter() - t0

    assert sorted(rt.exits) == [("learner-0", 0, 0), ("learner-1", 0, 0)]  # nobody restarted
    assert rt.finished["complete"] and rt.finished["steps"] == {"0": steps, "1": steps}
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    # one learner's steps, not one per process: the followers write nothing
    assert rt.finished["tokens"]["processed"] == cfg.fragments.count * M * steps * tokens_per_step
    assert summary["token_ledger_imbalance"] == 0 and summary["merges"] > 0
    assert initial > 2.5 and summary["eval_loss"] < initial - 0.5, (summary["eval_loss"], initial)
    for p, vs in merge_versions(run_dir).items():
        assert vs == list(range(1, len(vs) + 1)), (p, vs)
    store = bs.BlobStore(f"file://{run_dir}/store")
    learners = bs.read_control(store, "procs")["learners"]
    for m in range(M):
        assert learners[str(m)]["pids"][0] == learners[str(m)]["pid"] and len(learners[str(m)]["pids"]) == PROCESSES
        for pid in learners[str(m)]["pids"]:
            with pytest.raises(ProcessLookupError):  # every member reaped
                os.kill(pid, 0)
    assert store.list("ev/") == [] and not any(k.startswith("error/") for k in store.list("ctl/"))
    print(f"\nmultihost procs: 2 learners x {PROCESSES} processes x {DEVICES // PROCESSES} devices, "
          f"{steps} steps, {wall:.1f} s, eval loss {summary['eval_loss']:.3f} from {initial:.3f}")


@pytest.mark.slow
def test_kill_9_of_a_follower_restarts_its_whole_world_and_the_other_learner_goes_on(world, tmp_path):  # noqa: F811
    """Learner 0's follower is killed once learner 0 has checkpointed step 4 (every process of its
    world saved it, through Orbax); learner 0's world ends as a whole with the follower's -9, its
    incarnation 1 starts as a new world of 2 processes and rejoins (from that checkpoint or where
    it died), and learner 1, one world never touched, steps on and finishes."""
    # Paced (a step every 0.25 s) so that learner 1 is still training when learner 0 dies.
    cfg, setup, run_dir = world_variant(world, tmp_path, learner_checkpoint_every=4, restart_s=0.5,
                                        step_period_s=0.25)
    killed, stop = [], threading.Event()

    def killer():
        store, saved = bs.BlobStore(f"file://{run_dir}/store"), run_dir / "learners" / "learner-0"
        while not stop.is_set() and not killed:
            steps = [int(d.name) for d in saved.iterdir() if d.name.isdigit()] if saved.is_dir() else []
            if steps:
                learner = bs.read_control(store, "procs")["learners"]["0"]
                os.kill(learner["pids"][1], signal.SIGKILL)
                killed.append((learner["incarnation"], max(steps), learner["pids"]))
            stop.wait(0.01)

    thread = threading.Thread(target=killer)
    thread.start()
    t0 = time.perf_counter()
    try:
        rt, summary = procs.run(cfg, setup, run_dir, None)
    finally:
        stop.set()
        thread.join()
    wall = time.perf_counter() - t0

    assert killed and killed[0][0] == 0 and len(killed[0][2]) == PROCESSES, killed
    # the world's cause is the follower's kill; the leader's abort (or the group's kill) is its effect
    assert ("learner-0", 0, -signal.SIGKILL) in rt.exits and ("learner-0", 1, 0) in rt.exits, rt.exits
    assert [e for e in rt.exits if e[0] == "learner-1"] == [("learner-1", 0, 0)], rt.exits  # never restarted
    assert [(r["learner"], r["incarnation"]) for r in rt.rejoins] == [(0, 1)]
    assert rt.rejoins[0]["step"] >= 4  # from its checkpoint (fresh enough) or where it died
    assert rt.finished["complete"] and rt.finished["steps"] == {"0": STEPS, "1": STEPS}
    assert [0, 0] in rt.finished["dead"] and not any(d[0] == 1 for d in rt.finished["dead"])
    assert summary["token_ledger_imbalance"] == 0 and summary["merges"] > 0
    for p, vs in merge_versions(run_dir).items():  # no version applied twice or skipped
        assert vs == list(range(1, len(vs) + 1)), (p, vs)
    # learner 1 went on training after learner 0's world died
    assert max(train_times(run_dir, 1)) > rt.rejoins[0]["died_at"], (train_times(run_dir, 1), rt.rejoins)
    # incarnation 1 is a new world: two new processes
    now = bs.read_control(bs.BlobStore(f"file://{run_dir}/store"), "procs")["learners"]["0"]
    assert now["incarnation"] == 1 and len(now["pids"]) == PROCESSES and not set(now["pids"]) & set(killed[0][2])
    print(f"\nmultihost procs: 2 learners x {PROCESSES} processes, kill -9 of a follower, {wall:.1f} s")


def sigterm_once_stepped(run_dir, stop: threading.Event, sent: list):
    """As test_procs.sigterm_once_started, but the SIGTERM goes once the syncer has booked an event
    of every learner (each has stepped, so each has a step to save): 0.5 s after the start, learner
    1 (5x slower) was at times still at step 0 on a loaded machine, with nothing to save."""
    store, journal = bs.BlobStore(f"file://{run_dir}/store"), run_dir / "syncer_journal.jsonl"

    def terminate_once_stepped():
        while not stop.is_set():
            lines = journal.read_text().splitlines() if journal.exists() else []
            booked = {e.get("m") for e in map(json.loads, lines[:-1]) if e.get("do") == "event"}  # the last may be torn
            if booked >= set(range(M)):
                sent.extend([time.monotonic()] * 2)  # seen and sent: one moment
                os.kill(os.getpid(), signal.SIGTERM)
                return
            stop.wait(0.05)

    return store, threading.Thread(target=terminate_once_stepped)


@pytest.mark.slow
def test_sigterm_stops_every_world_at_one_step_boundary(world, tmp_path):  # noqa: F811
    """SIGTERM to the supervisor mid-run: each world's leader sees it, every member takes the
    agreed stop at the same step boundary, saves its part of the final checkpoint and leaves the
    world, so each world exits 143 as one; RunStopped carries the partial summary."""
    from diloco.runtime.stop import RunStopped

    cfg, setup, run_dir = world_variant(world, tmp_path, speeds=(1.0, 5.0))
    sent, stop = [], threading.Event()
    store, thread = sigterm_once_stepped(run_dir, stop, sent)
    thread.start()
    began = time.monotonic()
    try:
        with pytest.raises(RunStopped) as info:
            procs.run(cfg, setup, run_dir, None)
    finally:
        stop.set()
        thread.join()
    # as in test_procs: a stop takes at most as long as the start did, and 30 s however quick
    assert len(sent) == 2 and time.monotonic() - sent[1] < load_scaled(30.0, sent[0] - began)
    learners = bs.read_control(store, "procs")["learners"]
    for m in range(M):
        assert len(learners[str(m)]["pids"]) == PROCESSES
        for pid in learners[str(m)]["pids"]:
            with pytest.raises(ProcessLookupError):  # every member reaped
                os.kill(pid, 0)
        # the world's code is every member's own 143 (a clean stop), not a death
        assert bs.read_control(store, f"died/{m:04d}/0000")["exitcode"] == 128 + signal.SIGTERM
        saved = [int(d.name) for d in (run_dir / "learners" / f"learner-{m}").iterdir() if d.name.isdigit()]
        assert saved and 0 < max(saved) <= STEPS
    assert isinstance(info.value, KeyboardInterrupt) and info.value.run_dir == run_dir
    assert not info.value.forced and info.value.summary["token_ledger_imbalance"] == 0
    assert not any(k.startswith("error/") for k in store.list("ctl/"))


def test_a_sigterm_during_a_boundary_broadcast_stops_the_world_at_the_next(monkeypatch):
    """A SIGTERM the leader takes while a step boundary's decision is on its way (it said no stop)
    is not lost: every process goes on at this boundary, as agreed, and the next decision stops
    them all. (A reset flag once let a world train to the end through its SIGTERM.)"""
    from diloco.runtime import world as learner_world
    from diloco.runtime.procs import downlink
    from diloco.runtime.procs.learner import ProcLearner

    rt = object.__new__(ProcLearner)  # only what _check_world reads of a world's leader
    rt.m, rt.world, rt.leader, rt.tape, rt.superseded = 0, learner_world.World(0, 2, "h:1"), True, None, None
    rt.terminating, rt.accepted = False, []
    monkeypatch.setattr(downlink, "receive", lambda rt, unit: False)
    sent = []

    def broadcast(payload):  # the handler runs while the collective waits for the follower
        sent.append(json.loads(learner_world.unpack_frames(payload)[0])["stop"])
        rt.terminating = True
        return payload

    monkeypatch.setattr(learner_world, "broadcast_from_leader", broadcast)
    assert rt.check(None, None) is False and rt.check(None, None) is True
    assert sent == [False, True]
