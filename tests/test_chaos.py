"""Failure model and failure tapes: rates against MTBI, determinism, JSON, queries on hand-built
tapes, scavenged learners, and the chaos config section."""

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from diloco.chaos import tapes
from diloco.chaos.failures import (FailureModel, fraction_down, poisson_times, repair_times,
                                   sample_outages, steady_fraction_down)
from diloco.chaos.tapes import Event, Tape, from_json, generate, is_alive, live_slices, next_change, to_json
from diloco.config import ChaosConfig, ConfigError, TrainConfig, load, to_dict

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
POISSON = ChaosConfig(enabled=True, mtbi_s=76_800.0, repair_mean_s=30.0)


def test_failure_count_matches_mtbi():
    # slice rate 10 / 1000 s; each slice alternates Exp(100 s) up and 1 s down
    model = FailureModel(chips_per_slice=10, mtbi_s=1000.0, repair="fixed", repair_mean_s=1.0)
    out = sample_outages(model, 200, 10_000.0, np.random.default_rng(0))
    expected = 200 * 10_000.0 / (100.0 + 1.0)
    assert abs(out.down_s.size - expected) < 5 * math.sqrt(expected)
    assert np.all(out.down_s < 10_000.0) and np.all(np.diff(out.down_s)[np.diff(out.slice_id) == 0] > 0)
    # up time between a return and the next failure of the same slice is Exp(mean 100 s)
    same = np.diff(out.slice_id) == 0
    gaps = out.down_s[1:][same] - out.up_s[:-1][same]
    assert np.all(gaps > 0) and abs(gaps.mean() - 100.0) < 5 * 100.0 / math.sqrt(gaps.size)


def test_fraction_down_is_repair_over_cycle():
    model = FailureModel(chips_per_slice=1, mtbi_s=100.0, repair="exponential", repair_mean_s=50.0)
    out = sample_outages(model, 500, 20_000.0, np.random.default_rng(1))
    assert steady_fraction_down(model) == pytest.approx(1 / 3)
    assert fraction_down(out) == pytest.approx(1 / 3, abs=0.01)


@pytest.mark.parametrize("repair", ["fixed", "exponential", "lognormal"])
def test_repair_distributions_have_the_configured_mean(repair):
    model = FailureModel(repair=repair, repair_mean_s=600.0, repair_sigma=0.8)
    x = repair_times(model, np.random.default_rng(2), (200_000,))
    assert x.min() > 0 and x.mean() == pytest.approx(600.0, rel=0.02)
    if repair == "lognormal":  # median = mean * exp(-sigma^2 / 2)
        assert np.median(x) == pytest.approx(600.0 * math.exp(-0.32), rel=0.02)


def test_poisson_times_rate_and_order():
    t = poisson_times(0.5, 40_000.0, np.random.default_rng(3))
    assert abs(t.size - 20_000) < 5 * math.sqrt(20_000) and np.all(np.diff(t) >= 0)


def test_tape_is_deterministic_per_seed_and_round_trips():
    a, b = generate(POISSON, 4, 300.0), generate(POISSON, 4, 300.0)
    assert a == b and len(a.events) > 0
    assert generate(dataclasses.replace(POISSON, seed=1), 4, 300.0) != a
    assert from_json(to_json(a)) == a
    assert [tapes._key(e) for e in a.events] == sorted(tapes._key(e) for e in a.events)


def test_tape_failure_rate_matches_mtbi():
    # 4 learners x 4 slices, slice rate 256 / 76,800 s = 1 / 300 s, up ~300 s then ~30 s down
    tape = generate(POISSON, 4, 300_000.0)
    downs = sum(e.kind == "slice_down" for e in tape.events)
    expected = 16 * 300_000.0 / (300.0 + 30.0)
    assert abs(downs - expected) < 5 * math.sqrt(expected)


def test_from_json_rejects_bad_tapes():
    good = to_json(generate(POISSON, 2, 300.0))
    with pytest.raises(ValueError, match="format"):
        from_json(good.replace("diloco.chaos.tape/1", "other"))
    with pytest.raises(ValueError, match="slice_gone"):
        from_json(good.replace('"slice_down"', '"slice_gone"', 1))


def _hand_tape() -> Tape:
    ev = (Event(10.0, "slice_down", 0, 0), Event(20.0, "slice_down", 0, 1), Event(30.0, "slice_up", 0, 0),
          Event(40.0, "learner_add", 2), Event(50.0, "slice_down", 2, 1), Event(60.0, "learner_remove", 2))
    return Tape(learners=2, slices_per_learner=2, horizon_s=100.0, speeds=(1.0, 1.0, 1.0), jitter=0.0,
                seed=0, events=ev)


def test_queries_on_a_hand_built_tape():
    t = _hand_tape()
    assert [live_slices(t, 0, x) for x in (0, 10, 15, 20, 25, 30, 99)] == [2, 1, 1, 0, 0, 1, 1]
    assert [is_alive(t, 0, x) for x in (19.9, 20, 29.9, 30)] == [True, False, False, True]
    assert next_change(t, 0, 0) == 10 and next_change(t, 0, 10) == 20 and next_change(t, 0, 30) == math.inf
    assert all(live_slices(t, 1, x) == 2 for x in (0, 50, 100)) and next_change(t, 1, 0) == math.inf
    # scavenged learner 2: absent before its add and after its remove
    assert [live_slices(t, 2, x) for x in (39, 40, 50, 59, 60)] == [0, 2, 1, 1, 0]
    assert not is_alive(t, 2, 0) and is_alive(t, 2, 45) and not is_alive(t, 2, 70)
    assert next_change(t, 2, 0) == 40 and next_change(t, 2, 55) == 60
    assert from_json(to_json(t)) == t


