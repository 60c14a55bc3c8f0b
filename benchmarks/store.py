"""Object-store latency and throughput: put and get of fragment-sized objects on file:// against
s3:// on a local S3-compatible server (localbucket) and gs:// on a local GCS server
(gcp-storage-emulator), each a separate process on 127.0.0.1.

    python benchmarks/store.py --sizes 65536,1048576,16777216 --reps 20

Each repetition puts one object of each size under a new key (as contributions are written) and
reads it back, on each store in turn (which goes first rotates), so drift on a shared machine
hits all alike. file:// is the
procs default as the runtime opens it (sync=False: atomic, no fsync). Reports per store and size
the median and p90 latency and MB/s (size / median). Writes benchmarks/results/store.json.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

from diloco import store as bs  # noqa: E402


def start_server(kind: str, root: Path) -> tuple[subprocess.Popen, str]:
    """localbucket (kind s3) serving `root`, or gcp-storage-emulator (gs) with bucket "bench" in
    memory, on a free loopback port; returns the process and its endpoint."""
    (root / "bench").mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = (["-m", "localbucket", str(root), "--host", "127.0.0.1", "--port", str(port)] if kind == "s3" else
            ["-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory",
             "--default-bucket", "bench"])
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"the {kind} server did not start")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="65536,1048576,16777216", help="object sizes in bytes")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")  # localbucket checks no signature
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    with tempfile.TemporaryDirectory(prefix="diloco-store-bench-") as tmp:
        procs = {}
        try:
            for kind in ("s3", "gs"):
                procs[kind] = start_server(kind, Path(tmp) / kind)
            # tensorstore's gcs driver takes another server from this variable (docs/design.md#over-gcs)
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = procs["gs"][1]
            stores = {"file": bs.BlobStore(f"file://{tmp}/file", sync=False),
                      "s3": bs.BlobStore(f"s3://bench/run?endpoint={procs['s3'][1]}"),
                      "gs": bs.BlobStore("gs://bench/run")}
            blobs = {n: os.urandom(n) for n in sizes}
            times = {(name, n, op): [] for name in stores for n in sizes for op in ("put", "get")}
            for rep in range(args.reps + 1):  # rep 0 warms connections and caches, not counted
                for n in sizes:
                    order = list(stores.items())
                    for name, store in order[rep % len(order):] + order[:rep % len(order)]:  # who goes first rotates
                        key = f"up/{n:09d}/{rep:06d}"
                        t0 = time.perf_counter()
                        store.put(key, blobs[n])
                        t1 = time.perf_counter()
                        got = store.get(key)
                        t2 = time.perf_counter()
                        assert got == blobs[n]
                        if rep:
                            times[(name, n, "put")].append(t1 - t0)
                            times[(name, n, "get")].append(t2 - t1)
        finally:
            for proc, _ in procs.values():
                proc.kill()
                proc.wait()
    rows = []
    for (name, n, op), xs in times.items():
        med = statistics.median(xs)
        rows.append({"store": name, "bytes": n, "op": op, "median_ms": med * 1e3,
                     "p90_ms": percentile(xs, 0.9) * 1e3, "mb_per_s": n / med / 1e6, "reps": len(xs)})
    print(f"{'store':5} {'bytes':>9} {'op':3} {'median ms':>10} {'p90 ms':>8} {'MB/s':>8}")
    for r in sorted(rows, key=lambda r: (r["bytes"], r["op"], r["store"])):
        print(f"{r['store']:5} {r['bytes']:9d} {r['op']:3} {r['median_ms']:10.2f} {r['p90_ms']:8.2f} "
              f"{r['mb_per_s']:8.1f}")
    path = write("store", {"argv": sys.argv[1:], "servers": "localbucket 1.2.1 (s3), gcp-storage-emulator 2026.7.19 "
                           "in memory (gs), each another process on 127.0.0.1",
                           "file_sync": False, "results": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
