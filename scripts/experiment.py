"""Run the small-scale training experiments T1 to T8 (docs/experiments.md#training-experiments-t1-to-t8) on the sim runtime.

    python scripts/experiment.py experiment=t1               # results/t1.{md,csv,json}, t1_loss.png, t1_bars.png
    python scripts/experiment.py experiment=all              # every experiment, one after another
    python scripts/experiment.py experiment=t3 quick=true    # tiny model, 24 steps, one seed: a smoke test
    python scripts/experiment.py -m experiment=t1,t5         # a Hydra multirun
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from diloco.config import ConfigError
from diloco.experiments import runner, spec


@hydra.main(config_path="../configs", config_name="experiment", version_base="1.3")
def main(raw: DictConfig) -> None:
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax logs every checkpoint at INFO
    # The one place a DictConfig is seen: converted once to frozen, validated dataclasses, and
    # every run's TrainConfig composed and validated before the first one trains.
    try:
        settings = spec.load_settings(OmegaConf.to_container(raw, resolve=True))
        planned = runner.plan_all(settings)
        runner.ensure_devices(runner.devices_for(planned))  # before JAX starts: it fixes the count
        paths = runner.run_all(settings, planned)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    for path in paths:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
