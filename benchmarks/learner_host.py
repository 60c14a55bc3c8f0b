"""A learner's host work for one contribution and one returned fragment at a 1B model's fragment
size (41M values), encoded and decoded on the host against on the devices, side by side.

    python benchmarks/learner_host.py                      # 41M values, int4 + zstd up, int8 down
    python benchmarks/learner_host.py --values 4.6e6 --repeats 9

The proxy for an accelerator on a machine without one (docs/experiments.md#learner-host-work):
it times the host thread's CPU (`time.thread_time`), which does not count the work XLA's own
threads do for a "device" here, and counts the bytes that cross between the devices and the host.
The host passes run on this thread alone (DILOCO_HOST_THREADS=1, `--host-threads` to change), so
its CPU time is all the host work.
Each send and receive is what `LearnerUnit` does (diloco/runtime/unit.py), over a fragment shaped
like a 1b layer's MLP, attention output and key projection:

* send, host: copy the fragment's params to the host (fp32), the pseudo-gradient, the numba int4
  encode, zstd, checksum and frame;
* send, device: dispatch the jitted encode (diloco/algo/device_codecs.py) at the step ("start",
  on the step's path), then collect the packed payload and do zstd, checksum and frame ("frame",
  off the path when deferred past the next step's dispatch);
* receive, host: validate the int8 delta frame, decode it and add it to the held version, put the
  fp32 values on the devices;
* receive, device: validate the frame and its scales, put the int8 payload on the devices and
  dispatch the jitted decode and add.

Writes benchmarks/results/learner_host.json (or --out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

from diloco.algo import codec_specs, device_codecs, messages, payloads  # noqa: E402
from diloco.algo.merge import pseudo_gradient  # noqa: E402

# A 1b layer's gate, up, down, attention output and key projection: 40.9M values (d_model 2048,
# d_ff 5632, 8 kv heads of 128), about one of 24 fragments of configs/model/1b.yaml.
SHAPES = {("mlp", "gate"): (2048, 5632), ("mlp", "up"): (2048, 5632), ("mlp", "down"): (5632, 2048),
          ("attn", "o"): (2048, 2048), ("attn", "k"): (2048, 1024)}


def shapes_for(values: float) -> dict:
    """SHAPES scaled down (rows) to about `values` values."""
    total = sum(np.prod(s) for s in SHAPES.values())
    f = min(1.0, values / total)
    return {p: (max(1, int(s[0] * f)), s[1]) for p, s in SHAPES.items()}


def header(kind: str, spec: str, tensors, delta_against=None) -> dict:
    return {"kind": kind, "learner": 0, "incarnation": 0, "seq": 1, "fragment": 0, "base_version": 0,
            "version": 1, "c_steps": 24, "c_tokens": 24 * 8192, "codec": spec, "delta_against": delta_against,
            "tensors": tensors}


def timed(fn):
    t, c = time.perf_counter(), time.thread_time()
    out = fn()
    return out, time.thread_time() - c, time.perf_counter() - t


def spread(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host-threads", type=int, default=1, help="DILOCO_HOST_THREADS for the host passes")
    p.add_argument("--values", type=float, default=41e6)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--up", default="int4+zstd1")
    p.add_argument("--down", default="int8")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ["DILOCO_HOST_THREADS"] = str(args.host_threads)  # read at each pass (hostpool.threads)
    shapes = shapes_for(args.values)
    paths = sorted(shapes)
    rng = np.random.default_rng(0)
    anchor_h = {q: rng.standard_normal(shapes[q], np.float32) * 0.02 for q in paths}
    local_h = {q: anchor_h[q] - rng.standard_normal(shapes[q], np.float32) * 1e-3 for q in paths}
    n = sum(x.size for x in anchor_h.values())
    anchor = jax.device_put(anchor_h)
    local = jax.device_put(local_h)
    jax.block_until_ready((anchor, local))
    up, dc = codec_specs.codec_from_spec(args.up), device_codecs.for_spec(args.up)
    down, dd = codec_specs.codec_from_spec(args.down), device_codecs.decoder_for(args.down)

    def send_host():
        got = jax.device_get(local)
        diff = pseudo_gradient(anchor_h, {q: np.asarray(got[q], np.float32) for q in paths})
        tensors, payload, _ = payloads.pack_fragment(diff, up)
        return messages.encode(header("contribution", args.up, tensors), payload), 4 * n

    def send_start():
        payload, _ = dc.encode(tuple(anchor[q] for q in paths), tuple(local[q] for q in paths), ())
        for x in jax.tree.leaves(payload):
            x.copy_to_host_async()
        return payload

    def send_frame(payload):
        raw = jax.device_get(payload)
        chunks = device_codecs.to_wire(dc, raw, [shapes[q] for q in paths])
        tensors = [{"path": list(q), "shape": list(shapes[q]), "dtype": "float32", "nbytes": len(c)}
                   for q, c in zip(paths, chunks)]
        return (messages.encode(header("contribution", args.up, tensors), b"".join(chunks)),
                sum(x.nbytes for x in jax.tree.leaves(raw)))

    # The int8 delta a merge sends back, against the version the learner holds (its anchor).
    delta = {q: rng.standard_normal(shapes[q], np.float32) * 1e-3 for q in paths}
    tensors, payload, _ = payloads.pack_fragment(delta, down)
    frame = messages.encode(header("fragment", args.down, tensors, delta_against=0), payload)
    expected = {q: (shapes[q], np.float32) for q in paths}

    def receive_host():
        msg = messages.decode(frame)
        values = payloads.unpack_fragment(msg.header, msg.payload, None, expected)
        new = {q: anchor_h[q] + values[q] for q in paths}
        return jax.device_put(new), 4 * n

    def receive_device():
        msg = messages.decode(frame)
        layout = payloads.tensor_layout(msg.header, expected)
        raw = dd.check(msg.header, msg.payload, [s for _, s in layout])
        out = dd.apply(tuple(anchor[q] for q, _ in layout), jax.device_put(raw), [s for _, s in layout])
        return out, raw.nbytes

    # Everything compiled and warm before the clock; the device paths' results checked equal.
    host_frame = send_host()[0]
    assert send_frame(send_start())[0] == host_frame, "device and host frames differ"
    for a, b in zip(receive_device()[0], (receive_host()[0][q] for q in paths)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    rows = {k: {"cpu_s": [], "wall_s": []} for k in ("send_host", "send_start", "send_frame",
                                                     "receive_host", "receive_device")}
    plain = {"send_host": send_host, "receive_host": receive_host, "receive_device": receive_device}
    moved = {}
    for _ in range(args.repeats):
        for name in rows:
            if name == "send_frame":
                continue
            if name == "send_start":
                payload, cpu, wall = timed(send_start)
                jax.block_until_ready(payload)  # the device's own work, not the host's
                (_, nbytes), cpu2, wall2 = timed(lambda: send_frame(payload))
                rows["send_frame"]["cpu_s"].append(cpu2)
                rows["send_frame"]["wall_s"].append(wall2)
                moved["send_device"] = nbytes
            else:
                (out, nbytes), cpu, wall = timed(plain[name])
                jax.block_until_ready(out)
                moved[name] = nbytes
            rows[name]["cpu_s"].append(cpu)
            rows[name]["wall_s"].append(wall)
    result = {"args": vars(args), "values": n, "shapes": {"/".join(q): shapes[q] for q in paths},
              "bytes_crossing": moved,
              "times": {k: {m: spread(v) for m, v in r.items()} for k, r in rows.items()}}
    med = {k: statistics.median(r["cpu_s"]) for k, r in rows.items()}
    result["summary"] = {
        "send_host_cpu_ms": 1e3 * med["send_host"], "send_start_cpu_ms": 1e3 * med["send_start"],
        "send_frame_cpu_ms": 1e3 * med["send_frame"], "receive_host_cpu_ms": 1e3 * med["receive_host"],
        "receive_device_cpu_ms": 1e3 * med["receive_device"]}
    path = write("learner_host", result, args.out)
    s = result["summary"]
    print(f"{n:,} values: send host {s['send_host_cpu_ms']:.1f} ms CPU ({moved['send_host'] / 2**20:.0f} MiB to host) | "
          f"device: start {s['send_start_cpu_ms']:.2f} ms + frame {s['send_frame_cpu_ms']:.1f} ms "
          f"({moved['send_device'] / 2**20:.1f} MiB) || receive host {s['receive_host_cpu_ms']:.1f} ms "
          f"({moved['receive_host'] / 2**20:.0f} MiB to devices) | device {s['receive_device_cpu_ms']:.1f} ms "
          f"({moved['receive_device'] / 2**20:.1f} MiB)   (median of {args.repeats}; wrote {path})")


if __name__ == "__main__":
    main()
