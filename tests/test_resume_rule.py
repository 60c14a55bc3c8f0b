"""One resume rule for every runtime (docs/design.md#resuming-a-finished-run): paths compared after
resolving, a resume of a directory that holds no run refused, a finished run never retrained or
overwritten unless run.steps was raised (then dp and sim train on to the new count, the token
ledger counting each step once), and a learner of a resumed run rejoining at its own step."""

import dataclasses
import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import tiny_cfg

from diloco import run as drun
from diloco.config import ConfigError, TrainConfig
from diloco.runtime.pace import Pace

SEQ, BATCH, M = 32, 8, 2


def make_cfg(tmp_path, kind="sim", algo="diloco", steps=6, out="run", resume=False) -> TrainConfig:
    """The tests' tiny run (tests/conftest.py) in `out`, checkpointed every 3 steps, H = 2."""
    return tiny_cfg(tmp_path, kind, algo, data=dict(seq_len=SEQ, batch_size=BATCH), inner=dict(warmup_steps=2),
                    run=dict(steps=steps, log_every=2, eval_every=3, eval_batches=1, out_dir=str(out),
                             tensorboard=False, checkpoint_every=3, resume=resume),
                    fragments=dict(H=2), runtime=dict(learners=M))


def test_paths_are_compared_after_resolving(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert drun.same_setting(("run", "out_dir"), "runs/a", str(tmp_path / "runs" / "a"))
    assert drun.same_setting(("data", "paths"), ["x.txt", "d/../y.txt"], (str(tmp_path / "x.txt"), "y.txt"))
    assert not drun.same_setting(("run", "out_dir"), "runs/a", "runs/b")
    assert not drun.same_setting(("data", "data_dir"), "", "data")  # '' means none, not the working dir
    assert not drun.same_setting(("run", "seed"), 1, 2)
    # a saved relative out_dir, resumed with the absolute one a resume line prints: the same run
    cfg = make_cfg(tmp_path, out="runs/a")
    drun.prepare_run_dir(cfg)
    drun.prepare_run_dir(replace(cfg, run=replace(cfg.run, resume=True, out_dir=str(tmp_path / "runs/a"))))
    with pytest.raises(ConfigError, match=r"run.steps: 6 -> 9"):  # more steps only continue a finished run
        drun.prepare_run_dir(replace(cfg, run=replace(cfg.run, resume=True, steps=9)))
    drun.prepare_run_dir(replace(cfg, run=replace(cfg.run, resume=True, steps=9)), continuing=True)
    with pytest.raises(ConfigError, match=r"algo: 'diloco' -> 'dp'"):  # a top-level option counts too
        drun.prepare_run_dir(replace(cfg, algo="dp", run=replace(cfg.run, resume=True, steps=9)), continuing=True)


def test_a_run_saved_with_the_old_flat_runtime_keys_resumes(tmp_path, monkeypatch, capsys):
    """A config.yaml from before the runtime had sections (runtime.store_url, runtime.auth=off, ...):
    read with the new keys, so the same settings resume and a changed one is named by its new key."""
    import yaml

    from diloco.config import to_dict

    monkeypatch.chdir(tmp_path)
    cfg = make_cfg(tmp_path, out="runs/a")
    cfg = replace(cfg, runtime=replace(cfg.runtime, store=replace(cfg.runtime.store, url="store"),
                                       auth=replace(cfg.runtime.auth, mode="off")))
    old = to_dict(cfg)
    r = old["runtime"]
    store, auth, world, ray = r.pop("store"), r.pop("auth"), r.pop("world"), r.pop("ray")
    r.update({f"store_{k}": v for k, v in store.items()})  # store_url, store_endpoint, ...
    r.update(auth=auth["mode"], auth_secret_env=auth["secret_env"], auth_secret_file=auth["secret_file"],
             processes_per_learner=world["processes_per_learner"], world_heartbeat_s=world["heartbeat_s"],
             process_index=world["process_index"], world_address=world["address"], ray_address=ray["address"],
             learner_resources=ray["learner_resources"], syncer_resources=ray["syncer_resources"],
             tpu_topology=ray["tpu_topology"], tpu_version=ray["tpu_version"])
    (tmp_path / "runs/a").mkdir(parents=True)
    (tmp_path / "runs/a/config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    resumed = replace(cfg, run=replace(cfg.run, resume=True))
    drun.prepare_run_dir(resumed)  # the same settings: resumes
    assert "warning: runtime.store_url is deprecated, use runtime.store.url" in capsys.readouterr().err
    assert "store_url" not in (tmp_path / "runs/a/config.yaml").read_text()  # written back with the sections
    (tmp_path / "runs/a/config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    with pytest.raises(ConfigError, match=r"runtime\.store\.url: 'store' -> 'other'"):
        drun.prepare_run_dir(replace(resumed, runtime=replace(cfg.runtime, store=replace(cfg.runtime.store,
                                                                                         url="other"))))


def test_resume_of_a_directory_without_a_run_is_an_error_naming_it(tmp_path):
    for out in (tmp_path / "missing", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        with pytest.raises(ConfigError, match=f"run.out_dir={out} holds no run to resume"):
            drun.run(make_cfg(tmp_path, out=out, resume=True))
    assert not (tmp_path / "missing").exists() and not any((tmp_path / "empty").iterdir())


def test_a_resumed_learner_rejoins_at_its_own_step_under_every_rejoin_at():
    # 104.75 s into a run paced 0.5 s a step, a restarted learner takes up the grid's step 209 ...
    assert Pace.rejoin_step(0.5, "schedule", 104.75, 1.0, 400) == 209
    # ... but one coming back from a stop missed nothing: its checkpoint's step decides
    assert Pace.rejoin_step(0.5, "schedule", 104.75, 1.0, 400, resumed=True) == 0
    assert Pace.rejoin_step(0.5, "own", 104.75, 1.0, 400) == Pace.rejoin_step(0.5, "own", 104.75, 1.0, 400, True) == 0


def _files(run_dir: Path) -> dict:
    return {name: (run_dir / name).read_bytes() for name in ("summary.json", "metrics.jsonl", "config.yaml")}


def _train_steps(run_dir: Path) -> list:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sorted((r.get("learner", 0), r["step"]) for r in records if r["kind"] == "train")


@pytest.mark.parametrize("algo", ["dp", "diloco"])
def test_a_finished_run_is_left_as_it_is_and_more_steps_continue_it(tmp_path, algo, capsys):
    """dp and sim: resuming a finished run prints that it finished and changes nothing; raising
    run.steps trains the new steps only, each once (the records and the token count say so)."""
    out = tmp_path / "run"
    first = drun.run(make_cfg(tmp_path, algo=algo, out=out))
    before = _files(out)
    capsys.readouterr()
    again = drun.run(make_cfg(tmp_path, algo=algo, out=out, resume=True))
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"the run in {out} has finished its 6 steps; nothing to do"), line
    assert again == json.loads(before["summary.json"]) and _files(out) == before
    assert first["eval_loss"] == again["eval_loss"]

    more = drun.run(make_cfg(tmp_path, algo=algo, out=out, steps=9, resume=True))
    learners = 1 if algo == "dp" else M
    assert _train_steps(out) == sorted((m, s) for m in range(learners) for s in (2, 4, 6, 8, 9))
    if algo == "dp":
        assert more["steps"] == 9 and more["tokens"] == 9 * BATCH * SEQ
    else:
        assert more["tokens_processed"] == M * 9 * BATCH * SEQ and more["token_ledger_imbalance"] == 0
    assert json.loads((out / "summary.json").read_text())["eval_loss"] == more["eval_loss"]
    # a resume with the steps it now has is again "finished"
    assert drun.run(make_cfg(tmp_path, algo=algo, out=out, steps=9, resume=True)) == more
    if algo == "diloco":  # without snapshots a finished sim run has nothing to continue from
        cfg = make_cfg(tmp_path, algo=algo, out=out, steps=12, resume=True)
        before = _files(out)
        with pytest.raises(ConfigError, match="run.checkpoint_every=0 it saved no snapshot"):
            drun.run(replace(cfg, run=replace(cfg.run, checkpoint_every=0)))
        assert _files(out) == before


def test_a_finished_threads_run_is_left_as_it_is_and_more_steps_are_refused(tmp_path, capsys):
    out = tmp_path / "run"
    cfg = make_cfg(tmp_path, kind="threads", out=out)
    drun.run(cfg)
    before = _files(out)
    drun.run(replace(cfg, run=replace(cfg.run, resume=True)))
    assert "has finished its 6 steps" in capsys.readouterr().out and _files(out) == before
    with pytest.raises(ConfigError, match=r"run.steps=9 would continue the finished threads run"):
        drun.run(replace(cfg, run=dataclasses.replace(cfg.run, resume=True, steps=9)))
    assert _files(out) == before
