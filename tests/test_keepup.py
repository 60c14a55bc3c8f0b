"""Does the syncer keep up: the predicted share and its warning (analytic), the start-up round
timed on a copy of the syncer state, one warning in a run that cannot keep up, and the busy time in
the summary (docs/design.md#does-the-syncer-keep-up)."""

import logging
from dataclasses import replace

import numpy as np
import pytest

from diloco import report
from diloco.algo import codec_specs, quorum
from diloco.algo import syncer as sync
from diloco.algo.fragments import Fragment
from diloco.algo.outer import make_outer
from diloco.config import ConfigError, TrainConfig, from_dict
from diloco.runtime import keepup
from diloco.runtime.host import SyncerHost
from test_sim import build, corpus, make_cfg, model, run_sim  # noqa: F401  (fixtures)

LINE = "the syncer cannot keep up"


def rounds(seconds=(0.5, 0.5), values=(1000, 1000), M=4) -> keepup.Rounds:
    return keepup.Rounds(values, seconds, (0,), M, 0.0)


def test_share_is_the_rounds_per_H_steps_over_the_wall():
    # P = 2 fragments of 0.5 s rounds every H = 4 steps of 0.25 s: exactly the wall.
    assert keepup.share((0.5, 0.5), 4, 0.25) == 1.0
    assert keepup.share((0.5, 0.5), 4, 0.26) == pytest.approx(1.0 / 1.04)
    # Equal fragments: (P/H) x round / step.
    assert keepup.share((3.4,) * 24, 24, 0.131) == pytest.approx(24 / 24 * 3.4 / 0.131)


def test_warning_only_above_one_with_its_numbers_and_knobs():
    assert keepup.warning(rounds(), 4, 0.25, "int4+zstd1", 2, 2) is None  # exactly 1: it keeps up
    assert keepup.warning(rounds(), 4, 0.26, "int4+zstd1", 2, 2) is None  # 0.96
    line = keepup.warning(rounds((0.6, 0.5), (1200, 1000)), 4, 0.25, "int4+zstd1", 16, 8)  # 1.1
    assert line.startswith(LINE)
    for text in ("M=4", "0.600 s", "1,200 values", "0.550 s on average", "P=2", "1,000..1,200", "H=4",
                 "0.25 s", "= 1.10 > 1", "16 cores", "8 syncer threads", "fragments.count=2", "fragments.H=4",
                 "runtime.learners=4", "syncer.quorum", "codec.up=int4+zstd1", "DILOCO_HOST_THREADS",
                 "syncer.check_pace=false"):
        assert text in line, (text, line)


def test_plan_follows_the_config(tmp_path):
    cfg = make_cfg(tmp_path, runtime=dict(step_time=0.5))
    assert keepup.plan(cfg) == keepup.Plan(cfg.fragments.H, 0.5, 0.0)
    wall = replace(cfg, runtime=replace(cfg.runtime, kind="threads", step_period_s=0.2))
    assert keepup.plan(wall) == keepup.Plan(cfg.fragments.H, None, 0.2)  # learned from the learners' steps
    assert keepup.plan(replace(cfg, syncer=replace(cfg.syncer, check_pace=False))) is None
    with pytest.raises(ConfigError, match="syncer.check_pace must be true or false"):
        from_dict(TrainConfig, {"syncer": {"check_pace": "yes"}})


