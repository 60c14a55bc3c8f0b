"""The procs runtime: spawned learner and syncer processes talking through a file:// object store;
a failure-free run trains and balances its ledger, a learner killed with kill -9 mid-run is
restarted under a new incarnation, rejoins, and the run finishes with every merge applied once,
and a syncer killed with kill -9 is restarted from its checkpoint and skips and repeats no version."""

import json
import os
import signal
import threading
import time
from collections import defaultdict
from dataclasses import replace

import pytest
from conftest import alongside, diloco_world, load_scaled, tiny_cfg

from diloco import store as bs
from diloco.algo import syncer as sync
from diloco.algo.replay import apply as deliver, replay
from diloco.config import TrainConfig, validate
from diloco.runtime import procs
from diloco.runtime.procs import child as procs_child
from diloco.runtime.procs.reading import store_view
from diloco.runtime.runlog import read_decisions, read_inputs
from diloco.runtime.stop import RunStopped

STEPS, M, P = 20, 2, 2


def make_cfg(tmp_path, **runtime) -> TrainConfig:
    """The tests' tiny run (tests/conftest.py) on procs, 20 steps evaluated every 10."""
    return tiny_cfg(tmp_path, "procs", run=dict(steps=STEPS), runtime=runtime)


@pytest.fixture(scope="module")
def world(tmp_path_factory, pytestconfig):
    """One config and setup for the module, and one XLA compilation cache for every child process
    of its runs, kept in pytest's cache directory: later runs load what the first one compiled."""
    root = tmp_path_factory.mktemp("procs")
    cache = getattr(pytestconfig, "cache", None)  # None under -p no:cacheprovider
    xla_cache = root / "xla_cache" if cache is None else cache.mkdir("diloco-procs-xla")
    cfg = make_cfg(root)
    corpus, model, setup, evaluate_global, initial = diloco_world(cfg)
    with pytest.MonkeyPatch.context() as mp:  # read by the spawned children's jax only
        mp.setenv("JAX_COMPILATION_CACHE_DIR", str(xla_cache))
        mp.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        yield cfg, setup, evaluate_global, initial


def variant(built, tmp_path, **runtime):
    """The module's config (`built`: the world fixture's value) with other runtime settings (same
    model, steps and compiled code); runtime may name a section, e.g. world=WorldConfig(...)."""
    cfg, setup, _, _ = built
    cfg = validate(replace(cfg, runtime=replace(cfg.runtime, **runtime),
                           run=replace(cfg.run, out_dir=str(tmp_path / "run"))))
    (tmp_path / "run").mkdir()
    return cfg, setup, tmp_path / "run"


def merge_versions(run_dir) -> dict[int, list[int]]:
    versions = defaultdict(list)
    for r in read_decisions(run_dir / "decisions.jsonl"):
        if r["event"] == "merge":
            versions[r["fragment"]].append(r["version"])
    return versions


def test_two_learner_processes_train_merge_and_balance(world, tmp_path):
    _, _, evaluate_global, initial = world
    cfg, setup, run_dir = variant(world, tmp_path)
    cfg = replace(cfg, run=replace(cfg.run, profile=(1, 3)))  # learner 0's process traces steps 2 and 3
    rt, summary = procs.run(cfg, setup, run_dir, evaluate_global)

    assert sorted(rt.exits) == [("learner-0", 0, 0), ("learner-1", 0, 0)]  # nobody restarted
    assert rt.syncer.exitcode == 0 and rt.finished["complete"]
    assert rt.finished["steps"] == {"0": STEPS, "1": STEPS}
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    assert rt.finished["tokens"]["processed"] == P * M * STEPS * tokens_per_step  # every step booked once
    assert summary["token_ledger_imbalance"] == 0
    assert summary["merges"] > 0 and rt.finished["tokens"]["merged"] > 0
    assert summary["bytes_up"] > 0 and summary["bytes_down"] > 0 and summary["clock"] == "wall"
    assert initial > 2.5 and summary["eval_loss"] < initial - 0.5, (summary["eval_loss"], initial)
    for p, vs in merge_versions(run_dir).items():
        assert vs == list(range(1, len(vs) + 1)), (p, vs)

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for m in range(M):
        assert [r["step"] for r in records if r["kind"] == "train" and r["learner"] == m] == [5, 10, 15, 20]
        # each learner's tokens/s between its records (docs/design.md#model-flops-and-mfu)
        assert [r["step"] for r in records if r.get("learner") == m and r.get("tokens_per_s_per_device", 0) > 0] \
            == [10, 15, 20]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [10, 20, 20]  # periodic, last, final
    assert len(list((run_dir / "profile").rglob("*.xplane.pb"))) == 1

    # The syncer's inputs log replays to its decisions: the same code as sim and threads.
    events = list(read_inputs(run_dir / "syncer_inputs.bin"))
    again = replay(setup.policy, sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0, 1: 0}), events)
    assert json.loads(json.dumps(list(again.decisions))) == read_decisions(run_dir / "decisions.jsonl")
    assert all((again.fragments[p].theta[k] == rt.theta[k]).all() for p in range(P) for k in again.fragments[p].theta)
    store = bs.BlobStore(f"file://{run_dir}/store")
    assert store.list("rep/") == [] and store.list("ev/") == []  # every report read, every event booked


