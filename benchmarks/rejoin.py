"""Recovery times: a learner killed mid-run until its first merged contribution after rejoining
(threads runtime), and a syncer restored from its Orbax checkpoint.

    python benchmarks/rejoin.py --model small --steps 120 --kill-at 40

The learner figure splits into the restart delay (runtime.restart_s, a modelled constant), the
rebuild (restore of its checkpointed optimizer state, parameters from the syncer's Theta) and the
wait until the syncer merges a contribution of the new incarnation (at most about H / P steps plus
a grace window). The syncer figure is the restore of a checkpoint of the same run's syncer.
Writes benchmarks/results/rejoin.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import first_merge_of, write  # noqa: E402

from diloco.config import (DataConfig, FragmentsConfig, ModelConfig, RunConfig, RuntimeConfig,  # noqa: E402
                           SyncerConfig, TrainConfig, from_dict, validate)
from diloco.data import load_corpus  # noqa: E402
from diloco.model import build  # noqa: E402
from diloco.runtime import build as build_setup  # noqa: E402
from diloco.runtime import threads  # noqa: E402
from diloco.runtime.syncer_ckpt import SyncerCheckpoints  # noqa: E402
from diloco.runtime.unit import LearnerUnit  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--kill-at", type=int, default=40, help="learner 1's step at which it is killed")
    p.add_argument("--restart-s", type=float, default=1.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model_cfg = from_dict(ModelConfig, yaml.safe_load((CONFIGS / "model" / f"{args.model}.yaml").read_text()))
    tmp = Path(tempfile.mkdtemp(prefix="rejoin-"))
    cfg = validate(TrainConfig(
        model=model_cfg, data=DataConfig(source="synthetic", seq_len=64, batch_size=8, synthetic_vocab=256,
                                         synthetic_tokens=200_000, data_dir=str(tmp / "data")),
        run=RunConfig(steps=args.steps, progress=False, log_every=0, eval_every=0, out_dir=str(tmp / "run")),
        algo="diloco", fragments=FragmentsConfig(count=4, H=8, tau=1), syncer=SyncerConfig(quorum=1),
        runtime=RuntimeConfig(kind="threads", learners=2, devices_per_learner=1, restart_s=args.restart_s,
                              learner_checkpoint_every=10, max_rejoin_staleness=1000)))
    corpus = load_corpus(cfg.data)
    model = build(cfg.model, corpus.vocab_size, seed=0)
    setup = build_setup.build(cfg, corpus, model)
    rt = threads.Threads(cfg, setup, None, None, None, tmp / "learners")
    plain_step, killed_at = LearnerUnit.step, []

    def step(unit, *a, **k):
        if unit.learner == 1 and unit.ls.incarnation == 0 and unit.ls.step == args.kill_at and not killed_at:
            killed_at.append(rt.clock())
            rt.kill(1)
        return plain_step(unit, *a, **k)
    LearnerUnit.step = step
    try:
        summary = rt.run()
    finally:
        LearnerUnit.step = plain_step
    merged = [r["at"] for r in rt.syncer.decisions
              if r["event"] == "merge" and 1 in r["learners"] and r["at"] > killed_at[0]]
    first = first_merge_of(rt.syncer.decisions, 1, 1)
    learner = {"killed_at_s": killed_at[0], "first_merge_after_rejoin_s": first,
               "kill_to_first_merge_s": first - killed_at[0], "restart_s": args.restart_s,
               "rejoin": rt.rejoins[0]._asdict(), "merges_with_learner_1_after_kill": len(merged),
               "token_ledger_imbalance": summary["token_ledger_imbalance"]}

    ckpts = SyncerCheckpoints(tmp / "syncer", every=1)
    ckpts.save(rt.syncer, 0)
    ckpts.manager.wait_until_finished()
    start = time.perf_counter()
    restored, _ = ckpts.latest(setup.policy, setup.fragments)
    restore_s = time.perf_counter() - start
    ckpts.close()
    result = {"model": args.model, "params": int(sum(x.size for f in setup.theta0 for x in f.values())),
              "learner_threads": learner, "syncer_restore_s": restore_s}
    print(result)
    print("wrote", write("rejoin", result, args.out))


if __name__ == "__main__":
    main()
