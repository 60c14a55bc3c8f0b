"""run.profile: a jax.profiler trace of a window of steps in <run>/profile, for the data-parallel
trainer and learner 0 of the sim and threads runtimes; bad windows refused at start-up
(docs/design.md#profiling-a-run)."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import diloco_world
from test_flops import check_consistent, tiny_run

from diloco import report
from diloco.config import ConfigError, RunConfig, TrainConfig, validate
from diloco.train import flops, profile

ROOT = Path(__file__).resolve().parents[1]


def traces(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "profile").rglob("*.xplane.pb"))


def test_the_window_starts_and_stops_on_steps_done():
    w = (1, 3)
    assert [profile.action(done, w, False) for done in range(5)] == [None, "start", "start", None, None]
    assert [profile.action(done, w, True) for done in range(5)] == [None, None, None, "stop", "stop"]
    assert profile.action(0, (), False) is None and profile.action(0, None, False) is None


def test_only_learner_0s_leader_traces(tmp_path):
    cfg = validate(TrainConfig(run=RunConfig(steps=60, profile=(1, 3))))
    assert profile.for_run(cfg, tmp_path).window == (1, 3)
    assert profile.for_run(cfg, tmp_path, learner=1).window is None
    assert profile.for_run(cfg, tmp_path, leader=False).window is None
    assert profile.for_run(cfg, None).window is None
    assert profile.for_run(replace(cfg, run=replace(cfg.run, profile=())), tmp_path).window is None


def test_a_trace_cut_short_is_still_written(tmp_path):
    import jax.numpy as jnp

    with profile.Trace((0, 5), tmp_path / "profile") as trace:
        trace.at(0)
        assert trace.running
        jnp.ones(4).block_until_ready()
    assert not trace.running and traces(tmp_path)


@pytest.mark.parametrize("window", [(3, 1), (1,), (1, 2, 3), (-1, 2), (2, 2), (0, 61)])
def test_bad_windows_are_refused(window):
    with pytest.raises(ConfigError, match=r"run.profile=\[.*\] must be \[start_step, stop_step\] with 0 <= "
                                          r"start_step < stop_step <= run.steps=60"):
        validate(TrainConfig(run=RunConfig(steps=60, profile=window)))
    for off in ((), None):
        validate(TrainConfig(run=RunConfig(steps=60, profile=off)))
    validate(TrainConfig(run=RunConfig(steps=60, profile=(0, 60))))


def test_the_command_line_refuses_a_bad_window_with_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "algo=dp", "model=tiny", "run.steps=8",
                           "inner.warmup_steps=2", "run.profile=[3,1]", f"run.out_dir={tmp_path / 'run'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error:" in proc.stderr and "run.profile=[3, 1] must be [start_step, stop_step]" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("algo", ["dp", "diloco"])
def test_a_tiny_run_leaves_a_trace(tmp_path, algo):
    """Data parallel and the sim runtime, steps 2 and 3 traced."""
    from diloco.run import run

    run(tiny_run(tmp_path, algo, profile=(1, 3)))
    assert len(traces(tmp_path / algo)) == 1


def test_a_threads_run_traces_learner_0_and_rates_every_learner(tmp_path):
    """The learner loop every wall-clock runtime shares (threads, procs, ray) takes the trace; its
    train records carry each learner's throughput on the wall clock."""
    from diloco.runtime import threads

    cfg = tiny_run(tmp_path, "diloco", profile=(1, 3), peak_tflops=2.0)
    cfg = replace(cfg, runtime=replace(cfg.runtime, kind="threads", devices_per_learner=1))
    _, _, setup, evaluate_global, _ = diloco_world(cfg)
    run_dir = tmp_path / "threads"
    run_dir.mkdir()
    threads.run(cfg, setup, run_dir, evaluate_global)
    assert len(traces(run_dir)) == 1
    rated = [r for r in report.read_metrics(run_dir / "metrics.jsonl") if "tokens_per_s" in r]
    assert {r["learner"] for r in rated} == {0, 1}
    for r in rated:
        check_consistent(r, 1, setup.flops_per_token, 2.0)
    assert setup.flops_per_token == flops.flops_per_token(cfg.model, 16, cfg.data.seq_len)
