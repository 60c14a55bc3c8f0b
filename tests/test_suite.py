"""The suite's own rules (docs/design.md#tests): `make test ARGS=...` keeps pytest's pass-count line."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("target", ["test", "test-slow"])
@pytest.mark.parametrize("args", ["", "-x", "-q", "-q -x tests/test_docs.py", "--quiet"])
def test_make_test_is_quiet_once_whatever_args_bring(target, args):
    """pytest -q -q drops the final "N passed" line, so the Makefile adds its -q only when ARGS has none."""
    plan = subprocess.run(["make", "-n", target, f"ARGS={args}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert plan.returncode == 0, plan.stderr
    (command,) = [line for line in plan.stdout.splitlines() if " -m pytest" in line]
    words = command.split()
    assert sum(w in ("-q", "--quiet") for w in words) == 1 and "-qq" not in words, command
