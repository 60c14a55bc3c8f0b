"""Learners and the syncer started apart (scripts/learner.py, scripts/syncer.py): processes started
by hand with no supervisor, a learner killed with kill -9 and started again by hand, the run
finishing with a balanced ledger; and the claim, fence and config rules they couple by."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from diloco import store as bs
from diloco.config import AuthConfig, ConfigError, RuntimeConfig, TrainConfig, to_dict
from diloco.runtime.procs.child import died
from diloco.runtime.procs.standalone import await_world, claim, config_diff, joined

ROOT = Path(__file__).resolve().parents[1]
STEPS = 24


def overrides(tmp_path, *extra) -> list[str]:
    """tests/test_procs.py's tiny two-learner run, on the command line."""
    return ["model=tiny", "model.d_model=32", "model.d_ff=96", "model.max_seq_len=64", "data=synthetic",
            "data.seq_len=32", "data.batch_size=8", "data.synthetic_tokens=40000",
            f"data.data_dir={tmp_path / 'data'}", f"run.steps={STEPS}", "run.log_every=4", "run.eval_every=12",
            "run.eval_batches=2", "inner.warmup_steps=3", "runtime.learners=2", "runtime.devices_per_learner=1",
            "runtime.learner_checkpoint_every=4", "runtime.restart_s=0", "fragments.count=2", "fragments.H=4",
            "fragments.tau=1", "syncer.quorum=1", "run.checkpoint_every=2", f"run.out_dir={tmp_path / 'run'}",
            "run.progress=false", "run.plot=false", "run.tensorboard=false", *extra]


def start(script: str, args: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "scripts" / script), *args], cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


