"""Write the bandwidth report (docs/experiments.md#bandwidth) as configs/bandwidth.yaml says.

    python scripts/bandwidth.py
    python scripts/bandwidth.py run_dir=runs/tau0 scenario.datacenters=4
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from diloco.bandwidth import report


@hydra.main(config_path="../configs", config_name="bandwidth", version_base="1.3")
def main(raw: DictConfig) -> None:
    # The one place a DictConfig is seen: converted once to frozen, validated dataclasses.
    try:
        cfg = report.load_config(OmegaConf.to_container(raw, resolve=True))
        results = report.build(cfg)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    for path in report.write(results, cfg.out_dir):
        print(f"wrote {path}")
    print(f"Table 4: worst cell {results['table4_worst_ratio']:.2f}x off the paper")
    if "measured" in results:
        m = results["measured"]
        print(f"{m['run_dir']}: measured / analytic up {m['up_ratio']:.3f}, down {m['down_ratio']:.3f}; "
              f"data parallel / measured {m['dp_over_total']:.1f}x")


if __name__ == "__main__":
    main()
