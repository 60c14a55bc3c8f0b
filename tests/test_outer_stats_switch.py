"""syncer.outer_stats (docs/algorithm.md#outer-statistics-and-automatic-momentum): the consecutive
cosine and the last merged pseudo-gradient it keeps are observation only, so a syncer without them
merges bit for bit as one with them; without them no record, metrics line or summary carries
update_cos and nothing is kept; outer.momentum=auto with them off is refused; checkpoints written with
or without the kept delta (and from before it existed) restore under either setting."""

import json

import jax
import numpy as np
import pytest

from diloco.algo import close as closing
from diloco.algo import hostpool, outer_auto
from diloco.algo import syncer as sync
from diloco.algo.ledger import token_ledger
from diloco.algo.outer import make_outer
from diloco.algo.timeline import time_ledger
from diloco.config import ConfigError, TrainConfig, load, to_dict
from diloco.runtime.summary import merge_record, outer_summary
from diloco.runtime.syncer_ckpt import from_checkpoint, to_checkpoint
from diloco.train.footprint import host_estimate
from syncer_frames import FRAGS, THETA0, frame, merges, policy, publishes, start

NESTEROV = make_outer("nesterov", lr=0.7, momentum=0.9)


def rounds(pol, st, seeds, M=2):
    """One round per seed: M learners each send a random pseudo-gradient of both fragments (K = M:
    one merge per fragment and round); the publish frames of every merge, in order."""
    frames = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        for p in (0, 1):
            for m in range(M):
                fs = st.fragments[p]
                d = {q: (0.05 * rng.standard_normal(x.shape)).astype(np.float32) for q, x in fs.theta.items()}
                st, actions = sync.on_contribution(pol, st, frame({q: fs.theta[q] - d[q] for q in d}, fs.theta,
                                                                  learner=m, seq=2 * seed + p, fragment=p,
                                                                  base_version=fs.version), float(seed))
                frames += [a.frames for a in publishes(actions)]
    return st, frames


def same_merges(a, b):
    """Theta, the outer state and every merge record but update_cos equal, bit for bit."""
    for fa, fb in zip(a.fragments, b.fragments):
        assert fa.version == fb.version > 0
        for q in fa.theta:
            np.testing.assert_array_equal(fa.theta[q], fb.theta[q])
        for x, y in zip(*(jax_leaves(f.outer_state) for f in (fa, fb))):
            np.testing.assert_array_equal(x, y)
    strip = lambda st: [{k: v for k, v in r.items() if k != "update_cos"} for r in merges(st)]
    assert strip(a) == strip(b)


def jax_leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_the_close_without_statistics_is_bit_identical_and_keeps_nothing():
    """Two whole hostpool pieces, run on the pool's threads (a remainder's call: the syncer test)."""
    rng = np.random.default_rng(0)
    theta = {("a",): rng.standard_normal(2 * hostpool.CHUNK).astype(np.float32)}
    sums = {q: rng.standard_normal(x.shape).astype(np.float32) for q, x in theta.items()}
    gains = {q: np.float32(0.3) for q in theta}
    last = {q: rng.standard_normal(x.shape).astype(np.float32) for q, x in theta.items()}
    state = NESTEROV.init(theta)
    on = closing.close(NESTEROV, "tensor", sums, gains, theta, state, theta, last)
    off = closing.close(NESTEROV, "tensor", sums, gains, theta, state, theta, last, stats=False)
    assert off.delta is None and off.dot == 0.0 and on.delta is not None and on.dot != 0.0
    assert (off.finite, off.delta_norm, off.theta_norm) == (on.finite, on.delta_norm, on.theta_norm)
    for q in theta:
        np.testing.assert_array_equal(off.theta[q], on.theta[q])
        np.testing.assert_array_equal(off.diff[q], on.diff[q])
    for x, y in zip(jax_leaves(off.outer_state), jax_leaves(on.outer_state)):
        np.testing.assert_array_equal(x, y)


def test_a_syncer_without_statistics_merges_as_one_with_them():
    on_pol, off_pol = policy(K=2, outer=NESTEROV, merge="rda", outer_stats=True), policy(K=2, outer=NESTEROV, merge="rda")
    assert sync.measures(on_pol) and not sync.measures(off_pol)
    on, on_frames = rounds(on_pol, start(on_pol), range(1, 5))
    off, off_frames = rounds(off_pol, start(off_pol), range(1, 5))
    assert on_frames == off_frames and len(off_frames) == 8  # every broadcast byte for byte
    same_merges(on, off)
    assert all(f.stats == outer_auto.Stats() for f in off.fragments)  # nothing kept
    assert all(f.stats.last is not None for f in on.fragments)
    assert all("update_cos" not in r for r in merges(off))
    assert [r["update_cos"] is None for r in merges(on)] == [True, True] + [False] * 6


def test_without_statistics_metrics_and_summary_carry_no_update_cos():
    for outer_stats, rounds_measured in ((True, 6), (False, 0)):
        pol = policy(K=2, outer=NESTEROV, merge="rda", outer_stats=outer_stats)
        st, _ = rounds(pol, start(pol), range(1, 5))
        lines = [merge_record(st, r, i, token_ledger(2), (0, 0), time_ledger(), 0) for i, r in enumerate(merges(st))]
        assert sum("update_cos" in line for line in lines) == rounds_measured
        assert all(line["delta_norm"] > 0 and "agreement" in line for line in lines)  # measured in every case
        summary = outer_summary(merges(st))
        assert summary["update_cos_rounds"] == rounds_measured
        assert (summary["update_cos_mean"] is None) == (not outer_stats)
        assert summary["delta_norm_mean"] > 0


