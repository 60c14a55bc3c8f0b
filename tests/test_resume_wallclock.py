"""Clean stops and resumes of the wall-clock runtimes (docs/design.md#stopping-a-run): a real SIGINT
to a process running a tiny threads or procs run ends it without a traceback, with the partial
summary and the resume line; that line, pasted as printed, then finishes the run with a balanced
ledger, exactly the tokens of an uninterrupted run (under runtime.rejoin_at own and schedule), every
fragment's versions 1..n once each, every learner back as its next incarnation, and a clock that
never goes backwards. The resume line itself is checked without a run."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import yaml
from conftest import tiny_cfg

from diloco.config import ConfigError, TrainConfig, to_dict, validate
from diloco.runtime.stop import RunStopped, resume_hint, stop_message

ROOT = Path(__file__).resolve().parents[1]
STEPS, M, P = 40, 2, 2

# diloco.run.run as scripts/train.py drives it, printing what a stop prints. After the config file,
# the command line's overrides: those of an option (a.b=value) are applied as Hydra would, a
# group's (runtime=threads) the file already holds.
PROGRAM = """
import sys, yaml
from diloco.config import load
from diloco.run import run
from diloco.runtime.stop import EXIT_STATUS, RunStopped, stop_message
raw = yaml.safe_load(open(sys.argv[1]))
for word in sys.argv[2:]:
    key, value = word.split("=", 1)
    if "." in key:
        group, name = key.split(".")
        raw[group][name] = yaml.safe_load(value)
try:
    run(load(raw))
except RunStopped as stopped:
    print(stop_message(stopped, sys.argv[2:]))
    sys.exit(EXIT_STATUS)
