"""The experiments of docs/experiments.md#training-experiments-t1-to-t8: every file composes into valid runs that compare
like with like, the accounting helpers are right on hand-computed cases, and a tiny two-variant
experiment trains end to end into its Markdown, CSV, JSON and PNG reports."""

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from diloco.config import TrainConfig
from diloco.experiments import measure, runner, spec, tables
from diloco.experiments.spec import ExperimentSpec, Settings, Variant

ROOT = Path(__file__).resolve().parents[1]
NAMES = sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml"))
TABLES = [n for n in NAMES if n != "all"]


def _global_batch(cfg: TrainConfig) -> int:
    return cfg.data.batch_size * (cfg.runtime.learners if cfg.algo == "diloco" else 1)


# Issue 35's tables (T10 Muon, its small-model run T10s, T11 eager steps, T12 automatic outer momentum,
# T14 SparseLoCo) run on their own, not in `all`.
BEYOND = ["t10", "t10s", "t11", "t12", "t14"]


def test_the_suite_runs_t1_to_t8():
    assert TABLES == sorted([f"t{i}" for i in range(1, 9)] + BEYOND)
    assert list(spec.load_experiment("all").suite) == [f"t{i}" for i in range(1, 9)]


@pytest.mark.parametrize("name", TABLES)
@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_every_variant_composes_into_a_valid_config(name, quick):
    exp = spec.load_experiment(name)
    assert exp.name == name and exp.title and exp.paper and exp.expect
    jobs = spec.plan(exp, Settings(experiment=exp, quick=quick, seeds=exp.seeds[:1]))
    assert [j.variant for j in jobs] == [v.label for v in exp.variants]
    assert len({j.cfg.run.out_dir for j in jobs}) == len(jobs)
    # like with like: the same global batch and the same eval windows in every variant
    assert {_global_batch(j.cfg) for j in jobs} == {32}
    assert len({j.cfg.data.batch_size * j.cfg.run.eval_batches for j in jobs}) == 1
    assert {j.cfg.run.steps for j in jobs} == {24 if quick else 300}
    assert all(j.cfg.runtime.kind == "sim" for j in jobs)


@pytest.mark.parametrize("name", ["t1", "t2", "t3", "t4", "t5", "t6", "t7", "t8", *BEYOND])
def test_every_experiment_has_three_seeds(name):
    assert len(spec.load_experiment(name).seeds) >= 3


def test_seed_sets_every_seed_and_t2_variants_share_a_tape():
    exp = spec.load_experiment("t2")
    jobs = spec.plan(exp, Settings(experiment=exp, seeds=(3,)))
    assert {(j.cfg.run.seed, j.cfg.runtime.seed, j.cfg.chaos.seed) for j in jobs} == {(3, 3, 3)}
    by = {j.variant: j.cfg for j in jobs}
    assert by["elastic_dp"].algo == "dp" and by["elastic_dp"].chaos == by["decoupled"].chaos
    assert not by["decoupled_nofail"].chaos.enabled


def test_the_default_decoupled_run_is_shared_by_t1_t2_t5_and_t6():
    """The runner trains it once (runner._twin) only if these compose to the same config."""
    def cfg(name, label):
        exp = spec.load_experiment(name)
        job, = [j for j in spec.plan(exp, Settings(experiment=exp, seeds=(0,))) if j.variant == label]
        return runner._same_run(job.cfg)

    t1 = cfg("t1", "decoupled")
    assert cfg("t2", "decoupled_nofail") == cfg("t5", "int4") == cfg("t6", "balanced") == t1
    assert cfg("t5", "bf16") != t1


