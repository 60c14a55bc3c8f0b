"""The outer statistics and outer.momentum=auto (docs/algorithm.md#outer-statistics-and-automatic-momentum):
the rule on analytic sequences of merged pseudo-gradients, the close's dot product, the syncer's
records and outer steps against a hand-computed trajectory, and the statistics kept across a
checkpoint so a restarted syncer sets the same momentum."""

import json

import jax
import numpy as np
import optax
import pytest

from diloco.algo import close as closing
from diloco.algo import outer, outer_auto, quorum
from diloco.algo import syncer as sync
from diloco.algo.outer import make_outer
from diloco.algo.replay import replay
from diloco.config import ConfigError
from diloco.runtime.sim.runtime import Sim
from diloco.runtime.syncer_ckpt import from_checkpoint, to_checkpoint
from syncer_frames import FRAGS, THETA0, W, frame, merges, policy, start
from test_sim import build, corpus, make_cfg, model  # noqa: F401  (fixtures)

RULE = outer_auto.Rule()
PATH = ("x",)


def feed(deltas, rule=RULE):
    """The statistics after the merged pseudo-gradients `deltas` in turn, and the momentum the rule
    set before each of them."""
    stats, momenta = outer_auto.Stats(), []
    for d in deltas:
        momenta.append(outer_auto.momentum(rule, stats))
        d = np.asarray(d, np.float32)
        dot = float(np.dot(d, stats.last[PATH])) if stats.last is not None else 0.0
        stats, _ = outer_auto.observe(rule, stats, {PATH: d}, float(np.linalg.norm(d)), dot)
    return stats, momenta


def test_a_constant_direction_gets_the_ceiling():
    d = np.linspace(-1.0, 2.0, 50)
    stats, momenta = feed([d * s for s in (1.0, 3.0, 0.5, 2.0, 1.0, 1.0)])  # any sizes, one direction
    # warm-up until RULE.after cosines are measured: the 1st merge has none, the 2nd and 3rd add one each
    assert momenta[:3] == [RULE.warmup] * 3
    assert momenta[3:] == pytest.approx([RULE.ceiling] * 3)
    assert outer_auto.mean_cosine(RULE, stats) == pytest.approx(1.0)


def test_an_alternating_sign_gets_none():
    d = np.linspace(-1.0, 2.0, 50)
    stats, momenta = feed([d * (-1.0) ** t for t in range(8)])
    assert outer_auto.mean_cosine(RULE, stats) == pytest.approx(-1.0)
    assert momenta[3:] == [0.0] * 5


def test_independent_noise_gets_little():
    rng = np.random.default_rng(0)
    stats, momenta = feed([rng.standard_normal(20_000) for _ in range(12)])
    assert abs(outer_auto.mean_cosine(RULE, stats)) < 0.03
    assert max(momenta) < 0.03


def test_a_persistent_direction_under_noise_gets_its_share():
    """g_t = s + n_t with ||s||^2 = ||n_t||^2: consecutive cosines near 1/2, so momentum near 1/2."""
    rng = np.random.default_rng(1)
    s = rng.standard_normal(20_000)
    _, momenta = feed([s + rng.standard_normal(20_000) for _ in range(12)])
    assert momenta[-1] == pytest.approx(0.5, abs=0.03)


def test_the_warmup_and_the_ceiling_are_the_rules():
    rule = outer_auto.Rule(ceiling=0.6, warmup=0.3, after=1)
    _, momenta = feed([np.ones(4)] * 4, rule)
    assert momenta == pytest.approx([0.3, 0.3, 0.6, 0.6])


def test_a_cosine_that_says_nothing_is_not_counted():
    assert outer_auto.cosine(1.0, 0.0, 1.0) is None  # a zero update
    assert outer_auto.cosine(float("inf"), 1.0, 1.0) is None
    assert outer_auto.cosine(1.5, 1.0, 1.0) is None  # outside [-1, 1]: rounding, not a measurement
    before = outer_auto.Stats({PATH: np.ones(2)}, 1.0, 3, 0.5)
    stats, c = outer_auto.observe(RULE, before, {PATH: np.zeros(2)}, 0.0, 0.0)
    assert c is None and (stats.seen, stats.mean) == (3, 0.5) and stats.last_norm == 0.0


