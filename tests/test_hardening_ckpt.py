"""Damaged checkpoints and reused run directories (docs/design.md#checkpoint-integrity,
docs/design.md#run-directory-reuse): a checkpoint restores exactly as saved or is skipped with a
warning for the next older one or a fresh start, never raises and never returns altered values; a
learner never rejoins from a checkpoint outside its own past; a run never starts into a directory
an earlier run used.

Each test is built from the trigger of one defect; the property tests at the end damage saved
syncer and learner checkpoints at random."""

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from diloco import checkpoint
from diloco import run as drun
from diloco.algo import syncer as sync
from diloco.algo.replay import replay
from diloco.config import ConfigError, validate
from diloco.runtime.build import new_unit
from diloco.runtime.rejoin import LearnerCheckpoints, rejoin_unit
from diloco.runtime.sim import snapshots as snaps
from diloco.runtime.sim.runtime import Sim
from diloco.runtime.syncer_ckpt import SyncerCheckpoints, to_checkpoint
from test_sim import SGD, build, corpus, make_cfg, model  # noqa: F401  (fixtures)
from test_syncer_ckpt import recorded  # noqa: F401  (fixture)

# Every test here restores damaged or edited checkpoints. Orbax's background threads report a
# read they abandoned on a damaged file once its event loop has closed ("Event loop is closed",
# from a tensorstore future: seen once in a fresh-clone run, attributed to whichever test was
# running); harmless, as every restore's outcome is checked by the test itself.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

ROOT = Path(__file__).resolve().parents[1]


# --- helpers ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def warnings_logged():
    """The warnings diloco logs inside the block (hypothesis examples cannot use caplog)."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler, logger = Keep(logging.WARNING), logging.getLogger("diloco")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def leaves(tree) -> list:
    return [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def bitwise_equal(a, b) -> bool:
    la, lb = leaves(a), leaves(b)
    return [p for p, _ in la] == [p for p, _ in lb] and all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for (_, x), (_, y) in zip(la, lb))


def same_syncer(a: sync.SyncerState, b: sync.SyncerState) -> bool:
    """Everything a syncer checkpoint carries, bit for bit."""
    (arr_a, meta_a), (arr_b, meta_b) = to_checkpoint(a), to_checkpoint(b)
    return bitwise_equal(arr_a, arr_b) and json.dumps(meta_a, sort_keys=True) == json.dumps(meta_b, sort_keys=True)


def raw_restore(directory: Path, step: int):
    """What Orbax itself returns for `step`, with no digest check: the values a flip turns into."""
    manager = ocp.CheckpointManager(directory.absolute())
    try:
        restored = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
        return jax.tree.map(np.asarray, restored["state"]), restored["meta"]
    finally:
        manager.close()


def largest_file(step_dir: Path) -> Path:
    return max((f for f in step_dir.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def flip_silently(directory: Path, step: int, saved) -> None:
    """Flip one byte of the largest data file of `step` such that Orbax restores different values
    without an error (zstd data blocks carry no checksum): the trigger of the defect."""
    target = largest_file(directory / str(step))
    data = target.read_bytes()
    for frac in np.linspace(0.3, 0.9, 13):
        pos = int(len(data) * frac)
        damaged = bytearray(data)
        damaged[pos] ^= 0x20
        target.write_bytes(bytes(damaged))
        try:
            state, _ = raw_restore(directory, step)
        except Exception:  # noqa: BLE001 - Orbax noticed this one; find one it does not
            state = None
        if state is not None and not bitwise_equal(state, saved):
            return
        target.write_bytes(data)
    pytest.fail(f"no silent flip found in {target}")


def edit_meta(directory: Path, step: int, edit) -> None:
    path = directory / str(step) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


# --- item 19: digests of every array and of the meta ----------------------------------------------
@pytest.fixture(scope="module")
def saved_syncer(tmp_path_factory, recorded):  # noqa: F811
    """Syncer checkpoints after 10 and 20 inputs, in a directory the tests copy before damaging."""
    setup, start, inputs, _ = recorded
    older = replay(setup.policy, start, inputs[:10])
    newer = replay(setup.policy, older, inputs[10:20])
    directory = tmp_path_factory.mktemp("syncer") / "ckpt"
    ckpts = SyncerCheckpoints(directory, every=1, keep=3)
    ckpts.save(older, 10)
    ckpts.save(newer, 20)
    ckpts.close()
    return setup, directory, {10: older, 20: newer}


def _copy(directory: Path, into: Path) -> Path:
    shutil.copytree(directory, into)
    return into


def test_a_flipped_byte_in_the_newest_syncer_checkpoint_falls_back_to_the_previous(tmp_path, saved_syncer, caplog):
    setup, pristine, states = saved_syncer
    directory = _copy(pristine, tmp_path / "ckpt")
    flip_silently(directory, 20, raw_restore(pristine, 20)[0])
    ckpts = SyncerCheckpoints(directory, every=1, keep=3)
    try:
        restored, seen = ckpts.latest(setup.policy, setup.fragments)
    finally:
        ckpts.close()
    assert seen == 10 and same_syncer(restored, states[10])
    assert "syncer checkpoint" in caplog.text and "step 20 unusable" in caplog.text
    assert "digest mismatch" in caplog.text


def test_an_edited_meta_field_is_refused(tmp_path, saved_syncer, caplog):
    """A fragment's version + 1 in the JSON: restored as edited before."""
    setup, pristine, states = saved_syncer
    directory = _copy(pristine, tmp_path / "ckpt")

    def bump(meta):
        meta["fragments"][0]["version"] += 1
    edit_meta(directory, 20, bump)
    ckpts = SyncerCheckpoints(directory, every=1, keep=3)
    try:
        restored, seen = ckpts.latest(setup.policy, setup.fragments)
    finally:
        ckpts.close()
    assert seen == 10 and same_syncer(restored, states[10])
    assert "step 20 unusable" in caplog.text and "meta" in caplog.text


