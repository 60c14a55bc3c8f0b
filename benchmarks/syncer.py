"""Syncer throughput: admit M int4 contributions for one fragment, merge (RDA), outer Nesterov step
and publish, on the fragments of a ~100M-parameter model.

    python benchmarks/syncer.py --learners 8 --fragments 24

Times `on_contribution` for all M learners of a round (the last one triggers the merge at K = M),
for every fragment, and reports seconds per round and fp32 MB merged per second.
Writes benchmarks/results/syncer.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

from diloco.algo import messages, payloads, quorum  # noqa: E402
from diloco.algo import syncer as sync  # noqa: E402
from diloco.algo.codecs import make_codec  # noqa: E402
from diloco.algo.fragments import make_fragments  # noqa: E402
from diloco.algo.outer import make_outer  # noqa: E402
from diloco.config import ModelConfig  # noqa: E402
from diloco.model import abstract_params, count_params, is_embedding  # noqa: E402

# ~100M parameters with a 32k vocabulary, GPT-2-small-like shape.
MODEL = ModelConfig(name="100m", d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, d_ff=2048,
                    max_seq_len=1024, tie_embeddings=True)


def frame(learner: int, seq: int, p: int, values: dict, codec, spec: str) -> bytes:
    tensors, payload, _ = payloads.pack_fragment(values, codec)
    header = {"kind": "contribution", "learner": learner, "incarnation": 0, "seq": seq, "fragment": p,
              "base_version": 0, "version": 0, "c_steps": 24, "c_tokens": 24 * 4096, "codec": spec,
              "delta_against": None, "tensors": tensors}
    return messages.encode(header, payload)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--learners", type=int, default=8)
    p.add_argument("--fragments", type=int, default=24)
    p.add_argument("--codec", default="int4")
    p.add_argument("--limit", type=int, default=0, help="time only the first N fragments (0 = all)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    shapes = abstract_params(MODEL, 32768)
    n_params = count_params(shapes)
    frags = make_fragments(shapes, args.fragments, "balanced", is_embedding)
    rng = np.random.default_rng(0)
    theta0 = tuple({path: rng.standard_normal(_shape(shapes, path), np.float32) * 0.02 for path in f.paths}
                   for f in frags)
    policy = sync.Policy(quorum.GraceConfig(K=args.learners, gamma=0.0), make_outer("nesterov"),
                         down_codec=make_codec("int4"), down_spec="int4")
    st = sync.init(policy, frags, theta0, {m: 0 for m in range(args.learners)})
    codec = make_codec(args.codec)
    rows = []
    seq = 0
    for f in frags[: args.limit or None]:
        # Two rounds per fragment: the first compiles the merge for this fragment's tensor shapes
        # (once per run in practice), the second is timed.
        for _ in range(2):
            seq += 1
            frames = [frame(m, seq, f.index, {path: rng.standard_normal(x.shape, np.float32) * 1e-3
                                              for path, x in theta0[f.index].items()}, codec, args.codec)
                      for m in range(args.learners)]
            t = time.perf_counter()
            for fr in frames:
                st, actions = sync.on_contribution(policy, st, fr, 1.0)
            seconds = time.perf_counter() - t
            assert any(isinstance(a, sync.Publish) for a in actions), "the round did not merge"
        rows.append({"fragment": f.index, "values": f.size, "seconds": seconds,
                     "fp32_MB_per_s": args.learners * f.size * 4 / seconds / 1e6})
    steady = rows
    result = {"args": vars(args), "params": n_params, "rounds": rows,
              "median_seconds_per_round": statistics.median(r["seconds"] for r in steady),
              "median_fp32_MB_per_s": statistics.median(r["fp32_MB_per_s"] for r in steady),
              "total_seconds": sum(r["seconds"] for r in rows)}
    path = write("syncer", result, args.out)
    print(f"{n_params:,} params, {args.fragments} fragments, {args.learners} learners, {args.codec}: "
          f"median {result['median_seconds_per_round']:.3f} s per fragment round, "
          f"{result['median_fp32_MB_per_s']:.0f} MB/s of fp32 contributions; all rounds "
          f"{result['total_seconds']:.1f} s (wrote {path})")


def _shape(tree, path):
    for k in path:
        tree = tree[k]
    return tree.shape


if __name__ == "__main__":
    main()
