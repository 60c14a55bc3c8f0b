"""Evaluate a model's loss (nats/token, bits/byte) as configs/evaluate.yaml (plus overrides) says.

    python scripts/evaluate.py checkpoint=runs/x
    python scripts/evaluate.py checkpoint=runs/x paths='[notes/*.txt]'
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from diloco.config import ConfigError
from diloco.data.errors import DataError
from diloco.evaluation import parse, run
from diloco.hf import CheckpointError


@hydra.main(config_path="../configs", config_name="evaluate", version_base="1.3")
def main(raw: DictConfig) -> None:
    # JAX reports at INFO that it found no TPU, which reads as an error on a laptop.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    try:
        run(parse(OmegaConf.to_container(raw, resolve=True)))
    except (ConfigError, CheckpointError, DataError) as err:  # a user's mistake: message, no traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
