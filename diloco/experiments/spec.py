"""An experiment is data: variants of Hydra overrides of configs/train.yaml, seeds and the columns
to report (configs/experiment/*.yaml, docs/experiments.md#training-experiments-t1-to-t8). This module turns one into the
validated TrainConfigs to run; it trains nothing and never touches a device."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from diloco.config import ConfigError, TrainConfig, from_dict, legacy, load

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# Columns an experiment may add to the always-reported ones (diloco/experiments/tables.py).
EXTRA_METRICS = ("time_to_target", "clock_s", "tokens", "quorum_mean", "grace_mean_s", "stalls",
                 "norm_full", "norm_single", "norm_ratio", "tokens_merged_share", "peak_up_training",
                 "peak_over_mean", "throughput")

# quick=true: a tiny model, 24 steps of 32-token sequences, one seed: about a minute per experiment
# on a laptop CPU once JAX's compilation cache is warm (compiling dominates such short runs).
# Batch sizes are kept, so every variant still sees the same global batch; fragments travel every
# 8 steps so that a 24-step run still merges.
QUICK = ("model=tiny", "data.seq_len=32", "run.steps=24", "inner.warmup_steps=4", "run.log_every=4",
         "run.eval_every=8", "fragments.H=8", "runtime.learner_checkpoint_every=0")
QUICK_EVAL_SEQUENCES = 32

_LABEL = re.compile(r"^[A-Za-z0-9_.+-]+$")  # a variant's label is also its directory name


@dataclass(frozen=True)
class Variant:
    label: str
    overrides: tuple[str, ...] = ()
    reference: str = ""  # the variant its loss is compared with; "" = the experiment's first
    quick: tuple[str, ...] = ()  # overrides added under quick=true (e.g. shorter time windows)


@dataclass(frozen=True)
class ExperimentSpec:
    """One table of docs/experiments.md#training-experiments-t1-to-t8. `suite` instead names other experiments to run."""

    name: str = ""
    title: str = ""
    paper: str = ""  # the paper's result
    expect: str = ""  # what should hold at small scale
    notes: str = ""  # how the experiment departs from the paper's, and why
    base: tuple[str, ...] = ()  # train overrides shared by every variant
    variants: tuple[Variant, ...] = ()  # the first is the reference of relative differences
    seeds: tuple[int, ...] = (0,)  # each sets run.seed, runtime.seed and chaos.seed
    metrics: tuple[str, ...] = ()  # columns beyond the standard ones (EXTRA_METRICS)
    quick: tuple[str, ...] = ()  # overrides added under quick=true, after QUICK
    # Every run evaluates the same val windows: run.eval_batches = eval_sequences / data.batch_size,
    # since the eval set is cut into windows of the run's own batch size (diloco.data.eval_batches).
    eval_sequences: int = 256
    target_loss: float = 0.0  # for time_to_target; 0: per seed, the worst variant's final eval loss
    suite: tuple[str, ...] = ()


@dataclass(frozen=True)
class Settings:
    """configs/experiment.yaml: which experiment, and how to run it."""

    experiment: ExperimentSpec = field(default_factory=ExperimentSpec)
    quick: bool = False
    seeds: tuple[int, ...] = ()  # non-empty: replaces every experiment's seeds
    overrides: tuple[str, ...] = ()  # train overrides appended to every run, e.g. [run.steps=100]
    out_dir: str = "results"
    fresh: bool = False  # rerun runs whose directory already holds a finished run of the same config
    # JAX's persistent compilation cache: every run compiles the same steps again (one set per
    # learner sub-mesh), which is most of a short run's time on CPU; "" turns it off.
    compilation_cache: str = "~/.cache/diloco/xla"


class Job(NamedTuple):
    experiment: str
    variant: str
    seed: int
    cfg: TrainConfig


def check(spec: ExperimentSpec) -> ExperimentSpec:
    e = []
    if not _LABEL.match(spec.name or "?"):
        e.append(f"experiment name {spec.name!r} must match {_LABEL.pattern}")
    if not spec.suite:
        labels = [v.label for v in spec.variants]
        if not labels:
            e.append(f"experiment {spec.name}: no variants")
        if len(set(labels)) != len(labels):
            e.append(f"experiment {spec.name}: duplicate variant labels {labels}")
        e += [f"experiment {spec.name}: variant label {x!r} must match {_LABEL.pattern}"
              for x in labels if not _LABEL.match(x)]
        bad = [v.reference for v in spec.variants if v.reference and v.reference not in labels]
        if bad:
            e.append(f"experiment {spec.name}: unknown reference variant(s) {bad}; labels: {labels}")
        if not spec.seeds:
            e.append(f"experiment {spec.name}: no seeds")
    unknown = sorted(set(spec.metrics) - set(EXTRA_METRICS))
    if unknown:
        e.append(f"experiment {spec.name}: unknown metrics {unknown}; known: {', '.join(EXTRA_METRICS)}")
    if spec.eval_sequences < 1:
        e.append(f"experiment {spec.name}: eval_sequences={spec.eval_sequences} must be >= 1")
    if e:
        raise ConfigError("invalid experiment:\n  " + "\n  ".join(e))
    return spec