def test_a_syncer_checkpoint_without_a_field_falls_back(tmp_path, saved_syncer, caplog):
    """Also one written before digests existed (no integrity item): a missing field is a skip."""
    setup, pristine, states = saved_syncer
    directory = _copy(pristine, tmp_path / "ckpt")
    shutil.rmtree(directory / "20" / "integrity")
    edit_meta(directory, 20, lambda meta: meta.pop("live"))
    ckpts = SyncerCheckpoints(directory, every=1, keep=3)
    try:
        restored, seen = ckpts.latest(setup.policy, setup.fragments)
    finally:
        ckpts.close()
    assert seen == 10 and same_syncer(restored, states[10])
    assert "carries no digest" in caplog.text and "step 20 unusable" in caplog.text


def test_a_meta_changed_by_its_owner_while_the_save_runs_is_saved_as_it_was(tmp_path, caplog):
    """An asynchronous save writes the meta in the background; the caller's lists (a sim's link
    clocks) go on changing meanwhile. What lands is the meta as it was at save(), matching its
    digest, so the newest snapshot is not refused as damaged (a resume then retrained steps)."""
    manager = checkpoint.open_manager(tmp_path / "ck", keep=2, async_save=True)
    state = {"w": np.arange(4096, dtype=np.float32)}
    links = [0.0, 1.0]
    try:
        checkpoint.save(manager, 1, state, {"link_up": links})
        links.extend(range(10_000))
        links[0] = 9.0
    finally:
        manager.wait_until_finished()
        manager.close()
    manager = checkpoint.open_manager(tmp_path / "ck", keep=2, async_save=False)
    try:
        step, _, meta = checkpoint.restore_latest(manager, state)
    finally:
        manager.close()
    assert step == 1 and meta == {"link_up": [0.0, 1.0]} and "unusable" not in caplog.text