@pytest.mark.parametrize("n", [7, 3 * (1 << 18) + 5])  # one call, and pieces on the host pool
def test_the_close_returns_the_merged_delta_and_its_dot_with_the_last(n):
    rng = np.random.default_rng(2)
    theta = {("a",): rng.standard_normal(n).astype(np.float32), ("b",): rng.standard_normal(5).astype(np.float32)}
    sums = {p: rng.standard_normal(x.shape).astype(np.float32) for p, x in theta.items()}
    last = {p: rng.standard_normal(x.shape).astype(np.float32) for p, x in theta.items()}
    gains = {p: np.float32(0.5) for p in theta}
    opt = make_outer("nesterov", lr=0.7, momentum=0.9)
    done = closing.close(opt, None, sums, gains, theta, opt.init(theta), theta, last)
    for p in theta:
        np.testing.assert_array_equal(done.delta[p], np.float32(0.5) * sums[p])
    want = sum(float(np.dot(0.5 * sums[p].astype(np.float64), last[p])) for p in theta)
    assert done.dot == pytest.approx(want, rel=1e-5)
    assert closing.close(opt, None, sums, gains, theta, opt.init(theta), theta).dot == 0.0  # no last: zeros


def test_the_syncer_sets_momentum_from_the_measured_cosines():
    """One learner sends the same pseudo-gradient d each round (lr 1, merge average): the consecutive
    cosine is 1 from the 2nd merge, so the momentum is 0, 0, 0 and then the ceiling, and Theta follows
    optax's Nesterov step fed those momenta at lr (1 - mu)."""
    pol = policy(outer=make_outer("nesterov", lr=1.0, momentum="auto"), auto=RULE)
    st = start(pol, M=1)
    d = {p: np.float32(0.01) * (1 + np.arange(x.size, dtype=np.float32).reshape(x.shape))
         for p, x in THETA0[0].items()}
    for seq in range(1, 6):
        fs = st.fragments[0]
        local = {p: fs.theta[p] - d[p] for p in d}
        st, _ = sync.on_contribution(pol, st, frame(local, fs.theta, seq=seq, base_version=fs.version), float(seq))
    records = [r for r in merges(st) if r["fragment"] == 0]
    assert [r["momentum"] for r in records] == pytest.approx([0.0, 0.0, 0.0, 0.9, 0.9])
    assert records[0]["update_cos"] is None and [r["update_cos"] for r in records[1:]] == pytest.approx([1.0] * 4)
    norm = np.sqrt(sum(float(np.sum(x * x)) for x in d.values()))
    assert [r["delta_norm"] for r in records] == pytest.approx([norm] * 5)
    ref = {p: np.asarray(x, np.float32) for p, x in THETA0[0].items()}
    state = None
    for mu in [r["momentum"] for r in records]:
        sgd = optax.sgd(1.0 - mu, momentum=mu, nesterov=True)
        state = sgd.init(ref) if state is None else state
        step, state = sgd.update(d, state)
        ref = optax.apply_updates(ref, step)
    for p in ref:
        np.testing.assert_allclose(st.fragments[0].theta[p], ref[p], rtol=1e-6)
    assert outer.momentum_of(st.fragments[0].outer_state) == pytest.approx(0.9)


def test_a_fixed_momentum_run_records_the_statistics_but_no_momentum():
    pol = policy(outer=make_outer("nesterov", lr=0.7, momentum=0.9), outer_stats=True)  # syncer.outer_stats=on
    st = start(pol, M=1)
    for seq in range(1, 3):
        fs = st.fragments[0]
        st, _ = sync.on_contribution(pol, st, frame({p: v * 0.9 for p, v in fs.theta.items()}, fs.theta, seq=seq,
                                                    base_version=fs.version), float(seq))
    records = [r for r in merges(st) if r["fragment"] == 0]
    assert "momentum" not in records[0] and records[1]["update_cos"] is not None


