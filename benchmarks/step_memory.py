"""Compiled memory of the plain trainer's jitted step for each remat policy and loss chunk.

    python benchmarks/step_memory.py                            # 135m, batch 16 x 1024, every policy
    python benchmarks/step_memory.py --model 1b --vocab 32768 --batch 8 --seq 1024

XLA's memory analysis of the compiled programs (nothing runs, nothing is allocated, so any batch
compiles on a laptop): temp is what a program allocates beyond its arguments and outputs, for the
whole train step and for the loss's value and gradients alone, beside the count of what a GPU step
keeps for its backward pass (activations under the policy, one loss chunk's logits).
Writes benchmarks/results/step_memory_<model>.json; docs/experiments.md#inner-step-memory has the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

from diloco.config import DataConfig, InnerConfig, MeshConfig, ModelConfig, RunConfig, TrainConfig, from_dict
from diloco.model import abstract_params, count_params, with_params
from diloco.train.mesh import make_mesh
from diloco.train.footprint import activation_bytes
from diloco.train.step import make_loss
from diloco.train.trainer import compile_steps

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MIB = 2 ** 20


def measure(model_cfg: ModelConfig, vocab: int, batch: int, seq: int) -> dict:
    cfg = TrainConfig(model=model_cfg, data=DataConfig(batch_size=batch, seq_len=seq), inner=InnerConfig(),
                      mesh=MeshConfig(devices=1), run=RunConfig(steps=10_000))
    # Abstract params: the step is lowered and compiled from shapes only, nothing is allocated.
    params = abstract_params(model_cfg, vocab)
    model = with_params(model_cfg, vocab, params)
    compiled = compile_steps(model, cfg, make_mesh(cfg.mesh, batch))
    batch_BxL1 = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    t0 = time.perf_counter()
    step = compiled.train_step.lower(compiled.abstract_state, batch_BxL1).compile().memory_analysis()
    # The loss and its gradients alone: the step's peak can sit in the optimizer's update, after
    # the backward pass has freed the activations that remat and the chunked loss shrink.
    loss = make_loss(model, chunk=model_cfg.loss_chunk)
    grad = jax.jit(jax.value_and_grad(lambda p, b: loss(p, b)[0])).lower(params, batch_BxL1).compile()
    # What a GPU step keeps for its backward pass, by count (diloco/train/footprint.py): XLA's CPU
    # scheduler runs jax.checkpoint's recomputation during the forward pass, so the CPU figures
    # above do not show what remat saves (docs/experiments.md#inner-step-memory).
    gpu = activation_bytes(model_cfg, batch, seq, vocab, "gpu")
    return {"remat": model_cfg.remat, "loss_chunk": model_cfg.loss_chunk, "attention": model_cfg.attention,
            "gpu_activations_mib": round(gpu["activations"] / MIB, 1), "gpu_logits_mib": round(gpu["logits"] / MIB, 1),
            "step_temp_mib": round(step.temp_size_in_bytes / MIB, 1),
            "step_argument_mib": round(step.argument_size_in_bytes / MIB, 1),
            "step_output_mib": round(step.output_size_in_bytes / MIB, 1),
            "grad_temp_mib": round(grad.memory_analysis().temp_size_in_bytes / MIB, 1),
            "compile_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="135m")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--remat", nargs="+", default=["none", "dots", "full"])
    p.add_argument("--loss-chunk", nargs="+", type=int, default=[0, 256])
    p.add_argument("--attention", default="auto")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    base = from_dict(ModelConfig, yaml.safe_load((CONFIGS / "model" / f"{args.model}.yaml").read_text()))
    rows = []
    print(f"{'remat':<6}{'chunk':>6}{'step temp MiB':>15}{'grad temp MiB':>15}{'args MiB':>10}"
          f"{'GPU est. MiB':>14}{'compile s':>11}", flush=True)
    for remat in args.remat:
        for chunk in args.loss_chunk:
            cfg = dataclasses.replace(base, remat=remat, loss_chunk=chunk, attention=args.attention)
            r = measure(cfg, args.vocab, args.batch, args.seq)
            rows.append(r)
            gpu = r["gpu_activations_mib"] + r["gpu_logits_mib"]
            print(f"{remat:<6}{chunk:>6}{r['step_temp_mib']:>15,.1f}{r['grad_temp_mib']:>15,.1f}"
                  f"{r['step_argument_mib']:>10,.1f}{gpu:>14,.1f}{r['compile_s']:>11.1f}", flush=True)
    params = count_params(abstract_params(base, args.vocab))
    path = write(f"step_memory_{args.model}", {"args": vars(args), "params": params, "results": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
