"""The time series of a run (docs/design.md#metrics-series): per merge the syncer's counters, per
train record each learner's learning rate and throughput, in metrics.jsonl and TensorBoard; their
continuation across a resume; what a chaos tape injected in the summary; W&B beside TensorBoard."""

from dataclasses import replace

import pytest
from test_watch import event_files

from diloco import report
from diloco.chaos import tapes
from diloco.chaos.tapes import Event, Tape
from diloco.config import start_errors
from diloco.runtime import sim
from diloco.runtime.sim.runtime import Sim
from diloco.train.optim import lr_schedule
from diloco.watch import MERGE_SERIES, RunWatch


def check_series(cfg, run_dir, summary) -> None:
    """What every runtime's metrics.jsonl holds: one merge record per merge, its counters never
    going back and ending at the summary's; each train record's lr the schedule's at its step."""
    records = report.read_metrics(run_dir / "metrics.jsonl")
    merges = [r for r in records if r["kind"] == "merge"]
    assert [r["merges"] for r in merges] == list(range(1, summary["merges"] + 1))
    for key in ("bytes_up", "bytes_down", "stalls", "quarantined", "tokens"):
        values = [r[key] for r in merges]
        assert values == sorted(values), key
    assert 0 < merges[-1]["bytes_up"] <= summary["bytes_up"] and 0 < merges[-1]["bytes_down"] <= summary["bytes_down"]
    assert all(1 <= r["quorum"] <= cfg.runtime.learners and 0.0 <= r["goodput"] <= 1.0 for r in merges)
    assert merges[-1]["stalls"] <= summary["stalls"] and merges[-1]["quarantined"] == summary["quarantined"]
    schedule = lr_schedule(cfg.inner, cfg.run.steps)
    train = [r for r in records if r["kind"] == "train"]
    assert {r["learner"] for r in train} == set(range(cfg.runtime.learners))
    for r in train:  # the step's rate: the schedule at the optimizer count before it
        assert r["lr"] == pytest.approx(float(schedule(r["step"] - 1)), rel=1e-6), r
    assert len({r["lr"] for r in train}) > 1  # warmup and decay: a constant would prove nothing


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from conftest import diloco_world
    from test_conformance import make_cfg

    root = tmp_path_factory.mktemp("series")
    cfg = make_cfg(root, "sim")
    cfg = replace(cfg, run=replace(cfg.run, log_every=1, tensorboard=True))
    _, _, setup, evaluate_global, _ = diloco_world(cfg)
    return root, cfg, setup, evaluate_global


def test_a_sim_run_writes_every_series_and_tensorboard_plots_them(world):
    root, cfg, setup, evaluate_global = world
    run_dir = root / "plain"
    run_dir.mkdir()
    _, summary = sim.run(replace(cfg, run=replace(cfg.run, out_dir=str(run_dir))), setup, run_dir, evaluate_global)
    check_series(cfg, run_dir, summary)
    (scalars,) = event_files(run_dir / "tensorboard")
    assert {f"syncer/{key}" for key in MERGE_SERIES} - {"syncer/grace_s"} <= set(scalars)
    for m in range(cfg.runtime.learners):
        assert {f"train/lr/learner{m}", f"train/tokens_per_s/learner{m}"} <= set(scalars)
    assert len(scalars["syncer/bytes_up"]) == summary["merges"]


def test_a_resumed_run_continues_the_x_axis_and_counts_its_own_tokens(world):
    """Before: the resumed run's first points sat at one learner's count (the x-axis restarted near
    1/M of the run) and tokens/s divided the whole run's tokens by the resumed run's wall time."""
    root, cfg, setup, evaluate_global = world
    run_dir = root / "resumed"
    run_dir.mkdir()
    cfg = replace(cfg, run=replace(cfg.run, out_dir=str(run_dir), checkpoint_every=2))
    crashed, _ = sim.run(cfg, setup, run_dir, evaluate_global, stop=lambda s: s.steps_done >= 20)
    assert crashed.steps_done == 20
    _, summary = sim.run(replace(cfg, run=replace(cfg.run, resume=True)), setup, run_dir, evaluate_global)
    check_series(cfg, run_dir, summary)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    # snapshots every 2 steps of each of M learners: the last one at 20 learner steps
    assert summary["tokens_at_start"] == 20 * tokens_per_step < summary["tokens_processed"]
    first, second = event_files(run_dir / "tensorboard")
    resumed_x = [x for points in second.values() for x, _ in points]
    assert min(resumed_x) >= summary["tokens_at_start"]
    assert max(resumed_x) == summary["tokens_processed"]
    assert max(x for points in first.values() for x, _ in points) <= 20 * tokens_per_step


