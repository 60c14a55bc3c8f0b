"""Compile time and inner-step throughput (tokens/s) of the plain trainer's jitted step.

    python benchmarks/inner_step.py                 # tiny and base10m on all visible devices
    python benchmarks/inner_step.py --models tiny --steps 20

Writes benchmarks/results/inner_step.json. Each model is timed over the same devices in one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

from diloco.config import InnerConfig, MeshConfig, ModelConfig, RunConfig, TrainConfig, DataConfig, from_dict
from diloco.model import build, count_params
from diloco.train.mesh import make_mesh
from diloco.train.trainer import compile_steps

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def bench(model_name: str, batch: int, seq: int, steps: int, repeats: int, vocab: int) -> dict:
    model_cfg = from_dict(ModelConfig, yaml.safe_load((CONFIGS / "model" / f"{model_name}.yaml").read_text()))
    cfg = TrainConfig(model=model_cfg, data=DataConfig(batch_size=batch, seq_len=seq),
                      inner=InnerConfig(), mesh=MeshConfig(), run=RunConfig(steps=10_000))
    mesh = make_mesh(cfg.mesh, batch)
    model = build(model_cfg, vocab, seed=0)
    t0 = time.perf_counter()
    compiled = compile_steps(model, cfg, mesh)
    state = compiled.init(model.params)
    rng = np.random.default_rng(0)
    batches = [jax.device_put(rng.integers(0, vocab, (batch, seq + 1), dtype=np.int32),
                              compiled.batch_sharding) for _ in range(4)]
    state, metrics = compiled.train_step(state, batches[0])
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        for i in range(steps):
            state, metrics = compiled.train_step(state, batches[i % 4])
        jax.block_until_ready(metrics)
        rates.append(steps * batch * seq / (time.perf_counter() - t))
    return {"model": model_name, "params": count_params(model.params), "batch": batch, "seq_len": seq,
            "devices": int(mesh.devices.size), "compile_s": round(compile_s, 3),
            "tokens_per_s_median": round(statistics.median(rates), 1),
            "tokens_per_s_all": [round(r, 1) for r in rates], "steps_per_repeat": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny", "base10m"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = [bench(m, args.batch, args.seq, args.steps, args.repeats, args.vocab) for m in args.models]
    path = write("inner_step", {"args": vars(args), "results": rows}, args.out)
    print(f"{'model':<10}{'params':>12}{'compile s':>11}{'tokens/s':>12}")
    for r in rows:
        print(f"{r['model']:<10}{r['params']:>12,}{r['compile_s']:>11.2f}{r['tokens_per_s_median']:>12,.0f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
