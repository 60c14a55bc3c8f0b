"""Encode and decode throughput of the wire codecs against memcpy of the same bytes, side by side.

    python benchmarks/codecs.py                             # int8, int4, int4 + zstd 1; 128 KB to 64 MB
    python benchmarks/codecs.py --codecs all --rounds 11    # every codec, with and without zstd
    python benchmarks/codecs.py --sizes 4194304 --rounds 5  # one size (float32 values)

One process, one thread: the codecs run on one core (numba kernels and zstd, single-threaded), and
the BLAS/OpenMP pools are pinned to 1 before numpy loads. Throughput is GB/s of float32 input
(1 GB = 1e9 bytes) for encode and decode alike. Every round times each case once, cases in a
fresh random order each round, so that a noisy neighbour (the development machine is shared)
lands on every case alike; a sample of a small size repeats the call until it covers about 4 MB.
Each figure is the median over rounds, with the 25th and 75th percentiles and n. memcpy is
np.copyto into a buffer allocated once; "memcpy, new buffer" is x.copy(), which pays for fresh
pages as a decode, which must return a new array, does. Input is random normal float32.
Writes benchmarks/results/codecs.json.

Targets (issue 20 item 3): int8 and int4 encode >= 3 GB/s and int4 + zstd >= 2 GB/s at every size,
decode faster than encode.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import zstandard  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

from diloco.algo.codecs import CODECS, make_codec  # noqa: E402

SIZES = tuple(n // 4 for n in (128 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20))  # float32 values
TARGETS = {("int8", 0): 3.0, ("int4", 0): 3.0, ("int4", 1): 2.0}  # encode GB/s of float32 input
SAMPLE_BYTES = 4 << 20


def stats(gbps: list[float]) -> dict:
    q25, q50, q75 = np.percentile(gbps, [25, 50, 75])
    return {"median": round(float(q50), 3), "p25": round(float(q25), 3), "p75": round(float(q75), 3),
            "min": round(min(gbps), 3), "max": round(max(gbps), 3), "n": len(gbps)}


def cases(x: np.ndarray, specs: list[tuple[str, int]]) -> dict:
    """name -> (what, zero-argument call) for every timed case at this input."""
    dst = np.empty_like(x)
    out = {("memcpy", 0, "copy"): lambda: np.copyto(dst, x),
           ("memcpy, new buffer", 0, "copy"): lambda: x.copy()}
    for name, level in specs:
        codec = make_codec(name, zstd_level=level)
        payload, _ = codec.encode(x, codec.init(x.shape))  # compiles or loads the kernels, once
        out[(name, level, "encode")] = lambda c=codec: c.encode(x, c.init(x.shape))
        out[(name, level, "decode")] = lambda c=codec, p=payload: c.decode(p, x.shape)
    return out


def run_size(n: int, specs: list[tuple[str, int]], rounds: int, rng: random.Random) -> list[dict]:
    x = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    todo = cases(x, specs)
    reps = max(1, SAMPLE_BYTES // x.nbytes)
    samples: dict = {k: [] for k in todo}
    for _ in range(rounds):
        keys = list(todo)
        rng.shuffle(keys)
        for k in keys:
            t = time.perf_counter()
            for _ in range(reps):
                todo[k]()
            samples[k].append(x.nbytes * reps / (time.perf_counter() - t) / 1e9)
    rows = []
    for (name, level, what), gbps in samples.items():
        row = {"size_bytes": x.nbytes, "values": n, "codec": name, "zstd_level": level, "op": what,
               "reps_per_sample": reps, "gb_s": stats(gbps)}
        if what == "encode":
            codec = make_codec(name, zstd_level=level)
            payload, _ = codec.encode(x, codec.init(x.shape))
            y = codec.decode(payload, x.shape)
            row.update(payload_bytes=len(payload), ratio=round(x.nbytes / max(len(payload), 1), 3),
                       rel_l2_error=float(np.linalg.norm(y - x) / np.linalg.norm(x)))
        rows.append(row)
    return rows


def verdicts(rows: list[dict]) -> list[dict]:
    """Each target at each size: encode median against its floor, decode median against encode's."""
    out = []
    med = {(r["size_bytes"], r["codec"], r["zstd_level"], r["op"]): r["gb_s"]["median"] for r in rows}
    for (size, name, level, op), v in med.items():
        if op != "encode" or (name, level) not in TARGETS:
            continue
        floor = TARGETS[(name, level)]
        dec = med[(size, name, level, "decode")]
        out.append({"size_bytes": size, "codec": name, "zstd_level": level, "encode_gb_s": v,
                    "encode_target": floor, "encode_met": v >= floor, "decode_gb_s": dec,
                    "decode_faster": dec > v})
    return out


def fmt_size(b: int) -> str:
    return f"{b >> 20} MB" if b >= 1 << 20 else f"{b >> 10} KB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=list(SIZES), help="float32 values")
    parser.add_argument("--rounds", type=int, default=21, help="samples per case (alternated)")
    parser.add_argument("--codecs", nargs="*", default=["int8", "int4"],
                        help="codec names, or 'all'; each runs without zstd, int4 also with --zstd-level")
    parser.add_argument("--zstd-level", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="of the case order")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/codecs.json)")
    args = parser.parse_args()

    names = sorted(CODECS) if args.codecs == ["all"] else args.codecs
    specs = [(n, 0) for n in names] + [(n, args.zstd_level) for n in names
                                       if args.codecs == ["all"] or n == "int4"]
    load0 = os.getloadavg()[0]
    rng = random.Random(args.seed)
    rows = [r for n in args.sizes for r in run_size(n, specs, args.rounds, rng)]
    load1 = os.getloadavg()[0]

    print(f"GB/s of float32 input, one thread: median [p25, p75] of n = {args.rounds} alternated samples; "
          f"load average {load0:.1f} -> {load1:.1f} on {os.cpu_count()} CPUs")
    for r in rows:
        g = r["gb_s"]
        label = r["codec"] + (f" + zstd {r['zstd_level']}" if r["zstd_level"] else "")
        print(f"{fmt_size(r['size_bytes']):>6} {label:<20} {r['op']:<7} {g['median']:7.2f} "
              f"[{g['p25']:.2f}, {g['p75']:.2f}]")
    checks = verdicts(rows)
    for c in checks:
        label = c["codec"] + (f" + zstd {c['zstd_level']}" if c["zstd_level"] else "")
        print(f"target {fmt_size(c['size_bytes']):>6} {label:<14} encode {c['encode_gb_s']:.2f} >= "
              f"{c['encode_target']}: {'met' if c['encode_met'] else 'NOT met'}; decode {c['decode_gb_s']:.2f} "
              f"{'>' if c['decode_faster'] else 'NOT >'} encode")
    path = write("codecs", {
        "config": vars(args),
        "numpy": np.__version__,
        "zstandard": zstandard.__version__,
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_avg_1m": [load0, load1],
        "targets": checks,
        "results": rows,
    }, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
