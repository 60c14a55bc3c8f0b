"""Whole-run wall time of `make train` (Decoupled DiLoCo, sim runtime, 4 learners of batch 8)
against the data-parallel baseline at the same tokens (`algo=dp data.batch_size=32`).

    python benchmarks/train_vs_dp.py --steps 300 --rounds 3
    python benchmarks/train_vs_dp.py --before /tmp/old   # also `make train` of another checkout
    python benchmarks/train_vs_dp.py --steps 100 --rounds 1 --set model=base10m data=synthetic \
        data.synthetic_vocab=256 runtime.devices_per_learner=1   # one accelerator

Each round runs both, in alternating order, as separate `scripts/train.py` processes, so every
figure includes start-up, compiles, evals and checkpoints, as a user sees them. Goal: DiLoCo
within 1.3x of data parallel. `--before DIR` adds a third run per round, `make train` of the
checkout in DIR (e.g. `git worktree add /tmp/old <commit>`), with the same interpreter. `--set`
adds Hydra overrides to every run (the data-parallel one ignores the runtime group).
Writes benchmarks/results/train_vs_dp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"diloco": [], "dp": ["algo=dp", "data.batch_size=32"], "before": []}


def one(kind: str, steps: int, out: Path, before: Path | None, extra: list[str]) -> dict:
    root = before if kind == "before" else ROOT
    args = [sys.executable, str(root / "scripts" / "train.py"), *extra, *RUNS[kind], f"run.steps={steps}",
            f"run.out_dir={out}", "run.plot=false", "run.tensorboard=false", "run.progress=false"]
    env = {**os.environ, "CI": "1", "PYTHONPATH": str(root)}
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    t = time.perf_counter()
    subprocess.run(args, check=True, env=env, cwd=root, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    summary = json.loads((out / "summary.json").read_text())
    return {"process_s": wall, "run_wall_s": summary.get("wall_s"), "eval_loss": summary.get("eval_loss"),
            "tokens": summary.get("tokens")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", type=Path, default=None)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="Hydra overrides of every run")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    kinds = ["diloco", "dp"] + (["before"] if args.before else [])
    results = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                results[kind].append(one(kind, args.steps, Path(tmp) / f"{kind}-{r}", args.before, args.set))
                print(kind, r, f"{results[kind][-1]['process_s']:.1f} s", flush=True)
    ratios = [a["process_s"] / b["process_s"] for a, b in zip(results["diloco"], results["dp"])]
    med = {k: statistics.median(x["process_s"] for x in v) for k, v in results.items()}
    out = {"args": {**vars(args), "before": str(args.before) if args.before else None}, "runs": results, "median_process_s": med, "ratio_per_round": ratios,
           "ratio": med["diloco"] / med["dp"]}
    path = write("train_vs_dp", out, args.out)
    print(f"diloco {med['diloco']:.1f} s   dp {med['dp']:.1f} s   ratio {out['ratio']:.3f} "
          f"[{min(ratios):.3f}, {max(ratios):.3f}] n={len(ratios)}   (wrote {path})")
    if args.before:
        print(f"before {med['before']:.1f} s: ratio to dp {med['before'] / med['dp']:.3f}")


if __name__ == "__main__":
    main()
