"""Encode and decode throughput (MB/s of float32) and compression ratio of every wire codec.

    python benchmarks/codecs.py                          # 16M floats (64 MiB), 5 repeats
    python benchmarks/codecs.py --size 4000000 --repeats 3

One process, one thread: numpy's ufuncs are single-threaded anyway, and the BLAS/OpenMP pools are
pinned to 1 before numpy loads so that a codec's number means one core. Input is random normal
float32; each figure is the median over repeats. Writes benchmarks/results/codecs.json. The
project's target (issue) is >= 500 MB/s encode for int8 and int4 without zstd on one core.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import zstandard  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

from diloco.algo.codecs import CODECS, make_codec  # noqa: E402

TARGET_MBPS = 500.0
TARGET_CODECS = ("int8", "int4")


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def bench(name: str, zstd_level: int, x: np.ndarray, repeats: int, block: int, fraction: float) -> dict:
    codec = make_codec(name, zstd_level=zstd_level, block=block, topk_fraction=fraction)
    state = codec.init(x.shape)
    payload, _ = codec.encode(x, state)  # warm-up, and the payload the decode timings use
    y = codec.decode(payload, x.shape)
    mb = x.nbytes / 1e6
    enc = timed(lambda: codec.encode(x, state), repeats)
    dec = timed(lambda: codec.decode(payload, x.shape), repeats)
    return {
        "codec": name,
        "name": codec.name,
        "zstd_level": zstd_level,
        "encode_mb_s": round(mb / statistics.median(enc), 1),
        "decode_mb_s": round(mb / statistics.median(dec), 1),
        "encode_s_all": [round(t, 5) for t in enc],
        "decode_s_all": [round(t, 5) for t in dec],
        "payload_bytes": len(payload),
        "ratio": round(x.nbytes / max(len(payload), 1), 3),
        "bits_per_value": round(8 * len(payload) / x.size, 3),
        "rel_l2_error": float(np.linalg.norm(y - x) / np.linalg.norm(x)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=16 * 2**20, help="float32 values (default 16M = 64 MiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--zstd-level", type=int, default=1, help="level of the +zstd rows")
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--topk-fraction", type=float, default=0.01)
    parser.add_argument("--codecs", nargs="*", default=list(CODECS))
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/codecs.json)")
    args = parser.parse_args()

    x = np.random.default_rng(0).standard_normal(args.size, dtype=np.float32)
    rows = [bench(name, level, x, args.repeats, args.block, args.topk_fraction)
            for name in args.codecs for level in (0, args.zstd_level)]

    print(f"{args.size} float32 ({x.nbytes / 2**20:.0f} MiB), median of {args.repeats}, one thread")
    print(f"{'codec':<6} {'zstd':>4} {'enc MB/s':>9} {'dec MB/s':>9} {'ratio':>7} {'bits/val':>8} {'rel L2':>8}")
    for r in rows:
        print(f"{r['codec']:<6} {r['zstd_level'] or '-':>4} {r['encode_mb_s']:>9.0f} {r['decode_mb_s']:>9.0f} "
              f"{r['ratio']:>7.2f} {r['bits_per_value']:>8.3f} {r['rel_l2_error']:>8.4f}")
    checked = [r for r in rows if r["codec"] in TARGET_CODECS and r["zstd_level"] == 0]
    met = bool(checked) and all(r["encode_mb_s"] >= TARGET_MBPS for r in checked)
    print(f"target >= {TARGET_MBPS:.0f} MB/s encode for {', '.join(TARGET_CODECS)} without zstd: "
          f"{'met' if met else 'NOT met'}")

    path = write("codecs", {
        "config": vars(args),
        "numpy": np.__version__,
        "zstandard": zstandard.__version__,
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "target": {"encode_mb_s": TARGET_MBPS, "codecs": list(TARGET_CODECS), "met": met},
        "results": rows,
    }, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
