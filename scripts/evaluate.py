"""Evaluate a model's loss (nats/token, bits/byte), or its scores on downstream tasks, as
configs/evaluate.yaml (plus overrides) says.

    python scripts/evaluate.py checkpoint=runs/x
    python scripts/evaluate.py checkpoint=runs/x paths='[notes/*.txt]'
    python scripts/evaluate.py checkpoint=runs/x tasks='[task.yaml,task.json]' output=scores.json
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from diloco.cli import fail, quiet_logs
from diloco.config import ConfigError
from diloco.data.errors import DataError
from diloco.evaluation import parse, run
from diloco.hf import CheckpointError


@hydra.main(config_path="../configs", config_name="evaluate", version_base="1.3")
def main(raw: DictConfig) -> None:
    quiet_logs()
    try:
        run(parse(OmegaConf.to_container(raw, resolve=True)))
    except (ConfigError, CheckpointError, DataError) as err:  # a user's mistake: message, no traceback
        fail(err)


if __name__ == "__main__":
    main()