def test_auto_momentum_averages_and_keeps_the_step_along_a_steady_direction():
    """At a fixed mu the auto optimizer's step tends to lr x delta along a constant delta (the
    buffer's 1 / (1 - mu) taken back by the lr), where plain Nesterov's tends to lr x delta / (1 - mu)."""
    theta = {PATH: np.zeros(3, np.float32)}
    d = {PATH: np.ones(3, np.float32)}
    for name in ("nesterov", "sgd"):
        auto, plain = make_outer(name, lr=0.5, momentum="auto"), make_outer(name, lr=0.5, momentum=0.8)
        sa, sp = outer.with_momentum(auto.init(theta), 0.8), plain.init(theta)
        for _ in range(60):
            ua, sa = auto.update(d, sa)
            up, sp = plain.update(d, sp)
        assert np.asarray(ua[PATH]) == pytest.approx(-0.5, rel=1e-4)
        assert np.asarray(up[PATH]) == pytest.approx(-0.5 / 0.2, rel=1e-4)


def test_the_config_takes_auto_and_refuses_the_rest(tmp_path):
    assert make_cfg(tmp_path, outer=dict(name="nesterov", momentum="auto")).outer.momentum == "auto"
    with pytest.raises(ConfigError, match=r"outer.momentum='fast' must be a number in \[0, 1\) or auto"):
        make_cfg(tmp_path, outer=dict(name="nesterov", momentum="fast"))
    with pytest.raises(ConfigError, match="outer.momentum=auto needs outer.name in .* not 'average'"):
        make_cfg(tmp_path, outer=dict(name="average", momentum="auto"))
    with pytest.raises(ConfigError, match=r"outer.momentum=1.0 must be in \[0, 1\)"):
        make_cfg(tmp_path, outer=dict(name="nesterov", momentum=1.0))
    with pytest.raises(ValueError, match="average"):
        make_outer("average", momentum="auto")


def test_a_restored_syncer_sets_the_momentum_the_uninterrupted_one_does():
    """Statistics and the last merged pseudo-gradient go through a checkpoint (JSON and arrays), so
    the merges after a restore record the same cosines and momenta and reach the same Theta."""
    pol = policy(outer=make_outer("nesterov", lr=0.7, momentum="auto"), auto=RULE)
    rng = np.random.default_rng(3)
    drift = {p: rng.standard_normal(x.shape).astype(np.float32) for p, x in THETA0[0].items()}

    def send(st, seq):
        fs = st.fragments[0]
        d = {p: 0.05 * drift[p] + 0.02 * rng.standard_normal(x.shape).astype(np.float32) for p, x in fs.theta.items()}
        return frame({p: fs.theta[p] - d[p] for p in d}, fs.theta, seq=seq, base_version=fs.version)

    st = start(pol, M=1)
    for seq in range(1, 5):
        st, _ = sync.on_contribution(pol, st, send(st, seq), float(seq))
    arrays, meta = to_checkpoint(st)
    back = from_checkpoint(arrays, json.loads(json.dumps(meta)), pol, FRAGS)
    frames = [send(st, 5)]
    a, _ = sync.on_contribution(pol, st, frames[0], 5.0)
    b, _ = sync.on_contribution(pol, back, frames[0], 5.0)
    ra, rb = merges(a)[-1], merges(b)[-1]
    assert ra["momentum"] > 0.0 and ra["update_cos"] is not None
    assert (rb["momentum"], rb["update_cos"]) == (ra["momentum"], ra["update_cos"])
    for p in a.fragments[0].theta:
        np.testing.assert_array_equal(a.fragments[0].theta[p], b.fragments[0].theta[p])


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, build):
    """A sim run with outer.momentum=auto and int8 broadcasts, and all its syncer inputs."""
    cfg = make_cfg(tmp_path_factory.mktemp("rec"), steps=40, fragments=dict(count=2, H=4, tau=1),
                   syncer=dict(quorum=1), outer=dict(name="nesterov", lr=0.7, momentum="auto"),
                   codec=dict(up="int4", down="int8"), runtime=dict(speeds=(1.0, 1.3)))
    setup = build(cfg)
    inputs = []
    sim = Sim(cfg, setup, None, None, inputs)
    sim.run()
    return setup, sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0, 1: 0}), inputs, sim.syncer


