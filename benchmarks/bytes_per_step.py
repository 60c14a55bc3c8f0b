"""Bytes per inner step per learner, both directions, measured from serialized messages in a sim
run, against the analytic figure and against what data parallel would send for the same steps.

    python benchmarks/bytes_per_step.py                       # small model, M = 4, H = P = 24, int4
    python benchmarks/bytes_per_step.py --codecs int4 bf16 --zstd 0 1

Analytic payload per fragment send: the codec's exact size for every tensor (values x bits / 8
plus one float32 scale per 64-value block for the block codecs). Data parallel: a bf16 ring
all-reduce among the same M learners every step, 2 (M - 1) / M x N x 2 bytes sent per learner.
Writes benchmarks/results/bytes_per_step.json.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

from diloco.algo.codecs import make_codec  # noqa: E402
from diloco.config import (CodecConfig, DataConfig, FragmentsConfig, InnerConfig, ModelConfig,  # noqa: E402
                           RunConfig, RuntimeConfig, TrainConfig, from_dict, validate)
from diloco.data import load_corpus  # noqa: E402
from diloco.model import build, count_params  # noqa: E402
from diloco.bandwidth.analytic import dp_bytes_per_step  # noqa: E402
from diloco.runtime import build as build_setup, sim  # noqa: E402

import yaml  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def measure(base: TrainConfig, corpus, model, up: str, zstd: int) -> dict:
    cfg = replace(base, codec=CodecConfig(up=up, down=up if up != "2bit" else "int4", zstd_level=zstd))
    setup = build_setup.build(cfg, corpus, model)
    _, summary = sim.run(cfg, setup, None, None)
    M, steps, H = cfg.runtime.learners, cfg.run.steps, cfg.fragments.H
    n = count_params(model.params)
    codec = make_codec(up, block=cfg.codec.block)
    down_codec = make_codec(cfg.codec.down, block=cfg.codec.block)
    sends = steps // H  # every fragment leaves each learner once per H steps
    up_payload = sends * sum(codec.payload_bytes(tuple(x.shape)) for f in setup.theta0 for x in f.values())
    down_payload = sends * sum(down_codec.payload_bytes(tuple(x.shape)) for f in setup.theta0 for x in f.values())
    per_learner_step = lambda b: b / (M * steps)  # noqa: E731
    measured_up, measured_down = per_learner_step(summary["bytes_up"]), per_learner_step(summary["bytes_down"])
    dp = dp_bytes_per_step(n, M)
    return {
        "codec_up": up, "codec_down": cfg.codec.down, "zstd": zstd, "params": n, "learners": M, "H": H,
        "fragments": cfg.fragments.count, "steps": steps,
        "up_bytes_per_step": measured_up, "down_bytes_per_step": measured_down,
        "analytic_up_payload_per_step": up_payload / steps, "analytic_down_payload_per_step": down_payload / steps,
        "up_over_analytic": measured_up / (up_payload / steps),
        "dp_bytes_per_step": dp,
        "dp_over_diloco_sent": dp / measured_up,
        # Through one learner's link, both directions: DP sends and receives dp per step.
        "dp_over_diloco_link": 2 * dp / (measured_up + measured_down),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--codecs", nargs="+", default=["int4", "bf16", "fp32"])
    p.add_argument("--zstd", nargs="+", type=int, default=[0, 1])
    p.add_argument("--H", type=int, default=24)
    p.add_argument("--fragments", type=int, default=24)
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model_cfg = from_dict(ModelConfig, yaml.safe_load((CONFIGS / "model" / f"{args.model}.yaml").read_text()))
    base = validate(TrainConfig(
        model=model_cfg, data=DataConfig(source="synthetic", seq_len=32, batch_size=2, data_dir="data",
                                         synthetic_vocab=256, synthetic_tokens=100_000),
        inner=InnerConfig(warmup_steps=4), run=RunConfig(steps=args.H * 2, progress=False),
        algo="diloco",
        # Steady state: the final flush at the end of a run would add one send per fragment.
        fragments=FragmentsConfig(count=args.fragments, H=args.H, tau=2, final_sync=False),
        runtime=RuntimeConfig(learners=args.learners, devices_per_learner=1)))
    corpus = load_corpus(base.data)
    model = build(base.model, corpus.vocab_size, seed=0)
    rows = [measure(base, corpus, model, c, z) for c in args.codecs for z in args.zstd]
    path = write("bytes_per_step", {"args": vars(args), "results": rows}, args.out)
    print(f"{'up':<6}{'zstd':>5}{'up B/step':>12}{'analytic':>12}{'ratio':>8}{'down B/step':>13}"
          f"{'DP B/step':>13}{'DP/sent':>9}{'DP/link':>9}")
    for r in rows:
        print(f"{r['codec_up']:<6}{r['zstd']:>5}{r['up_bytes_per_step']:>12,.0f}{r['analytic_up_payload_per_step']:>12,.0f}"
              f"{r['up_over_analytic']:>8.3f}{r['down_bytes_per_step']:>13,.0f}{r['dp_bytes_per_step']:>13,.0f}"
              f"{r['dp_over_diloco_sent']:>9.1f}{r['dp_over_diloco_link']:>9.1f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
