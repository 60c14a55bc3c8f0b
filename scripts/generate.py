"""Generate from a checkpoint as configs/generate.yaml (plus command-line overrides) says.

    python scripts/generate.py chat='["What is the capital of France?"]'
    python scripts/generate.py checkpoint=runs/x prompt='["ROMEO:"]' temperature=0.8 top_k=40
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from diloco.cli import fail, quiet_logs
from diloco.config import ConfigError
from diloco.generation import parse, run
from diloco.hf import CheckpointError


@hydra.main(config_path="../configs", config_name="generate", version_base="1.3")
def main(raw: DictConfig) -> None:
    quiet_logs()
    try:
        run(parse(OmegaConf.to_container(raw, resolve=True)))
    except (ConfigError, CheckpointError, ValueError) as err:  # a user's mistake: message, no traceback
        fail(err)


if __name__ == "__main__":
    main()
