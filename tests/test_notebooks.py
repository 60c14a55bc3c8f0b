"""Every notebook runs top to bottom on a small run directory (code cells executed in order).

Notebooks are committed without outputs; this executes their code without a Jupyter kernel, so
the suite needs no extra dependencies. The first cell tagged `parameters` is replaced by ours.
"""

import json
from pathlib import Path

import matplotlib
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.fixture
def run_dir(tmp_path):
    records = [{"kind": "train", "learner": m, "step": s, "tokens": s * 100, "loss": 3.0 - 0.01 * s}
               for m in range(2) for s in range(10, 60, 10)]
    records += [{"kind": "eval", "step": s, "tokens": s * 200, "eval_loss": 2.9 - 0.01 * s} for s in (25, 50)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (tmp_path / "summary.json").write_text(json.dumps({"algo": "diloco", "eval_loss": 2.4, "unigram_loss": 3.3}))
    return tmp_path


def test_notebooks_have_no_outputs():
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            assert not cell.get("outputs"), f"{path.name}: commit notebooks without outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, run_dir):
    matplotlib.use("Agg")
    nb = json.loads(path.read_text())
    namespace: dict = {}
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            namespace["RUN_DIR"] = str(run_dir)
            continue
        exec(compile("".join(cell["source"]), f"{path.name}", "exec"), namespace)
    CHECKS[path.stem](namespace["records"], run_dir)


def _curves(records, run_dir):  # every line of metrics.jsonl, in order
    assert records == [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _dynamics(records, run_dir):  # one run directory: its eval points, on steps (its evals have no clock)
    written = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records == [{**r, "time": r["step"]} for r in written if r["kind"] == "eval"]


def _bandwidth(records, run_dir):  # Table 4: each model, method and target utilisation once
    from diloco.bandwidth import table4

    cells = [(r["model"], r["method"], r["target"]) for r in records]
    assert sorted(cells) == sorted((m, k, t) for m in table4.MODELS for k in table4.METHODS for t in table4.TARGETS)


def _goodput(records, run_dir):  # no goodput.json here: the quick study, each row at each of its chip counts
    from diloco.chaos import study

    quick = study.load({"quick": True})
    chips = quick.chips
    rows = {(r["mode"], r["learners"]) for r in records}
    assert ("dp", 1) in rows and {m for _, m in rows} >= set(quick.learners), rows
    assert sorted((r["mode"], r["learners"], r["requested_chips"]) for r in records) == sorted(
        (mode, m, c) for mode, m in rows for c in chips)
    assert all(0 < r["goodput"] <= 1 for r in records), records


# What each notebook's `records` must hold on the run directory above.
CHECKS = {"training_curves": _curves, "training_dynamics": _dynamics, "bandwidth": _bandwidth, "goodput": _goodput}
