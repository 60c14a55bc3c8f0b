"""Chaos drill: a failure-free procs run, then the same run while learners are SIGKILLed about every
--every seconds and the syncer once (diloco/experiments/drill.py); writes results/chaos_drill.{json,md}.

    python scripts/chaos_drill.py model=tiny runtime=procs runtime.learners=3 runtime.devices_per_learner=1 \
        run.steps=300 run.eval_every=10 run.checkpoint_every=4 runtime.learner_checkpoint_every=20 \
        run.progress=false run.plot=false --every 20 --syncer-at 0.5 --seed 0 --noise
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", type=float, default=20.0, help="mean seconds between learner kills")
    p.add_argument("--schedule", choices=("poisson", "fixed"), default="poisson")
    p.add_argument("--syncer-at", type=float, default=0.5, help="kill the syncer once at this fraction of "
                   "the failure-free run's merges (after a syncer checkpoint exists)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise", action="store_true", help="a second failure-free run, compared with the first "
                   "the same way: how far two runs differ without any failure")
    p.add_argument("--out", default="runs/chaos_drill", help="run directories: <out>/free, <out>/chaos")
    p.add_argument("--results", default="results/chaos_drill", help="writes <results>.json and .md")
    args, overrides = p.parse_known_args()
    # Before jax is imported: the devices every learner sub-mesh needs, and one compilation cache
    # for both runs and every restarted child (spawned children inherit the environment).
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(args.out).absolute() / "xla_cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    logging.getLogger("absl").setLevel(logging.WARNING)

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from diloco import report
    from diloco.config import ConfigError, load
    from diloco.experiments import drill

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        raw = compose(config_name="train", overrides=[*overrides, f"run.out_dir={args.out}"])
    try:  # the one place a DictConfig is seen, as in scripts/train.py
        cfg = load(OmegaConf.to_container(raw, resolve=True))
    except ConfigError as err:
        sys.exit(f"error: {err}")
    result = drill.run_drill(cfg, Path(args.out), args.every, args.syncer_at, args.seed, args.schedule,
                             args.noise)
    command = shlex.join(["python", "scripts/chaos_drill.py", *sys.argv[1:]])
    result["command"] = command
    out = Path(args.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str))
    out.with_suffix(".md").write_text(drill.markdown(result, command))
    print(report.format_table(drill.rows(result), title="chaos drill"))


if __name__ == "__main__":
    main()