def test_kill_9_learner_restarts_rejoins_and_balances(world, tmp_path):
    """kill -9 of learner 1's process mid-run: the supervisor restarts it as incarnation 1, which
    rejoins from the store's Theta; the syncer books the death, drops nothing twice, finishes."""
    cfg, setup, run_dir = variant(world, tmp_path, speeds=(1.0, 3.0), learner_checkpoint_every=4, restart_s=1.0)
    killed = []

    def killer(stop):
        """Kill learner 1 once it has checkpointed step 4 (Orbax renames a finished step into place)."""
        store, saved = bs.BlobStore(f"file://{run_dir}/store"), run_dir / "learners" / "learner-1"
        while not stop.is_set() and not killed:
            steps = [int(d.name) for d in saved.iterdir() if d.name.isdigit()] if saved.is_dir() else []
            if steps:
                learner = bs.read_control(store, "procs")["learners"]["1"]
                os.kill(learner["pid"], signal.SIGKILL)
                killed.append((learner["incarnation"], max(steps)))
            stop.wait(0.01)

    rt, summary = alongside(killer, lambda: procs.run(cfg, setup, run_dir, None))

    assert killed and killed[0][0] == 0, killed
    assert ("learner-1", 0, -signal.SIGKILL) in rt.exits and ("learner-1", 1, 0) in rt.exits
    assert [(r["learner"], r["incarnation"]) for r in rt.rejoins] == [(1, 1)]
    assert rt.rejoins[0]["step"] >= 4  # from its checkpoint (fresh enough) or where it died
    assert rt.finished["complete"] and rt.finished["steps"] == {"0": STEPS, "1": STEPS}
    assert [1, 0] in rt.finished["dead"]
    assert summary["token_ledger_imbalance"] == 0 and summary["merges"] > 0
    for p, vs in merge_versions(run_dir).items():  # no version applied twice or skipped
        assert vs == list(range(1, len(vs) + 1)), (p, vs)
    assert summary["uptime"] > 0
    # runtime.restart_s once its devices were back (at once: a kill), on top of spawn and compile
    [r] = rt.rejoins
    assert r["time"] - r["down_until"] >= 1.0 and r["down_until"] >= r["died_at"]