def test_auto_momentum_turns_them_on_and_off_refuses_it():
    assert sync.measures(policy(outer=make_outer("nesterov", lr=0.7, momentum="auto"), auto=outer_auto.Rule()))
    assert [outer_auto.measured(s, a) for s in ("auto", "on", "off") for a in (False, True)] == [
        False, True, True, True, False, False]
    raw = to_dict(TrainConfig())
    raw["outer"]["momentum"], raw["syncer"]["outer_stats"] = "auto", "off"
    with pytest.raises(ConfigError, match="outer.momentum=auto .* syncer.outer_stats=off"):
        load(raw)
    raw["outer"]["momentum"], raw["syncer"]["outer_stats"] = 0.9, "sometimes"
    with pytest.raises(ConfigError, match="syncer.outer_stats='sometimes' not in auto|on|off"):
        load(raw)
    for setting in ("auto", "on", "off"):
        raw["syncer"]["outer_stats"] = setting
        assert load(raw).syncer.outer_stats == setting


def test_the_memory_estimate_counts_the_kept_copy_only_where_measured():
    syncer, P = {}, 3_000_000
    for setting, momentum in (("auto", 0.9), ("on", 0.9), ("off", 0.9), ("auto", "auto")):
        raw = to_dict(TrainConfig())
        raw["algo"], raw["syncer"]["outer_stats"], raw["outer"]["momentum"] = "diloco", setting, momentum
        syncer[setting, momentum] = host_estimate(load(raw), P, 256).parts["syncer"]
    assert syncer["auto", 0.9] == syncer["off", 0.9]
    assert syncer["on", 0.9] - syncer["off", 0.9] == syncer["auto", "auto"] - syncer["off", 0.9] == 4.0 * P


@pytest.mark.parametrize("saved,restored", [(True, False), (False, True), (True, True), (False, False)])
def test_a_checkpoint_restores_under_either_setting(saved, restored):
    """Saved with or without the kept delta, restored with or without statistics: the merges after
    the restore are those of a syncer that never stopped and was restored into the new setting's
    policy from the start (same Theta, same broadcasts); with statistics the cosine resumes at once
    where the delta was saved, and one merge later where it was not."""
    pols = {s: policy(K=2, outer=NESTEROV, merge="rda", outer_stats=s) for s in (True, False)}
    st, _ = rounds(pols[saved], start(pols[saved]), range(1, 3))
    arrays, meta = to_checkpoint(st)
    assert ("last_delta" in arrays["f0"]) == saved
    back = from_checkpoint(arrays, json.loads(json.dumps(meta)), pols[restored], FRAGS)
    assert (back.fragments[0].stats.last is not None) == (saved and restored)  # dropped when not measured
    after, frames = rounds(pols[restored], back, range(3, 5))
    cont, cont_frames = rounds(pols[saved], st, range(3, 5))
    assert frames == cont_frames
    same_merges(after, cont)
    if restored:
        cosines = [r["update_cos"] for r in merges(after)[4:] if r["fragment"] == 0]
        assert (cosines[0] is not None) == saved and cosines[1] is not None


def test_a_checkpoint_from_before_the_statistics_restores():
    """No "stats" in the JSON and no kept delta in the arrays (checkpoints older than them)."""
    pol = policy(K=2, outer=NESTEROV, merge="rda", outer_stats=True)
    st, _ = rounds(pol, start(pol), range(1, 3))
    arrays, meta = to_checkpoint(st)
    meta = json.loads(json.dumps(meta))
    for p, fm in enumerate(meta["fragments"]):
        del fm["stats"], arrays[f"f{p}"]["last_delta"]
    back = from_checkpoint(arrays, meta, pol, FRAGS)
    assert all(f.stats == outer_auto.Stats() for f in back.fragments)
    after, _ = rounds(pol, back, range(3, 5))
    cont, _ = rounds(pol, st, range(3, 5))
    same_merges(after, cont)


def test_the_printed_summary_shows_the_outer_statistics_where_measured():
    """The summary a run prints has an `outer` line with the means it measured, none without them."""
    from diloco import report
    base = {"merges": 12, "update_cos_rounds": 0, "update_cos_mean": None, "outer_momentum_mean": None}
    assert not [x for x in report.render_summary(base, "run").splitlines() if x.startswith("outer")]
    stats = {**base, "update_cos_mean": 0.4125, "update_cos_rounds": 11}
    (line,) = [x for x in report.render_summary(stats, "run").splitlines() if x.startswith("outer")]
    assert line.endswith("update cosine 0.412 (11 rounds)")
    (line,) = [x for x in report.render_summary({**stats, "outer_momentum_mean": 0.8}, "run").splitlines()
               if x.startswith("outer")]
    assert line.endswith("update cosine 0.412 (11 rounds), momentum mean 0.800 (outer.momentum=auto)")
