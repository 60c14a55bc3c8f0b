"""Sweeps of scripts/train.py through Hydra's submitit launcher (docs/sweeps.md): each job a whole
run in its own directory, a bad value in one job its `error:` line, the Slurm options reaching sbatch."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "scripts" / "train.py"
# The lightest job that is still a whole run: data parallel, 2 steps, a checkpoint and a summary.
TINY_JOB = ["algo=dp", "model=tiny", "data=synthetic", "data.seq_len=32", "data.batch_size=8", "run.steps=2",
            "run.log_every=1", "run.eval_every=2", "run.eval_batches=1", "run.checkpoint_every=2",
            "inner.warmup_steps=1", "run.progress=false", "run.plot=false", "run.tensorboard=false"]


def _train_module():
    """scripts/train.py imported under another name, so its `__main__` block does not run."""
    spec = importlib.util.spec_from_file_location("train_script", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sweep(tmp_path, *overrides, env=None):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", **(env or {})}
    return subprocess.run([sys.executable, str(TRAIN), "-m", *overrides], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


def test_preflight_passes_multirun_arguments_and_still_catches_a_mistyped_swept_key(capsys):
    train = _train_module()
    args = ["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=720",
            "hydra.launcher.gpus_per_node=8", "hydra.launcher.tasks_per_node=1",
            "+hydra.launcher.additional_parameters.mail-type=END", "hydra.sweep.dir=/scratch/s",
            "outer.lr=0.5,0.7", "fragments.H=24,48", "model=tiny,small", "inner.lr=range(1,3)", "--multirun"]
    assert train._preflight([*args, "--debug"]) == args
    with pytest.raises(SystemExit) as stop:
        train._preflight(["--multirun", "hydra/launcher=submitit_local", "outer.lrr=0.5,0.7"])
    assert stop.value.code == 2
    assert "unknown option 'outer.lrr'; did you mean outer.lr?" in capsys.readouterr().err


@pytest.mark.slow  # 12 s of three runs; the sweep's pre-flight and the slurm hand-off run by default
def test_local_sweep_runs_each_job_in_its_own_directory_and_a_bad_value_is_its_error_line(tmp_path):
    """Three jobs through submitit_local: two finish in <run.out_dir>/0 and /1 with their swept
    inner.lr in config.yaml; the third's lr is refused as in a single run (no traceback, status 2)
    and leaves no job directory."""
    sweep = tmp_path / "sweep"
    proc = _sweep(tmp_path, "hydra/launcher=submitit_local", *TINY_JOB, f"data.data_dir={tmp_path / 'data'}",
                  f"run.out_dir={sweep}", "inner.lr=0.001,0.002,-1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: invalid config:\n  inner.lr=-1" in proc.stderr and "must be > 0" in proc.stderr
    assert "Traceback" not in proc.stderr
    for num, lr in ((0, 0.001), (1, 0.002)):
        job = sweep / str(num)
        saved = yaml.safe_load((job / "config.yaml").read_text())
        assert saved["inner"]["lr"] == lr and saved["run"]["out_dir"] == str(job)
        assert (job / "summary.json").is_file() and (job / "checkpoints" / "2").is_dir()
    assert not (sweep / "2").exists()
    # Under submitit the failed job also says why in its own log, where Slurm users look.
    logs = [p.read_text() for p in (sweep / ".submitit").glob("*/*_log.err")]
    assert sum("inner.lr=-1" in text and "must be > 0" in text for text in logs) == 1


def test_a_sweep_job_started_as_several_tasks_is_refused_before_it_runs(tmp_path):
    """tasks_per_node=2 would start each job twice, two whole runs writing one directory."""
    proc = _sweep(tmp_path, "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2", *TINY_JOB,
                  f"run.out_dir={tmp_path / 'sweep'}", "inner.lr=0.001")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: this sweep job was started as 2 tasks" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "sweep" / "0" / "config.yaml").exists()


def test_slurm_sweep_hands_sbatch_one_array_of_the_jobs_with_the_launcher_options(tmp_path):
    """Without a cluster: a stand-in sbatch keeps the script submitit wrote and refuses it (srun
    only has to exist), so this is everything up to the queue."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/sh\ncp "$1" "$SBATCH_CAPTURE"\necho "sbatch: no cluster here" >&2\nexit 1\n')
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    script = tmp_path / "job.sh"
    sweep = tmp_path / "sweep"
    proc = _sweep(tmp_path, "hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu",
                  "hydra.launcher.timeout_min=720", "hydra.launcher.gpus_per_node=8", "hydra.launcher.tasks_per_node=1",
                  "hydra.launcher.cpus_per_task=16", f"run.out_dir={sweep}", "outer.lr=0.5,0.7", "fragments.H=24,48",
                  env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SBATCH_CAPTURE": str(script)})
    assert proc.returncode != 0 and "sbatch: no cluster here" in proc.stderr
    lines = script.read_text().splitlines()
    for flag in ("--array=0-3%4", "--partition=gpu", "--time=720", "--gpus-per-node=8", "--ntasks-per-node=1",
                 "--cpus-per-task=16", "--nodes=1", f"--output={sweep}/.submitit/%A_%a/%A_%a_0_log.out"):
        assert f"#SBATCH {flag}" in lines, (flag, lines)
    assert any(line.startswith("srun ") and "-m submitit.core._submit" in line for line in lines)
    # The four jobs' overrides, as Hydra listed them before submitting.
    for lr, h in ((0.5, 24), (0.5, 48), (0.7, 24), (0.7, 48)):
        assert f"outer.lr={lr} fragments.H={h}" in proc.stdout + proc.stderr
