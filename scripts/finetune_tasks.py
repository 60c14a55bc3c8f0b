"""Fine-tune a pretrained checkpoint on BIG-bench tasks by DP, DP + LoRA, Decoupled DiLoCo and
DiLoCo + LoRA, and score each on the tasks' test splits (configs/finetune_tasks.yaml,
docs/finetuning.md#real-tasks).

    python scripts/finetune_tasks.py                     # = make finetune-tasks: every task, variant, seed
    python scripts/finetune_tasks.py only_tasks=[2_digit_addition] only=[dp_lora] seeds=[0]
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from diloco.cli import fail, quiet_logs
from diloco.config import ConfigError
from diloco.hf import CheckpointError


@hydra.main(config_path="../configs", config_name="finetune_tasks", version_base="1.3")
def main(raw: DictConfig) -> None:
    quiet_logs()
    from diloco.experiments import finetune_tasks

    try:
        paths = finetune_tasks.run(finetune_tasks.parse(OmegaConf.to_container(raw, resolve=True)))
    except (ConfigError, CheckpointError) as err:  # a user's mistake (TaskError is one): message, no traceback
        fail(err)
    for path in paths:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
