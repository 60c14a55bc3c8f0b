"""A sim run stopped mid-way and resumed from its latest snapshot ends exactly where the
uninterrupted run does: same Theta bit for bit, same summary (less the syncer's real seconds),
same decisions, same input log."""

from dataclasses import replace

import numpy as np
import pytest

from diloco.algo import syncer as sync
from diloco.config import ChaosConfig, validate
from diloco.runtime import sim as sim_mod
from diloco.runtime.runlog import InputLog, input_offset, read_decisions, read_inputs
from diloco.runtime.summary import replayable
from test_sim import build, corpus, make_cfg, model  # noqa: F401  (fixtures)


def cfg_for(tmp, name, resume=False, eager=False):
    """K = 1 with grace, P = 2, int4 with error feedback up, int8 down, Nesterov, a chaos tape with
    failures and a scavenged learner: every kind of state a snapshot must carry. `eager`: eager outer
    steps with tau = 5 > H = 4 (their anchors and stand-ins in flight too)."""
    eager_groups = dict(fragments=dict(tau=5, eager=True), syncer=dict(anchor="base")) if eager else {}
    cfg = make_cfg(tmp, steps=24, fragments=dict(count=2, H=4, tau=1), syncer=dict(quorum=1),
                   outer=dict(name="nesterov", lr=0.7, momentum=0.9),
                   codec=dict(up="int4", down="int8", error_feedback=True),
                   runtime=dict(speeds=(1.0, 1.3), jitter=0.1, restart_s=1.0, learner_checkpoint_every=4))
    chaos = ChaosConfig(enabled=True, slices_per_learner=2, chips_per_slice=1, mtbi_s=60.0, repair="fixed",
                        repair_mean_s=3.0, scavenge=((5.0, 15.0),), seed=1)
    run = replace(cfg.run, out_dir=str(tmp / name), checkpoint_every=3, keep_checkpoints=2, resume=resume)
    cfg = replace(cfg, chaos=chaos, run=run)
    if eager:
        cfg = replace(cfg, fragments=replace(cfg.fragments, **eager_groups["fragments"]),
                      syncer=replace(cfg.syncer, **eager_groups["syncer"]))
    return validate(cfg)


@pytest.mark.parametrize("eager", [False, pytest.param(True, marks=pytest.mark.slow)])  # eager: 25-50 s
def test_resume_from_a_snapshot_equals_the_uninterrupted_run(tmp_path, build, eager):
    whole = cfg_for(tmp_path, "whole", eager=eager)
    setup = build(whole)
    a, summary_a = sim_mod.run(whole, setup, tmp_path / "whole", None)
    assert a.rejoins and summary_a["token_ledger_imbalance"] == 0

    cut = cfg_for(tmp_path, "cut", eager=eager)
    b, none = sim_mod.run(cut, setup, tmp_path / "cut", None, stop=lambda s: s.steps_done >= 31)
    assert none is None and b.steps_done == 31
    c, summary_c = sim_mod.run(cfg_for(tmp_path, "cut", resume=True, eager=eager), setup, tmp_path / "cut", None)

    assert replayable(summary_c) == replayable(summary_a)  # real seconds aside
    for x, y in zip(sync.theta(a.syncer).values(), sync.theta(c.syncer).values()):
        np.testing.assert_array_equal(x, y)
    assert read_decisions(tmp_path / "cut" / "decisions.jsonl") == read_decisions(tmp_path / "whole" / "decisions.jsonl")
    # The resumed log kept its prefix in place and appended the rest: byte for byte the whole run's.
    assert (tmp_path / "cut" / "syncer_inputs.bin").read_bytes() == (tmp_path / "whole" / "syncer_inputs.bin").read_bytes()
    for ua, uc in zip(a.units, c.units):
        assert ua.ls == uc.ls
        for x, y in zip(*(np.concatenate([np.ravel(l) for l in jax_leaves(u.state)]) for u in (ua, uc))):
            assert x == y