def small_syncer(sizes, M=3):
    """A syncer state of fragments of about these many values (two tensors each), int8 up."""
    rng = np.random.default_rng(1)
    frags, values = [], []
    for p, n in enumerate(sizes):
        theta = {(f"f{p}", "w"): rng.standard_normal((n // 8, 8), np.float32) * 0.02,
                 (f"f{p}", "b"): rng.standard_normal((n - n // 8 * 8,), np.float32) * 0.02}
        frags.append(Fragment(p, tuple(sorted(theta)), n, False))
        values.append(theta)
    pol = sync.Policy(quorum.GraceConfig(K=1), make_outer("nesterov"), down_codec=codec_specs.codec_from_spec("int8"),
                      down_spec="int8", up_spec="int8")
    return pol, sync.init(pol, tuple(frags), tuple(values), {m: 0 for m in range(M)})


def test_measure_times_a_copy_and_scales_close_sizes():
    pol, st = small_syncer((4000, 3800, 400))
    before = [{k: x.copy() for k, x in fs.theta.items()} for fs in st.fragments]
    r = keepup.measure(pol, st, 3, codec_specs.codec_from_spec("int8"), "int8")
    assert r.values == (4000, 3800, 400) and r.learners == 3 and r.cost_s > 0
    assert r.measured == (0, 2)  # 3800 is within 10% of 4000: scaled from it
    assert all(s > 0 for s in r.seconds)
    assert r.seconds[1] == pytest.approx(r.seconds[0] * 3800 / 4000)
    # The syncer's own state is as it was: no merge, no round, no decision, the same Theta.
    assert st.merges == 0 and len(st.decisions) == 0 and not st.last_seq
    for fs, theta in zip(st.fragments, before):
        assert fs.version == 0 and fs.round is None and not fs.contributions and len(fs.refs) == 1
        assert all(np.array_equal(fs.theta[k], x) for k, x in theta.items())
    # With nothing left of the budget only the largest is timed; the rest scale from it.
    r = keepup.measure(pol, st, 3, codec_specs.codec_from_spec("int8"), "int8", budget_s=0.0)
    assert r.measured == (0,) and r.seconds[2] == pytest.approx(r.seconds[0] * 400 / 4000)


def test_a_sim_that_cannot_keep_up_says_so_once(tmp_path, build, caplog):  # noqa: F811
    cfg = make_cfg(tmp_path, steps=8, runtime=dict(step_time=1e-7))  # no round is that fast
    with caplog.at_level(logging.WARNING, logger="diloco.runtime.host"):
        sim, summary = run_sim(cfg, build(cfg))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(LINE)]
    assert len(lines) == 1, lines
    assert "1e-07 s" in lines[0] and f"H={cfg.fragments.H}" in lines[0]
    assert summary["syncer_pace_share"] > 1 and summary["syncer_round_s"] > 0
    assert summary["syncer_busy_s"] > 0 and summary["syncer_busy_share"] is None  # virtual clock
    assert "syncer" in report.render_summary(summary, "run")


def test_a_sim_that_keeps_up_is_silent_and_the_check_can_be_off(tmp_path, build, caplog):  # noqa: F811
    slow = make_cfg(tmp_path, steps=4, runtime=dict(step_time=1e4))
    off = make_cfg(tmp_path / "off", steps=4, runtime=dict(step_time=1e-7), syncer=dict(check_pace=False))
    with caplog.at_level(logging.WARNING, logger="diloco.runtime.host"):
        _, summary = run_sim(slow, build(slow))
        _, off_summary = run_sim(off, build(off))
    assert not [r for r in caplog.records if r.getMessage().startswith(LINE)]
    assert 0 < summary["syncer_pace_share"] < 1
    assert off_summary["syncer_pace_share"] is None and off_summary["syncer_round_s"] is None
    assert off_summary["syncer_busy_s"] > 0


def test_a_wall_clock_host_reads_the_step_time_from_the_learners_steps(tmp_path, build, caplog):  # noqa: F811
    cfg = make_cfg(tmp_path)
    setup = build(cfg)
    M = cfg.runtime.learners
    host = SyncerHost(setup, {m: 0 for m in range(M)}, pace=keepup.Plan(cfg.fragments.H, None, 0.0))
    assert host.rounds is not None and host.pace_share is None
    tokens = cfg.data.batch_size * cfg.data.seq_len
    with caplog.at_level(logging.WARNING, logger="diloco.runtime.host"):
        for k in range(2 * keepup.STEPS_PER_LEARNER):
            for m in range(M):
                host.step(m, 0, k * 1e-7, (k + 1) * 1e-7, tokens, (k + 1) * 1e-7)
            if k + 1 < keepup.STEPS_PER_LEARNER:
                assert host.pace_share is None  # not enough steps known yet
    assert host.pace_share == pytest.approx(sum(host.rounds.seconds) / (cfg.fragments.H * 1e-7), rel=1e-6)
    assert len([r for r in caplog.records if r.getMessage().startswith(LINE)]) == 1