def test_a_checkpoint_written_before_digests_is_restored_with_a_warning(tmp_path, caplog):
    """The documented choice: accepted, unverified, with a warning naming it."""
    manager = checkpoint.open_manager(tmp_path / "ck", keep=2, async_save=False)
    state = {"w": np.arange(6, dtype=np.float32)}
    checkpoint.save(manager, 3, state, {"tokens": 12})
    manager.wait_until_finished()
    manager.close()
    shutil.rmtree(tmp_path / "ck" / "3" / "integrity")  # what a save before this change left
    manager = checkpoint.open_manager(tmp_path / "ck", keep=2, async_save=False)
    try:
        step, restored, meta = checkpoint.restore_latest(manager, state)
    finally:
        manager.close()
    assert step == 3 and meta == {"tokens": 12} and bitwise_equal(jax.device_get(restored), state)
    assert "step 3 carries no digest" in caplog.text


def test_restore_latest_skips_a_silently_flipped_step(tmp_path, caplog):
    """The rule the data-parallel trainer and the learners restore through."""
    manager = checkpoint.open_manager(tmp_path / "ck", keep=3, async_save=False)
    rng = np.random.default_rng(0)
    states = {s: {"w": rng.standard_normal(20_000).astype(np.float32), "step": np.int32(s)} for s in (5, 10)}
    for s, state in states.items():
        checkpoint.save(manager, s, state, {"tokens": s})
    manager.wait_until_finished()
    manager.close()
    flip_silently(tmp_path / "ck", 10, states[10])
    manager = checkpoint.open_manager(tmp_path / "ck", keep=3, async_save=False)
    try:
        step, restored, meta = checkpoint.restore_latest(manager, states[10])
    finally:
        manager.close()
    assert step == 5 and meta == {"tokens": 5} and bitwise_equal(jax.device_get(restored), states[5])
    assert "step 10 unusable" in caplog.text and "digest mismatch" in caplog.text


def test_a_damaged_sim_snapshot_falls_back_to_the_previous(tmp_path, build, caplog):
    cfg = make_cfg(tmp_path, steps=4)
    setup = build(cfg)
    sims = {}
    for steps in (2, 4):
        sim = Sim(replace(cfg, run=replace(cfg.run, steps=steps)), setup, None, None, [])
        sim.run()
        sims[steps] = snaps.snapshot(sim)
    manager = checkpoint.open_manager(tmp_path / "sim", keep=3, async_save=False)
    for steps, (arrays, meta) in sims.items():
        checkpoint.save(manager, steps, arrays, meta)
    manager.wait_until_finished()
    manager.close()
    edit_meta(tmp_path / "sim", 4, lambda meta: meta.update(now=meta["now"] + 1.0))
    shots = snaps.SimSnapshots(tmp_path / "sim", every=1, keep=3)
    try:
        arrays, meta = shots.latest()
    finally:
        shots.close()
    assert meta["steps_done"] == sims[2][1]["steps_done"] and meta["now"] == sims[2][1]["now"]
    assert bitwise_equal(arrays, sims[2][0])
    assert "sim snapshot" in caplog.text and "step 4 unusable" in caplog.text


# --- learner checkpoints: unusable ones make a fresh rejoin, never an error -------------------------
ADAMW = replace(SGD, optimizer="adamw")


