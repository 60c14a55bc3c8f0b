"""The Hydra entry point end to end: outputs of a run, and config errors that name the values."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY_RUN = ["algo=dp", "model=tiny", "data=synthetic", "data.seq_len=32", "data.batch_size=8", "run.steps=6",
            "run.log_every=2", "run.eval_every=3", "run.eval_batches=1", "run.checkpoint_every=3",
            "inner.warmup_steps=2", "run.progress=false"]


def train(tmp_path, *overrides):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *overrides,
                           f"data.data_dir={tmp_path / 'data'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_run_writes_config_metrics_checkpoints_summary_and_plot(tmp_path):
    out = tmp_path / "run"
    proc = train(tmp_path, *TINY_RUN, f"run.out_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["name"] == "tiny" and saved["run"]["steps"] == 6
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [2, 4, 6]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [3, 6]
    summary = json.loads((out / "summary.json").read_text())
    evals = [r["eval_loss"] for r in records if r["kind"] == "eval"]
    assert summary["steps"] == 6 and summary["eval_loss"] == evals[-1]
    assert summary["train_loss"] == [r["loss"] for r in records if r["kind"] == "train"][-1]
    # It learned: past its first eval and past the token frequencies (2.26 against 2.51 nats when written).
    assert summary["eval_loss"] < evals[0] and summary["eval_loss"] < summary["unigram_loss"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["3", "6"]
    assert (out / "loss.png").stat().st_size > 10_000
    assert "eval loss" in proc.stdout and "nats/token" in proc.stdout  # the summary, with units
    assert summary["wall_s"] > 0 and summary["rejoins"] == 0
    assert (out / "tensorboard").is_dir()
    assert not (out / "train.log").exists()  # Hydra logs to the console only (docs/design.md#outputs-of-a-run)
    # The trained model is exported as a Hugging Face folder (docs/models.md).
    from diloco.hf import load
    exported = load(out / "model")
    assert exported.config.d_model == saved["model"]["d_model"] and summary["model_dir"] == str(out / "model")


def test_unknown_key_and_bad_value_fail_before_training(tmp_path):
    proc = train(tmp_path, *TINY_RUN, "+model.d_modle=64", f"run.out_dir={tmp_path / 'x'}")
    assert proc.returncode == 2
    assert "model.d_modle" in proc.stderr and not (tmp_path / "x").exists()
    proc = train(tmp_path, *TINY_RUN, "data.seq_len=1000", f"run.out_dir={tmp_path / 'y'}")
    assert proc.returncode == 2
    assert "data.seq_len=1000 exceeds model.max_seq_len=128" in proc.stderr
    assert not (tmp_path / "y").exists()  # refused before the run directory is made


def test_every_kind_of_user_error_is_one_block_without_a_traceback_and_leaves_no_run(tmp_path):
    """Config, data and device errors (before: a 20-line Hydra traceback, and a runs/<time>/ that
    looked like a real run), a mistyped key (before: Hydra's "use +runtime.lerners=4")."""
    cases = [
        (["run.steps=20", "inner.warmup_steps=50"], "for a run this short set inner.warmup_steps=2"),
        (["data=files", "data.paths=[missing.txt]"], "file 'missing.txt' not found"),
        (["algo=diloco", "runtime=threads", "runtime.learners=4", "runtime.devices_per_learner=2"], "only 2 are visible"),
        (["algo=diloco", "runtime.devices_per_learner=4"], "only 2 devices are visible"),
        (["runtime.stall_limit_stpes=2"], "did you mean runtime.stall_limit_steps?"),
        (["run.resume=true"], "holds no run to resume"),
    ]
    for i, (overrides, message) in enumerate(cases):
        out = tmp_path / f"run{i}"
        proc = train(tmp_path, *TINY_RUN[:-1], *overrides, f"run.out_dir={out}")
        assert proc.returncode == 2, (overrides, proc.stderr[-2000:])
        assert message in proc.stderr and proc.stderr.startswith("error: "), (overrides, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert not out.exists(), (overrides, list(out.iterdir()))
    proc = train(tmp_path, "--debug", *TINY_RUN, "inner.warmup_steps=50", f"run.out_dir={tmp_path / 'dbg'}")
    assert proc.returncode != 0 and "Traceback" in proc.stderr  # --debug shows where it came from


def test_describe_lists_every_option_and_the_presets(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--describe"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert "runtime: procs | ray | sim | threads" in proc.stdout
    assert "  runtime.auth.mode = 'auto'" in proc.stdout and "syncer.clip = 2.0" in proc.stdout
    # only the groups train.yaml composes: experiment= is scripts/experiment.py's
    presets = proc.stdout.split("Presets (group=name):\n")[1].split("\n\n")[0]
    assert "  model: " in presets and "experiment" not in presets, presets


def test_an_old_flat_key_on_the_command_line_lands_in_its_section_with_a_notice(tmp_path):
    """runtime.store_retry_s= from before the runtime had sections: renamed, with one line saying
    so, and checked as runtime.store.retry_s (0 is refused, so the run stops before any data)."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "runtime.kind=procs",
                           "runtime.store_retry_s=0", f"run.out_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "warning: runtime.store_retry_s is deprecated, use runtime.store.retry_s\n" in proc.stderr
    assert "runtime.store.retry_s=0" in proc.stderr and "unknown option" not in proc.stderr, proc.stderr


def pasted(line: str) -> list[str]:
    """The arguments scripts/train.py gets when a printed `resume with: make train ARGS="..."` line
    is pasted into a shell: the shell unquotes ARGS, make hands $(ARGS) to a shell again."""
    import shlex

    make, target, args = shlex.split(line.removeprefix("resume with: "))
    assert (make, target) == ("make", "train") and args.startswith("ARGS="), line
    return shlex.split(args.removeprefix("ARGS="))


def test_ctrl_c_prints_the_resume_line_and_the_resume_finishes(tmp_path):
    """A SIGINT mid-run (sim: the default runtime) ends with exit 130, no traceback and the one
    command that resumes it; running that command, as printed, finishes the run. The run
    directory is given relative to the working directory, as a user types it."""
    import signal
    import time

    out = tmp_path / "run"
    args = [*TINY_RUN, "algo=diloco", "runtime.learners=2", "runtime.devices_per_learner=1", "run.steps=80",
            "run.checkpoint_every=5", "run.eval_every=40", "run.out_dir=run", "data.data_dir=data"]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train.py"), *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list((out / "sim").glob("*/")) if (out / "sim").exists() else True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert "stopped; partial summary" in stdout and "nats/token" not in stderr
    (line,) = [x for x in stdout.splitlines() if x.startswith("resume with: make train ARGS=")]
    assert "run.resume=true" in pasted(line)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *pasted(line)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["token_ledger_imbalance"] == 0 and summary["tokens_processed"] == 2 * 80 * 8 * 32
