"""The frame checksum: one blake2b stream over the payload (DLC1 frames) against the tree checksum
of DLC2 frames (diloco/algo/checksum.py) on one thread and on every core.

    python benchmarks/checksum.py                        # 1, 4 and 20 MB payloads, 41 rounds
    python benchmarks/checksum.py --sizes 20e6 --rounds 101

One process. Each round times every case once, in a fresh random order (the development machine is
shared, so a busy neighbour lands on every case alike); a sample of a small payload repeats the call
until it covers about 8 MB. "tree, 1 thread" sets DILOCO_HOST_THREADS=1, "tree, all cores" leaves it
unset (hostpool.threads(): the cores this process may run on). Each figure is the median time per
call with its 25th/75th percentiles, min, max and n; the ratios are paired per round (the same
round's samples), median [min, max]. "cpu/wall" is the process's CPU time over the wall time of a
sample: how many threads were at work on average, which other jobs on the machine do not change
the way they change the times. Writes benchmarks/results/checksum.json.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

from diloco.algo import checksum, hostpool  # noqa: E402

SAMPLE_BYTES = 8 << 20


def stream(payload: bytes) -> str:
    """The DLC1 frames' checksum."""
    return hashlib.blake2b(payload, digest_size=8).hexdigest()


def tree(threads: int | None):
    def call(payload: bytes) -> str:
        if threads is None:
            os.environ.pop(hostpool.ENV, None)
        else:
            os.environ[hostpool.ENV] = str(threads)
        return checksum.checksum(payload)
    return call


CASES = {"stream (DLC1)": stream, "tree, 1 thread": tree(1), "tree, all cores": tree(None)}
RATIOS = (("stream (DLC1)", "tree, all cores"), ("tree, 1 thread", "tree, all cores"),
          ("stream (DLC1)", "tree, 1 thread"))


def spread(xs: list[float]) -> dict:
    q25, q50, q75 = np.percentile(xs, [25, 50, 75])
    return {"median": float(q50), "p25": float(q25), "p75": float(q75), "min": min(xs), "max": max(xs),
            "n": len(xs)}


def run_size(n: int, rounds: int, rng: random.Random) -> dict:
    payload = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    reps = max(1, SAMPLE_BYTES // n)
    saved = os.environ.get(hostpool.ENV)
    for call in CASES.values():  # warm the pool and the caches once
        call(payload)
    samples: dict[str, list[float]] = {k: [] for k in CASES}
    busy: dict[str, list[float]] = {k: [] for k in CASES}  # process CPU time / wall: threads at work
    for _ in range(rounds):
        keys = list(CASES)
        rng.shuffle(keys)
        for k in keys:
            t, c = time.perf_counter(), time.process_time()
            for _ in range(reps):
                CASES[k](payload)
            wall = time.perf_counter() - t
            samples[k].append(wall / reps)
            busy[k].append((time.process_time() - c) / wall)
    if saved is None:
        os.environ.pop(hostpool.ENV, None)
    else:
        os.environ[hostpool.ENV] = saved
    row = {"bytes": n, "pieces": -(-n // checksum.PIECE), "reps_per_sample": reps,
           "seconds": {k: spread(v) for k, v in samples.items()},
           "cpu_over_wall": {k: spread(v) for k, v in busy.items()},
           "paired": {f"{a} / {b}": spread([x / y for x, y in zip(samples[a], samples[b])]) for a, b in RATIOS}}
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"{n / 1e6:6.1f} MB: " + ", ".join(f"{k} {1e3 * v:.2f} ms (cpu/wall {statistics.median(busy[k]):.2f})"
                                            for k, v in med.items()), flush=True)
    for name, r in row["paired"].items():
        print(f"          {name}: {r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["1e6", "4e6", "20e6"], help="payload bytes")
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rng = random.Random(args.seed)
    load = [os.getloadavg()[0]]
    rows = [run_size(int(float(s)), args.rounds, rng) for s in args.sizes]
    load.append(os.getloadavg()[0])
    path = write("checksum", {"piece_bytes": checksum.PIECE, "threads_all": hostpool.threads(),
                              "affinity": sorted(os.sched_getaffinity(0)), "load_1min_start_end": load,
                              "rows": rows}, args.out)
    print(f"threads (all cores): {hostpool.threads()}, load {load[0]:.2f} -> {load[1]:.2f}; wrote {path}")


if __name__ == "__main__":
    main()
