"""Tokens/s of a Decoupled DiLoCo learner against the plain trainer, same model and devices.

    python benchmarks/learner_overhead.py --model small --devices 2 --steps 48 -P 24 -H 24 --tau 2

The learner runs the same jitted inner step plus its per-step work, as the wall-clock learner
loop (diloco/runtime/learner_loop.py) does it, waiting for each step to end: applying merged fragments tau steps later (fed back by a local syncer with K = 1),
counters, a device copy of the due fragment, and its int4 encode after the next step is dispatched
(`--no-defer`: encoded at once, before the next step). Both loops are timed alternately in one
process, `--repeats` blocks each. Besides tokens/s it times the learner's host work per step:
on the critical path (apply_due, the fragment's device copy, the schedule's counters) and the encode, which runs while
the devices compute (with --no-defer it runs inside step(), on the path, and its time includes
waiting for the step to end). Goal: >= 0.99x; critical host work
<= 0.3% of a step. Writes benchmarks/results/learner_overhead.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

from diloco.algo import syncer as sync  # noqa: E402
from diloco.config import (DataConfig, FragmentsConfig, InnerConfig, ModelConfig, RunConfig,  # noqa: E402
                           RuntimeConfig, TrainConfig, from_dict, validate)
from diloco.data import batch_at, load_corpus  # noqa: E402
from diloco.model import build  # noqa: E402
from diloco.runtime import build as build_setup  # noqa: E402
from diloco.runtime import unit as unit_mod  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("-P", "--fragments", type=int, default=24)
    p.add_argument("-H", "--sync-every", type=int, default=24)
    p.add_argument("--tau", type=int, default=2)
    p.add_argument("--no-defer", action="store_true", help="encode each step's fragment before the next step")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model_cfg = from_dict(ModelConfig, yaml.safe_load((CONFIGS / "model" / f"{args.model}.yaml").read_text()))
    cfg = validate(TrainConfig(
        model=model_cfg, data=DataConfig(source="synthetic", seq_len=args.seq, batch_size=args.batch,
                                         synthetic_vocab=256, synthetic_tokens=200_000),
        inner=InnerConfig(warmup_steps=0), run=RunConfig(steps=10_000, progress=False), algo="diloco",
        fragments=FragmentsConfig(count=args.fragments, H=args.sync_every, tau=args.tau),
        runtime=RuntimeConfig(learners=1, devices_per_learner=args.devices)))
    corpus = load_corpus(cfg.data)
    model = build(cfg.model, corpus.vocab_size, seed=0)
    setup = build_setup.build(cfg, corpus, model)
    syncer = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0})
    unit = build_setup.new_unit(setup, 0, 0, syncer)
    compiled = setup.compiled[0]
    state = compiled.init(model.params)
    tokens = args.batch * args.seq

    # Host work, timed piece by piece: on the CPU backend a "dispatch" may run the step inline, so
    # the time of a whole step() call would count device compute as host work.
    host = {"apply": [], "snapshot": [], "counters": [], "encode": [], "encode_work": []}

    def timed(owner, name: str, key: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                host[key].append(time.perf_counter() - t0)
        setattr(owner, name, wrapper)

    timed(unit_mod.LearnerUnit, "_snapshot", "snapshot")
    timed(unit_mod.LearnerUnit, "_encode", "encode_work")  # wherever it runs
    timed(unit_mod.lsm, "after_step", "counters")
    timed(unit_mod, "trained_tokens", "counters")

    def plain(n: int) -> float:
        nonlocal state
        t = time.perf_counter()
        for i in range(n):
            batch = batch_at(corpus.train, seed=0, learner=0, num_learners=1, step=i,
                             batch_size=args.batch, seq_len=args.seq)
            state, metrics = compiled.train_step(state, jax.device_put(batch, compiled.batch_sharding))
        jax.block_until_ready(metrics)
        return n * tokens / (time.perf_counter() - t)

    def feed(frames) -> float:
        """The syncer's merge runs elsewhere in a real deployment: its time is taken out."""
        nonlocal syncer
        t_sync = time.perf_counter()
        for frame in frames:
            syncer, actions = sync.on_contribution(setup.policy, syncer, frame, 0.0)
            for a in actions:
                if isinstance(a, sync.Publish):
                    unit.receive(a.frames[0])
        return time.perf_counter() - t_sync

    def learner(n: int) -> float:
        t, elsewhere = time.perf_counter(), 0.0
        for _ in range(n):
            t0 = time.perf_counter()
            unit.apply_due()
            host["apply"].append(time.perf_counter() - t0)
            result = unit.step(defer=not args.no_defer)
            frames = result.frames
            if unit.deferred > 1:  # the previous step's frames, while this one runs
                t0 = time.perf_counter()
                frames = unit.finish()[0]
                host["encode"].append(time.perf_counter() - t0)
            jax.block_until_ready(unit.state)  # as the wall-clock loop does, to time its steps
            elsewhere += feed(frames)
        while unit.deferred:
            elsewhere += feed(unit.finish()[0])
        jax.block_until_ready(unit.state.params)
        return n * tokens / (time.perf_counter() - t - elsewhere)

    plain(3), learner(3)  # compile and warm up both paths
    for v in host.values():
        v.clear()
    rates = {"plain": [], "learner": []}
    for _ in range(args.repeats):
        rates["plain"].append(plain(args.steps))
        rates["learner"].append(learner(args.steps))
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratios = [a / b for a, b in zip(rates["learner"], rates["plain"])]
    step_s = tokens / med["plain"]
    # Host work per step: means (a send step costs more than a quiet one; the mean is the share).
    steps = args.repeats * args.steps
    mean = {k: sum(v) / steps for k, v in host.items()}
    # With --no-defer the encode runs inside step(), before the next step: on the critical path.
    # With --no-defer the encode is on the critical path too, and its time includes waiting for
    # the step (its device_get syncs), so it is no host-work figure: compare encode_work deferred.
    critical = mean["apply"] + mean["snapshot"] + mean["counters"]
    result = {"args": vars(args), "tokens_per_s": rates, "median": med, "ratio": med["learner"] / med["plain"],
              "ratio_per_block": ratios, "ratio_spread": [min(ratios), max(ratios)], "plain_step_s": step_s,
              "host_s_per_step": mean, "critical_host_s_per_step": critical,
              "critical_host_share": critical / step_s,
              "encode_share": mean["encode_work"] / step_s}
    path = write("learner_overhead", result, args.out)
    print(f"plain {med['plain']:,.0f} tok/s   learner {med['learner']:,.0f} tok/s   ratio {result['ratio']:.3f} "
          f"[{min(ratios):.3f}, {max(ratios):.3f}] n={len(ratios)}   critical host work "
          f"{100 * result['critical_host_share']:.2f}% of a step, encode "
          f"{100 * result['encode_share']:.2f}%   (wrote {path})")


if __name__ == "__main__":
    main()