def test_the_chaos_summary_counts_what_the_tape_injected(world):
    """Before: a tape whose slice failures never took a learner's last slice read "0 learner
    deaths" and nothing else, as if no failure had happened."""
    root, cfg, setup, _ = world
    cfg = replace(cfg, runtime=replace(cfg.runtime, restart_s=2.0, learner_checkpoint_every=0))
    tape = Tape(2, 2, 1000.0, (1.0, 1.0), 0.0, 0, tuple(Event(*e) for e in (
        (3.0, "slice_down", 1, 0), (9.0, "slice_up", 1, 0),  # learner 1 steps on half its batch
        (5.0, "slice_down", 0, 0), (5.0, "slice_down", 0, 1),  # learner 0 loses both: it dies
        (8.0, "slice_up", 0, 0), (8.0, "slice_up", 0, 1),
        (900.0, "slice_down", 1, 1))))  # after the run: not injected into it
    tape = replace(tape, events=tuple(sorted(tape.events, key=tapes._key)))
    run = Sim(cfg, setup, None, None, tape=tape)
    summary = run.run()
    assert summary["slice_failures"] == 3 and summary["learner_outages"] == 1
    assert summary["learner_deaths"] == 1 and len(run.rejoins) == 1
    text = report.render_summary({**summary, "rejoins": len(run.rejoins)}, "run")
    assert "3 slice failures injected (1 took a learner's last slice), 1 learner deaths, 1 rejoins" in text


def test_injected_counts_outages_of_present_learners_only():
    tape = Tape(1, 2, 100.0, (1.0, 1.0), 0.0, 0, (
        Event(1.0, "slice_down", 0, 0), Event(2.0, "slice_down", 0, 0),  # the same slice again: no outage
        Event(3.0, "slice_down", 0, 1),  # the last one: an outage
        Event(4.0, "learner_add", 1), Event(5.0, "slice_down", 1, 0), Event(6.0, "learner_remove", 1),
        Event(7.0, "slice_down", 1, 1)))  # removed: gone, not an outage
    assert tapes.injected(tape, 2.5) == {"slice_failures": 2, "learner_outages": 0}
    assert tapes.injected(tape, 100.0) == {"slice_failures": 5, "learner_outages": 1}


def test_run_wandb_without_the_package_is_one_start_up_error(world, monkeypatch):
    import importlib.util

    _, cfg, _, _ = world
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = replace(cfg, run=replace(cfg.run, wandb=True))
    assert [e for e in start_errors(cfg) if "wandb" in e] == [
        "run.wandb=true needs the wandb package: pip install -e .[wandb] (or run.wandb=false)"]
    assert not [e for e in start_errors(replace(cfg, run=replace(cfg.run, wandb=False))) if "wandb" in e]


def test_wandb_gets_the_scalars_tensorboard_gets_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from test_watch import RECORDS

    from diloco.config import TrainConfig
    from diloco.wandb_sink import WandbScalars

    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline unless the user says otherwise
    sink = WandbScalars(TrainConfig(), tmp_path)
    logged = []
    log = sink.run.log
    monkeypatch.setattr(sink.run, "log", lambda data, *a, **k: (logged.append(dict(data)), log(data, *a, **k)))
    writer = report.MetricsWriter(tmp_path / "metrics.jsonl", RunWatch(steps=20, learners=2, progress=False,
                                                                       tensorboard_dir=tmp_path / "tb", wandb=sink))
    for r in RECORDS:
        writer.write(r)
    writer.summary({"goodput": 0.9, "bytes_up": 1234})
    writer.close()
    (tb,) = event_files(tmp_path / "tb")
    assert sink.run.settings.mode == "offline"
    assert {k for d in logged for k in d} == set(tb) | {"tokens"}
    for tag, points in tb.items():  # the same points, against the same x-axis
        assert [(d["tokens"], pytest.approx(d[tag])) for d in logged if tag in d] == points, tag
    wandb.teardown()  # the service writes the run's file after finish returns; this waits for it
    (blob,) = [p.read_bytes() for p in (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")]
    assert [tag for tag in tb if tag.encode() not in blob] == []  # written to the offline run's file
    assert (tmp_path / "wandb" / "run_id").read_text() in blob.decode("latin-1")


def test_bytes_sent_so_far_sum_each_chunk_once_and_follow_a_restored_ledger():
    from diloco.algo import traffic

    def truth(led):
        ev = traffic.byte_events(led)
        return tuple(int(ev["nbytes"][ev["direction"] == d].sum()) for d in (0, 1))

    led, counted = traffic.byte_ledger(), traffic.Sent()
    for i in range(700):  # chunks of 256 rows, and a tail
        led = traffic.add_bytes(led, float(i), 10 + i % 7, "up" if i % 3 else "down", i % 2, 0, "fp32")
        if i % 50 == 0:
            *got, counted = traffic.sent(led, counted)
            assert tuple(got) == truth(led)
    other = traffic.byte_ledger()  # a ledger restored from a checkpoint: other arrays, as many chunks
    for i in range(700):
        other = traffic.add_bytes(other, float(i), 1, "up", 0, 0, "fp32")
    assert traffic.sent(other, counted)[:2] == (700, 0)
