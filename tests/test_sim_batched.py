"""sim's batched learners (runtime.batch_learners, docs/design.md#sim): learners whose steps fall
within one step of each other take them as one vmapped step over a learner axis, each with its
own data, state, counters and sends; the run books and merges what the one-by-one run does, its
numbers within float32 rounding of it, and it replays and resumes exactly."""

from dataclasses import replace

import jax
import numpy as np
import pytest

from diloco.algo import syncer as sync
from diloco.config import ConfigError, validate
from diloco.runtime import sim as sim_mod
from diloco.runtime.build import new_unit
from diloco.runtime.sim import batched
from diloco.runtime.summary import replayable
from test_sim import build, corpus, make_cfg, model  # noqa: F401  (fixtures)


def cfg_for(tmp, name, batch, **runtime):
    cfg = make_cfg(tmp, steps=16, fragments=dict(count=2, H=4, tau=1), syncer=dict(quorum=1),
                   codec=dict(up="int4", down="int8", error_feedback=True),
                   runtime=dict(learners=4, batch_learners=batch, **runtime))
    return replace(cfg, run=replace(cfg.run, out_dir=str(tmp / name)))


@pytest.fixture
def sizes(monkeypatch):
    """The size of every batched step the sim takes."""
    seen, real = [], batched.step_together

    def recording(units, rows, fetch):
        seen.append(len(units))
        return real(units, rows, fetch)

    monkeypatch.setattr(batched, "step_together", recording)
    return seen


@pytest.mark.parametrize("runtime", [{}, {"speeds": (1.0, 1.3, 1.0, 1.1), "jitter": 0.1}], ids=["in_phase", "jittered"])
def test_batched_learners_train_as_one_by_one(tmp_path, build, sizes, runtime):
    one = cfg_for(tmp_path, "one", "off", **runtime)
    setup = build(one)
    a, summary_a = sim_mod.run(one, setup, tmp_path / "one", None)
    assert sizes == []
    b, summary_b = sim_mod.run(cfg_for(tmp_path, "many", "on", **runtime), setup, tmp_path / "many", None)
    assert sizes and max(sizes) > 1 and sum(sizes) <= b.steps_done
    for key in ("merges", "tokens_processed", "token_ledger_imbalance", "quarantined"):
        assert summary_b[key] == summary_a[key], key
    assert summary_b["token_ledger_imbalance"] == 0
    for x, y in zip(sync.theta(a.syncer).values(), sync.theta(b.syncer).values()):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-6)
    for ua, ub in zip(a.units, b.units):
        assert ua.ls.step == ub.ls.step and ua.ls.versions == ub.ls.versions


def test_a_batched_run_repeats_and_resumes_exactly(tmp_path, build, sizes):
    whole = cfg_for(tmp_path, "whole", "on", speeds=(1.0, 1.3, 1.0, 1.1), jitter=0.1)
    setup = build(whole)
    a, summary_a = sim_mod.run(whole, setup, tmp_path / "whole", None)
    assert max(sizes) > 1
    cut = replace(cfg_for(tmp_path, "cut", "on", speeds=(1.0, 1.3, 1.0, 1.1), jitter=0.1))
    cut = replace(cut, run=replace(cut.run, checkpoint_every=3))
    _, none = sim_mod.run(cut, setup, tmp_path / "cut", None, stop=lambda s: s.steps_done >= 29)
    assert none is None
    c, summary_c = sim_mod.run(replace(cut, run=replace(cut.run, resume=True)), setup, tmp_path / "cut", None)
    assert replayable(summary_c) == replayable(summary_a)
    for x, y in zip(sync.theta(a.syncer).values(), sync.theta(c.syncer).values()):
        np.testing.assert_array_equal(x, y)


def test_units_stepped_together_are_units_stepped_apart(tmp_path, build):
    """Each unit's params, counters and frames after three joint steps match three steps alone."""
    cfg = cfg_for(tmp_path, "units", "on")
    setup = build(cfg)
    state = sync.init(setup.policy, setup.fragments, setup.theta0, {m: 0 for m in range(4)}, merges=False)
    apart = [new_unit(setup, m, 0, state) for m in range(3)]
    together = [new_unit(setup, m, 0, state) for m in range(3)]
    for _ in range(3):
        alone = [u.step(fetch_loss=True) for u in apart]
        joint = batched.step_together(together, None, [True] * 3)
        for x, y in zip(alone, joint):
            assert x.sends == y.sends and x.tokens == y.tokens and len(x.frames) == len(y.frames)
            np.testing.assert_allclose(y.loss, x.loss, rtol=1e-5)
    for u, v in zip(apart, together):
        assert u.ls == v.ls
        for x, y in zip(jax.tree.leaves(jax.device_get(u.state.params)), jax.tree.leaves(jax.device_get(v.state.params))):
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-7)


def test_batch_learners_takes_auto_on_or_off(tmp_path):
    cfg = cfg_for(tmp_path, "x", "on")
    with pytest.raises(ConfigError, match="runtime.batch_learners='yes' must be auto, on or off"):
        validate(replace(cfg, runtime=replace(cfg.runtime, batch_learners="yes")))
