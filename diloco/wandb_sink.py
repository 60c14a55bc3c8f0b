"""The run's scalars to Weights & Biases (run.wandb, the optional extra `wandb`): the tags and the
global-token x-axis TensorBoard gets (diloco/watch.py), files in <run>/wandb, offline unless the
user's WANDB_MODE says otherwise, so a run needs no account and no network
(docs/design.md#metrics-series; `wandb sync <run>/wandb/offline-run-*` uploads one later)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from diloco.config import to_dict

STEP = "tokens"  # every series is plotted against the run's total tokens, as in TensorBoard


class WandbScalars:
    """A W&B run fed scalars as TensorBoard's SummaryWriter is (add_scalar, close). The scalars of
    one record share one x value and go out as one log call. A resumed run continues the W&B run of
    the stopped one (its id is kept in <run>/wandb/run_id)."""

    def __init__(self, cfg, run_dir: Path):
        import wandb  # the optional extra; config.start_errors refused run.wandb=true without it

        folder = Path(run_dir) / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id)
        self.run = wandb.init(project=cfg.run.wandb_project, dir=str(run_dir), id=run_id, name=Path(run_dir).name,
                              resume="allow", mode=os.environ.get("WANDB_MODE", "offline"), config=to_dict(cfg),
                              reinit="create_new",
                              # requirements: a pip freeze at start (half a minute on a loaded
                              # machine); requirements.lock pins the environment already
                              settings=wandb.Settings(silent=True, console="off", x_save_requirements=False))
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)
        self.pending: dict[str, float] = {}
        self.at: int | None = None

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self.pending and (step != self.at or tag in self.pending):
            self.flush()
        self.pending[tag], self.at = float(value), int(step)

    def flush(self) -> None:
        if self.pending:
            self.run.log({**self.pending, STEP: self.at})
            self.pending = {}

    def close(self) -> None:
        self.flush()
        self.run.finish()