@pytest.fixture(scope="module")
def learner_world(tmp_path_factory, build):
    """A two-fragment setup with AdamW, and learner 1's checkpoints at steps 4 and 8 (incarnation
    0, versions (1, 1)), each with its own distinctive optimizer state."""
    tmp = tmp_path_factory.mktemp("learner")
    cfg = make_cfg(tmp, steps=20, fragments=dict(count=2, H=2, tau=0))
    cfg = validate(replace(cfg, inner=ADAMW))
    setup = build(cfg)
    base = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0, 1: 0})
    at_1 = base._replace(fragments=tuple(fs._replace(version=1, refs=((1, fs.refs[-1][1]),))
                                         for fs in base.fragments))
    directory = tmp / "learners"
    ckpts = LearnerCheckpoints(directory, every=4)
    saved = {}
    rng = np.random.default_rng(1)
    for step in (4, 8):
        unit = new_unit(setup, 1, 0, at_1, step)
        unit.state = unit.state.replace(opt_state=jax.tree.map(
            lambda x: x + rng.standard_normal(x.shape).astype(x.dtype) if x.dtype == np.float32 else x,
            jax.device_get(unit.state.opt_state)))
        unit.state = jax.device_put(unit.state, unit.compiled.state_sharding)
        assert ckpts.maybe_save(unit)
        saved[step] = jax.device_get(unit.state.opt_state)
    ckpts.close()
    return setup, directory, saved, base, at_1


def rejoin(setup, directory, syncer_state, stopped_at=8, incarnation=1, max_staleness=100):
    ckpts = LearnerCheckpoints(directory, every=4)
    try:
        return rejoin_unit(setup, 1, incarnation, syncer_state, ckpts, max_staleness, stopped_at)
    finally:
        ckpts.close()


def test_the_learner_world_rejoins_from_its_newest_checkpoint(learner_world):
    setup, directory, saved, _, at_1 = learner_world
    unit, how = rejoin(setup, directory, at_1)
    assert (how.restored_from, how.step, how.staleness) == (8, 8, 0)
    assert bitwise_equal(jax.device_get(unit.state.opt_state), saved[8])


@pytest.mark.parametrize("legacy", [False, True])
def test_a_learner_checkpoint_without_versions_rejoins_from_an_older_one_or_fresh(tmp_path, learner_world,
                                                                                   legacy, caplog):
    """rejoin_unit raised KeyError('versions'); now the step is skipped with a warning."""
    setup, pristine, saved, _, at_1 = learner_world
    directory = _copy(pristine, tmp_path / "learners")
    for step in (4, 8):
        if legacy:  # written before digests: only the field check stands between it and a crash
            shutil.rmtree(directory / "learner-1" / str(step) / "integrity")
        edit_meta(directory / "learner-1", step, lambda meta: meta.pop("versions"))
    unit, how = rejoin(setup, directory, at_1, stopped_at=10)
    assert (how.restored_from, how.step) == (None, 10)
    fresh = new_unit(setup, 1, 1, at_1, 10)
    assert bitwise_equal(jax.device_get(unit.state.opt_state), jax.device_get(fresh.state.opt_state))
    assert "step 8 unusable" in caplog.text and "step 4 unusable" in caplog.text
    assert ("versions" if legacy else "digest mismatch of the meta") in caplog.text


def test_an_unreadable_learner_directory_rejoins_fresh(tmp_path, learner_world, monkeypatch, caplog):
    setup, pristine, _, _, at_1 = learner_world
    directory = tmp_path / "learners"
    directory.mkdir()
    (directory / "learner-1").write_text("not a directory")
    unit, how = rejoin(setup, directory, at_1, stopped_at=6)
    assert (how.restored_from, how.step, how.staleness) == (None, 6, -1)

    def unreadable(*args, **kwargs):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(LearnerCheckpoints, "latest", unreadable)
    unit, how = rejoin(setup, pristine, at_1, stopped_at=6)
    assert (how.restored_from, how.step, how.staleness) == (None, 6, -1)
    assert "Input/output error" in caplog.text and "rejoining fresh" in caplog.text