def load_settings(raw: dict) -> Settings:
    settings = from_dict(Settings, raw)
    check(settings.experiment)
    return settings


@contextlib.contextmanager
def hydra_configs() -> Iterator[None]:
    """Hydra's compose API over configs/: inside scripts/experiment.py Hydra is already set up on
    that directory; anywhere else (tests, notebooks) it is set up for the duration (once for many
    compositions: setting it up costs more than composing)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        yield
    else:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            yield


def _compose(config_name: str, overrides: list[str]) -> dict:
    from hydra import compose
    from omegaconf import OmegaConf

    with hydra_configs():
        return OmegaConf.to_container(compose(config_name=config_name, overrides=overrides), resolve=True)


def load_experiment(name: str) -> ExperimentSpec:
    """configs/experiment/<name>.yaml as composed by configs/experiment.yaml."""
    raw = _compose("experiment", [f"experiment={name}"])
    return check(from_dict(ExperimentSpec, raw["experiment"], "experiment"))


def members(spec: ExperimentSpec) -> list[ExperimentSpec]:
    """The experiments to run: the spec itself, or each experiment its suite names."""
    with hydra_configs():
        return [load_experiment(n) for n in spec.suite] if spec.suite else [spec]


def run_dir(out_dir: str, experiment: str, variant: str, seed: int) -> str:
    return str(Path(out_dir) / experiment / variant / f"seed{seed}")


def train_config(spec: ExperimentSpec, variant: Variant, seed: int, settings: Settings) -> TrainConfig:
    """Compose train.yaml with base, variant, quick and command-line overrides, in that order
    (the last value of a key wins), then the seed and the run directory."""
    quick = [*QUICK, *spec.quick, *variant.quick] if settings.quick else []
    overrides = [*spec.base, *variant.overrides, *quick, *settings.overrides,
                 f"run.seed={seed}", f"runtime.seed={seed}", f"chaos.seed={seed}",
                 f"run.out_dir={run_dir(settings.out_dir, spec.name, variant.label, seed)}",
                 "run.progress=false", "run.plot=false"]
    try:
        raw = _compose("train", legacy.overrides(overrides))
    except Exception as err:  # Hydra's and OmegaConf's errors (a bad override) share no base class
        raise ConfigError(f"experiment {spec.name}, variant {variant.label}: {err}") from None
    batch = raw["data"]["batch_size"]
    sequences = QUICK_EVAL_SEQUENCES if settings.quick else spec.eval_sequences
    if sequences % batch:
        raise ConfigError(f"experiment {spec.name}, variant {variant.label}: eval_sequences={sequences} "
                          f"is not divisible by data.batch_size={batch}, so variants would be "
                          "evaluated on different windows")
    raw["run"]["eval_batches"] = sequences // batch
    try:
        return load(raw)
    except ConfigError as err:
        raise ConfigError(f"experiment {spec.name}, variant {variant.label}: {err}") from None


def dp_reference(spec: ExperimentSpec, seed: int, settings: Settings) -> TrainConfig:
    """The config whose data parallel a study's bytes are compared with: its first variant that
    trains data parallel, whether or not `only` picked it to run (a DiLoCo variant's M learners
    would be another number of slices), else its first variant."""
    first = None
    with hydra_configs():
        for variant in spec.variants:
            cfg = train_config(spec, variant, seed, settings)
            if cfg.algo == "dp":
                return cfg
            first = first or cfg
    return first


def plan(spec: ExperimentSpec, settings: Settings) -> list[Job]:
    """Every (variant, seed) run of one experiment, seeds innermost; quick keeps the first seed."""
    seeds = settings.seeds or spec.seeds
    if settings.quick:
        seeds = seeds[:1]
    with hydra_configs():
        return [Job(spec.name, v.label, s, train_config(spec, v, s, settings))
                for v in spec.variants for s in seeds]


def devices_needed(jobs: list[Job]) -> int:
    """Simulated devices the Decoupled DiLoCo runs need (M x devices per learner; scavenged
    learners share the base learners' sub-meshes)."""
    return max([j.cfg.runtime.learners * j.cfg.runtime.devices_per_learner
                for j in jobs if j.cfg.algo == "diloco"], default=1)