def test_kill_9_syncer_restarts_from_its_checkpoint_and_skips_or_repeats_no_version(world, tmp_path):
    """kill -9 of the syncer once it has checkpointed and published a version after that: the
    supervisor restarts it, it restores the checkpoint and remakes the versions after it from its
    journal; learners keep training. Every step is booked once, every version made once, and the
    versions learners saw before the kill are the ones the run's record holds."""
    _, _, evaluate_global, initial = world
    cfg, setup, run_dir = variant(world, tmp_path, speeds=(1.0, 2.0))
    cfg = validate(replace(cfg, run=replace(cfg.run, checkpoint_every=4)))  # merges between checkpoints
    killed, seen = [], {}

    def killer(stop):
        store, saved, published = bs.BlobStore(f"file://{run_dir}/store"), run_dir / "syncer", None
        while not stop.is_set() and not killed:
            if saved.is_dir() and any(d.name.isdigit() for d in saved.iterdir()):  # renamed in when done
                total = sum(pub.version for pub in bs.latest(store).values())
                if published is None:
                    published = total
                elif total > published:
                    os.kill(bs.read_control(store, "procs")["syncer"], signal.SIGKILL)
                    killed.append(total)
                    view, _ = store_view(store, setup)  # what learners could fetch at the kill
                    seen.update({p: fs.refs[-1] for p, fs in enumerate(view.fragments) if fs.version})
            stop.wait(0.005)

    rt, summary = alongside(killer, lambda: procs.run(cfg, setup, run_dir, evaluate_global))

    assert killed and ("syncer", 0, -signal.SIGKILL) in rt.exits, (killed, rt.exits)
    assert rt.finished["complete"] and rt.finished["steps"] == {"0": STEPS, "1": STEPS}
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    assert rt.finished["tokens"]["processed"] == P * M * STEPS * tokens_per_step  # no step booked twice
    assert summary["token_ledger_imbalance"] == 0 and summary["merges"] > 0
    for p, vs in merge_versions(run_dir).items():  # no version made twice or skipped
        assert vs == list(range(1, len(vs) + 1)), (p, vs)
    assert initial > 2.5 and summary["eval_loss"] < initial - 0.5, (summary["eval_loss"], initial)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for m in range(M):  # reports the first syncer made are not made again
        assert [r["step"] for r in records if r["kind"] == "train" and r["learner"] == m] == [5, 10, 15, 20]

    # The input log, truncated to the checkpoint and continued, replays to the run's decisions and
    # Theta, and through the versions learners saw before the kill, value for value.
    st = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0, 1: 0})
    matched = set()
    for event in read_inputs(run_dir / "syncer_inputs.bin"):
        st, _ = deliver(setup.policy, st, event)
        for p, (version, values) in seen.items():
            ref = dict(st.fragments[p].refs).get(version)
            if ref is not None and p not in matched:
                assert all((ref[k] == values[k]).all() for k in values), (p, version)
                matched.add(p)
    assert seen and matched == set(seen), (seen.keys(), matched)
    assert json.loads(json.dumps(list(st.decisions))) == read_decisions(run_dir / "decisions.jsonl")
    assert all((st.fragments[p].theta[k] == rt.theta[k]).all() for p in range(P) for k in st.fragments[p].theta)
    store = bs.BlobStore(f"file://{run_dir}/store")
    assert store.list("rep/") == [] and store.list("ev/") == [] and store.list("up/") == []


def sigterm_once_started(run_dir, stop: threading.Event, sent: list):
    """(the run's store, a thread that sends this process SIGTERM 0.5 s after the run's clock has
    started, noting when it saw the start and when it sent the signal in `sent`, unless `stop` is
    set first)."""
    store = bs.BlobStore(f"file://{run_dir}/store")

    def terminate_once_started():
        while not stop.is_set():
            try:
                started = bs.read_control(store, "start")
            except ValueError:  # not yet (the supervisor clears the store first)
                started = None
            if started is not None:
                sent.append(time.monotonic())
                stop.wait(0.5)
                sent.append(time.monotonic())
                os.kill(os.getpid(), signal.SIGTERM)
                return
            stop.wait(0.01)

    return store, threading.Thread(target=terminate_once_started)