@pytest.fixture
def env(tmp_path, pytestconfig):
    """The processes' environment: two CPU devices each, a shared run secret, one XLA cache for
    every process of the module's runs (kept in pytest's cache directory when there is one)."""
    cache = getattr(pytestconfig, "cache", None)
    xla = tmp_path / "xla" if cache is None else cache.mkdir("diloco-standalone-xla")
    return {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": str(xla), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "DILOCO_AUTH_SECRET": "x" * 64}


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait(poll, timeout: float, what: str):
    limit = time.monotonic() + timeout
    while time.monotonic() < limit:
        if (found := poll()):
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.mark.slow  # 26 s of five JAX processes; procs' kill -9 and rejoin runs by default
def test_kill_9_a_learner_started_by_hand_and_start_it_again(tmp_path, env):
    args, run_dir = overrides(tmp_path), tmp_path / "run"
    syncer = start("syncer.py", args, tmp_path / "syncer.log", env)
    learners = {m: start("learner.py", [f"runtime.learner_index={m}", *args], tmp_path / f"l{m}.log", env)
                for m in (0, 1)}
    try:
        # Learner 1 has trained (a train record) and saved a checkpoint: kill -9 it, start it again.
        wait(lambda: any(r["kind"] == "train" and r["learner"] == 1 and r["step"] >= 8 for r in metrics(run_dir)),
             240, "learner 1's step 8")
        learners[1].kill()
        assert learners[1].wait(30) == -signal.SIGKILL
        again = start("learner.py", ["runtime.learner_index=1", *args], tmp_path / "l1b.log", env)
        assert syncer.wait(300) == 0, (tmp_path / "syncer.log").read_text()[-3000:]
        assert learners[0].wait(300) == 0 and again.wait(300) == 0, (tmp_path / "l1b.log").read_text()[-3000:]
    finally:
        for p in [syncer, *learners.values()]:
            if p.poll() is None:
                p.kill()

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["token_ledger_imbalance"] == 0 and summary["learner_deaths"] == 1 and summary["rejoins"] == 1
    rejoin = [r for r in metrics(run_dir) if r["kind"] == "rejoin"]
    assert [(r["learner"], r["incarnation"]) for r in rejoin] == [(1, 1)]
    assert rejoin[0]["step"] >= 8  # where its predecessor stopped (the syncer's burial), not from scratch
    store = bs.BlobStore(f"file://{run_dir}/store")
    assert bs.read_control(store, died(1, 0))["exitcode"] == -signal.SIGKILL  # written by its successor's claim
    assert bs.read_control(store, died(1, 1))["exitcode"] == 0 and bs.read_control(store, "finished")
    # A learner started once the run is over has nothing to do.
    late = subprocess.run([sys.executable, str(ROOT / "scripts" / "learner.py"), "runtime.learner_index=0", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert late.returncode == 0 and "has finished" in late.stdout + late.stderr
    # So has the syncer host, started again as a Kubernetes Deployment restarts even a process that exited 0.
    host = subprocess.run([sys.executable, str(ROOT / "scripts" / "syncer.py"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert host.returncode == 0 and "has finished" in host.stdout, host.stderr[-2000:]


@pytest.mark.slow  # 45 s of six JAX processes on 2 cores; the follower rules are tested below by default
def test_kill_9_a_follower_of_a_learner_world_started_by_hand_and_start_the_world_again(tmp_path, env):
    """2 learners x 2 processes, each process started by hand as one host of its learner. kill -9
    of learner 1's follower: its leader aborts within the world's heartbeat (no Python runs, no
    notice); the follower started again first waits for a new claim instead of joining the dead
    world, the leader started again claims incarnation 1 (writing incarnation 0's notice), the new
    world rejoins, and the run ends balanced with one death and one rejoin."""
    args = overrides(tmp_path, "runtime.world.processes_per_learner=2", "runtime.devices_per_learner=2",
                     "runtime.world.heartbeat_s=2", "runtime.world.address=127.0.0.1")
    run_dir = tmp_path / "run"  # 2 CPU devices a process: a world's member takes its 1 (jax_num_cpu_devices)

    def host(m: int, i: int, tag: str = "") -> subprocess.Popen:
        return start("learner.py", [f"runtime.learner_index={m}", f"runtime.world.process_index={i}", *args],
                     tmp_path / f"l{m}p{i}{tag}.log", env)

    syncer = start("syncer.py", args, tmp_path / "syncer.log", env)
    hosts = {(m, i): host(m, i) for m in (0, 1) for i in (1, 0)}  # followers first: they wait for a claim
    again = {}
    try:
        wait(lambda: any(r["kind"] == "train" and r["learner"] == 1 and r["step"] >= 8 for r in metrics(run_dir)),
             300, "learner 1's step 8")
        hosts[1, 1].kill()
        assert hosts[1, 1].wait(30) == -signal.SIGKILL
        assert hosts[1, 0].wait(300) in (-signal.SIGABRT, 128 + signal.SIGABRT)  # the leader lost its peer
        again[1] = host(1, 1, "b")
        time.sleep(3)  # it must not have joined incarnation 0's dead world in the meantime
        assert again[1].poll() is None
        again[0] = host(1, 0, "b")
        assert syncer.wait(300) == 0, (tmp_path / "syncer.log").read_text()[-3000:]
        for p, log in [(hosts[0, 0], "l0p0"), (hosts[0, 1], "l0p1"), (again[0], "l1p0b"), (again[1], "l1p1b")]:
            assert p.wait(300) == 0, (tmp_path / f"{log}.log").read_text()[-3000:]
    finally:
        for p in [syncer, *hosts.values(), *again.values()]:
            if p.poll() is None:
                p.kill()

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["token_ledger_imbalance"] == 0 and summary["learner_deaths"] == 1 and summary["rejoins"] == 1
    rejoin = [r for r in metrics(run_dir) if r["kind"] == "rejoin"]
    assert [(r["learner"], r["incarnation"]) for r in rejoin] == [(1, 1)] and rejoin[0]["step"] >= 8
    store = bs.BlobStore(f"file://{run_dir}/store")
    assert bs.read_control(store, died(1, 0))["exitcode"] == -signal.SIGKILL  # by the new leader's claim
    assert bs.read_control(store, died(1, 1))["exitcode"] == 0 and bs.read_control(store, died(0, 0))["exitcode"] == 0
    assert bs.read_control(store, joined(1, 1, 1)) and bs.read_control(store, joined(0, 1, 1)) is None


def test_a_follower_joins_the_newest_claim_it_has_not_joined_and_nothing_after_the_end(tmp_path):
    store = bs.BlobStore(f"file://{tmp_path}/store")
    world = {"coordinator": "10.0.0.2:8476", "processes": 2}
    claim(store, 1, "a", world)
    held = await_world(store, 1, 1, 2)
    assert (held["incarnation"], held["token"], held["world"]) == (0, "a", world)
    assert bs.read_control(store, joined(1, 0, 1))["pid"] == os.getpid()
    # Started again (its world died): incarnation 0 is joined already, so it waits for the next claim.
    later = threading.Timer(0.5, lambda: claim(store, 1, "b", {**world, "coordinator": "10.0.0.3:9000"}))
    later.start()
    t0 = time.monotonic()
    held = await_world(store, 1, 1, 2)
    assert time.monotonic() - t0 >= 0.4 and (held["incarnation"], held["world"]["coordinator"]) == (1, "10.0.0.3:9000")
    with pytest.raises(ConfigError, match="world of 2 process.*processes_per_learner=4"):
        await_world(store, 1, 2, 4)  # its index is unjoined, but the leader's world is not its size
    claim(store, 0, "c")  # a leader of one process: no world to join
    with pytest.raises(ConfigError, match="world of 1 process"):
        await_world(store, 0, 1, 2)
    bs.write_control(store, "finished", {"at": 1.0})
    assert await_world(store, 1, 1, 2) is None


def test_claims_number_incarnations_and_write_the_notice_a_killed_predecessor_left_none(tmp_path):
    store = bs.BlobStore(f"file://{tmp_path}/store")
    assert claim(store, 3, "a") == 0 and bs.read_control(store, died(3, 0)) is None
    assert claim(store, 3, "b") == 1
    assert bs.read_control(store, died(3, 0)) == {"at": 0.0, "exitcode": -signal.SIGKILL}  # no clock yet
    bs.write_control(store, died(3, 1), {"at": 5.0, "exitcode": 0})  # it wrote its own on the way out
    bs.write_control(store, "start", {"t0": time.time() - 100.0})
    assert claim(store, 3, "c") == 2 and bs.read_control(store, died(3, 1)) == {"at": 5.0, "exitcode": 0}
    assert claim(store, 0, "d") == 0  # each index counts on its own
    assert bs.read_control(store, "claim/0003")["token"] == "c"  # the fence "b" now finds taken


def test_a_learner_whose_config_is_not_the_runs_is_refused_by_key():
    base = TrainConfig()
    mine = to_dict(TrainConfig(runtime=RuntimeConfig(learners=8, learner_index=2)))
    diff = config_diff(mine, to_dict(base))
    assert diff == ["runtime.learners: 8 here, 4 in the run"]  # learner_index is per process
    assert config_diff(to_dict(base), to_dict(base)) == []


def test_bad_standalone_settings_are_refused_by_name(tmp_path, env, monkeypatch):
    learner = subprocess.run([sys.executable, str(ROOT / "scripts" / "learner.py"), *overrides(tmp_path)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert learner.returncode != 0 and "runtime.learner_index" in learner.stderr  # before JAX is imported
    # Processes started apart cannot share a secret one of them made up (scripts/train.py prints it as error:)
    from diloco.runtime import build as build_setup
    monkeypatch.delenv("DILOCO_AUTH_SECRET", raising=False)
    cfg = TrainConfig(runtime=RuntimeConfig(kind="procs", launch="external"))
    with pytest.raises(ConfigError, match="same run secret"):
        build_setup.auth_secret(cfg)
    with pytest.raises(ConfigError, match="runtime.learner_index in 0..3"):
        from diloco.runtime.procs.standalone import run_learner
        run_learner(cfg)
    from diloco.config import validate
    with pytest.raises(ConfigError, match="runtime.launch='external' needs runtime.kind=procs"):
        validate(TrainConfig(runtime=RuntimeConfig(kind="threads", launch="external")))


def test_the_syncer_host_refuses_a_store_holding_another_runs_traffic(tmp_path):
    from dataclasses import replace

    from diloco.runtime.procs.standalone import External
    from diloco.runtime.procs.supervisor import Procs

    store = bs.BlobStore(f"file://{tmp_path}/store")
    store.put("ev/0000/0000/000000000000", b"{}")
    cfg = TrainConfig(runtime=RuntimeConfig(kind="procs", launch="external", auth=AuthConfig(mode="off")))
    host = Procs.__new__(Procs)  # the store check needs no setup or processes
    host.store, host.url, host.cfg, host.run_dir = store, f"file://{tmp_path}/store", replace(cfg), None
    host.launcher, host.ignored = External(), {}
    with pytest.raises(ConfigError, match="another run's objects"):
        host._start()
