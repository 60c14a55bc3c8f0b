"""Run every (variant, seed) of an experiment in-process with diloco.run, each in its own directory
results/<experiment>/<variant>/seed<k>/, and write results/<experiment>.{md,csv,json} and PNGs.

A run directory that already holds a finished run of the same config is reused (not retrained),
so an interrupted `experiment=all` picks up where it stopped. A run whose config equals a finished
run of another experiment (T1's Decoupled DiLoCo is T5's int4 and T6's balanced) is copied from it:
sim runs are deterministic given the config, so training it again would give the same files.
`fresh=true` retrains everything.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import yaml

from diloco.config import ConfigError, TrainConfig, from_dict, to_dict
from diloco.experiments import measure, plots, tables
from diloco.experiments.spec import ExperimentSpec, Job, Settings, devices_needed, members, plan

_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")
# Simulated devices scripts/experiment.py asks for: the most any experiment file needs (M = 16
# learners of one device in T4 and T8). A Hydra multirun trains several experiments in one process
# and JAX fixes the device count when it starts, so the first experiment cannot ask for less.
DEVICES = 16


def ensure_devices(n: int) -> None:
    """Ask for at least n simulated CPU devices. XLA reads the flag when JAX first touches a
    device, so this must run before any run starts; a machine with real accelerators ignores it."""
    flags = os.environ.get("XLA_FLAGS", "")
    m = _COUNT.search(flags)
    if m and int(m.group(1)) >= n:
        return
    flag = f"--xla_force_host_platform_device_count={n}"
    os.environ["XLA_FLAGS"] = _COUNT.sub(flag, flags) if m else f"{flags} {flag}".strip()


def enable_compilation_cache(path: str) -> None:
    """Load executables compiled by an earlier run (of this process or another) instead of
    compiling them again; as diloco/runtime/procs/learner.py does for restarted learners."""
    import jax

    if path and jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(Path(path).expanduser()))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


# The sections only Decoupled DiLoCo reads: a data-parallel run trains the same whatever they hold
# (a finetune= preset's outer step, say), so they are not part of its identity.
DILOCO_ONLY = ("fragments", "outer", "codec", "syncer")


def _comparable(d: dict) -> dict:
    """A config dict as two runs of it compare: under model.init_from the run writes the
    checkpoint's shape into `model` (diloco/inputs.py), so only the path and the compute dtype
    are the config's own there; under algo=dp the DiLoCo-only sections are left out."""
    if d["model"].get("init_from"):
        d = {**d, "model": {k: d["model"][k] for k in ("init_from", "dtype")}}
    if d["algo"] == "dp":
        d = {k: v for k, v in d.items() if k not in DILOCO_ONLY}
    return d


def _finished(cfg: TrainConfig, run_dir: Path) -> dict | None:
    """The summary of a finished run of exactly this config in run_dir, if there is one. The saved
    config is loaded as today's code would load it, so a run made before a config field existed
    still counts (a new field's default keeps the old behaviour)."""
    paths = [run_dir / n for n in ("config.yaml", "summary.json", "timing.json")]
    if not all(p.exists() for p in paths):
        return None
    try:
        saved = to_dict(from_dict(TrainConfig, yaml.safe_load(paths[0].read_text())))
    except ConfigError:  # a field that no longer exists: a different config
        return None
    if _comparable(saved) != _comparable(to_dict(cfg)):
        return None
    return {**json.loads(paths[1].read_text()), **json.loads(paths[2].read_text())}


def _same_run(cfg: TrainConfig) -> dict:
    """cfg as a dict, without where it is written."""
    d = _comparable(to_dict(cfg))
    return {**d, "run": {k: v for k, v in d["run"].items() if k != "out_dir"}}


def _twin(cfg: TrainConfig, out_dir: Path) -> Path | None:
    """Another run directory under out_dir (results/<experiment>/<variant>/seed<k>) holding a
    finished run of the same config written elsewhere, with every summary key today's runs have
    (measure.LATE_KEYS) when it is a DiLoCo run."""
    want = _same_run(cfg)
    here = Path(cfg.run.out_dir).resolve()
    for path in sorted(out_dir.glob("*/*/seed*/config.yaml")):
        d = path.parent
        if d.resolve() == here:
            continue
        try:
            saved = from_dict(TrainConfig, yaml.safe_load(path.read_text()))
        except (ConfigError, yaml.YAMLError):
            continue
        if _same_run(saved) != want:
            continue
        summary = _finished(saved, d)
        late = measure.LATE_KEYS if saved.algo != "dp" else ()
        if summary is not None and all(k in summary for k in late):
            return d
    return None


def _copy_twin(cfg: TrainConfig, twin: Path, run_dir: Path) -> None:
    shutil.copytree(twin, run_dir)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def _aside(run_dir: Path) -> Path:
    """Where a run directory waits while a run of another config replaces it (a dot name, so no
    glob of run directories reads it)."""
    return run_dir.with_name(f".{run_dir.name}.replaced")