def test_sigterm_stops_every_process_and_gives_a_partial_summary(world, tmp_path):
    """SIGTERM to the supervisor (as from a process manager) mid-run: the learners checkpoint and
    exit, the syncer finishes with what it booked, RunStopped carries its summary."""
    # Both learners paced at 20 x 5 ms a step (2 s for the run), so however fast the machine, no
    # learner can finish before the SIGTERM lands 0.5 s after the start (learner 0 at 5 ms a step
    # once did, on a quiet machine, and exited 0 instead of 143).
    cfg, setup, run_dir = variant(world, tmp_path, speeds=(20.0, 20.0), step_period_s=0.005)
    sent, stop = [], threading.Event()
    store, thread = sigterm_once_started(run_dir, stop, sent)

    handler = signal.getsignal(signal.SIGTERM)
    thread.start()
    began = time.monotonic()
    try:
        with pytest.raises(RunStopped) as info:  # a KeyboardInterrupt, carrying the partial summary
            procs.run(cfg, setup, run_dir, None)
    finally:
        stop.set()
        thread.join()
    # Stopping (a checkpoint per learner, the syncer's last booking, every process reaped) is less
    # work than starting (spawning them, importing JAX, compiling): it may take as long as the start
    # did on this machine just now, and 30 s however quick that was.
    assert len(sent) == 2 and time.monotonic() - sent[1] < load_scaled(30.0, sent[0] - began)
    assert signal.getsignal(signal.SIGTERM) == handler  # the supervisor's handler is gone
    pids = bs.read_control(store, "procs")
    for pid in [pids["syncer"], *(x["pid"] for x in pids["learners"].values())]:
        with pytest.raises(ProcessLookupError):  # reaped: no process, not even a zombie
            os.kill(pid, 0)
    assert isinstance(info.value, KeyboardInterrupt) and info.value.resumable and not info.value.forced
    assert info.value.summary["token_ledger_imbalance"] == 0 and info.value.run_dir == run_dir
    # what a resume needs: the stop's clock and reports read, and every learner's exit notice
    assert bs.read_control(store, "stopped")["at"] > 0
    for m in range(M):
        assert bs.read_control(store, f"died/{m:04d}/0000")["exitcode"] == 128 + signal.SIGTERM
    # each learner checkpointed where SIGTERM found it (the periodic interval, 50, was never reached)
    for m in range(M):
        saved = [int(d.name) for d in (run_dir / "learners" / f"learner-{m}").iterdir() if d.name.isdigit()]
        assert saved and 0 < max(saved) <= STEPS


@pytest.mark.slow  # 20 s; the wall-clock reading of a tape is tested under threads too
def test_a_chaos_tape_drives_the_learner_processes(world, tmp_path):
    """A hand-written tape file replayed on the wall clock: learner 1 computes half its batch from
    the start, loses its last slice 0.05 s in (its process exits with EXIT_DOWN) and gets one back at
    2 s; its successor waits for that and runtime.restart_s, rejoins and finishes. Down time is
    booked until the tape's return, the ledger balances, and no version is skipped or repeated."""
    from diloco.chaos import tapes

    tape = tapes.Tape(M, 2, 100.0, (1.0, 1.0), 0.0, 0, (
        tapes.Event(0.0, "slice_down", 1, 0), tapes.Event(0.05, "slice_down", 1, 1),
        tapes.Event(2.0, "slice_up", 1, 1)))
    path = tmp_path / "tape.json"
    path.write_text(tapes.to_json(tape))
    cfg, setup, run_dir = variant(world, tmp_path, restart_s=0.5)
    cfg = validate(replace(cfg, chaos=replace(cfg.chaos, enabled=True, tape_file=str(path))))
    rt, summary = procs.run(cfg, setup, run_dir, None)

    assert ("learner-1", 0, procs_child.EXIT_DOWN) in rt.exits
    assert [(r["learner"], r["incarnation"]) for r in rt.rejoins] == [(1, 1)]
    assert rt.rejoins[0]["time"] >= 2.0 + 0.5  # not before the tape gave a slice back, then restart_s
    assert rt.rejoins[0]["time"] - rt.rejoins[0]["down_until"] >= 0.5 and rt.rejoins[0]["down_until"] >= 2.0
    assert summary["token_ledger_imbalance"] == 0 and 0 < summary["goodput"] < 1
    # the summary counts what the tape injected beside the death it caused (docs/design.md#the-summary)
    assert (summary["slice_failures"], summary["learner_outages"], summary["learner_deaths"]) == (2, 1, 1)
    assert rt.finished["steps"] == {"0": STEPS, "1": STEPS}
    versions = merge_versions(run_dir)
    assert all(vs == list(range(1, len(vs) + 1)) for vs in versions.values())
