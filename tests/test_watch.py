"""Watching a run: the status line and TensorBoard event files fed by the run's metrics records."""

import struct

import pytest

from diloco import report
from diloco.watch import RunWatch


def event_files(directory):
    """[{tag: [(step, value), ...]}] per tensorboard event file, oldest first (TFRecord framing,
    Event protos)."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(directory.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns):
        blob, pos, scalars = path.read_bytes(), 0, {}
        while pos < len(blob):
            (n,) = struct.unpack_from("<Q", blob, pos)
            event = event_pb2.Event.FromString(blob[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in event.summary.value:
                scalars.setdefault(v.tag, []).append((event.step, v.simple_value))
        out.append(scalars)
    return out


def read_scalars(directory):
    """{tag: [(step, value), ...]} over every tensorboard event file of `directory`, oldest first."""
    out: dict[str, list] = {}
    for scalars in event_files(directory):
        for tag, points in scalars.items():
            out.setdefault(tag, []).extend(points)
    return out


RECORDS = [
    {"kind": "train", "learner": 0, "step": 10, "time": 10.0, "tokens": 1280, "loss": 3.5},
    {"kind": "train", "learner": 1, "step": 10, "time": 10.5, "tokens": 1280, "loss": 3.4},
    {"kind": "eval", "step": 10, "time": 10.5, "tokens": 2560, "eval_loss": 3.3, "merges": 4},
    {"kind": "merge", "time": 10.5, "fragment": 0, "version": 4, "merges": 4, "tokens": 2560, "quorum": 2,
     "bytes_up": 1000, "bytes_down": 2000, "stalls": 0, "quarantined": 0, "goodput": 0.95, "grace_s": 0.5},
    {"kind": "rejoin", "time": 11.0, "learner": 1, "incarnation": 1, "step": 10},
    {"kind": "train", "learner": 0, "step": 20, "time": 20.0, "tokens": 2560, "loss": 3.1},
]


def test_event_files_hold_every_learners_loss_and_the_eval_against_global_tokens(tmp_path):
    writer = report.MetricsWriter(tmp_path / "metrics.jsonl",
                                  RunWatch(steps=20, learners=2, progress=False, tensorboard_dir=tmp_path / "tb"))
    for r in RECORDS:
        writer.write(r)
    writer.summary({"goodput": 0.9, "bytes_up": 1234, "clock": "virtual"})
    writer.close()
    scalars = read_scalars(tmp_path / "tb")
    assert scalars["eval/loss"] == [(2560, pytest.approx(3.3))]
    assert scalars["train/loss/learner0"] == [(1280, pytest.approx(3.5)), (3840, pytest.approx(3.1))]
    assert scalars["train/loss/learner1"] == [(2560, pytest.approx(3.4))]
    assert scalars["syncer/merges"] == [(2560, 4.0)] and scalars["failures/rejoins"] == [(2560, 1.0)]
    assert scalars["syncer/quorum"] == [(2560, 2.0)] and scalars["syncer/bytes_down"] == [(2560, 2000.0)]
    assert scalars["syncer/goodput"] == [(2560, pytest.approx(0.95))] and scalars["syncer/grace_s"] == [(2560, 0.5)]
    assert scalars["summary/goodput"] == [(3840, pytest.approx(0.9))] and "summary/clock" not in scalars
    assert report.read_metrics(tmp_path / "metrics.jsonl") == RECORDS  # metrics.jsonl is unchanged


def test_the_status_line_shows_steps_merges_eval_and_learner_detail(monkeypatch, capsys):
    monkeypatch.delenv("CI", raising=False)
    watch = RunWatch(steps=20, learners=2, progress=True, clock="virtual", log_every=10)
    for r in RECORDS:
        watch(r)
    watch.close()
    err = capsys.readouterr().err
    assert "30/40" in err and "merges 4" in err and "eval 3.300" in err and "rejoins 1" in err
    assert "(virtual)" in err and "L0 3.100@20" in err and "L1 3.400@10" in err


def test_quiet_when_asked_and_under_ci(monkeypatch, capsys):
    monkeypatch.setenv("CI", "1")
    for progress in (True, False):
        watch = RunWatch(steps=20, learners=2, progress=progress)
        for r in RECORDS:
            watch(r)
        watch.close()
    assert capsys.readouterr().err == ""


def test_a_sim_run_shows_progress_and_writes_event_files(tmp_path, monkeypatch, capsys):
    """The DiLoCo sim run (before: nothing on screen until the summary) draws the status line."""
    from dataclasses import replace

    from conftest import diloco_world
    from test_conformance import make_cfg

    from diloco.runtime import sim

    monkeypatch.delenv("CI", raising=False)
    cfg = make_cfg(tmp_path, "sim")
    cfg = replace(cfg, run=replace(cfg.run, progress=True, tensorboard=True))
    _, _, setup, evaluate_global, _ = diloco_world(cfg)
    run_dir = tmp_path / "sim"
    run_dir.mkdir()
    _, summary = sim.run(cfg, setup, run_dir, evaluate_global)
    err = capsys.readouterr().err
    total = cfg.run.steps * cfg.runtime.learners
    assert f"{total}/{total}" in err and "merges" in err and "(virtual)" in err
    scalars = read_scalars(run_dir / "tensorboard")
    assert scalars["eval/loss"][-1][1] == pytest.approx(summary["eval_loss"], rel=1e-6)
    assert {f"train/loss/learner{m}" for m in range(cfg.runtime.learners)} <= set(scalars)


def test_every_curve_shares_the_runs_total_tokens(tmp_path, monkeypatch):
    """Before: DiLoCo train points sat at each learner's own count and evals at the total, so the
    train curve covered a 1/M of the axis and every learner was one zigzag line."""
    clock = report.GlobalTokens()
    assert [clock.see(r) for r in RECORDS] == [1280, 2560, 2560, 2560, 2560, 3840]
    lines = []
    import matplotlib.axes
    plain = matplotlib.axes.Axes.plot

    def spy(ax, *args, **kw):
        lines.append((kw.get("label"), list(args[0]), list(args[1])))
        return plain(ax, *args, **kw)
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    report.plot_losses(RECORDS, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert lines == [("learner 0 train loss", [1280, 3840], [3.5, 3.1]), ("learner 1 train loss", [2560], [3.4]),
                     ("global eval loss", [2560], [3.3])]


def test_the_summary_reads_with_units_and_warns_above_the_unigram_baseline():
    summary = {"corpus": "shakespeare-byte", "algo": "diloco", "params": 820352, "learners": 4, "clock": "virtual",
               "clock_s": 41.0, "wall_s": 92.6, "merges": 10, "tokens_processed": 163840, "tokens_merged_share": 0.925,
               "bytes_up": 4428749, "bytes_down": 9253172, "peak_rate_up": 1622950.0, "goodput": 1.0, "uptime": 0.975,
               "quorum_mean": 4.0, "quorum_min": 4, "grace_mean_s": 1.0, "grace_max_s": 1.0, "stalls": 0,
               "quarantined": 0, "rejoins": 2, "token_ledger_imbalance": 0, "eval_loss": 3.2488,
               "eval_bits_per_byte": 4.687, "train_loss": 3.31, "unigram_loss": 3.292, "dp_bytes_over_diloco": 57.56}
    text = report.render_summary(summary, "run r")
    for want in ["3.2488 nats/token  4.6870 bits/byte  (unigram baseline 3.2920)", "41.0 s virtual, 92.6 s wall",
                 "163,840, 92.5% merged", "up 4.43 MB, down 9.25 MB, peak up 1.62 MB/s; 57.6x fewer",
                 "100.0%, 97.5%", "2 rejoins, 0 stalls, 0 quarantined frames, token ledger balanced"]:
        assert want in text, want
    assert "warning" not in text
    assert "above the unigram baseline" in report.render_summary({**summary, "eval_loss": 3.4}, "run r")
