"""Convert a checkpoint (GGUF, HF folder, run directory) into a Hugging Face folder.

    python scripts/convert.py checkpoint=smollm2 out=exports/smollm2
    python scripts/convert.py checkpoint=runs/x out=exports/x dtype=float32
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from diloco import hf
from diloco.cli import fail


@hydra.main(config_path="../configs", config_name="convert", version_base="1.3")
def main(raw: DictConfig) -> None:
    cfg = OmegaConf.to_container(raw, resolve=True)
    try:
        if not cfg["out"]:
            raise ValueError("give the folder to write: out=<path>")
        pre = hf.load(hf.resolve(cfg["checkpoint"]))
        out = hf.save(Path(cfg["out"]), pre.config, pre.model.params, pre.tokenizer, dtype=cfg["dtype"],
                      max_shard_bytes=int(cfg["max_shard_bytes"]))
    except ValueError as err:  # ConfigError, CheckpointError: a user's mistake, no traceback
        fail(err)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {out}: {pre.config.family or 'llama'} model, {pre.vocab_size} tokens vocabulary, "
          f"{size / 1e6:.1f} MB ({cfg['dtype']})")


if __name__ == "__main__":
    main()
