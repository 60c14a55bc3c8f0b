"""scripts/evaluate.py: a run's exported model evaluates to the eval loss its summary reports; any
text gives nats/token and bits/byte; mistakes are one-line errors."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from diloco.evaluation import bits_per_byte, windows
from test_cli import TINY_RUN, train

ROOT = Path(__file__).resolve().parents[1]


def evaluate(tmp_path, *overrides):
    env = {**os.environ, "XLA_FLAGS": ""}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "evaluate.py"), *overrides],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_windows_predict_every_token_but_the_first_once():
    tokens = np.arange(23, dtype=np.int32)
    batches = windows(tokens, seq_len=4, batch_size=2)
    targets = np.concatenate([b[:, 1:].ravel() for b in batches])
    assert list(targets) == list(range(1, 21))  # the tail 21, 22 does not fill a window
    assert [b.shape for b in batches] == [(2, 5), (2, 5), (1, 5)]
    for b in batches:
        np.testing.assert_array_equal(b[:, 1:-1] + 0, b[:, :-2] + 1)


def test_bits_per_byte_divides_out_the_tokenizer():
    assert bits_per_byte(math.log(256), 1.0) == pytest.approx(8.0)  # a uniform byte model
    assert bits_per_byte(math.log(2) * 6, 3.0) == pytest.approx(2.0)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evaluate")
    out = tmp / "run"
    proc = train(tmp, *TINY_RUN, "data=shakespeare", f"run.out_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_a_runs_model_evaluates_to_its_summarys_eval_loss(run_dir, tmp_path):
    from diloco.evaluation import EvaluateConfig, run
    summary = json.loads((run_dir / "summary.json").read_text())
    result = run(EvaluateConfig(checkpoint=str(run_dir)), out=open(os.devnull, "w"))
    assert result["nats_per_token"] == pytest.approx(summary["eval_loss"], rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(summary["eval_loss"] / math.log(2), rel=1e-2)  # ~1 byte/token
    text = tmp_path / "notes.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 40)
    proc = evaluate(tmp_path, f"checkpoint={run_dir}", f"paths=[{text}]", "seq_len=32")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "nats/token" in proc.stdout and "bits/byte" in proc.stdout


@pytest.mark.parametrize("overrides, message", [
    ([], "checkpoint= is required"),
    (["checkpoint=nowhere"], "nowhere: no such file or folder"),
    (["batch_size=0"], "batch_size=0 must be > 0"),
])
def test_user_mistakes_are_one_line_errors(tmp_path, overrides, message):
    proc = evaluate(tmp_path, *overrides)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_text_is_needed_for_a_folder_and_must_exist(run_dir, tmp_path):
    proc = evaluate(tmp_path, f"checkpoint={run_dir / 'model'}")
    assert proc.returncode == 2 and "give text to evaluate on" in proc.stderr
    proc = evaluate(tmp_path, f"checkpoint={run_dir}", "paths=[missing.txt]")
    assert proc.returncode == 2 and "not found" in proc.stderr and "Traceback" not in proc.stderr
