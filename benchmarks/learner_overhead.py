"""Tokens/s of a Decoupled DiLoCo learner against the plain trainer, same model and devices.

    python benchmarks/learner_overhead.py --model small --devices 2 --steps 48

The learner runs the same jitted inner step plus its per-step work: counters, extracting and
int4-encoding the due fragment, and applying merged fragments tau steps later (fed back by a local
syncer with K = 1). Both loops are timed alternately in one process. Target: >= 0.97x.
Writes benchmarks/results/learner_overhead.json.
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

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model_cfg = from_dict(ModelConfig, yaml.safe_load((CONFIGS / "model" / f"{args.model}.yaml").read_text()))
    cfg = validate(TrainConfig(
        model=model_cfg, data=DataConfig(source="synthetic", seq_len=args.seq, batch_size=args.batch,
                                         synthetic_vocab=256, synthetic_tokens=200_000),
        inner=InnerConfig(warmup_steps=0), run=RunConfig(steps=10_000, progress=False), algo="diloco",
        fragments=FragmentsConfig(count=24, H=24, tau=2),
        runtime=RuntimeConfig(learners=1, devices_per_learner=args.devices)))
    corpus = load_corpus(cfg.data)
    model = build(cfg.model, corpus.vocab_size, seed=0)
    setup = build_setup.build(cfg, corpus, model)
    syncer = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0})
    unit = build_setup.new_unit(setup, 0, 0, syncer)
    compiled = setup.compiled[0]
    state = compiled.init(model.params)
    tokens = args.batch * args.seq

    def plain(n: int) -> float:
        nonlocal state
        t = time.perf_counter()
        for i in range(n):
            batch = batch_at(corpus.train, seed=0, learner=0, num_learners=1, step=i,
                             batch_size=args.batch, seq_len=args.seq)
            state, metrics = compiled.train_step(state, jax.device_put(batch, compiled.batch_sharding))
        jax.block_until_ready(metrics)
        return n * tokens / (time.perf_counter() - t)

    def learner(n: int) -> float:
        """The syncer's merge runs elsewhere in a real deployment: its time is taken out."""
        nonlocal syncer
        t, elsewhere = time.perf_counter(), 0.0
        for _ in range(n):
            unit.apply_due()
            result = unit.step()
            for frame in result.frames:
                t_sync = time.perf_counter()
                syncer, actions = sync.on_contribution(setup.policy, syncer, frame, 0.0)
                publish = [a for a in actions if isinstance(a, sync.Publish)]
                elsewhere += time.perf_counter() - t_sync
                for a in publish:
                    unit.receive(a.frames[0])
        jax.block_until_ready(unit.state.params)
        return n * tokens / (time.perf_counter() - t - elsewhere)

    plain(3), learner(3)  # compile and warm up both paths
    rates = {"plain": [], "learner": []}
    for _ in range(args.repeats):
        rates["plain"].append(plain(args.steps))
        rates["learner"].append(learner(args.steps))
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {"args": vars(args), "tokens_per_s": rates, "median": med, "ratio": med["learner"] / med["plain"]}
    path = write("learner_overhead", result, args.out)
    print(f"plain {med['plain']:,.0f} tok/s   learner {med['learner']:,.0f} tok/s   "
          f"ratio {result['ratio']:.3f}   (wrote {path})")


if __name__ == "__main__":
    main()
