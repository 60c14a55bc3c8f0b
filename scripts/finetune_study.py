"""Fine-tune a pretrained checkpoint on the record task three ways and score each by its answers
(configs/finetune_study.yaml, docs/finetuning.md).

    python scripts/finetune_study.py                                   # = make finetune, about an hour
    python scripts/finetune_study.py 'overrides=["run.steps=8"]' out_dir=/tmp/ft
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from diloco.cli import fail, quiet_logs
from diloco.config import ConfigError
from diloco.hf import CheckpointError


@hydra.main(config_path="../configs", config_name="finetune_study", version_base="1.3")
def main(raw: DictConfig) -> None:
    quiet_logs()
    from diloco.experiments import finetune_study

    try:
        paths = finetune_study.run(finetune_study.parse(OmegaConf.to_container(raw, resolve=True)))
    except (ConfigError, CheckpointError) as err:  # a user's mistake: message, no traceback
        fail(err)
    for path in paths:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
