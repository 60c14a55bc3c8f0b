"""Goodput of data parallel, elastic data parallel and Decoupled DiLoCo at 150k to 2.4M chips.

    python scripts/goodput.py               # fit, predict, write results/goodput.{md,csv,json,png}
    python scripts/goodput.py quick=true    # a few simulated days: seconds, for a smoke test
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from diloco.chaos import results, study
from diloco.config import ConfigError


@hydra.main(config_path="../configs", config_name="goodput", version_base="1.3")
def main(raw: DictConfig) -> None:
    # The one place a DictConfig is seen: converted once to a frozen, validated dataclass.
    try:
        cfg = study.load(OmegaConf.to_container(raw, resolve=True))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    result = study.run(cfg)
    for path in results.write(result, cfg.out_dir):
        print(f"wrote {path}")
    print(results.markdown(result))


if __name__ == "__main__":
    main()