def test_sixteen_learners_ask_for_sixteen_devices(monkeypatch):
    exp = spec.load_experiment("t8")
    assert spec.devices_needed(spec.plan(exp, Settings(experiment=exp))) == 16
    monkeypatch.setenv("XLA_FLAGS", "--foo --xla_force_host_platform_device_count=8")
    runner.ensure_devices(16)
    assert os.environ["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=16"
    runner.ensure_devices(4)  # never lowers it
    assert os.environ["XLA_FLAGS"].endswith("=16")


def test_bad_experiments_are_named():
    with pytest.raises(spec.ConfigError, match="unknown metrics"):
        spec.check(ExperimentSpec(name="x", variants=(Variant("a"),), metrics=("lossy",)))
    with pytest.raises(spec.ConfigError, match="unknown reference"):
        spec.check(ExperimentSpec(name="x", variants=(Variant("a", reference="b"),)))
    exp = ExperimentSpec(name="x", variants=(Variant("a", ("syncer.quorom=2",)),))
    with pytest.raises(spec.ConfigError, match="experiment x, variant a: .*syncer.quorom"):
        spec.plan(exp, Settings(experiment=exp))
    exp = ExperimentSpec(name="x", variants=(Variant("a", ("data.batch_size=48",)),), eval_sequences=256)
    with pytest.raises(spec.ConfigError, match="eval_sequences=256 is not divisible by data.batch_size=48"):
        spec.plan(exp, Settings(experiment=exp))


def test_elastic_dp_clock_by_hand():
    # 4 slices, one step per second at full strength; a slice fails at t = 10 and returns at 20,
    # each change pausing the job for 2 s: full speed to 10, paused to 12, 3/4 speed to 20,
    # paused to 22, full speed after.
    bp, progress, rate = measure.elastic_progress(np.array([10.0, 20.0]), np.array([-1, 1]), 4, 2.0, 1.0)
    t = measure.step_times(bp, progress, rate, np.array([0, 5, 10, 13, 16, 20]))
    np.testing.assert_allclose(t, [0, 5, 10, 12 + 3 / 0.75, 12 + 6 / 0.75, 22 + 4])
    assert measure.computing_share(bp, rate, 30.0) == pytest.approx(26 / 30)  # uptime
    # goodput weights each second by the live slices: 10 + 8 x 3/4 + 8 of 30 s
    assert measure.computing_share(bp, rate, 30.0, step_s=1.0) == pytest.approx(24 / 30)
    # no failures: the plain clock
    bp, progress, rate = measure.elastic_progress(np.array([]), np.array([], int), 4, 2.0, 1.5)
    np.testing.assert_allclose(measure.step_times(bp, progress, rate, np.array([2.0])), [3.0])


def test_dp_step_time_is_compute_plus_ring_all_reduce():
    cfg = TrainConfig()
    r = cfg.runtime
    bytes_ = 2 * (r.learners - 1) / r.learners * 1000 * 2
    assert measure.dp_step_s(cfg, 1000) == pytest.approx(
        r.step_time + bytes_ / r.bandwidth + 2 * (r.learners - 1) * r.latency)


def test_merge_norms_pair_each_full_merge_with_its_contributions():
    def arrival(fragment, learner, seq):
        return {"event": "arrival", "fragment": fragment, "key": [learner, 0, seq]}

    decisions = [arrival(0, 0, 1), arrival(0, 1, 1), arrival(1, 0, 2), arrival(1, 1, 2),
                 {"event": "merge", "fragment": 0, "learners": [0, 1], "delta_norm": 1.0},
                 {"event": "merge", "fragment": 1, "learners": [0, 1], "delta_norm": 9.0},  # embedding
                 arrival(0, 1, 3), {"event": "quarantine", "key": [0, 0, 3]},
                 {"event": "merge", "fragment": 0, "learners": [1], "delta_norm": 5.0}]  # not all M
    norms = {(0, 0, 1): 1.5, (1, 0, 1): 2.5, (1, 0, 3): 7.0}
    n = measure.merge_norms(decisions, learners=2, skip={1}, norms=norms)
    assert (n["norm_full"], n["norm_single"], n["norm_ratio"]) == (1.0, 2.0, 0.5)


def _row(variant, seed, loss, curve):
    return {"variant": variant, "seed": seed, "eval_loss": loss, "curve": curve}


def test_relative_loss_is_paired_by_seed_and_time_to_target_interpolates():
    exp = ExperimentSpec(name="x", variants=(Variant("a"), Variant("b")), seeds=(0, 1))
    rows = [_row("a", 0, 3.0, [[1, 10, 4.0], [2, 20, 3.0]]), _row("a", 1, 3.2, [[1, 10, 4.0], [2, 20, 3.2]]),
            _row("b", 0, 3.15, [[1, 10, 3.5], [2, 20, 3.15]]), _row("b", 1, 3.2, [[1, 10, 3.3], [2, 20, 3.2]])]
    result = tables.aggregate(exp, Settings(experiment=exp), rows)
    a, b = result["variants"]
    assert b["rel_loss"][0] == pytest.approx(0.025) and b["rel_loss"][1] == pytest.approx(np.std([0.05, 0], ddof=1))
    assert a["mean"]["eval_loss"] == pytest.approx(3.1) and math.isnan(a["mean"]["merges"])
    # Each run is timed on its own curve to its seed's worst final loss (seed 0: b's 3.15, seed 1: 3.2).
    assert result["seed_targets"] == {"0": 3.15, "1": 3.2} and result["target_loss"] == pytest.approx(3.175)
    times = {(r["variant"], r["seed"]): r["time_to_target"] for r in result["runs"]}
    assert times == {("a", 0): pytest.approx(18.5), ("a", 1): 20, ("b", 0): 20, ("b", 1): 20}
    assert a["mean"]["time_to_target"] == pytest.approx(19.25) and b["mean"]["time_to_target"] == 20
    assert a["std"]["time_to_target"] == pytest.approx(np.std([18.5, 20], ddof=1))
    assert tables.time_to({"time": [10, 20], "loss": [3.0, 2.0]}, 2.5) == 15
    assert tables.time_to({"time": [10, 20], "loss": [3.0, 2.0]}, 1.0) == math.inf


@pytest.mark.slow  # 15 s of runs; every variant's config and the reports' arithmetic are tested by default
def test_quick_experiment_end_to_end(tmp_path):
    """Two variants, one seed, tiny model: reports with the expected rows, then a rerun that
    reuses the finished runs instead of training again."""
    exp = ExperimentSpec(
        name="smoke", title="DP vs Decoupled DiLoCo, M = 2", paper="-", expect="-",
        base=("runtime.learners=2", "runtime.devices_per_learner=1", "run.steps=16"),
        variants=(Variant("dp", ("algo=dp", "data.batch_size=16", "mesh.devices=2")),
                  Variant("decoupled", ("data.batch_size=8",))),
        metrics=("clock_s", "time_to_target"))
    settings = Settings(experiment=exp, quick=True, out_dir=str(tmp_path), compilation_cache="",
                        overrides=("run.steps=16",))
    paths = runner.run_all(settings)
    names = sorted(p.name for p in paths)
    assert names == ["smoke.csv", "smoke.json", "smoke.md", "smoke_bars.png", "smoke_loss.png"]
    rows = list(csv.DictReader((tmp_path / "smoke.csv").open()))
    assert [(r["variant"], r["seed"], r["algo"]) for r in rows] == [("dp", "0", "dp"), ("decoupled", "0", "diloco")]
    md = (tmp_path / "smoke.md").read_text()
    assert "| `dp` | 1 |" in md and "| `decoupled` | 1 |" in md and "![smoke_loss.png]" in md
    result = json.loads((tmp_path / "smoke.json").read_text())
    dp, dl = result["variants"]
    assert dp["mean"]["tokens"] == dl["mean"]["tokens"] == 16 * 16 * 32  # same tokens, same batch
    assert dl["mean"]["merges"] > 0 and 0 < dl["mean"]["up_per_step"] < dp["mean"]["up_per_step"]
    assert len(dp["curve"]["loss"]) >= 2 and all(math.isfinite(x) for x in dl["curve"]["loss"])
    assert (tmp_path / "smoke_loss.png").stat().st_size > 10_000

    walls = [r["wall_s"] for r in result["runs"]]
    runner.run_all(settings)  # finished runs of the same config are reused, not retrained
    assert [r["wall_s"] for r in json.loads((tmp_path / "smoke.json").read_text())["runs"]] == walls

    # the training-dynamics notebook draws an experiment's results JSON too
    nb = json.loads((ROOT / "notebooks" / "training_dynamics.ipynb").read_text())
    namespace = {"RUN_DIR": str(tmp_path / "smoke.json")}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code" and "parameters" not in cell["metadata"].get("tags", []):
            exec(compile("".join(cell["source"]), "training_dynamics.ipynb", "exec"), namespace)
    assert len(namespace["records"]) == len(dp["curve"]["loss"]) + len(dl["curve"]["loss"])


@pytest.mark.slow
def test_script_runs_t1_quick(tmp_path):
    out = subprocess.run([sys.executable, "scripts/experiment.py", "experiment=t1", "quick=true",
                          f"out_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    md = (tmp_path / "t1.md").read_text()
    assert all(f"| `{v}` |" in md for v in ("dp", "sync", "decoupled"))
    assert (tmp_path / "t1_loss.png").exists() and (tmp_path / "t1_bars.png").exists()


def test_a_finished_run_is_reused_when_its_config_only_lacks_newer_fields(tmp_path):
    """A run saved before a config field existed still counts as the same run; a changed value or
    a field that no longer exists does not, except in a section data parallel never reads."""
    import yaml

    from diloco.config import to_dict

    cfg = TrainConfig()
    old = to_dict(cfg)
    del old["syncer"]["anchor"]  # as written before syncer.anchor existed
    (tmp_path / "summary.json").write_text('{"eval_loss": 2.0}')
    (tmp_path / "timing.json").write_text('{"wall_s": 1.0}')
    dp_outer = {**old, "outer": {**old["outer"], "lr": 1.0}}  # data parallel never reads it
    for raw, reused in ((old, True), ({**old, "algo": "diloco"}, False),
                        ({**old, "retired_field": 1}, False), (dp_outer, True),
                        ({**dp_outer, "inner": {**old["inner"], "lr": 1.0}}, False)):
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
        got = runner._finished(cfg, tmp_path)
        assert (got == {"eval_loss": 2.0, "wall_s": 1.0}) if reused else got is None


def test_a_run_equal_to_a_finished_run_of_another_experiment_is_copied(tmp_path):
    """T5's int4 and T6's balanced are T1's decoupled: the runner copies the finished directory
    (sim runs are deterministic given the config) and records the new place; a different value is
    not a twin, nor is an unfinished run or one whose summary predates a key today's runs write."""
    import yaml

    from diloco.config import from_dict, to_dict

    def cfg_at(path, **codec):
        raw = to_dict(TrainConfig())
        raw["algo"] = "diloco"
        raw["run"].update(steps=7, out_dir=str(path))
        raw["codec"].update(codec)
        return from_dict(TrainConfig, raw)

    done = tmp_path / "t1" / "decoupled" / "seed0"
    done.mkdir(parents=True)
    (done / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg_at(done))))
    (done / "decisions.jsonl").write_text("{}\n")
    target = tmp_path / "t5" / "int4" / "seed0"
    assert runner._twin(cfg_at(target), tmp_path) is None  # no summary yet: unfinished
    (done / "summary.json").write_text('{"eval_loss": 2.0}')
    (done / "timing.json").write_text('{"wall_s": 3.0}')
    assert runner._twin(cfg_at(target), tmp_path) is None  # older summary: retrain, not copy
    assert runner._finished(cfg_at(done), done) is not None  # though it is still read in place
    (done / "summary.json").write_text('{"eval_loss": 2.0, "peak_rate_up_training": 1.0}')
    assert runner._twin(cfg_at(target), tmp_path) == done
    assert runner._twin(cfg_at(target, up="bf16"), tmp_path) is None
    assert runner._twin(cfg_at(done), tmp_path) is None  # a run is not its own twin

    runner._copy_twin(cfg_at(target), done, target)
    assert (target / "decisions.jsonl").read_text() == "{}\n"
    assert runner._finished(cfg_at(target), target) == {"eval_loss": 2.0, "peak_rate_up_training": 1.0,
                                                        "wall_s": 3.0}


def test_a_finished_run_survives_a_replacement_that_does_not_finish(tmp_path, monkeypatch):
    """A directory holding another config's finished run is set aside while its replacement runs:
    a replacement refused before it starts (memory), one that fails, and one killed mid-run (its
    leftovers found by the next call) all give the old run back whole; one that finishes replaces it."""
    import yaml

    import diloco.run
    from diloco.config import ConfigError, from_dict, to_dict
    from diloco.experiments.spec import Job

    def cfg(steps):
        raw = to_dict(TrainConfig())
        raw["run"].update(steps=steps, out_dir=str(tmp_path / "t1" / "dp" / "seed0"))
        return from_dict(TrainConfig, raw)

    run_dir = tmp_path / "t1" / "dp" / "seed0"
    run_dir.mkdir(parents=True)
    old = {"config.yaml": yaml.safe_dump(to_dict(cfg(5))), "summary.json": '{"eval_loss": 2.0}',
           "timing.json": '{"wall_s": 1.0}', "metrics.jsonl": '{"step": 5}\n'}
    for name, text in old.items():
        (run_dir / name).write_text(text)
    settings = Settings(out_dir=str(tmp_path))
    job = Job("t1", "dp", 0, cfg(7))
    files = lambda: {p.name: p.read_text() for p in run_dir.iterdir()}  # noqa: E731

    def refused(c):
        raise ConfigError("needs 40 GB, the machine has 24 GB")

    def fails(c):
        run_dir.mkdir()
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
        raise RuntimeError("a step failed")

    for fake, error in ((refused, ConfigError), (fails, RuntimeError)):
        monkeypatch.setattr(diloco.run, "run", fake)
        with pytest.raises(error):
            runner.trained(job, settings)
        assert files() == old and not runner._aside(run_dir).exists()

    # killed mid-run: the old run is still aside, a partial run in its place
    run_dir.rename(runner._aside(run_dir))
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert runner.trained(Job("t1", "dp", 0, cfg(5)), settings) == {"eval_loss": 2.0, "wall_s": 1.0}
    assert files() == old  # put back, and it is the finished run of that config

    def finishes(c):
        run_dir.mkdir()
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(c)))
        (run_dir / "summary.json").write_text('{"eval_loss": 1.5}')
        return {"eval_loss": 1.5}

    monkeypatch.setattr(diloco.run, "run", finishes)
    assert runner.trained(job, settings)["eval_loss"] == 1.5
    assert runner._finished(cfg(7), run_dir)["eval_loss"] == 1.5
    assert not runner._aside(run_dir).exists() and "metrics.jsonl" not in files()