# --- item 18: checkpoints from the future, reused run directories ----------------------------------
@pytest.mark.parametrize("case", ["versions ahead", "step ahead", "incarnation"])
def test_a_learner_checkpoint_from_the_future_is_not_used(tmp_path, learner_world, case, caplog):
    """The trigger: an earlier run's checkpoint in the same directory, at versions the new run's
    syncer has not reached (negative staleness passed max_rejoin_staleness) and a later step."""
    setup, directory, saved, base, at_1 = learner_world
    syncer_state, stopped_at, incarnation = at_1, 8, 1
    if case == "versions ahead":
        syncer_state = base  # the syncer is at (0, 0); the checkpoints hold (1, 1)
    elif case == "step ahead":
        stopped_at = 3  # the dead incarnation stopped before either checkpoint's step
    else:
        incarnation = 0  # the rejoining incarnation did not write them
    caplog.set_level(logging.INFO, logger="diloco.checkpoint")
    unit, how = rejoin(setup, directory, syncer_state, stopped_at=stopped_at, incarnation=incarnation)
    assert (how.restored_from, how.step) == (None, stopped_at), how
    # a normal resume finds such checkpoints: said as information, not as damage
    assert "step 8 skipped" in caplog.text and "unusable" not in caplog.text, caplog.text
    assert {r.levelno for r in caplog.records if r.name == "diloco.checkpoint"} == {logging.INFO}


def test_a_learner_checkpoint_from_the_past_is_still_used(learner_world):
    setup, directory, saved, _, at_1 = learner_world
    unit, how = rejoin(setup, directory, at_1, stopped_at=6)  # step 8 is ahead; step 4 is not
    assert (how.restored_from, how.step) == (4, 6)  # step 4's optimizer state, at the step where it stopped
    assert bitwise_equal(jax.device_get(unit.state.opt_state), saved[4])


def _cfg(tmp_path, kind: str, algo: str = "diloco", resume: bool = False):
    cfg = make_cfg(tmp_path, runtime=dict(kind=kind))
    return validate(replace(cfg, algo=algo, run=replace(cfg.run, resume=resume)))


def _used(run_dir: Path) -> None:
    """What an earlier run leaves: its config, metrics and a learner checkpoint directory."""
    (run_dir / "learners" / "learner-1" / "8").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("earlier: run\n")
    (run_dir / "metrics.jsonl").write_text('{"kind": "train"}\n')


@pytest.mark.parametrize("kind", ["sim", "threads", "procs"])
def test_a_new_run_into_a_used_run_dir_is_refused(tmp_path, kind):
    cfg = _cfg(tmp_path, kind)
    run_dir = Path(cfg.run.out_dir)
    _used(run_dir)
    with pytest.raises(ConfigError) as err:
        drun.run(cfg)
    message = str(err.value)
    assert f"run.out_dir={run_dir}" in message and "already holds a run" in message
    assert "learners" in message and "choose another run.out_dir" in message
    assert "pass run.resume=true" in message  # every runtime resumes
    # refused before anything was written: the earlier run's files are as they were
    assert (run_dir / "config.yaml").read_text() == "earlier: run\n"
    assert (run_dir / "metrics.jsonl").read_text() == '{"kind": "train"}\n'
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "learners", "metrics.jsonl"]


def test_a_run_dir_is_accepted_when_new_empty_holding_other_files_or_resumed(tmp_path):
    drun.check_run_dir(_cfg(tmp_path, "sim"))  # does not exist yet
    run_dir = Path(_cfg(tmp_path, "sim").run.out_dir)
    run_dir.mkdir()
    drun.check_run_dir(_cfg(tmp_path, "sim"))
    (run_dir / "notes.txt").write_text("a user's file\n")  # not a run's output
    drun.check_run_dir(_cfg(tmp_path, "sim"))
    _used(run_dir)
    drun.check_run_dir(_cfg(tmp_path, "sim", resume=True))
    drun.check_run_dir(_cfg(tmp_path, "sim", algo="dp", resume=True))
    with pytest.raises(ConfigError, match="pass run.resume=true"):
        drun.check_run_dir(_cfg(tmp_path, "sim", algo="dp"))


