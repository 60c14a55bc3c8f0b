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
from conftest import diloco_world, tiny_cfg

from diloco.runtime import sim

GOLDEN = Path(__file__).parent / "golden" / "tiny_diloco_sim.json"


def test_golden_diloco_sim_run(tmp_path):
    # tests/test_conformance.py's one-layer tiny run, with M = 3 learners, one of them slower.
    cfg = tiny_cfg(tmp_path, model=dict(n_layers=1, d_ff=64), inner=dict(warmup_steps=2),
                   data=dict(seq_len=16, batch_size=8, synthetic_tokens=20_000),
                   run=dict(steps=24, log_every=4, eval_every=4, eval_batches=2),
                   runtime=dict(learners=3, speeds=(1.0, 1.0, 1.5), jitter=0.1, learner_checkpoint_every=0))
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