def test_a_study_skips_a_run_refused_for_memory_trains_the_rest_and_then_fails_naming_it(monkeypatch, tmp_path):
    """One run too big for the memory free now costs only itself: the runs after it still train,
    the study writes its tables, and then fails naming the run and why (the same command later
    trains only what is missing). Any other error still stops the study at once."""
    from diloco.config import ConfigError
    from diloco.experiments.spec import Job
    from diloco.train.footprint import MemoryRefused

    jobs = [Job("ft", v, s, None) for v in ("dp", "diloco_m4", "diloco_lora_m4") for s in (0, 1)]

    def trained(job, settings):
        if job.variant == "diloco_m4" and job.seed == 1:
            raise MemoryRefused("this run needs about 15.9 GiB of memory and 14.0 GiB is available")
        return {"eval_loss": float(job.seed)}

    monkeypatch.setattr(runner, "trained", trained)
    refused = []
    done = [(j.variant, j.seed, s["eval_loss"]) for j, s in runner.trained_each(jobs, Settings(), refused)]
    assert done == [("dp", 0, 0.0), ("dp", 1, 1.0), ("diloco_m4", 0, 0.0), ("diloco_lora_m4", 0, 0.0),
                    ("diloco_lora_m4", 1, 1.0)]
    assert refused == ["ft diloco_m4 seed 1: this run needs about 15.9 GiB of memory and 14.0 GiB is available"]
    written = [tmp_path / "ft.md", tmp_path / "ft.json"]
    with pytest.raises(ConfigError, match=r"1 run\(s\) refused for memory") as err:
        runner.complete(refused, written)
    assert "ft diloco_m4 seed 1: this run needs about 15.9 GiB" in str(err.value) and str(written[0]) in str(err.value)
    assert runner.complete([], written) == written

    def broken(job, settings):
        raise ConfigError("data.paths matched no file")

    monkeypatch.setattr(runner, "trained", broken)
    with pytest.raises(ConfigError, match="no file"):
        list(runner.trained_each(jobs, Settings(), []))
