"""Time per mode of the goodput simulator at 2.4M chips over 30 days (docs/experiments.md#benchmarks).

    python benchmarks/goodput.py                 # 15 rounds
    python benchmarks/goodput.py --rounds 5 --chips 1200000

Each round starts cold (the shared failure draws cleared), times the draws once (what every mode
at the size shares: the candidate failures, the outages, their time order, the dp failure times),
then every mode given those draws, in a fresh random order, then study.timing cold (every mode
from nothing, what docs/experiments.md#goodput-at-millions-of-chips quotes). Figures are the
median over rounds, with the 25th and 75th percentiles and n. One thread. Writes
benchmarks/results/goodput.json.

Target (issue 20 item 5): every mode together, cold, < 0.5 s.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

from diloco.chaos import goodput, study  # noqa: E402

DAY = 86_400.0
TARGET_S = 0.5
LEARNERS = (2, 4, 8, 16)


def cold() -> None:
    for cached in (goodput._candidates, goodput.outages, goodput._by_time, goodput.dp_failures):
        cached.cache_clear()


def stats(xs: list[float]) -> dict:
    q25, q50, q75 = np.percentile(xs, [25, 50, 75])
    return {"median_s": round(float(q50), 4), "p25_s": round(float(q25), 4), "p75_s": round(float(q75), 4),
            "min_s": round(min(xs), 4), "max_s": round(max(xs), 4), "n": len(xs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chips", type=int, default=2_400_000)
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0, help="of the mode order")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/goodput.json)")
    args = parser.parse_args()

    c, h = goodput.Constants(), args.days * DAY
    modes = [("dp", 1), ("elastic_dp", 1)] + [("diloco", m) for m in LEARNERS]
    n_slices = round(args.chips / c.chips_per_slice)
    samples: dict[str, list[float]] = {k: [] for k in ["draws", *(f"{m}/{k}" for m, k in modes), "all modes, cold"]}
    rng = random.Random(args.seed)
    load0 = os.getloadavg()[0]
    for _ in range(args.rounds):
        cold()
        t = time.perf_counter()
        goodput._by_time(c.failures(), n_slices, h, 0)
        goodput.dp_failures(n_slices * c.chips_per_slice, c.mtbi_s, n_slices, h, 0)
        samples["draws"].append(time.perf_counter() - t)
        for mode, m in rng.sample(modes, len(modes)):
            t = time.perf_counter()
            goodput.simulate(mode, args.chips, c, h, 0, m)
            samples[f"{mode}/{m}"].append(time.perf_counter() - t)
        cold()
        samples["all modes, cold"].append(study.timing(c, LEARNERS, args.chips, h))
    load1 = os.getloadavg()[0]

    rows = {k: stats(v) for k, v in samples.items()}
    print(f"goodput simulator, {args.chips:,} chips, {args.days:g} days, one seed: seconds, median [p25, p75] "
          f"of n = {args.rounds} rounds; load average {load0:.1f} -> {load1:.1f} on {os.cpu_count()} CPUs")
    for k, r in rows.items():
        print(f"{k:<16} {r['median_s']:.3f} [{r['p25_s']:.3f}, {r['p75_s']:.3f}]")
    met = rows["all modes, cold"]["median_s"] < TARGET_S
    print(f"target every mode, cold, < {TARGET_S} s: {'met' if met else 'NOT met'}")
    path = write("goodput", {"config": vars(args), "load_avg_1m": [load0, load1],
                             "target": {"seconds": TARGET_S, "met": met}, "results": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