@pytest.mark.slow  # a sim run: about 30 s
def test_a_sim_run_sets_momentum_and_a_restored_syncer_keeps_it(recorded):
    setup, st, inputs, final = recorded
    momenta = [r["momentum"] for r in merges(final)]
    assert setup.policy.auto == RULE and len(momenta) > 8 and max(momenta) > 0.0  # the rule took over
    resumed = None
    for i, event in enumerate(inputs):  # cut after every 5th input: the restore holds what was saved
        st = replay(setup.policy, st, [event])
        if i % 5:
            continue
        arrays, meta = to_checkpoint(st)
        back = from_checkpoint(arrays, json.loads(json.dumps(meta)), setup.policy, setup.fragments)
        for a, b in zip(back.fragments, st.fragments):
            assert a.stats[1:] == b.stats[1:] and (a.stats.last is None) == (b.stats.last is None)
            for p in a.stats.last or {}:
                np.testing.assert_array_equal(a.stats.last[p], b.stats.last[p])
            assert outer.momentum_of(a.outer_state) == outer.momentum_of(b.outer_state)
        if resumed is None and i >= len(inputs) // 2:  # and a restart from it ends as the uninterrupted run
            resumed = replay(setup.policy, back, inputs[i + 1:])
            assert json.loads(json.dumps(list(resumed.decisions))) == json.loads(json.dumps(list(final.decisions)))
            for a, b in zip(resumed.fragments, final.fragments):
                for p in a.theta:
                    np.testing.assert_array_equal(a.theta[p], b.theta[p])
    assert resumed is not None


@pytest.mark.slow  # a threads run: 86 s at load 24 on the shared 2-core machine
def test_a_threads_run_sets_momentum_and_writes_the_series(tmp_path_factory):
    """The wall-clock runtime shares the syncer: its merges carry the statistics and the momentum
    into metrics.jsonl, TensorBoard and the summary, and its input log replays to the same decisions."""
    from dataclasses import replace

    from conftest import diloco_world
    from test_conformance import make_cfg as conformance_cfg
    from test_watch import event_files

    from diloco import report
    from diloco.runtime import threads
    from diloco.runtime.runlog import read_decisions, read_inputs

    root = tmp_path_factory.mktemp("threads_auto")
    cfg = conformance_cfg(root, "threads")
    cfg = replace(cfg, outer=replace(cfg.outer, momentum="auto"), run=replace(cfg.run, tensorboard=True))
    _, _, setup, evaluate_global, _ = diloco_world(cfg)
    run_dir = root / "threads"
    run_dir.mkdir(exist_ok=True)
    _, summary = threads.run(cfg, setup, run_dir, evaluate_global)
    records = [r for r in report.read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "merge"]
    assert records and all(0.0 <= r["momentum"] <= RULE.ceiling and r["delta_norm"] > 0 for r in records)
    cosines = [r["update_cos"] for r in records if "update_cos" in r]
    assert len(cosines) == summary["update_cos_rounds"] > 0 and all(-1.0 <= c <= 1.0 for c in cosines)
    assert summary["outer_momentum_mean"] == pytest.approx(np.mean([r["momentum"] for r in records]))
    (scalars,) = event_files(run_dir / "tensorboard")
    assert {"syncer/delta_norm/fragment0", "syncer/update_cos/fragment0", "syncer/momentum/fragment1"} <= set(scalars)
    again = replay(setup.policy, sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0, 1: 0}),
                   list(read_inputs(run_dir / "syncer_inputs.bin")))
    assert json.loads(json.dumps(list(again.decisions))) == read_decisions(run_dir / "decisions.jsonl")
