"""Goodput simulator: exact lost chip-seconds for hand-placed failures in every mode, the overlap
rules, closed forms, M = 1 equals elastic data parallel, monotonicity, the fit and the report."""

import json
import math
import time
from dataclasses import replace

import numpy as np
import pytest

from diloco.chaos import calibrate, results, study
from diloco.chaos import goodput
from diloco.chaos.failures import (Outages, events_by_time, poisson_times, sample_outages, slice_events,
                                   stable_order)
from diloco.chaos.goodput import Constants, dp_job, elastic_job, elastic_jobs, pauses, simulate
from diloco.config import ConfigError

S, H = 256, 10_000.0  # chips per slice, horizon (s)
C = Constants(restart_s=80.0, reconfig_s=10.0, repair_s=500.0, chips_per_slice=S)
DAY = 86_400.0


def _outages(n_slices, slices, downs, ups):
    return Outages(slice_id=np.array(slices), down_s=np.array(downs, float), up_s=np.array(ups, float),
                   n_slices=n_slices, horizon_s=H)


def test_no_failures_means_full_goodput():
    c = Constants(mtbi_s=1e30)
    for mode, m in [("dp", 1), ("elastic_dp", 1), ("diloco", 8)]:
        cell = simulate(mode, 150_000, c, 30 * DAY, 0, m)
        assert cell.goodput == 1.0 and cell.uptime == 1.0 and cell.failures == 0


@pytest.mark.parametrize("overlap,expected", [
    ("share", [(0, 10), (12, 22)]),  # the event at 5 joins the first pause; 12 starts its own
    ("extend", [(0, 22)]),  # every event restarts the pause
    ("queue", [(0, 30)]),  # three pauses served back to back
])
def test_overlap_rules(overlap, expected):
    s, e = pauses(np.array([0.0, 5.0, 12.0]), 10.0, overlap)
    assert list(zip(s.tolist(), e.tolist())) == expected


def test_one_failure_costs_exactly_the_restart_in_dp():
    cell = dp_job(np.array([1000.0]), 8 * S, C, H)
    assert cell.goodput == pytest.approx(1 - 80.0 / H) and cell.uptime == cell.goodput


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_one_failure_costs_exactly_the_repair_and_two_pauses(m):
    """8 slices; slice 0 fails at 1000 s and is back at 1500 s. Its learner (all 8 slices when
    M = 1, else 8 / M of them) pauses 10 s on 7 / (8 / M) - 1 live slices, then 10 s on all."""
    cell = elastic_jobs(_outages(8, [0], [1000.0], [1500.0]), m, C)
    per = 8 // m
    lost = S * 500.0 + (per - 1) * S * 10.0 + per * S * 10.0
    assert cell.goodput == pytest.approx(1 - lost / (8 * S * H), rel=1e-12)
    assert cell.uptime == pytest.approx(1 - 20.0 / H if m == 1 else 1.0)
    assert cell.down_fraction == pytest.approx(500.0 / (8 * H))


def test_overlapping_failures_share_one_pause():
    """Slices 0 and 1 fail at 100 s and 103 s, back at 600 s and 603 s; each pair of events
    shares one 10 s pause (share), so 20 s of pauses in all."""
    cell = elastic_jobs(_outages(8, [0, 1], [100.0, 103.0], [600.0, 603.0]), 1, C)
    lost = 2 * S * 500.0 + (7 * 3 + 6 * 7) * S + (7 * 3 + 8 * 7) * S
    assert cell.goodput == pytest.approx(1 - lost / (8 * S * H), rel=1e-12)
    assert cell.uptime == pytest.approx(1 - 20.0 / H)
    # extend: 13 s per pair of events, the second event restarting the reconfiguration
    ext = elastic_jobs(_outages(8, [0, 1], [100.0, 103.0], [600.0, 603.0]), 1,
                       Constants(reconfig_s=10.0, repair_s=500.0, chips_per_slice=S, overlap="extend"))
    assert ext.uptime == pytest.approx(1 - 26.0 / H)