def test_the_cli_reports_a_used_run_dir_in_one_line_and_exits_nonzero(tmp_path):
    run_dir = tmp_path / "run"
    _used(run_dir)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "model=tiny", "data=synthetic",
                           f"data.data_dir={tmp_path / 'data'}", f"run.out_dir={run_dir}", "run.progress=false"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"error: run.out_dir={run_dir} already holds a run" in proc.stderr
    assert "pass run.resume=true to continue it, or choose another run.out_dir" in proc.stderr
    assert (run_dir / "config.yaml").read_text() == "earlier: run\n"


# --- property tests: random damage -----------------------------------------------------------------
_DAMAGE = settings(max_examples=40, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _damages():
    """One to three of: flip a byte (of any file, or of a step's largest: array data, where zstd
    blocks carry no checksum and a flip most often restores silently as other values), truncate a
    file, delete a file or a directory; positions and choices as fractions of what is there."""
    one = hs.tuples(hs.sampled_from(["flip", "flip data", "truncate", "delete"]), hs.floats(0, 1, exclude_max=True),
                    hs.floats(0, 1, exclude_max=True), hs.integers(1, 255))
    return hs.lists(one, min_size=1, max_size=3)


def _damage(root: Path, damages) -> list[str]:
    done = []
    for op, which, where, mask in damages:
        if op == "flip data":
            paths = [largest_file(step) for step in sorted(root.iterdir())
                     if step.is_dir() and any(f.is_file() for f in step.rglob("*"))]
        else:
            paths = sorted(p for p in root.rglob("*") if op == "delete" or p.is_file())
        if not paths:
            continue
        path = paths[int(which * len(paths))]
        if op == "delete":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        else:
            data = bytearray(path.read_bytes())
            if not data:
                continue
            pos = int(where * len(data))
            if op.startswith("flip"):
                data[pos] ^= mask
            else:
                data = data[:pos]
            path.write_bytes(bytes(data))
        done.append(f"{op} {path.relative_to(root)}")
    return done


@settings(_DAMAGE)
@given(_damages())
def test_a_damaged_syncer_checkpoint_restores_exactly_or_falls_back(saved_syncer, damages):
    setup, pristine, states = saved_syncer
    with tempfile.TemporaryDirectory() as tmp, warnings_logged() as warned:
        directory = _copy(pristine, Path(tmp) / "ckpt")
        done = _damage(directory, damages)
        ckpts = SyncerCheckpoints(directory, every=1, keep=3)
        try:
            found = ckpts.latest(setup.policy, setup.fragments)
        finally:
            ckpts.close()
    if found is None:
        assert warned, done
        return
    restored, seen = found
    assert seen in states and same_syncer(restored, states[seen]), (done, seen)
    assert seen == 20 or warned, done


@settings(_DAMAGE)
@given(_damages())
def test_a_damaged_learner_checkpoint_rejoins_exactly_or_falls_back(learner_world, damages):
    setup, pristine, saved, _, at_1 = learner_world
    with tempfile.TemporaryDirectory() as tmp, warnings_logged() as warned:
        directory = _copy(pristine, Path(tmp) / "learners")
        done = _damage(directory / "learner-1", damages)
        unit, how = rejoin(setup, directory, at_1)
    assert how.restored_from in (None, 4, 8), (done, how)
    if how.restored_from is None:
        assert how.step == 8 and how.staleness == -1
        opt = jax.device_get(new_unit(setup, 1, 1, at_1, 8).state.opt_state)
    else:
        assert how.step == 8  # where the dead incarnation stopped, whichever checkpoint it restored
        opt = saved[how.restored_from]
    assert bitwise_equal(jax.device_get(unit.state.opt_state), opt), (done, how)
    fresh = new_unit(setup, 1, 1, at_1, 8)
    assert bitwise_equal(jax.device_get(unit.state.params), jax.device_get(fresh.state.params))
    # step 8 not restored: a warning says why, unless its whole directory is gone (nothing to warn of)
    assert how.restored_from == 8 or warned or "delete 8" in done, (done, how)
