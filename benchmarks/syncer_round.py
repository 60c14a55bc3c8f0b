"""One syncer round against memcpy of the same bytes, and the syncer's start-up compile time.

    python benchmarks/syncer_round.py                       # the grid: M = 2, 4, 8, 16 x 0.1M..40M values
    python benchmarks/syncer_round.py --learners 8 --sizes 3.34e6 --repeats 7
    python benchmarks/syncer_round.py --startup             # init + first rounds of the 100.7M model
    python benchmarks/syncer_round.py --cores --learners 16 --sizes 3.88e7   # one core against all
    python benchmarks/syncer_round.py --stats --learners 4 --sizes 3.88e7 --repeats 20  # outer statistics' cost
    git show 1d226a6:diloco/algo/roundsum.py > /tmp/roundsum_before.py  # the numpy passes
    python benchmarks/syncer_round.py --learners 8 --sizes 3.34e6 --baseline /tmp/roundsum_before.py

A round is M contributions of one fragment (int4 + zstd up, int8 down: the run's default codecs),
K = M, so the M-th contribution merges (RDA, outer Nesterov) and publishes. Timed: the M calls of
`on_contribution` (frames encoded beforehand), the last of them alone (admission of the last one
plus the close of the round: merge, outer step, broadcast), and `np.copyto` of M x N float32
values (one N-value buffer copied M times), the bytes of the round's contributions in fp32,
interleaved with the rounds so both see the same load. Every figure is a median with its min and
max over `--repeats` rounds, after one untimed round (it compiled the merge before the streaming
accumulator made init compile it).

`--baseline FILE` (another version of diloco/algo/roundsum.py) times its per-contribution passes
(delta, the sum update, norms) against the current ones in the same process, rounds alternated
A B B A so both see the same load, and adds the paired ratio baseline / current per round pair.

`--cores` runs one round of --sizes[0] values and --learners[0] contributions in two processes, one
pinned to one core (as `taskset -c 0`, so hostpool gives it one thread) and one on every core this
one may use, rounds alternated A B B A after one untimed round each, and reports each round's time,
its last contribution and its peak resident memory (VmHWM, reset before the round) over the memory
held before it; the contributions are encoded once and framed again per round. Writes
benchmarks/results/syncer_round.json (or --label, --out):

`--stats`: the round of --sizes[0] values and --learners[0] contributions by two syncers fed the
same contributions, with the outer statistics (syncer.outer_stats=on) and without, rounds alternated
A B B A after one untimed round each: the round, its last contribution and the close's own pass
(timed where the syncer calls it), each with the paired ratio with / without; the bytes the
statistics hold (the fragment's last merged delta; 4 x --model-values, the 1b preset's, for a model);
both syncers must end with the same Theta bit for bit. Writes benchmarks/results/syncer_round.json.

`--startup` times `sync.init` of the 100.7M-parameter model (24 fragments, M = 8: what compiles
there) and then the first and second round of every fragment: first - second is the compile
stall a round still pays. Writes benchmarks/results/syncer_round.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402
from round_parts import (fragment_values, frames_for, frames_of, memcpy, memory_mb, one_round,  # noqa: E402
                         passes_of, payloads_for, policy, reset_peak, spread, use)

from diloco.algo import close as closing  # noqa: E402
from diloco.algo import codec_specs, hostpool  # noqa: E402
from diloco.algo import syncer as sync  # noqa: E402
from diloco.algo.fragments import Fragment, make_fragments  # noqa: E402


def grid(args) -> list[dict]:
    rows = []
    up_codec = codec_specs.codec_from_spec(args.up)
    current, baseline = passes_of(args.baseline)
    variants = ("current",) if baseline is None else ("current", "baseline")
    for n in args.sizes:
        n = int(float(n))
        for M in args.learners:
            if M * n > args.max_values:
                print(f"skip M={M} N={n:,}: {M * n:,} values > --max-values {args.max_values:,}")
                continue
            rng = np.random.default_rng(0)
            theta = fragment_values(n, rng)
            frag = Fragment(0, tuple(theta), sum(x.size for x in theta.values()), False)
            pol = policy(M, args.up, args.down)
            t = time.perf_counter()
            st = sync.init(pol, (frag,), (theta,), {m: 0 for m in range(M)})
            init_s = time.perf_counter() - t
            src = np.ones(frag.size, np.float32)
            dst = np.empty_like(src)
            first = None
            times = {v: ([], [], []) for v in variants}  # rounds, closes, copies
            order = [variants[(r + 1) // 2 % len(variants)] for r in range(len(variants) * (args.repeats + 1))]
            for r, v in enumerate(order):  # A B B A A B ...; the first round of each variant untimed
                use(current if v == "current" else baseline)
                frames = frames_for(st, 0, M, r + 1, up_codec, args.up, rng)
                st, seconds, close = one_round(pol, st, frames)
                copy = memcpy(dst, src, M)
                if r < len(variants):
                    first = seconds if v == "current" else first
                    continue
                for xs, x in zip(times[v], (seconds, close, copy)):
                    xs.append(x)
            use(current)
            rounds, closes, copies = times["current"]
            row = {"learners": M, "values": frag.size, "init_s": init_s, "first_round_s": first,
                   "round_s": spread(rounds), "last_contribution_s": spread(closes),
                   "memcpy_s": spread(copies),
                   "ratio": statistics.median(rounds) / statistics.median(copies)}
            rows.append(row)
            print(f"M={M:2d} N={frag.size:>10,}: round {row['round_s']['median']:.4f} s "
                  f"[{row['round_s']['min']:.4f}, {row['round_s']['max']:.4f}], last contribution "
                  f"{row['last_contribution_s']['median']:.4f} s, memcpy {row['memcpy_s']['median']:.4f} s: "
                  f"{row['ratio']:.1f}x (n={args.repeats}; init {init_s:.2f} s, first round {first:.3f} s)",
                  flush=True)
            if baseline is not None:
                b_rounds, b_closes, b_copies = times["baseline"]
                paired = [b / c for b, c in zip(b_rounds, rounds)]
                row["baseline"] = {"round_s": spread(b_rounds), "last_contribution_s": spread(b_closes),
                                   "memcpy_s": spread(b_copies),
                                   "ratio": statistics.median(b_rounds) / statistics.median(b_copies),
                                   "baseline_over_current": spread(paired)}
                print(f"      baseline: round {statistics.median(b_rounds):.4f} s [{min(b_rounds):.4f}, "
                      f"{max(b_rounds):.4f}], {row['baseline']['ratio']:.1f}x memcpy; baseline / current "
                      f"{statistics.median(paired):.2f} [{min(paired):.2f}, {max(paired):.2f}]", flush=True)
    return rows


def serve(args) -> None:
    """--cores' child: one fragment of --sizes[0] values and --learners[0] contributions, set up
    once; a round per "round" line on stdin, its figures as one JSON line on stdout."""
    n, M = int(float(args.sizes[0])), args.learners[0]
    rng = np.random.default_rng(0)
    theta = fragment_values(n, rng)
    frag = Fragment(0, tuple(theta), sum(x.size for x in theta.values()), False)
    pol = policy(M, args.up, args.down)
    st = sync.init(pol, (frag,), (theta,), {m: 0 for m in range(M)})
    payloads = payloads_for(st, 0, M, codec_specs.codec_from_spec(args.up), rng)
    src, dst = np.ones(frag.size, np.float32), np.empty(frag.size, np.float32)
    print("@@" + json.dumps({"values": frag.size, "threads": hostpool.threads(),
                             "cores": sorted(os.sched_getaffinity(0))}), flush=True)
    for seq, line in enumerate(sys.stdin, 1):
        if line.strip() != "round":
            break
        frames = frames_of(st, 0, payloads, seq, args.up)
        before, _ = memory_mb()
        reset_peak()
        st, seconds, close = one_round(pol, st, frames)
        del frames
        _, peak = memory_mb()
        print("@@" + json.dumps({"round_s": seconds, "last_contribution_s": close, "rss_before_mb": before,
                                 "peak_mb": peak, "growth_mb": peak - before, "memcpy_s": memcpy(dst, src, M)}),
              flush=True)


def cores(args) -> dict:
    """The same round in two processes, one pinned to one core and one on every core this one may
    use, rounds alternated A B B A so both see the same load; the first round of each untimed."""
    allowed = sorted(os.sched_getaffinity(0))
    cmd = [sys.executable, __file__, "--serve", "--learners", str(args.learners[0]), "--sizes", args.sizes[0],
           "--up", args.up, "--down", args.down]
    procs = {"one": subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=lambda: os.sched_setaffinity(0, {allowed[0]})),
             "all": subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)}

    def reply(name):
        for line in procs[name].stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
        raise RuntimeError(f"the {name}-core child ended early (exit {procs[name].wait()})")

    setup = {name: reply(name) for name in procs}
    rows = {name: [] for name in procs}
    order = ["one", "all", "all", "one"] * ((args.repeats + 2) // 2)
    for name in order[: 2 * (args.repeats + 1)]:
        procs[name].stdin.write("round\n")
        procs[name].stdin.flush()
        rows[name].append(reply(name))
        r = rows[name][-1]
        print(f"{name:3s} ({setup[name]['threads']} threads): round {r['round_s']:.3f} s, last contribution "
              f"{r['last_contribution_s']:.3f} s, peak {r['peak_mb']:.0f} MB (+{r['growth_mb']:.0f} over the "
              f"{r['rss_before_mb']:.0f} before it)", flush=True)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    timed = {name: xs[1:] for name, xs in rows.items()}
    paired = [a["round_s"] / b["round_s"] for a, b in zip(timed["one"], timed["all"])]
    out = {name: {"threads": setup[name]["threads"], "cores": setup[name]["cores"], "values": setup[name]["values"],
                  **{k: spread([r[k] for r in xs]) for k in ("round_s", "last_contribution_s", "memcpy_s", "peak_mb",
                                                             "rss_before_mb", "growth_mb")}, "rounds": xs}
           for name, xs in timed.items()}
    out["one_over_all"] = spread(paired)
    print(f"one core / all ({len(allowed)}): {statistics.median(paired):.2f} [{min(paired):.2f}, {max(paired):.2f}] "
          f"(n={len(paired)}); rounds {out['one']['round_s']['median']:.3f} s against "
          f"{out['all']['round_s']['median']:.3f} s")
    return out


def stats_ab(args) -> dict:
    """--stats: the same round with the outer statistics and without, alternated in one process."""
    n, M = int(float(args.sizes[0])), args.learners[0]
    rng = np.random.default_rng(0)
    theta = fragment_values(n, rng)
    frag = Fragment(0, tuple(theta), sum(x.size for x in theta.values()), False)
    pols = {v: policy(M, args.up, args.down, outer_stats=v == "with") for v in ("with", "without")}
    sts = {v: sync.init(pol, (frag,), (theta,), {m: 0 for m in range(M)}) for v, pol in pols.items()}
    payloads = payloads_for(sts["with"], 0, M, codec_specs.codec_from_spec(args.up), rng)  # both get these
    times = {v: ([], [], []) for v in pols}  # rounds, last contributions, the close's own pass
    order = (["with", "without", "without", "with"] * (args.repeats + 2))[: 2 * (args.repeats + 1)]
    inner, closes, load = closing.close, [], [os.getloadavg()[0]]

    def timed_close(*a, **k):  # the syncer's call of the close, timed where it is made
        t = time.perf_counter()
        out = inner(*a, **k)
        closes.append(time.perf_counter() - t)
        return out

    closing.close = timed_close
    for r, v in enumerate(order):
        st, seconds, close = one_round(pols[v], sts[v], frames_of(sts[v], 0, payloads, r + 1, args.up))
        sts[v] = st
        if r >= 2:
            for xs, x in zip(times[v], (seconds, close, closes[-1])):
                xs.append(x)
    closing.close = inner
    same = all(np.array_equal(sts["with"].fragments[0].theta[q], sts["without"].fragments[0].theta[q]) for q in theta)
    assert same and sts["without"].fragments[0].stats.last is None, "the statistics must only observe"
    held = sum(x.nbytes for x in sts["with"].fragments[0].stats.last.values())
    out = {"values": frag.size, "learners": M, "theta_identical": same, "last_bytes_per_fragment": held,
           "last_bytes_model": 4 * args.model_values, "model_values": args.model_values,
           "load_average_1min": load + [os.getloadavg()[0]]}  # before, after
    for k, name in enumerate(("round_s", "last_contribution_s", "close_s")):
        w, wo = times["with"][k], times["without"][k]
        out[name] = {"with": spread(w), "without": spread(wo), "with_over_without": spread([a / b for a, b in zip(w, wo)]),
                     "with_minus_without_ms": spread([1e3 * (a - b) for a, b in zip(w, wo)])}
        x, r = out[name], out[name]["with_over_without"]
        print(f"{name}: with {x['with']['median']:.4f} s, without {x['without']['median']:.4f} s; paired with / "
              f"without {r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}], with - without "
              f"{x['with_minus_without_ms']['median']:+.1f} ms (n={len(w)})", flush=True)
    print(f"held by the statistics: {held / 1e6:.1f} MB for this fragment of {frag.size:,} values, "
          f"{4 * args.model_values / 1e9:.2f} GB for {args.model_values:,} values; load {load[0]:.1f} -> "
          f"{out['load_average_1min'][1]:.1f}; Theta identical")
    return out


def startup(args) -> dict:
    from diloco.config import ModelConfig
    from diloco.model import abstract_params, is_embedding

    model = ModelConfig(name="100m", d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, d_ff=2048,
                        max_seq_len=1024, tie_embeddings=True)
    shapes = abstract_params(model, 32768)
    frags = make_fragments(shapes, args.fragments, "balanced", is_embedding)
    rng = np.random.default_rng(0)

    def shape(path):
        tree = shapes
        for k in path:
            tree = tree[k]
        return tree.shape

    theta0 = tuple({path: rng.standard_normal(shape(path), np.float32) * 0.02 for path in f.paths}
                   for f in frags)
    M = args.startup_learners
    pol = policy(M, args.up, args.down)
    t = time.perf_counter()
    st = sync.init(pol, frags, theta0, {m: 0 for m in range(M)})
    init_s = time.perf_counter() - t
    codec = codec_specs.codec_from_spec(args.up)
    stalls = []
    for f in frags[: args.limit or None]:
        seconds = []
        for r in range(2):
            frames = frames_for(st, f.index, M, 2 * f.index + r + 1, codec, args.up, rng)
            st, s, _ = one_round(pol, st, frames)
            seconds.append(s)
        stalls.append({"fragment": f.index, "values": f.size, "first_s": seconds[0], "second_s": seconds[1]})
        print(f"fragment {f.index:2d} ({f.size:,} values): first round {seconds[0]:.3f} s, "
              f"second {seconds[1]:.3f} s", flush=True)
    total = sum(max(0.0, r["first_s"] - r["second_s"]) for r in stalls)
    print(f"init {init_s:.2f} s; first-round stalls (first - second) {total:.2f} s over {len(stalls)} fragments")
    return {"learners": M, "fragments": len(frags), "init_s": init_s, "rounds": stalls,
            "first_round_stall_s": total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--learners", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--sizes", nargs="+", default=["1e5", "1e6", "3.34e6", "1e7", "4e7"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--up", default="int4+zstd1")
    p.add_argument("--down", default="int8")
    p.add_argument("--max-values", type=int, default=700_000_000,
                   help="skip grid points with more than this many contributed values (memory)")
    p.add_argument("--startup", action="store_true", help="time init and the first rounds of the 100.7M model")
    p.add_argument("--startup-learners", type=int, default=8)
    p.add_argument("--fragments", type=int, default=24)
    p.add_argument("--limit", type=int, default=0, help="--startup: only the first N fragments (0 = all)")
    p.add_argument("--baseline", default=None,
                   help="a roundsum.py whose per-contribution passes are timed against the current ones, alternated")
    p.add_argument("--cores", action="store_true",
                   help="the round at --sizes[0], --learners[0] on one core and on all, alternated, with peak memory")
    p.add_argument("--stats", action="store_true",
                   help="the round at --sizes[0], --learners[0] with the outer statistics and without, alternated")
    p.add_argument("--model-values", type=int, default=983_640_064, help="--stats: a whole model's values (1b)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--label", default="", help="a name for this run in the JSON (e.g. before, after)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.serve:
        return serve(args)
    result = {"args": vars(args)}
    if args.cores:
        result["cores"] = cores(args)
    elif args.stats:
        result["stats"] = stats_ab(args)
    elif args.startup:
        result["startup"] = startup(args)
    else:
        result["rounds"] = grid(args)
    path = write("syncer_round" + (f"_{args.label}" if args.label else ""), result, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
