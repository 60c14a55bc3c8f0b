"""What the outer statistics (docs/algorithm.md#outer-statistics-and-automatic-momentum) add to a
syncer round, at 38.8M values (benchmarks/round_parts.py's fragment_values: a 1b fragment at
P = 24), Nesterov, RDA per tensor, side by side in one process with the round of an older commit:

    git show 55285e3:diloco/algo/close.py > /tmp/close_before.py
    python benchmarks/outer_stats_cost.py --baseline /tmp/close_before.py --repeats 14

before: drift.agreement's norm pass over the round's sums, then the baseline's close (which takes
the sums' squares again for the unit merge); after: close.sum_squares once for both, then the close
with the fragment's last merged delta (its dot product, and the new delta written out). Rounds
alternate A B B A after two untimed rounds of each; figures are medians [min, max] and the paired
difference after - before per round pair. Writes benchmarks/results/outer_stats_cost.json (or --out).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402
from round_parts import fragment_values, spread  # noqa: E402

from diloco.algo import close as current  # noqa: E402
from diloco.algo import roundsum  # noqa: E402
from diloco.algo.outer import make_outer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="diloco/algo/close.py of the commit to compare with")
    p.add_argument("--values", default="3.88e7")
    p.add_argument("--repeats", type=int, default=14)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    spec = importlib.util.spec_from_file_location("close_before", args.baseline)
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    rng = np.random.default_rng(0)
    theta = fragment_values(int(float(args.values)), rng)
    paths = list(theta)
    sums = {q: rng.standard_normal(x.shape, np.float32) for q, x in theta.items()}
    gains = {q: np.float32(0.01) for q in theta}
    opt = make_outer("nesterov")
    state = opt.init(theta)
    held = {"last": {q: np.zeros(x.shape, np.float32) for q, x in theta.items()}}

    def round_of(variant: str) -> float:
        t = time.perf_counter()
        if variant == "after":
            squares = current.sum_squares([sums[q] for q in paths])
            done = current.close(opt, "tensor", sums, gains, theta, state, theta, held["last"],
                                 dict(zip(paths, squares)))
            held["last"] = done.delta  # kept until the next round, as the syncer keeps it
        else:
            _ = [roundsum.norm(sums[q]) for q in paths]
            done = before.close(opt, "tensor", sums, gains, theta, state, theta)
        held[variant] = done  # each variant's output alive until its next round, as Theta is
        return time.perf_counter() - t

    order = (["after", "before", "before", "after"] * args.repeats)[: 2 * args.repeats + 4]
    times: dict[str, list[float]] = {"after": [], "before": []}
    for i, variant in enumerate(order):
        seconds = round_of(variant)
        if i >= 4:
            times[variant].append(seconds)
    paired = [a - b for a, b in zip(times["after"], times["before"])]
    result = {"values": sum(x.size for x in theta.values()), "after_s": spread(times["after"]),
              "before_s": spread(times["before"]), "after_minus_before_s": spread(paired)}
    print(f"after {result['after_s']['median']:.4f} s, before {result['before_s']['median']:.4f} s, "
          f"paired after - before {statistics.median(paired):+.4f} s [{min(paired):+.4f}, {max(paired):+.4f}] "
          f"(n = {len(paired)})")
    print(f"wrote {write('outer_stats_cost', result, args.out)}")


if __name__ == "__main__":
    main()
