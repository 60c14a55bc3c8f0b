"""A short Decoupled DiLoCo run on the sim runtime, pinned: eval losses and the merges' delta norms.

The sim is deterministic (virtual clock, seeded jitter), so any change to the learner, syncer,
codecs, merge or outer step shows here. After an intended change, regenerate with
    UPDATE_GOLDEN=1 pytest tests/test_golden_diloco.py
and say why in the commit message.
"""

import json
import os
from pathlib import Path

import numpy as np
from conftest import diloco_world

from diloco.config import (DataConfig, FragmentsConfig, InnerConfig, ModelConfig, RunConfig, RuntimeConfig,
                           SyncerConfig, TrainConfig, validate)
from diloco.runtime import sim

GOLDEN = Path(__file__).parent / "golden" / "tiny_diloco_sim.json"
TINY = ModelConfig(name="tiny", d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64)


def test_golden_diloco_sim_run(tmp_path):
    data = DataConfig(source="synthetic", seq_len=16, batch_size=8, data_dir=str(tmp_path / "data"),
                      synthetic_vocab=16, synthetic_tokens=20_000, synthetic_branching=2)
    cfg = validate(TrainConfig(
        model=TINY, data=data, inner=InnerConfig(lr=1e-2, warmup_steps=2),
        run=RunConfig(steps=24, log_every=4, eval_every=4, eval_batches=2, progress=False, plot=False),
        algo="diloco", fragments=FragmentsConfig(count=2, H=4, tau=1), syncer=SyncerConfig(quorum=1),
        runtime=RuntimeConfig(kind="sim", learners=3, devices_per_learner=1, speeds=(1.0, 1.0, 1.5),
                              jitter=0.1, learner_checkpoint_every=0)))
    _, _, setup, evaluate_global, initial = diloco_world(cfg)
    rt, summary = sim.run(cfg, setup, None, evaluate_global)
    got = {"eval_losses": [loss for _, _, loss in rt.evals],
           "delta_norms": [r["delta_norm"] for r in rt.syncer.decisions if r["event"] == "merge"],
           "merges": summary["merges"]}
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=1))
    want = json.loads(GOLDEN.read_text())
    assert got["merges"] == want["merges"], "golden run changed; see the module docstring"
    np.testing.assert_allclose(got["eval_losses"], want["eval_losses"], rtol=1e-4,
                               err_msg="golden run changed; see the module docstring")
    np.testing.assert_allclose(got["delta_norms"], want["delta_norms"], rtol=1e-4)
    assert got["eval_losses"][-1] < initial - 0.3  # and the global model is learning
