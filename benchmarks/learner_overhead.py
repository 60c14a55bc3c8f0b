"""Tokens/s of a Decoupled DiLoCo learner against the plain trainer, same model and devices.

    python benchmarks/learner_overhead.py --model small --devices 2 --steps 48 -P 24 -H 24 --tau 2
    python benchmarks/learner_overhead.py --model 1b --vocab 32768 --devices 1 --batch 8 --seq 1024 \
        --steps 24 --encode host                    # an accelerator (benchmarks/accelerator.py)
    python benchmarks/learner_overhead.py --checkpoint smollm2 --sft --devices 1 --batch 2 --seq 256 \
        --steps 3 --repeats 3 -P 4 -H 8 [--lora-rank 8]     # fine-tuning SmolLM2-135M (docs/finetuning.md)

The learner runs the same jitted inner step plus its per-step work, as the wall-clock learner
loop (diloco/runtime/learner_loop.py) does it, waiting for each step to end: applying merged
fragments tau steps later (fed back by a local syncer with K = 1), counters, and the due
fragment's send. `--encode device` (the default) dispatches the int4 encode on the devices at the
step and copies only its packed payload to the host; `--encode host` copies the fragment's params
and encodes them on the host (docs/design.md#encoding-on-the-device). Either way the frame is
finished after the next step is dispatched (`--no-defer`: at once, before the next step). Both
loops are timed alternately in one process, `--repeats` blocks each. Besides tokens/s it times
the learner's host work per step: on the critical path (apply_due, `unit_send.start`: the
device encode's dispatch or the params' device copy, the schedule's counters) and the frame
(`unit_send.frame`: collecting the payload, zstd, checksum, frame, and on the host path the encode itself),
which runs while the devices compute (with --no-defer it runs inside step(), on the path, and its
time includes waiting for the step to end). `host_bytes` counts the contributions' bytes copied
from the devices to the host. On the CPU backend a dispatch may run its computation inline, so
there `start` of the device path counts the encode itself. Goal: >= 0.99x; critical host work
<= 0.3% of a step. Writes benchmarks/results/learner_overhead.json.

With --checkpoint the model is that checkpoint (as model.init_from) and, with --sft, the batches
are packed rows of the record task's conversations (diloco/experiments/records.py) with the
masked loss; --lora-rank trains LoRA adapters on it instead (finetune.lora). The figures then
also give the plain step's compile time and the process's peak memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import tempfile
import sys
import time
from pathlib import Path

import jax
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

from diloco.algo import syncer as sync  # noqa: E402
from diloco.config import (DataConfig, FinetuneConfig, FragmentsConfig, InnerConfig, LoraConfig,  # noqa: E402
                           ModelConfig, RunConfig, RuntimeConfig, TrainConfig, from_dict, validate)
from diloco.data import load_corpus, train_batch, trained_tokens  # noqa: E402
from diloco.experiments import records  # noqa: E402
from diloco.inputs import load_inputs  # noqa: E402
from diloco.model import build  # noqa: E402
from diloco.runtime import build as build_setup  # noqa: E402
from diloco.runtime import unit as unit_mod  # noqa: E402
from diloco.runtime import unit_send  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="a preset of configs/model/")
    p.add_argument("--dtype", default="", help="float32|bfloat16: the activation dtype (default: the preset's)")
    p.add_argument("--vocab", type=int, default=256, help="the synthetic tokens' vocabulary, hence the model's")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("-P", "--fragments", type=int, default=24)
    p.add_argument("-H", "--sync-every", type=int, default=24)
    p.add_argument("--tau", type=int, default=2)
    p.add_argument("--no-defer", action="store_true", help="frame each step's fragment before the next step")
    p.add_argument("--encode", choices=("device", "host"), default="device",
                   help="where the block codec's encode runs (UnitSpec.device_encode)")
    p.add_argument("--checkpoint", default="", help="a HF folder, a .gguf or smollm2: start from it")
    p.add_argument("--sft", action="store_true", help="the record task's chats, masked loss (needs --checkpoint)")
    p.add_argument("--lora-rank", type=int, default=0, help="> 0: train LoRA adapters (needs --checkpoint)")
    p.add_argument("--lora-targets", default="q,k,v,o,gate,up,down", help="as configs/finetune/lora.yaml")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model_cfg = from_dict(ModelConfig, yaml.safe_load((CONFIGS / "model" / f"{args.model}.yaml").read_text()))
    if args.dtype:
        model_cfg = dataclasses.replace(model_cfg, dtype=args.dtype)
    data = DataConfig(source="synthetic", seq_len=args.seq, batch_size=args.batch, synthetic_vocab=args.vocab,
                      synthetic_tokens=max(200_000, 4 * args.batch * args.seq))
    inner, finetune = InnerConfig(warmup_steps=0), FinetuneConfig()
    if args.checkpoint:
        from diloco.generation import resolve

        model_cfg = ModelConfig(init_from=str(resolve(args.checkpoint)), dtype=args.dtype or "float32")
        inner = InnerConfig(warmup_steps=0, lr=1e-4)
        finetune = FinetuneConfig(lora=LoraConfig(rank=args.lora_rank, targets=tuple(args.lora_targets.split(","))))
    if args.sft:
        chats = records.write_jsonl(Path(tempfile.mkdtemp()) / "train.jsonl", records.splits(0, 1000, 1)[0])
        data = DataConfig(source="sft", paths=(str(chats),), seq_len=args.seq, batch_size=args.batch,
                          data_dir=str(chats.parent))
    cfg = validate(TrainConfig(
        model=model_cfg, data=data, inner=inner, finetune=finetune,
        run=RunConfig(steps=10_000, progress=False), algo="diloco",
        fragments=FragmentsConfig(count=args.fragments, H=args.sync_every, tau=args.tau),
        runtime=RuntimeConfig(learners=1, devices_per_learner=args.devices)))
    if args.checkpoint:
        cfg, corpus, model, _ = load_inputs(cfg)
    else:
        corpus = load_corpus(cfg.data)
        model = build(cfg.model, corpus.vocab_size, seed=0)
    t_build = time.perf_counter()
    setup = build_setup.build(cfg, corpus, model)
    setup = setup._replace(spec=setup.spec._replace(device_encode=args.encode == "device"))
    build_s = time.perf_counter() - t_build
    syncer = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0})
    unit = build_setup.new_unit(setup, 0, 0, syncer)
    compiled = setup.compiled[0]
    state = compiled.init(jax.device_put(model.params, compiled.state_sharding.params))

    def batch(i: int):
        return train_batch(corpus.train, seed=0, learner=0, num_learners=1, step=i, batch_size=args.batch,
                           seq_len=args.seq)

    # Trained tokens of a step: every predicted token of a window, the assistant's of packed rows.
    # The learner draws the same batches at the same steps, so both loops count alike.
    tokens = sum(trained_tokens(batch(i)) for i in range(args.steps)) / args.steps

    # Host work, timed piece by piece: on the CPU backend a "dispatch" may run the step inline, so
    # the time of a whole step() call would count device compute as host work.
    host = {"apply": [], "start": [], "counters": [], "finish": [], "frame_work": [], "host_encode": []}

    def timed(owner, name: str, key: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                host[key].append(time.perf_counter() - t0)
        setattr(owner, name, wrapper)

    timed(unit_send, "start", "start")  # at the step: on the critical path
    timed(unit_send, "frame", "frame_work")  # wherever it runs
    timed(unit_send, "encode_host", "host_encode")  # inside frame, host path only
    timed(unit_mod.lsm, "after_step", "counters")
    timed(unit_mod, "trained_tokens", "counters")

    def plain(n: int) -> float:
        nonlocal state
        t = time.perf_counter()
        for i in range(n):
            state, metrics = compiled.train_step(state, jax.device_put(batch(i), compiled.batch_sharding))
        jax.block_until_ready(metrics)
        return n * tokens / (time.perf_counter() - t)

    def feed(frames) -> float:
        """The syncer's merge runs elsewhere in a real deployment: its time is taken out."""
        nonlocal syncer
        t_sync = time.perf_counter()
        unchecked = setup.policy._replace(claim_slack=None)  # no step reports reach this syncer
        for frame in frames:
            syncer, actions = sync.on_contribution(unchecked, syncer, frame, 0.0)
            for a in actions:
                if isinstance(a, sync.Publish):
                    unit.receive(a.frames[0])
        return time.perf_counter() - t_sync

    sent = 0  # contributions framed in the timed blocks

    def learner(n: int) -> float:
        nonlocal sent
        t, elsewhere = time.perf_counter(), 0.0
        for _ in range(n):
            t0 = time.perf_counter()
            unit.apply_due()
            host["apply"].append(time.perf_counter() - t0)
            result = unit.step(defer=not args.no_defer)
            sent += len(result.sends)
            frames = result.frames
            if unit.deferred > 1:  # the previous step's frames, while this one runs
                t0 = time.perf_counter()
                frames = unit.finish()[0]
                host["finish"].append(time.perf_counter() - t0)
            jax.block_until_ready(unit.state)  # as the wall-clock loop does, to time its steps
            elsewhere += feed(frames)
        while unit.deferred:
            elsewhere += feed(unit.finish()[0])
        jax.block_until_ready(unit.state.params)
        return n * tokens / (time.perf_counter() - t - elsewhere)

    t_first = time.perf_counter()
    plain(1)  # compiles the train step (the learner's is the same executable)
    first_s = time.perf_counter() - t_first
    unit.warm_up()  # compiles the device encoder of every fragment shape
    plain(2), learner(3)  # warm up both paths
    for v in host.values():
        v.clear()
    sent, unit.host_bytes = 0, 0
    rates = {"plain": [], "learner": []}
    for _ in range(args.repeats):
        rates["plain"].append(plain(args.steps))
        rates["learner"].append(learner(args.steps))
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratios = [a / b for a, b in zip(rates["learner"], rates["plain"])]
    step_s = tokens / med["plain"]
    compile_s = first_s - step_s  # the first call less a warm step
    # Host work per step: means (a send step costs more than a quiet one; the mean is the share).
    steps = args.repeats * args.steps
    mean = {k: sum(v) / steps for k, v in host.items()}
    # With --no-defer the frame is on the critical path too, and its time includes waiting for
    # the step (its device_get syncs), so it is no host-work figure: compare frame_work deferred.
    critical = mean["apply"] + mean["start"] + mean["counters"]
    result = {"args": vars(args), "tokens_per_s": rates, "median": med, "ratio": med["learner"] / med["plain"],
              "ratio_per_block": ratios, "ratio_spread": [min(ratios), max(ratios)], "plain_step_s": step_s,
              "host_s_per_step": mean, "critical_host_s_per_step": critical,
              "critical_host_share": critical / step_s,
              "frame_share": mean["frame_work"] / step_s,
              "contributions": sent, "host_bytes_per_step": unit.host_bytes / steps,
              "host_bytes_per_contribution": unit.host_bytes / max(sent, 1),
              "params": sum(x.size for x in jax.tree.leaves(model.params)),
              "trained_tokens_per_step": tokens, "plain_compile_s": compile_s, "build_s": build_s,
              # ru_maxrss is KiB on Linux: the whole process, both loops' states included
              "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    path = write("learner_overhead", result, args.out)
    print(f"plain {med['plain']:,.0f} tok/s   learner {med['learner']:,.0f} tok/s   ratio {result['ratio']:.3f} "
          f"[{min(ratios):.3f}, {max(ratios):.3f}] n={len(ratios)}   critical host work "
          f"{100 * result['critical_host_share']:.2f}% of a step, frame "
          f"{100 * result['frame_share']:.2f}%   {args.encode} encode: device->host "
          f"{result['host_bytes_per_step'] / 2**20:.2f} MiB/step, "
          f"{result['host_bytes_per_contribution'] / 2**20:.2f} MiB/contribution   plain step {step_s:.3f} s, "
          f"compile {compile_s:.1f} s, peak RSS {result['peak_rss_gb']:.2f} GB   (wrote {path})")


if __name__ == "__main__":
    main()
