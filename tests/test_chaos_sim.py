"""Failures in the sim runtime, driven by chaos tapes: partial slices, death, rejoin under a new
incarnation from the syncer's Theta (and the learner's own checkpoint), scavenged learners."""

from dataclasses import replace

import numpy as np
import pytest

from diloco.algo import syncer as sync
from diloco.algo import timeline
from diloco.chaos import tapes
from diloco.chaos.tapes import Event, Tape
from diloco.config import ChaosConfig, validate
from diloco.runtime.rejoin import LearnerCheckpoints, rejoin_unit
from diloco.runtime.sim.runtime import Sim
from diloco.runtime.walltape import chaos_tape
from diloco.runtime.summary import replayable
from test_sim import build, corpus, make_cfg, model  # noqa: F401  (fixtures)

STEPS = 30


def cfg_for(tmp, **over):
    """M = 2 of batch 8, P = 2, H = 4, tau = 1, K = 1 with grace: Decoupled DiLoCo in miniature."""
    cfg = make_cfg(tmp, steps=STEPS, fragments=dict(count=2, H=4, tau=1), syncer=dict(quorum=1),
                   runtime=dict(restart_s=2.0, **over))
    return cfg


def tape(*events, learners=2, speeds=(1.0, 1.0)) -> Tape:
    return Tape(learners, 2, 1000.0, speeds, 0.0, 0, tuple(Event(*e) for e in events))


def training_uptime(sim) -> float:
    """Uptime over the training span (until the last inner step ends): the run's end also holds
    the last messages in flight after every learner finished, which no failure causes."""
    iv = timeline.intervals(sim.time)
    end = float(iv["end"][iv["state"] == timeline.STATES.index("compute")].max())
    return timeline.uptime(sim.time, 1, 0.0, end)


def run(cfg, setup, t, checkpoints=None):
    sim = Sim(cfg, setup, None, None, tape=t, checkpoints=checkpoints)
    summary = sim.run()
    assert summary["token_ledger_imbalance"] == 0
    assert sim.tokens.in_flight == {}
    assert summary["learner_deaths"] == len(sim.tokens.dead)  # every incarnation the tape ended
    return sim, summary


def test_a_learner_losing_a_slice_steps_with_half_the_batch(tmp_path, build):
    cfg = cfg_for(tmp_path)
    sim, _ = run(cfg, build(cfg), tape((5.0, "slice_down", 1, 0), (15.0, "slice_up", 1, 0)))
    seq = cfg.data.seq_len
    # learner 0: 30 full steps; learner 1: steps starting at t in [5, 15) (10 of them) at half size
    assert sim.tokens.processed[0] == (30 * 8 + 20 * 8 + 10 * 4) * seq
    assert sim.rejoins == [] and timeline.seconds(sim.time)[1]["down"] == 0.0
    # goodput counts live chips: half of those 10 steps' time is degraded, the learner still up
    secs = timeline.seconds(sim.time)[1]
    assert secs["degraded"] == pytest.approx(10 * 0.5) and secs["compute"] == pytest.approx(30 - 5.0)
    assert timeline.goodput(sim.time, 1) == pytest.approx(25 / 30) and training_uptime(sim) == 1.0


def test_a_dead_learner_rejoins_under_a_new_incarnation_and_the_run_never_stops(tmp_path, build):
    cfg = cfg_for(tmp_path)
    t = tape((6.0, "slice_down", 1, 0), (6.0, "slice_down", 1, 1),
             (14.0, "slice_up", 1, 0), (16.0, "slice_up", 1, 1))
    sim, summary = run(cfg, build(cfg), t)
    (how,) = sim.rejoins
    assert (how.learner, how.incarnation, how.restored_from) == (1, 1, None)
    assert how.step == 6  # it died at its step boundary t = 6, after 6 steps, and resumes there
    assert all(u.ls.step == STEPS for u in sim.units)
    secs = timeline.seconds(sim.time)[1]
    assert secs["down"] == pytest.approx(14.0 - 6.0) and secs["restarting"] == pytest.approx(2.0)
    assert training_uptime(sim) == 1.0  # learner 0 never stopped: zero global downtime
    assert 0 < summary["goodput"] < 1
    assert sim.syncer.live == {0: 0, 1: 1}
    # what the dead incarnation had not sent is lost; its late messages are dropped, never merged
    assert sum(sim.tokens.lost) > 0
    merged = [r for r in sim.syncer.decisions if r["event"] == "merge"]
    assert all(learner == 0 for r in merged if 6.5 < r["at"] < 16.0 for learner in r["learners"])
    assert any(1 in r["learners"] for r in merged if r["at"] > 18.0)


