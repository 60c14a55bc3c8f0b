"""Train a model as configs/train.yaml (plus command-line overrides) says.

    python scripts/train.py model=tiny run.steps=200
    python scripts/train.py run.out_dir=runs/x run.resume=true
    python scripts/train.py --describe          # every option, its default and meaning
    python scripts/train.py --describe preset=llama3_8b   # ... and that run's memory per device
    python scripts/train.py -m hydra/launcher=submitit_local outer.lr=0.5,0.7   # a sweep (docs/sweeps.md)

A user's mistake (config, data, devices, checkpoints, a used run directory) prints one `error:`
block and exits 2 without a traceback; `--debug` or HYDRA_FULL_ERROR=1 shows it. In a multirun
each job runs in <run.out_dir>/<job number> and the sweep ends with the first failed job's `error:`.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from diloco.cli import fail, quiet_logs
from diloco.config import ConfigError, legacy, load
from diloco.config.describe import describe, unknown_keys
from diloco.data.errors import DataError
from diloco.hf import CheckpointError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# The errors a user's input causes; anything else is a bug and keeps its traceback.
USER_ERRORS = (ConfigError, DataError, CheckpointError)
DEBUG = "--debug" in sys.argv or os.environ.get("HYDRA_FULL_ERROR") == "1"


class JobUserError(CompactHydraException):
    """A user's mistake in one job of a multirun. Hydra hands a failed job's exception back to the
    process that started the sweep (pickled, under submitit) and prints this kind as its message
    alone, where any other exception gets a traceback."""


def _job_error(message: object) -> JobUserError:
    """A sweep job's user error, to raise: the other jobs go on and the sweep reports the first
    failed one's when all are done. Under submitit a job's stderr is its own log
    (<sweep dir>/.submitit/<id>/), so the job says it there too."""
    if "SUBMITIT_FOLDER" in os.environ:
        print(f"error: {message}", file=sys.stderr)
    return JobUserError(f"error: {message}")


def _groups() -> dict[str, list[str]]:
    """Config group -> its presets (configs/<group>/*.yaml): `model=tiny` picks one. Only the groups
    of train.yaml's defaults list (configs/experiment/ is scripts/experiment.py's)."""
    import yaml

    defaults = yaml.safe_load((CONFIGS / "train.yaml").read_text())["defaults"]
    names = sorted(g for d in defaults if isinstance(d, dict) and (g := next(iter(d))).isidentifier())
    return {g: sorted(p.stem for p in (CONFIGS / g).glob("*.yaml")) for g in names}


def _preflight(argv: list[str]) -> list[str]:
    """What scripts/train.py answers before Hydra: --describe/--help, and mistyped keys (Hydra
    would only say "use +key=value", adding the typo as a new key). An option's old key
    (runtime.store_url=...) is renamed to its new one (diloco/config/legacy.py)."""
    argv = legacy.overrides(argv)
    if "--describe" in argv or "--help" in argv or "-h" in argv:
        presets = "\n".join(f"  {g}: {' | '.join(names)}" for g, names in _groups().items())
        print(__doc__.strip() + "\n\nPresets (group=name):\n" + presets + "\n\n" + describe())
        overrides = [a for a in argv if not a.startswith("-")]
        if overrides:  # a configuration to size: its memory per device
            print("\n" + _estimate(overrides))
        sys.exit(0)
    errors = unknown_keys([a for a in argv if not a.startswith("-")], set(_groups()))
    if errors:
        fail("\n  ".join(["the command line names options that do not exist:", *errors]))
    return [a for a in argv if a != "--debug"]


def _estimate(overrides: list[str]) -> str:
    """The memory estimate (diloco/train/footprint.py) of configs/train.yaml with `overrides`."""
    from hydra import compose, initialize_config_dir

    from diloco.train import footprint

    errors = unknown_keys(overrides, set(_groups()))
    if errors:
        fail("\n  ".join(["the command line names options that do not exist:", *errors]))
    try:
        with initialize_config_dir(str(CONFIGS), version_base="1.3"):
            raw = compose("train", overrides=overrides)
        cfg = load(OmegaConf.to_container(raw, resolve=True))
    except (ConfigError, CompactHydraException) as err:
        fail(err)
    return "\n".join(footprint.describe(cfg))


def _job_tasks() -> int:
    """How many copies of this job its launcher started. submitit starts tasks_per_node x nodes
    of each job (through srun on Slurm), and every copy would be a whole run in the same directory."""
    if "SUBMITIT_FOLDER" not in os.environ:  # set by submitit in the processes of its jobs
        return 1
    import submitit

    return submitit.JobEnvironment().num_tasks


def _ours(run_dir: Path) -> bool:
    """Whether `run_dir` is empty before this start (Hydra makes it, and writes nothing in it)."""
    return not run_dir.is_dir() or not any(run_dir.iterdir())


def _clean_failed_start(run_dir: Path) -> None:
    """A start that failed leaves only what it wrote itself (our config.yaml): remove it, and the
    directory if that empties it, so no half-made run is left behind."""
    (run_dir / "config.yaml").unlink(missing_ok=True)
    if run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()


def _stopped(stop: KeyboardInterrupt, run_dir: Path) -> None:
    """A stopped run prints its partial summary and the line that resumes it, then exits 130.
    threads and procs raise RunStopped with what they saved; sim and the data-parallel trainer a
    plain KeyboardInterrupt after their final snapshot or checkpoint."""
    from diloco.runtime.stop import EXIT_STATUS, RunStopped, stop_message

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a late Ctrl-C must not traceback the printing
    if DEBUG:
        raise stop
    if not isinstance(stop, RunStopped):
        stop = RunStopped(run_dir, None, resumable=(run_dir / "config.yaml").exists())
    print(stop_message(stop, list(HydraConfig.get().overrides.task)))
    sys.exit(EXIT_STATUS)


@hydra.main(config_path="../configs", config_name="train", version_base="1.3")
def main(raw: DictConfig) -> None:
    quiet_logs()
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if multirun and (tasks := _job_tasks()) > 1:  # before JAX, and before any copy writes a file
        raise _job_error(f"this sweep job was started as {tasks} tasks, each a whole run in one directory; "
                         "set hydra.launcher.tasks_per_node=1 hydra.launcher.nodes=1 (docs/sweeps.md)")
    from diloco.run import run  # after the preflight: importing JAX takes seconds

    # The one place a DictConfig is seen: converted once to frozen, validated dataclasses.
    plain = OmegaConf.to_container(raw, resolve=True)
    if multirun:
        # All jobs of a sweep resolve the same run.out_dir, the sweep's directory (hydra.sweep.dir);
        # each runs in its own Hydra job directory under it instead, <sweep dir>/<job number>.
        plain.setdefault("run", {})["out_dir"] = os.path.join(hydra_cfg.sweep.dir, hydra_cfg.sweep.subdir)
    run_dir = Path(str(plain.get("run", {}).get("out_dir", "")))
    fresh = bool(run_dir.parts) and _ours(run_dir)  # a directory this start made, not an earlier run's
    try:
        cfg = load(plain)
        run(cfg)
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: what was saved, and how to go on
        _stopped(stop, run_dir)
    except USER_ERRORS as err:
        if fresh:
            _clean_failed_start(run_dir)
        if DEBUG:
            raise
        if multirun:
            raise _job_error(err) from None
        fail(err)


if __name__ == "__main__":
    sys.argv[1:] = _preflight(sys.argv[1:])
    try:
        main()
    except SystemExit as done:
        # Hydra ends a sweep whose job failed with status 1, raised while it handles that job's
        # exception; a user's mistake keeps the status 2 of a single run's `error:`.
        if isinstance(done.__context__, JobUserError):
            sys.exit(2)
        raise