def _restore(run_dir: Path) -> None:
    """Put back a run directory set aside for a replacement that did not finish: the replacement
    was refused (memory, devices, data), failed or was killed, and its partial directory goes."""
    aside = _aside(run_dir)
    if aside.exists():
        if run_dir.exists():
            shutil.rmtree(run_dir)
        aside.rename(run_dir)


def trained(job: Job, settings: Settings) -> dict:
    """Train one run, or reuse a finished run of its config (in its directory or, copied, from a
    twin elsewhere under out_dir), and return its summary with wall_s.

    A directory holding another config's run is set aside, not deleted, until its replacement has
    finished: `run` refuses a used directory (a stale metrics.jsonl would mix two runs), and a
    replacement refused before it starts (it cannot fit in memory, say) must not cost the finished
    run it would have replaced."""
    from diloco.run import run

    run_dir = Path(job.cfg.run.out_dir)
    _restore(run_dir)  # a replacement killed before it finished
    summary = None if settings.fresh else _finished(job.cfg, run_dir)
    if summary is not None:
        return summary
    if run_dir.exists():
        if Path(settings.out_dir).resolve() not in run_dir.resolve().parents:
            raise RuntimeError(f"refusing to replace {run_dir}: not under out_dir={settings.out_dir}")
        run_dir.rename(_aside(run_dir))
    try:
        twin = None if settings.fresh else _twin(job.cfg, Path(settings.out_dir))
        if twin is not None:
            _copy_twin(job.cfg, twin, run_dir)
            print(f"[{job.experiment}] {job.variant} seed {job.seed}: the same run as {twin}, copied", flush=True)
            summary = _finished(job.cfg, run_dir)
        if summary is None:
            start = time.perf_counter()
            summary = run(job.cfg)
            timing = {"wall_s": time.perf_counter() - start}
            (run_dir / "timing.json").write_text(json.dumps(timing))
            summary = {**summary, **timing}
    except BaseException:
        _restore(run_dir)
        raise
    if _aside(run_dir).exists():
        shutil.rmtree(_aside(run_dir))
    return summary


def trained_each(jobs: Iterable[Job], settings: Settings, refused: list[str]) -> Iterator[tuple[Job, dict]]:
    """(job, summary) for each job that trains or is reused, in order. A run refused because it
    cannot fit in the memory available now is skipped with its reason appended to `refused`, so one
    run too big for the moment does not cost the rest of a study hours long; `complete` then fails
    the study once its tables of the others are written."""
    from diloco.train.footprint import MemoryRefused

    for job in jobs:
        try:
            summary = trained(job, settings)
        except MemoryRefused as err:
            refused.append(f"{job.experiment} {job.variant} seed {job.seed}: {err}")
            print(f"[{job.experiment}] {job.variant} seed {job.seed}: skipped, not enough memory now", flush=True)
            continue
        yield job, summary


def complete(refused: list[str], written: list[Path]) -> list[Path]:
    """`written` (the study's tables), or fail a study whose runs `trained_each` skipped, naming
    each and why."""
    if refused:
        raise ConfigError(f"{len(refused)} run(s) refused for memory and skipped; the other runs are in "
                          f"{', '.join(map(str, written))}, and the same command trains only what is missing "
                          "(finished runs are reused):\n  " + "\n  ".join(refused))
    return written


def run_job(job: Job, settings: Settings) -> dict:
    """Train one run (or reuse it) and return its row (diloco/experiments/measure.py)."""
    run_dir = Path(job.cfg.run.out_dir)
    summary = trained(job, settings)
    row = measure.row(job.cfg, summary, run_dir)
    print(f"[{job.experiment}] {job.variant} seed {job.seed}: eval loss {row['eval_loss']:.4f} "
          f"({summary['wall_s']:.1f} s)", flush=True)
    return {"experiment": job.experiment, "variant": job.variant, "seed": job.seed,
            "run_dir": str(run_dir), "wall_s": summary["wall_s"], **row}


def run_experiment(spec: ExperimentSpec, settings: Settings, jobs: list[Job] | None = None) -> list[Path]:
    """Train an experiment's runs and write its reports; returns the files written."""
    jobs = plan(spec, settings) if jobs is None else jobs
    rows = [run_job(j, settings) for j in jobs]
    result = tables.aggregate(spec, settings, rows)
    figures = plots.write(result, Path(settings.out_dir))
    return tables.write(result, Path(settings.out_dir), [f.name for f in figures]) + figures


def plan_all(settings: Settings) -> list[tuple[ExperimentSpec, list[Job]]]:
    """The runs of the experiment of `settings`, or of each member of a suite: composed and
    validated up front, so that a bad variant fails before hours of training."""
    return [(spec, plan(spec, settings)) for spec in members(settings.experiment)]


def devices_for(planned: list[tuple[ExperimentSpec, list[Job]]]) -> int:
    return max([DEVICES, *(devices_needed(jobs) for _, jobs in planned)])


def run_all(settings: Settings, planned: list[tuple[ExperimentSpec, list[Job]]] | None = None) -> list[Path]:
    """Train and report every planned experiment; returns the files written."""
    planned = plan_all(settings) if planned is None else planned
    enable_compilation_cache(settings.compilation_cache)
    return [p for spec, jobs in planned for p in run_experiment(spec, settings, jobs)]