def test_sigterm_saves_a_final_snapshot_and_resume_finishes_the_run(tmp_path, build):
    """SIGTERM after step 13 (between the periodic snapshots at 12 and 18): the sim takes one more step,
    saves a snapshot there and raises KeyboardInterrupt; resuming ends where the whole run does."""
    import os
    import signal

    whole = cfg_for(tmp_path, "whole")
    setup = build(whole)
    a, summary_a = sim_mod.run(whole, setup, tmp_path / "whole", None)

    def term(sim):
        if sim.steps_done == 13 and not sim.interrupted:
            os.kill(os.getpid(), signal.SIGTERM)
        return False

    with pytest.raises(KeyboardInterrupt):
        sim_mod.run(cfg_for(tmp_path, "term"), setup, tmp_path / "term", None, stop=term)
    assert signal.getsignal(signal.SIGTERM) is not None  # the previous handler is back
    assert 14 in {int(p.name) for p in (tmp_path / "term" / "sim").iterdir() if p.name.isdigit()}
    c, summary_c = sim_mod.run(cfg_for(tmp_path, "term", resume=True), setup, tmp_path / "term", None)
    assert replayable(summary_c) == replayable(summary_a)  # real seconds aside
    for x, y in zip(sync.theta(a.syncer).values(), sync.theta(c.syncer).values()):
        np.testing.assert_array_equal(x, y)


def jax_leaves(tree):
    import jax
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(tree))]


def test_resume_without_a_snapshot_starts_from_the_beginning(tmp_path, build):
    cfg = cfg_for(tmp_path, "fresh", resume=True)
    sim, summary = sim_mod.run(cfg, build(cfg), tmp_path / "fresh", None)
    assert summary is not None and all(u.ls.step == 24 for u in sim.units[:2])


def test_input_offset_skips_payloads_and_counts_records(tmp_path):
    """The byte after the first n records, found from the headers alone, is where a resumed log is
    cut: what is kept reads back as the first n inputs."""
    from diloco.algo.replay import Input

    path = tmp_path / "syncer_inputs.bin"
    log = InputLog(path)
    events = [Input("live", 0.0, ((0, 0),)), Input("contribution", 1.0, bytes(range(256)) * 40),
              Input("deadline", 2.0, 1), Input("contribution", 3.0, b"x" * 7)]
    ends = []
    for e in events:
        log.append(e)
        ends.append(log.offset())
    log.close()
    assert [input_offset(path, n) for n in range(5)] == [0, *ends]
    with pytest.raises(ValueError, match="fewer than the 5 input records"):
        input_offset(path, 5)
    InputLog(path, keep=input_offset(path, 2)).close()
    assert [(e.kind, e.at, e.data) for e in read_inputs(path)] == [(e.kind, e.at, e.data) for e in events[:2]]


@pytest.mark.slow  # 15 s
def test_resume_where_merges_sum_an_eager_learners_sends(tmp_path, build):
    """M = K = 2, learner 1 three times slower, tau = 4 > H = 2, Nesterov: learner 0's sends are summed
    two or three to a merge, so its stand-ins carry a part of the momentum's move each
    (docs/algorithm.md#eager-outer-steps). The snapshot carries that part: resumed, the run ends bit
    for bit where the whole one does (dropped, every value of Theta differed)."""
    def cfg(name, resume=False):
        c = make_cfg(tmp_path, steps=24, runtime=dict(speeds=(1.0, 3.0)), fragments=dict(H=2, tau=4, eager=True),
                     syncer=dict(anchor="base"), outer=dict(name="nesterov", lr=0.7, momentum=0.9))
        return validate(replace(c, run=replace(c.run, out_dir=str(tmp_path / name), checkpoint_every=3,
                                               keep_checkpoints=2, resume=resume)))

    setup = build(cfg("whole"))
    a, _ = sim_mod.run(cfg("whole"), setup, tmp_path / "whole", None)
    assert a.units[0].sends_per_merge[0] > 1.0
    sim_mod.run(cfg("cut"), setup, tmp_path / "cut", None, stop=lambda s: s.steps_done >= 23)
    c, _ = sim_mod.run(cfg("cut", resume=True), setup, tmp_path / "cut", None)
    for x, y in zip(sync.theta(a.syncer).values(), sync.theta(c.syncer).values()):
        np.testing.assert_array_equal(x, y)
