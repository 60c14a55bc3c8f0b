"""One tiny Decoupled DiLoCo config through every runtime: sim, threads and procs share one event
vocabulary, one booking host and (threads, procs) one learner loop, so each must give a balanced
token ledger, versions 1..n for every fragment, and a syncer its own input log rebuilds exactly."""

import json

import numpy as np
import pytest
from conftest import diloco_world, tiny_cfg

from diloco.algo import ledger, messages
from diloco.algo import syncer as sync
from diloco.algo.replay import replay
from diloco.config import TrainConfig
from diloco.runtime import procs, sim, threads
from diloco.runtime.runlog import read_decisions, read_inputs
from test_series import check_series

STEPS, M, P = 16, 2, 2
RUNTIMES = {"sim": sim.run, "threads": threads.run, "procs": procs.run, "ray": None}  # ray: imported when run


def make_cfg(root, kind: str) -> TrainConfig:
    """The tests' tiny run (tests/conftest.py) one layer deep, on shorter rows, K = M, no checkpoints."""
    return tiny_cfg(root, kind, model=dict(n_layers=1, d_ff=64), inner=dict(warmup_steps=2),
                    data=dict(seq_len=16, batch_size=8, synthetic_tokens=20_000),
                    run=dict(steps=STEPS, log_every=4, eval_every=8, eval_batches=1, out_dir=str(root / kind),
                             checkpoint_every=0),
                    syncer=dict(quorum=M), runtime=dict(learner_checkpoint_every=0))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("conformance")
    cfg = make_cfg(root, "sim")
    _, _, setup, evaluate_global, _ = diloco_world(cfg)
    return root, setup, evaluate_global


def run_ray(cfg, setup, run_dir, evaluate_global):
    """On a Ray instance of this machine the runtime starts itself, bound to 127.0.0.1 (see
    tests/test_ray.py's loopback); stopped again at the end."""
    pytest.importorskip("ray")
    from test_ray import loopback

    with pytest.MonkeyPatch.context() as mp:
        loopback(mp)
        return procs.run(cfg, setup, run_dir, evaluate_global)  # runtime.kind=ray: the Ray launcher


# procs and ray are slow here: the same checks of a procs run are in tests/test_procs.py's first test
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k in ("procs", "ray") else k
                                  for k in sorted(RUNTIMES)])
def test_every_runtime_balances_versions_and_replays(world, kind):
    root, setup, evaluate_global = world
    cfg = make_cfg(root, kind)
    run_dir = root / kind
    run_dir.mkdir(exist_ok=True)
    rt, summary = (RUNTIMES[kind] or run_ray)(cfg, setup, run_dir, evaluate_global)

    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    assert summary["token_ledger_imbalance"] == 0
    if kind not in ("procs", "ray"):  # their ledgers live in the syncer's process; its summary carries them
        ledger.check_balance(rt.tokens)
        assert rt.tokens.processed == (M * STEPS * tokens_per_step,) * P
    assert summary["merges"] > 0 and np.isfinite(summary["eval_loss"])
    check_series(cfg, run_dir, summary)  # every runtime writes the same series through the one writer

    decisions = read_decisions(run_dir / "decisions.jsonl")
    for p in range(P):
        versions = [d["version"] for d in decisions if d["event"] == "merge" and d["fragment"] == p]
        assert versions == list(range(1, len(versions) + 1)), (kind, p, versions)

    # Replaying the syncer's input log from Theta_0 remakes its decisions and its final Theta.
    inputs = list(read_inputs(run_dir / "syncer_inputs.bin"))
    # every learner told the syncer it finished, once, after its last contribution was delivered
    assert sorted(e.data for e in inputs if e.kind == "finished") == [(m, 0) for m in range(M)], kind
    for m in range(M):
        last = max(i for i, e in enumerate(inputs) if e.kind == "contribution"
                   and messages.decode(e.data, verify=False).header["learner"] == m)
        assert last < next(i for i, e in enumerate(inputs) if e.kind == "finished" and e.data[0] == m), kind
    again = replay(setup.policy, sync.init(setup.policy, setup.fragments, setup.theta0,
                                           {m: 0 for m in range(M)}), inputs)
    assert json.loads(json.dumps(list(again.decisions))) == decisions
    final = rt.theta if kind in ("procs", "ray") else sync.theta(rt.syncer)
    for path, x in sync.theta(again).items():
        np.testing.assert_array_equal(x, final[path], err_msg=f"{kind}: {path}")
