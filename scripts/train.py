"""Train a model as configs/train.yaml (plus command-line overrides) says.

    python scripts/train.py model=tiny run.steps=200
    python scripts/train.py run.out_dir=runs/x run.resume=true
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from diloco.config import ConfigError, load
from diloco.run import run


@hydra.main(config_path="../configs", config_name="train", version_base="1.3")
def main(raw: DictConfig) -> None:
    # Orbax logs every checkpoint step at INFO through absl; keep the console for the run itself.
    logging.getLogger("absl").setLevel(logging.WARNING)
    # The one place a DictConfig is seen: converted once to frozen, validated dataclasses.
    try:
        cfg = load(OmegaConf.to_container(raw, resolve=True))
        run(cfg)  # also a ConfigError: a used run.out_dir, a resume whose config differs
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
