"""Compile time, step time, tokens/s, MFU and peak device memory of the plain trainer's jitted step,
per model preset and attention, remat and loss-chunk choice.

    python benchmarks/inner_step.py                 # tiny and base10m on all visible devices
    python benchmarks/inner_step.py --models tiny --steps 20
    python benchmarks/inner_step.py --models 135m --vocab 49152 --batch 16 --seq 1024 \
        --attention auto --remat none dots full --loss-chunk 0 256     # an accelerator's grid

Writes benchmarks/results/inner_step.json. Every row is timed over the same devices in one run:
`--repeats` timings of `--steps` steps after the compiling one. MFU is model FLOPs per token
(diloco/train/flops.py: 6N plus attention) x tokens/s over the devices' bf16 peak (known device
kinds, or --peak-tflops), absent on a CPU. Peak memory is the device's own counter where it has
one (GPU, TPU), read after each row; XLA's compiled temp size otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
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
from diloco.train import flops
from diloco.train.mesh import make_mesh
from diloco.train.trainer import compile_steps

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def bench(model_name: str, batch: int, seq: int, steps: int, repeats: int, vocab: int,
          peak: float = 0.0, devices: int = 0, **choices) -> dict:
    """One row: the `model_name` preset with `choices` (attention, remat, loss_chunk) replacing its own."""
    model_cfg = from_dict(ModelConfig, yaml.safe_load((CONFIGS / "model" / f"{model_name}.yaml").read_text()))
    model_cfg = dataclasses.replace(model_cfg, **{k: v for k, v in choices.items() if v is not None})
    cfg = TrainConfig(model=model_cfg, data=DataConfig(batch_size=batch, seq_len=seq),
                      inner=InnerConfig(), mesh=MeshConfig(devices=devices), run=RunConfig(steps=10_000))
    mesh = make_mesh(cfg.mesh, batch)
    model = build(model_cfg, vocab, seed=0)
    t0 = time.perf_counter()
    compiled = compile_steps(model, cfg, mesh)
    state = compiled.init(model.params)
    rng = np.random.default_rng(0)
    batches = [jax.device_put(rng.integers(0, vocab, (batch, seq + 1), dtype=np.int32),
                              compiled.batch_sharding) for _ in range(4)]
    lowered = compiled.train_step.lower(state, batches[0])
    state, metrics = compiled.train_step(state, batches[0])
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    step_s = []
    for _ in range(repeats):
        t = time.perf_counter()
        for i in range(steps):
            state, metrics = compiled.train_step(state, batches[i % 4])
        jax.block_until_ready(metrics)
        step_s.append((time.perf_counter() - t) / steps)
    step = statistics.median(step_s)
    devices = int(mesh.devices.size)
    per_token = flops.flops_per_token(model_cfg, vocab, seq)
    rates = flops.throughput(batch * seq / step, per_token, flops.hardware(devices, peak))
    return {"model": model_name, "params": count_params(model.params), "batch": batch, "seq_len": seq,
            "attention": model_cfg.attention, "remat": model_cfg.remat, "loss_chunk": model_cfg.loss_chunk,
            "dtype": model_cfg.dtype, "devices": devices, "device_kind": jax.devices()[0].device_kind,
            "compile_s": round(compile_s, 3), "step_s_median": step, "step_s_all": step_s,
            "tokens_per_s_median": round(batch * seq / step, 1),
            "tokens_per_s_all": [round(batch * seq / s, 1) for s in step_s], "steps_per_repeat": steps,
            "flops_per_token": per_token, **rates, "peak_memory_mib": _peak_mib(lowered)}


def _peak_mib(lowered) -> float:
    """The device's peak bytes in use (allocator statistics, reset by nothing: the most of any row
    so far on the GPU) or, where it keeps none (CPU), XLA's compiled temp and argument sizes."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return round(stats["peak_bytes_in_use"] / 2 ** 20, 1)
    mem = lowered.compile().memory_analysis()
    return round((mem.temp_size_in_bytes + mem.argument_size_in_bytes) / 2 ** 20, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny", "base10m"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--attention", nargs="+", default=[None], help="model.attention values (default: the preset's)")
    p.add_argument("--remat", nargs="+", default=[None], help="model.remat values (default: the preset's)")
    p.add_argument("--loss-chunk", nargs="+", type=int, default=[None], help="model.loss_chunk values")
    p.add_argument("--devices", type=int, default=0, help="devices of the mesh (0: all visible)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="one device's peak (0: its kind's known one)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    print(f"{'model':<10}{'attention':>10}{'remat':>6}{'chunk':>6}{'compile s':>10}{'step ms':>9}"
          f"{'tokens/s':>11}{'MFU':>7}{'peak MiB':>10}", flush=True)
    rows = []
    for m, attention, remat, chunk in itertools.product(args.models, args.attention, args.remat, args.loss_chunk):
        r = bench(m, args.batch, args.seq, args.steps, args.repeats, args.vocab, args.peak_tflops, args.devices,
                  attention=attention, remat=remat, loss_chunk=chunk)
        rows.append(r)
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        print(f"{m:<10}{r['attention']:>10}{r['remat']:>6}{r['loss_chunk']:>6}{r['compile_s']:>10.2f}"
              f"{1e3 * r['step_s_median']:>9.1f}{r['tokens_per_s_median']:>11,.0f}{mfu:>7}"
              f"{r['peak_memory_mib']:>10,.0f}", flush=True)
    path = write("inner_step", {"args": vars(args), "results": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