"""


def make_cfg(tmp_path, kind: str, resume: bool = False, processes: int = 1, rejoin_at: str = "own",
             out: str | None = None) -> TrainConfig:
    """The tests' tiny run (tests/conftest.py), 40 steps; paced at 0.1 s a step so the run lasts
    seconds whatever the machine, long enough for the SIGINT to land mid-run. processes > 1: each
    learner a world of that many processes, one device each. out: the run directory as the user
    gives it."""
    return tiny_cfg(tmp_path, kind, run=dict(steps=STEPS, eval_every=20, out_dir=out or str(tmp_path / "run"),
                                             checkpoint_every=4, resume=resume),
                    runtime=dict(devices_per_learner=processes, world=dict(processes_per_learner=processes), step_period_s=0.1,
                                 restart_s=0.2, rejoin_at=rejoin_at))


def launch(tmp_path, cfg: TrainConfig, name: str, overrides: list[str] | None = None) -> subprocess.Popen:
    """PROGRAM on `cfg` in tmp_path; `overrides`: its command line (the run's kind if not given)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={M}", "JAX_PLATFORMS": "cpu"}
    out, err = (tmp_path / f"{name}.out").open("w"), (tmp_path / f"{name}.err").open("w")
    words = overrides if overrides is not None else [f"runtime={cfg.runtime.kind}"]
    return subprocess.Popen([sys.executable, "-c", PROGRAM, str(path), *words],
                            cwd=tmp_path, env=env, stdout=out, stderr=err, text=True)


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def stop_and_resume(tmp_path, kind: str, processes: int = 1, rejoin_at: str = "own") -> tuple[str, dict, list[dict]]:
    """SIGINT once both learners have logged a step, then resume with the printed line as it would
    be pasted (the run directory given relative, as a user types it); (stop's stdout, summary, records)."""
    from test_cli import pasted

    run_dir = tmp_path / "run"
    cfg = make_cfg(tmp_path, kind, processes=processes, rejoin_at=rejoin_at, out="run")
    proc = launch(tmp_path, cfg, "stop")
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if {r["learner"] for r in records(run_dir) if r["kind"] == "train"} == set(range(M)):
                break
            time.sleep(0.05)
        assert proc.poll() is None, (tmp_path / "stop.err").read_text()[-3000:]
        proc.send_signal(signal.SIGINT)
        code = proc.wait(120)
    finally:
        proc.kill()
    out, err = (tmp_path / "stop.out").read_text(), (tmp_path / "stop.err").read_text()
    assert code in (0, 130), (code, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert "partial summary" in out and "token ledger balanced" in out, out
    (line,) = [x for x in out.splitlines() if x.startswith("resume with: ")]
    words = pasted(line)
    assert words[0] == f"runtime={kind}" and words[1] == "run.resume=true", line
    assert (tmp_path / words[2].removeprefix("run.out_dir=")).resolve() == run_dir.resolve(), line
    assert not (run_dir / "summary.json").exists()
    stopped = max(r["time"] for r in records(run_dir))

    proc = launch(tmp_path, cfg, "resume", words)
    try:
        code = proc.wait(300)
    finally:
        proc.kill()
    err = (tmp_path / "resume.err").read_text()
    assert code == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    # the checkpoints a stop saves past the syncer's last booked step are skipped as information,
    # not reported as damage (docs/design.md#checkpoint-integrity)
    assert "unusable" not in err and "Damaged" not in err, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["clock_s"] > stopped  # the clock went on from the stop
    return out, summary, records(run_dir)


def replays_to_its_decisions(run_dir: Path, cfg: TrainConfig, monkeypatch) -> None:
    """The input log of the whole run, stopped and resumed, replays from Theta_0 to its decisions."""
    from diloco.algo import syncer as sync
    from diloco.algo.replay import replay
    from diloco.data import load_corpus
    from diloco.model import build
    from diloco.runtime import build as build_setup
    from diloco.runtime.runlog import read_decisions, read_inputs

    secret = run_dir / "auth_secret"  # procs: the run's own, so its signed frames verify
    if secret.exists():
        monkeypatch.setenv(cfg.runtime.auth.secret_env, secret.read_text().strip())
    corpus = load_corpus(cfg.data)
    setup = build_setup.build(cfg, corpus, build(cfg.model, corpus.vocab_size, cfg.run.seed))
    st = sync.init(setup.policy, setup.fragments, setup.theta0, dict.fromkeys(range(M), 0))
    again = replay(setup.policy, st, list(read_inputs(run_dir / "syncer_inputs.bin")))
    assert json.loads(json.dumps(list(again.decisions))) == read_decisions(run_dir / "decisions.jsonl")


def check_resumed(run_dir: Path, summary: dict, recs: list[dict]) -> None:
    assert summary["token_ledger_imbalance"] == 0 and summary["merges"] > 0
    tokens_per_step = 16 * 32
    # every learner's steps 1..STEPS trained exactly once, as in an uninterrupted run: none redone,
    # none skipped (a resumed learner rejoins at its own step under every runtime.rejoin_at)
    rejoins = [r for r in recs if r["kind"] == "rejoin"]
    assert summary["tokens_processed"] == M * STEPS * tokens_per_step, (summary["tokens_processed"], rejoins)
    versions = defaultdict(list)
    for r in (json.loads(x) for x in (run_dir / "decisions.jsonl").read_text().splitlines()):
        if r["event"] == "merge":
            versions[r["fragment"]].append(r["version"])
    assert set(versions) == set(range(P))
    for p, vs in versions.items():  # across the stop: no version skipped or made twice
        assert vs == list(range(1, len(vs) + 1)), (p, vs)
    # each learner came back once, as incarnation 1, at the step where it stopped or later
    assert sorted((r["learner"], r["incarnation"]) for r in rejoins) == [(m, 1) for m in range(M)], rejoins
    for m in range(M):
        train = [r for r in recs if r["kind"] == "train" and r["learner"] == m]
        times = [r["time"] for r in train]
        assert times == sorted(times), (m, times)  # the wall clock never went backwards
        assert train[-1]["step"] == STEPS
    # the resumed run's tokens/s: its own tokens over its own wall time; the merge series goes on
    assert 0 < summary["tokens_at_start"] < summary["tokens_processed"]
    assert summary["tokens_per_s"] == pytest.approx(
        (summary["tokens_processed"] - summary["tokens_at_start"]) / summary["wall_s"])
    merges = [r["merges"] for r in recs if r["kind"] == "merge"]
    assert merges == sorted(merges) and merges[-1] == summary["merges"], merges


def test_resume_hint_keeps_the_overrides_and_sets_resume_and_out_dir():
    hint = resume_hint("runs/a b", ["runtime=threads", "run.out_dir=old", "+run.resume=false", "data.paths=[x y]"])
    assert hint == ('resume with: make train ARGS="runtime=threads \'data.paths=[x y]\' run.resume=true '
                    '\'run.out_dir=runs/a b\'"')
    assert resume_hint("r", ['a="$x"']) == 'resume with: make train ARGS="\'a=\\"\\$x\\"\' run.resume=true run.out_dir=r"'
    stopped = RunStopped(Path("r"), {"merges": 3}, resumable=True)
    assert isinstance(stopped, KeyboardInterrupt)
    text = stop_message(stopped, ["model=tiny"])
    assert "merges" in text and text.splitlines()[-1] == 'resume with: make train ARGS="model=tiny run.resume=true run.out_dir=r"'
    assert "cannot be resumed" in stop_message(RunStopped(None, None, resumable=True), [])


def test_resume_with_threads_or_procs_is_a_valid_config_and_procs_needs_its_journal(tmp_path):
    for kind in ("threads", "procs"):
        assert make_cfg(tmp_path, kind, resume=True).run.resume
    cfg = make_cfg(tmp_path, "procs")
    from dataclasses import replace
    with pytest.raises(ConfigError, match="run.checkpoint_every > 0"):
        validate(replace(cfg, run=replace(cfg.run, resume=True, checkpoint_every=0)))


@pytest.mark.slow  # threads' stop is in tests/test_threads.py, a wall-clock resume here under procs
def test_sigint_stops_a_threads_run_cleanly_and_resume_finishes_it(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    out, summary, recs = stop_and_resume(tmp_path, "threads")
    assert any(d.name.isdigit() for d in (run_dir / "syncer").iterdir())  # the stop's syncer checkpoint
    check_resumed(run_dir, summary, recs)
    replays_to_its_decisions(run_dir, make_cfg(tmp_path, "threads"), monkeypatch)


# 30 s a run: slow. Each runtime's resume rule is pinned without a run in tests/test_resume_rule.py,
# the pasted resume line in tests/test_cli.py, a procs run's stop in tests/test_procs.py.
@pytest.mark.slow
@pytest.mark.parametrize("rejoin_at", ["own", "schedule"])
def test_sigint_stops_a_procs_run_cleanly_and_resume_finishes_it(tmp_path, monkeypatch, rejoin_at):
    run_dir = tmp_path / "run"
    out, summary, recs = stop_and_resume(tmp_path, "procs", rejoin_at=rejoin_at)
    check_resumed(run_dir, summary, recs)
    replays_to_its_decisions(run_dir, make_cfg(tmp_path, "procs"), monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_sigint_stops_a_ray_run_cleanly_and_resume_finishes_it(tmp_path, monkeypatch, processes):
    """The same under runtime=ray on a Ray instance the run starts itself (on 127.0.0.1: the
    variable tests/test_ray.py's loopback sets, read by the child's Ray when it is imported). With
    processes=2 each learner is a world of 2 processes on 2 actors (docs/multihost.md#ray): the
    stop reaches each world's leader, which stops its follower at the same step boundary, and the
    resumed run brings every world back as incarnation 1."""
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    run_dir = tmp_path / "run"
    out, summary, recs = stop_and_resume(tmp_path, "ray", processes=processes)
    check_resumed(run_dir, summary, recs)
    replays_to_its_decisions(run_dir, make_cfg(tmp_path, "ray", processes=processes), monkeypatch)