def test_a_learner_without_live_slices_is_stopped():
    # learner 0 of 2 loses both its slices over [100, 300): goodput counts no chips, uptime holds
    cell = elastic_jobs(_outages(4, [0, 1], [100.0, 100.0], [300.0, 300.0]), 2, C)
    lost = 2 * S * 200.0 + 2 * S * 10.0  # both slices out 200 s, then the return pause on both
    assert cell.goodput == pytest.approx(1 - lost / (4 * S * H), rel=1e-12) and cell.uptime == 1.0
    p, s, e = elastic_job(np.array([100.0, 100.0]), np.array([-S, -S]), 2 * S, 10.0, "share", H)
    assert p == pytest.approx(2 * S * 100.0) and list(zip(s, e)) == [(100.0, H)]


def test_poisson_failures_match_mtbi():
    n, h = 1_200_000, 2 * DAY
    times = poisson_times(n / C.mtbi_s, h, np.random.default_rng(0))
    expected = n * h / C.mtbi_s
    assert abs(times.size - expected) < 5 * math.sqrt(expected)


@pytest.mark.parametrize("overlap,closed_form", [
    ("share", lambda x: 1 / (1 + x)),  # renewal: up Exp(1 / rate), then one pause
    ("extend", lambda x: math.exp(-x)),  # up only after a gap of one pause without failures
    ("queue", lambda x: 1 - x),  # M/D/1 queue busy share
])
def test_dp_goodput_matches_closed_forms(overlap, closed_form):
    c = Constants(restart_s=60.0, overlap=overlap)
    cell = simulate("dp", 300_000, c, 20 * DAY, 0)
    x = cell.chips / c.mtbi_s * 60.0
    assert cell.goodput == pytest.approx(closed_form(x), abs=0.01)


def test_diloco_with_one_learner_is_elastic_dp():
    a = simulate("elastic_dp", 600_000, C, 2 * DAY, 3)
    b = simulate("diloco", 600_000, C, 2 * DAY, 3, learners=1)
    fields = ("goodput", "uptime", "down_fraction", "failures", "chips")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]


def test_goodput_falls_with_chips_and_rises_with_learners():
    chips = [150_000, 300_000, 600_000, 1_200_000]
    for mode, m in [("dp", 1), ("elastic_dp", 1), ("diloco", 8)]:
        g = [simulate(mode, n, C, 2 * DAY, 0, m).goodput for n in chips]
        assert all(a > b for a, b in zip(g, g[1:])), (mode, g)
    g = [simulate("diloco", 1_200_000, C, 2 * DAY, 0, m).goodput for m in (1, 2, 4, 8, 16)]
    assert all(a < b for a, b in zip(g, g[1:])), g


def test_m_learners_on_n_chips_match_one_elastic_job_on_n_over_m():
    """The paper's rule of thumb holds by construction of the model (same failure density)."""
    a = simulate("diloco", 1_200_000, C, 5 * DAY, 0, learners=8).goodput
    b = simulate("elastic_dp", 150_000, C, 5 * DAY, 0).goodput
    assert a == pytest.approx(b, abs=0.005)


def test_fit_recovers_known_constants():
    chips, h = (150_000, 600_000, 2_400_000), 2 * DAY
    truth = Constants(restart_s=50.0, reconfig_s=12.0, repair_s=4000.0)
    dp = tuple(calibrate.row("dp", truth, chips, h, 1))
    el = tuple(calibrate.row("elastic_dp", truth, chips, h, 1))
    got = calibrate.fit_dp(Constants(), h, 1, chips, dp)
    assert got.restart_s == pytest.approx(50.0, rel=0.01)
    got = calibrate.fit_elastic(Constants(reconfig_s=30.0, repair_s=1000.0), h, 1, chips, el)
    assert got.reconfig_s == pytest.approx(12.0, rel=0.05) and got.repair_s == pytest.approx(4000.0, rel=0.05)


def test_2_4m_chips_over_30_days_takes_seconds():
    t0 = time.process_time()  # CPU seconds: what the study costs, however busy the machine
    study.timing(C, (2, 4, 8, 16), 2_400_000, 30 * DAY)
    # about 0.5 s on the shared 2-core machine (docs/experiments.md#benchmarks); loose for CI
    assert time.process_time() - t0 < 15.0


