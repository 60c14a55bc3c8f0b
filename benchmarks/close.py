"""The close of one round (diloco/algo/close.py) in pieces on the host pool against one XLA call
over the whole fragment, side by side in one process.

    python benchmarks/close.py                       # 38.8M values (a 1b fragment at P = 24)
    taskset -c 0 python benchmarks/close.py          # the same on one core
    python benchmarks/close.py --values 4.64e6 --per tensor --repeats 9

The fragment is three tensors (a quarter, a quarter and a half of --values), outer Nesterov, the
merge `--per` (none: averaging; tensor or fragment: RDA's unit directions). Rounds alternate
A B B A after one untimed round of each (it compiles); each figure is a median with min and max,
and the process's CPU and system time per round (system time is mostly page faults on fresh
output arrays). "one call" is the same pass the pieces run, given the whole fragment, as for an
optimizer that is not element-wise. Writes benchmarks/results/close.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time
from pathlib import Path

import jax
import numpy as np

from diloco.algo import close, hostpool, outer


def _fragment(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    sizes = {("a",): n // 4, ("b",): n // 4, ("c",): n - 2 * (n // 4)}

    def draw(k: int) -> np.ndarray:
        x = hostpool.aligned_empty(k)  # as the syncer's sums and Theta are: jax reads them in place
        x[:] = rng.standard_normal(k, np.float32)
        return x

    theta = {p: draw(k) for p, k in sizes.items()}
    return theta, {p: draw(k) for p, k in sizes.items()}, {p: x + np.float32(0.01) for p, x in theta.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", type=float, default=3.88e7)
    ap.add_argument("--per", choices=("none", "tensor", "fragment"), default="none")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--out", default="benchmarks/results/close.json")
    a = ap.parse_args()
    n, per = int(a.values), None if a.per == "none" else a.per
    theta, sums, prev = _fragment(n)
    opt = outer.make_outer("nesterov", lr=0.7, momentum=0.9)
    state = jax.tree.map(np.asarray, opt.init(theta))
    gains = {p: np.float32(0.5) for p in theta}
    split = outer.elementwise

    def run(pieces: bool) -> None:
        outer.elementwise = split if pieces else (lambda o: False)
        try:
            close.close(opt, per, sums, gains, theta, state, prev)
        finally:
            outer.elementwise = split

    modes = {"one call": False, "pieces": True}
    times = {m: [] for m in modes}
    cpu = {m: [0.0, 0.0] for m in modes}
    for m in modes:
        run(modes[m])
    for r in range(a.repeats):
        for m in (list(modes) if r % 4 in (0, 3) else list(modes)[::-1]):
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            run(modes[m])
            times[m].append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu[m][0] += r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
            cpu[m][1] += r1.ru_stime - r0.ru_stime
    ratios = sorted(x / y for x, y in zip(times["one call"], times["pieces"]))
    result = {
        "values": n, "per": a.per, "repeats": a.repeats, "cores": len(os.sched_getaffinity(0)),
        "threads": hostpool.threads(), "machine": platform.machine(), "load": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d"),
        **{m: {"median_s": float(np.median(t)), "min_s": min(t), "max_s": max(t),
               "cpu_s": cpu[m][0] / a.repeats, "sys_s": cpu[m][1] / a.repeats} for m, t in times.items()},
        "one_call_over_pieces_paired": {"median": float(np.median(ratios)), "min": ratios[0], "max": ratios[-1]},
    }
    for m in modes:
        r = result[m]
        print(f"{m:9s} {r['median_s']:.3f} s [{r['min_s']:.3f}, {r['max_s']:.3f}]  cpu {r['cpu_s']:.3f} s"
              f"  sys {r['sys_s']:.3f} s")
    print(f"one call / pieces, paired: {result['one_call_over_pieces_paired']['median']:.2f}x"
          f" [{ratios[0]:.2f}, {ratios[-1]:.2f}]  ({result['threads']} threads, load {result['load']:.1f})")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