def test_disabled_config_gives_an_empty_tape():
    t = generate(ChaosConfig(), 3, 1000.0)
    assert t.events == () and t.speeds == (1.0, 1.0, 1.0) and all(is_alive(t, m, 500) for m in range(3))


def test_scavenged_learners_and_straggler_speeds():
    cfg = dataclasses.replace(POISSON, scavenge=((100.0, 200.0), (250.0, 1e9)), speeds=(1.0, 1.18), jitter=0.1)
    t = generate(cfg, 3, 300.0)
    assert t.total_learners == 5 and t.speeds == (1.0, 1.18, 1.0, 1.18, 1.0) and t.jitter == 0.1
    adds = {e.learner: e.time for e in t.events if e.kind == "learner_add"}
    removes = {e.learner: e.time for e in t.events if e.kind == "learner_remove"}
    assert adds == {3: 100.0, 4: 250.0} and removes == {3: 200.0}  # learner 4 stays to the horizon
    for e in t.events:
        if e.learner == 3 and e.kind.startswith("slice"):
            assert 100.0 <= e.time < 200.0
    assert live_slices(t, 3, 99.0) == 0 and live_slices(t, 3, 100.0) == 4 and live_slices(t, 3, 200.0) == 0
    # adding a window leaves the base learners' failures untouched
    assert [e for e in t.events if e.learner < 3] == list(generate(POISSON, 3, 300.0).events)


def test_live_slices_stay_in_range_on_a_long_tape():
    t = generate(dataclasses.replace(POISSON, repair="lognormal"), 2, 3000.0)
    for e in t.events:
        assert 0 <= live_slices(t, e.learner, e.time) <= t.slices_per_learner


@pytest.mark.parametrize("key,value,expected", [
    ("repair", "weibull", "chaos.repair='weibull'"),
    ("mtbi_s", 0.0, "chaos.mtbi_s=0.0 must be > 0"),
    ("slices_per_learner", 0, "chaos.slices_per_learner=0 must be >= 1"),
    ("speeds", [1.0, 0.0], "chaos.speeds=[1.0, 0.0] must all be > 0"),
    ("scavenge", [[5.0, 1.0]], "chaos.scavenge[0]=[5.0, 1.0] must be [start_s, stop_s]"),
    ("jitter", -0.1, "chaos.jitter=-0.1 must be >= 0"),
])
def test_bad_chaos_values_are_named(key, value, expected):
    raw = to_dict(TrainConfig())
    raw["chaos"][key] = value
    with pytest.raises(ConfigError) as err:
        load(raw)
    assert expected in str(err.value)


def test_chaos_section_round_trips():
    cfg = dataclasses.replace(TrainConfig(), chaos=dataclasses.replace(POISSON, scavenge=((1.0, 2.0),)))
    assert load(to_dict(cfg)) == cfg


@pytest.mark.parametrize("option", ["none", "poisson"])
def test_chaos_group_files_list_every_field_and_compose(option):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    fields = {f.name for f in dataclasses.fields(ChaosConfig)}
    assert set(yaml.safe_load((CONFIGS / "chaos" / f"{option}.yaml").read_text())) == fields
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        raw = compose(config_name="train", overrides=[f"chaos={option}", "run.out_dir=runs/test"])
    cfg = load(OmegaConf.to_container(raw, resolve=True))
    assert cfg.chaos.enabled == (option == "poisson")


def test_rows_and_return_times_on_a_hand_written_tape():
    tape = Tape(2, 4, 100.0, (1.0, 1.0), 0.0, 0, (
        Event(1.0, "slice_down", 0, 0), Event(2.0, "slice_down", 0, 1), Event(2.0, "slice_down", 0, 2),
        Event(3.0, "slice_down", 0, 3), Event(5.0, "slice_up", 0, 2)))
    rows = [tapes.batch_rows(tape, 0, t, batch_size=8, devices=2) for t in (0.0, 1.0, 2.0)]
    assert rows == [8, 6, 2] and tapes.rows_options(tape, 8, 2) == (2, 4, 6, 8)
    assert tapes.back_at(tape, 0, 3.5) == 5.0 and tapes.back_at(tape, 0, 0.5) == 0.5
    assert tapes.back_at(dataclasses.replace(tape, events=tape.events[:4]), 0, 3.5) == math.inf


@pytest.mark.parametrize("runtime, chaos, message", [
    ("procs", {"scavenge": [[1.0, 2.0]]}, "chaos.scavenge"),
    ("threads", {"scavenge": [[1.0, 2.0]]}, "chaos.scavenge"),
    ("threads", {"wall_scale": 0.0}, "chaos.wall_scale"),
])
def test_wall_clock_chaos_configs_are_checked(runtime, chaos, message):
    raw = to_dict(TrainConfig())
    raw.update(algo="diloco")
    raw["runtime"].update(kind=runtime)
    raw["chaos"].update(enabled=True, **chaos)
    with pytest.raises(ConfigError, match=message):
        load(raw)


@pytest.mark.parametrize("runtime, period, rejoin_at, message", [
    ("threads", -1.0, "own", "runtime.step_period_s=-1.0 must be >= 0"),
    ("sim", 0.5, "own", "runtime.step_period_s=0.5 paces the wall-clock runtimes"),
    ("procs", 0.0, "schedule", "runtime.rejoin_at=schedule needs runtime.step_period_s > 0"),
    ("procs", 0.5, "peer", "runtime.rejoin_at='peer' must be own or schedule"),
])
def test_step_period_and_rejoin_at_are_checked(runtime, period, rejoin_at, message):
    raw = to_dict(TrainConfig())
    raw.update(algo="diloco")
    raw["runtime"].update(kind=runtime, step_period_s=period, rejoin_at=rejoin_at)
    with pytest.raises(ConfigError, match=message):
        load(raw)