def test_bad_goodput_config_values_are_named():
    with pytest.raises(ConfigError) as err:
        study.load({"overlap": "merge", "seeds": 0, "chips": []})
    assert "overlap='merge'" in str(err.value) and "seeds=0" in str(err.value) and "chips=[]" in str(err.value)
    with pytest.raises(ConfigError, match="unknown key"):
        study.load({"chip": [1]})


def test_quick_study_writes_every_output(tmp_path):
    cfg = study.load({"quick": True, "learners": [8], "out_dir": str(tmp_path)})
    result = study.run(cfg)
    paths = results.write(result, tmp_path)
    assert sorted(p.name for p in paths) == ["goodput.csv", "goodput.json", "goodput.md", "goodput.png"]
    data = json.loads((tmp_path / "goodput.json").read_text())
    assert {(x["mode"], x["learners"]) for x in data["cells"]} == {("dp", 1), ("elastic_dp", 1), ("diloco", 8)}
    assert 0 < data["constants"]["reconfig_s"] < 600
    assert "| data parallel, elastic (fitted) |" in paths[0].read_text()
    assert len((tmp_path / "goodput.csv").read_text().splitlines()) == 1 + 3 * 5


def test_every_elastic_mode_shares_one_draw_and_it_is_the_seeds():
    """The draws are made once per (seed, size) and shared, read-only, by elastic_dp and every M;
    they are exactly what sample_outages draws from the same stream."""
    c, h, n_slices = Constants(repair="exponential"), 2 * DAY, 2_343
    goodput.outages.cache_clear()
    for mode, m in [("elastic_dp", 1), ("diloco", 2), ("diloco", 8)]:
        simulate(mode, 600_000, c, h, 3, m)
    assert goodput.outages.cache_info().misses == 1  # drawn once, then shared
    shared = goodput.outages(c.failures(), n_slices, h, 3)
    fresh = sample_outages(c.failures(), n_slices, h, np.random.default_rng([3, n_slices]))
    for name in ("slice_id", "down_s", "up_s"):
        assert np.array_equal(getattr(shared, name), getattr(fresh, name))
        assert not getattr(shared, name).flags.writeable
    # a new repair time re-runs only the walk over the same candidate failures
    other = goodput.outages(replace(c, repair_s=2 * c.repair_s).failures(), n_slices, h, 3)
    assert other.down_s[0] == shared.down_s[0] and other.down_s.size < shared.down_s.size


def _all_stopped_by_sweep(stops, h):
    """The former sweep over every job's interval ends: the reference for the intersection."""
    starts = np.concatenate([s for s, _ in stops])
    ends = np.minimum(np.concatenate([e for _, e in stops]), h)
    x = np.concatenate([starts, ends])
    step = np.concatenate([np.ones(starts.size, int), -np.ones(ends.size, int)])
    order = np.lexsort((step, x))
    x, count = x[order], np.cumsum(step[order])
    gaps = np.diff(np.append(x, h))
    return float(gaps[count == len(stops)].sum())


@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_time_all_jobs_are_stopped_matches_a_sweep(m):
    r = np.random.default_rng(m)
    for _ in range(50):
        stops = []
        for _ in range(m):
            p, s, e = elastic_job(np.sort(r.uniform(0, H, 40)), r.choice([-S, S], 40), 20 * S, 150.0, "share", H)
            stops.append((s, e))
        assert goodput._all_stopped(stops, H) == _all_stopped_by_sweep(stops, H)


def test_stable_order_is_a_stable_sort_even_with_ties():
    r = np.random.default_rng(0)
    for key in [r.uniform(0, 1, 1000), r.integers(0, 20, 1000).astype(float), np.zeros(5), np.empty(0)]:
        assert np.array_equal(stable_order(key), np.argsort(key, kind="stable"))


def test_grouping_time_sorted_events_is_the_group_time_sort():
    out = sample_outages(C.failures(), 64, 30 * DAY, np.random.default_rng(1))
    owner = np.arange(64) * 5 // 64
    group, time_, delta = slice_events(out, owner, by_time=events_by_time(out))
    key = np.lexsort((time_, group))
    assert np.array_equal(key, np.arange(group.size))  # sorted by (group, time)
    assert np.array_equal(np.sort(time_), np.sort(events_by_time(out)[1]))