def test_rejoin_keeps_its_checkpointed_optimizer_state_only_when_fresh(tmp_path, build):
    t = tape((9.5, "slice_down", 1, 0), (9.5, "slice_down", 1, 1),
             (11.0, "slice_up", 1, 0), (11.0, "slice_up", 1, 1))
    for stale, restored in ((8, 8), (0, None)):
        cfg = cfg_for(tmp_path, max_rejoin_staleness=stale)
        ckpts = LearnerCheckpoints(tmp_path / f"ckpt-{stale}", every=4)
        sim, _ = run(cfg, build(cfg), t, ckpts)
        (how,) = sim.rejoins
        assert how.restored_from == restored, how
        assert how.staleness > 0  # the syncer merged learner 0's work meanwhile
        # at the step where it stopped, whatever it restored: the steps after its checkpoint are
        # merged or lost, never trained twice
        assert how.step == 10
        # rejoin_at=schedule: a rejoin (now, after the run) moved forward to the step the others
        # are at, whatever it restored; never moved back from its own
        setup = build(cfg)
        for at_least in (40, 3):
            unit, again = rejoin_unit(setup, 1, 9, sim.host.state, ckpts, stale, 10, at_least)
            assert again.step == unit.ls.step == int(unit.state.step) == max(10, at_least)


def test_a_scavenged_learner_joins_for_its_window_only(tmp_path, build):
    cfg = cfg_for(tmp_path)
    t = tape((3.0, "learner_add", 2), (12.0, "learner_remove", 2), learners=2, speeds=(1.0, 1.0, 1.0))
    sim, summary = run(cfg, build(cfg), t)
    assert [(r.learner, r.incarnation) for r in sim.rejoins] == [(2, 0)]
    secs = timeline.seconds(sim.time)[2]
    assert secs["down"] == 0.0 and secs["compute"] == pytest.approx(12.0 - 5.0)  # restart_s = 2
    merged_by = {m for r in sim.syncer.decisions if r["event"] == "merge" for m in r["learners"]}
    assert merged_by == {0, 1, 2}
    assert training_uptime(sim) == 1.0


def test_a_generated_chaos_run_is_deterministic(tmp_path, build):
    chaos = ChaosConfig(enabled=True, slices_per_learner=2, chips_per_slice=1, mtbi_s=40.0,
                        repair="fixed", repair_mean_s=4.0, seed=3)
    cfg = validate(replace(cfg_for(tmp_path), chaos=chaos))
    t = chaos_tape(cfg)
    assert any(e.kind == "slice_down" for e in t.events)
    setup = build(cfg)
    a, sa = run(cfg, setup, t)
    b, sb = run(cfg, setup, tapes.from_json(tapes.to_json(t)))
    assert replayable(sa) == replayable(sb)  # the syncer's real seconds differ
    for x, y in zip(sync.theta(a.syncer).values(), sync.theta(b.syncer).values()):
        np.testing.assert_array_equal(x, y)
    assert a.syncer.decisions == b.syncer.decisions


@pytest.mark.slow
def test_t9_a_killed_learner_rejoins_without_a_global_stall_and_the_loss_holds(tmp_path, build, corpus, model):
    """docs/experiments.md#t9-kill-and-rejoin at small scale: learner 1 of 2 dies for 20 of 120 steps and restarts from
    its checkpoint. Global downtime stays zero, its contributions after the rejoin are at most H
    versions stale, and the final loss is within seed noise of the failure-free runs (3 seeds)."""
    import jax

    from diloco.data import eval_batches
    from diloco.run import params_of
    from diloco.train.trainer import evaluate

    def final_loss(cfg, setup, t):
        sim, _ = run(cfg, setup, t, LearnerCheckpoints(tmp_path / f"ck{cfg.run.seed}{len(t.events)}", every=10))
        theta = sync.theta(sim.syncer)
        params = params_of(model, theta)
        compiled = setup.compiled[0]
        val = eval_batches(corpus.val, batch_size=8, seq_len=cfg.data.seq_len, n=4)
        return sim, evaluate(compiled, jax.device_put(params, compiled.state_sharding.params), val)

    H = 4
    kill = tape((40.0, "slice_down", 1, 0), (40.0, "slice_down", 1, 1),
                (60.0, "slice_up", 1, 0), (60.0, "slice_up", 1, 1))
    calm, hurt = [], []
    for seed in range(3):
        cfg = cfg_for(tmp_path, max_rejoin_staleness=100)
        cfg = replace(cfg, run=replace(cfg.run, steps=120, seed=seed))
        setup = build(cfg)
        calm.append(final_loss(cfg, setup, tape())[1])
        sim, loss = final_loss(cfg, setup, kill)
        hurt.append(loss)
        assert training_uptime(sim) == 1.0
        (how,) = sim.rejoins
        assert how.restored_from is not None
        after = [s for r in sim.syncer.decisions if r["event"] == "merge" and r["at"] > 62.0
                 for m, s in zip(r["learners"], r["staleness"]) if m == 1]
        assert after and max(after) <= H
    spread = max(calm) - min(calm)
    assert abs(np.mean(hurt) - np.mean(calm)) <= max(spread, 0.02 * np.mean(calm)), (calm, hurt)
