"""Merge rules are one registry (merge.MERGES): a rule registered there is accepted by the config
checks and merged by the syncer's streamed round sums exactly as its reference merge says, in a
sim run end to end; a name not in it is refused at validation, naming it."""

import jax
import numpy as np
import pytest

from diloco.algo import merge as merging
from diloco.algo import syncer as sync
from diloco.config import ConfigError
from syncer_frames import publishes
from test_sim import build, corpus, host, make_cfg, merge_records, model, run_sim  # noqa: F401  (fixtures)
from test_syncer_stream import _close_enough, _frame, _policy, _start, reference_round


def _once(weight, norms):  # every contribution with tokens counts once, whatever its tokens
    return (1.0 if weight > 0 else 0.0,) * len(norms)


def _sum_gains(weights, clips, norms, scales):  # sum = z S is the merged delta itself
    return tuple(scales)


def _sum_reference(deltas, weights):
    kept = [d for d, w in zip(deltas, weights) if w > 0]
    return jax.tree.map(lambda *xs: sum(np.asarray(x, np.float32) for x in xs), *kept)


def _uniform_gains(weights, clips, norms, scales):  # the mean over the contributions with tokens
    count = sum(1 for w in weights if w > 0)
    return tuple(z / count for z in scales)


def _uniform_reference(deltas, weights):
    return merging.weighted_average(deltas, [1.0 if w > 0 else 0.0 for w in weights])


SUM = merging.MergeRule("sum", _once, _sum_gains, None, True, _sum_reference)
UNIFORM = merging.MergeRule("uniform", _once, _uniform_gains, None, True, _uniform_reference)


@pytest.mark.parametrize("rule", [SUM, UNIFORM], ids=lambda r: r.name)
@pytest.mark.parametrize("case", [dict(), dict(anchor="base"), dict(clip=2.0), dict(scale="live")],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "plain")
def test_a_registered_rule_streams_as_its_reference_merge(rule, case, monkeypatch):
    """Token weights differ per learner (8 + 3m tokens per step), so neither toy rule is `average`;
    the clip case sends one 30x contribution, which a rule with clip_rebuilds folds again scaled."""
    monkeypatch.setitem(merging.MERGES, rule.name, rule)
    M = 3
    rng = np.random.default_rng(7)
    live = M + 1 if case.get("scale") == "live" else M
    pol = _policy(M, rule.name, **case)
    st = _start(pol, live, rng)
    seq = 0
    for rnd in range(3):
        fs = st.fragments[0]
        items = []
        for m in range(M):
            seq += 1
            base = max(0, fs.version - 1) if rnd == 2 and m == 0 else fs.version  # one stale base
            big = 30.0 if case.get("clip") and m == M - 1 else 1.0
            fr, local = _frame(st, rng, m, seq, base, scale=1e-2 * big)
            st, actions = sync.on_contribution(pol, st, fr, float(seq))
            items.append((local, base, 4, 4 * (8 + 3 * m)))
        assert len(publishes(actions)) == 1
        _close_enough(st.fragments[0].theta, reference_round(pol, fs, items, live, st.fragments[0].norms), fs.theta)
    assert {r["method"] for r in merge_records(st)} == {rule.name}
    if case.get("clip"):
        assert M - 1 in merge_records(st)[-1]["clipped"]


def test_a_registered_rule_validates_and_merges_a_sim_run(tmp_path, build, monkeypatch):
    """K = M = 2, tau = 0, outer average (Theta' = Theta - delta), fp32: under the plain sum every
    merge gives Theta' = Theta - sum_m (Theta - theta_m), the sum rule's reference merge of the two
    learners' deltas, i.e. theta_0 + theta_1 - Theta."""
    monkeypatch.setitem(merging.MERGES, SUM.name, SUM)
    cfg = make_cfg(tmp_path, steps=6, syncer=dict(quorum=2, merge="sum", embedding_merge="sum"))
    checked = []

    def before_merge(sim):
        theta = sync.theta(sim.syncer)
        params = [host(u) for u in sim.units]

        def after():
            deltas = [{p: theta[p] - params[m][p] for p in theta} for m in range(2)]
            merged = SUM.reference(deltas, [1.0, 1.0])
            new = sync.theta(sim.syncer)
            for p in theta:
                np.testing.assert_allclose(new[p], theta[p] - merged[p], rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(new[p], params[0][p] + params[1][p] - theta[p], rtol=1e-5, atol=1e-6)
            checked.append(sim.syncer.merges)
        return after

    sim, _ = run_sim(cfg, build(cfg), before_merge)
    assert checked == [1, 2, 3]
    records = merge_records(sim.syncer)
    assert [(r["method"], r["learners"]) for r in records] == [("sum", [0, 1])] * 3


@pytest.mark.parametrize("field", ["merge", "embedding_merge"])
def test_an_unregistered_rule_is_refused_at_validation_naming_it(tmp_path, field):
    with pytest.raises(ConfigError) as err:
        make_cfg(tmp_path, syncer={field: "median"})
    assert f"syncer.{field}='median' not in" in str(err.value)
    assert "average" in str(err.value) and "rda" in str(err.value)  # the registered ones, as choices


def test_the_syncer_refuses_an_unregistered_rule_naming_it():
    with pytest.raises(ValueError, match="unknown merge method 'median'"):
        _start(_policy(1, "median"), 1, np.random.default_rng(0))
