"""The threads runtime: a real 2-learner run on the wall clock, heterogeneous speeds, full queues,
and clean shutdown on an exception in any thread or a Ctrl-C in the main thread."""

import json
import os
import signal
import threading
import time
from dataclasses import replace

import pytest
from conftest import diloco_world, load_scaled, tiny_cfg

from diloco.algo import ledger, timeline
from diloco.algo import syncer as sync
from diloco.algo.replay import replay
from diloco.config import TrainConfig, validate
from diloco.runtime import build as build_setup
from diloco.runtime import sim, threads
from diloco.runtime.runlog import read_decisions, read_inputs
from diloco.runtime.unit import LearnerUnit

STEPS, M, P = 40, 2, 2


class Boom(RuntimeError):
    pass


def make_cfg(tmp_path, **runtime) -> TrainConfig:
    """The tests' tiny run (tests/conftest.py) on threads, 40 steps evaluated every 20."""
    return tiny_cfg(tmp_path, "threads", run=dict(steps=STEPS, eval_every=20), runtime=runtime)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One setup for the module: the two learners' inner steps compile once (the slow part)."""
    cfg = make_cfg(tmp_path_factory.mktemp("threads"))
    corpus, model, setup, evaluate_global, initial = diloco_world(cfg)
    return cfg, setup, evaluate_global, initial


def variant(world, **changes):
    """The module's config and setup with other runtime/syncer settings (same compiled steps)."""
    cfg, setup, _, _ = world
    quorum = changes.pop("quorum", cfg.syncer.quorum)
    cfg = validate(replace(cfg, runtime=replace(cfg.runtime, **changes),
                           syncer=replace(cfg.syncer, quorum=quorum)))
    return cfg, setup._replace(policy=build_setup.policy(cfg))


@pytest.fixture
def no_leftover_threads():
    before = set(threading.enumerate())
    yield
    # Compared as "nothing new", since threads of earlier tests (e.g. checkpoint writers) may end meanwhile.
    # The first Orbax save in a process starts asyncio's executor thread, which lives as long as the
    # process: it is Orbax's, not the runtime's. TensorBoard's writer (tensorboardX) queues its events
    # on a multiprocessing queue, whose feeder thread ends a moment after the writer is closed.
    left = {t for t in set(threading.enumerate()) - before
            if not t.name.startswith("asyncio_") and t.name != "QueueFeederThread"}
    assert not left, f"the threads runtime left threads running: {left}"


def test_two_learners_train_merge_and_balance(world, tmp_path, no_leftover_threads):
    cfg, setup, evaluate_global, initial = world
    rt, summary = threads.run(cfg, setup, tmp_path, evaluate_global)

    assert [u.ls.step for u in rt.units] == [STEPS] * M
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    assert rt.tokens.processed == (M * STEPS * tokens_per_step,) * P  # every step booked, once
    ledger.check_balance(rt.tokens)
    assert summary["token_ledger_imbalance"] == 0
    assert summary["merges"] == rt.syncer.merges > 0 and sum(rt.tokens.merged) > 0
    assert summary["bytes_up"] > 0 and summary["bytes_down"] > 0
    assert all(secs["compute"] > 0 for secs in timeline.seconds(rt.time).values())
    # Random init sits near log(V) = log(16) = 2.77 nats; 40 steps on the order-2 Markov source
    # take the merged global model far below it.
    assert initial > 2.5
    assert summary["eval_loss"] < initial - 1.0, (summary["eval_loss"], initial)
    # The syncer's work as a share of the wall, and the start-up check's prediction at the step
    # time read from the learners' first steps (docs/design.md#does-the-syncer-keep-up).
    assert 0 < summary["syncer_busy_s"] < summary["clock_s"] and 0 < summary["syncer_busy_share"] < 1
    assert summary["syncer_pace_share"] > 0 and summary["syncer_round_s"] > 0
    # Same summary keys as sim, so run_diloco can dispatch on runtime.kind.
    sim_keys = set(sim.Sim(replace(cfg, runtime=replace(cfg.runtime, kind="sim")), setup, None, None).summary())
    assert sim_keys <= set(summary)

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for m in range(M):
        assert [r["step"] for r in records if r["kind"] == "train" and r["learner"] == m] == list(range(5, 41, 5))
    assert [r["step"] for r in records if r["kind"] == "eval"] == [20, 40, 40]  # periodic, last, final

    # Timing made this run's decisions, and the inputs log recorded every input with its wall-clock
    # time: replaying it from Theta_0 rebuilds the syncer bit for bit.
    events = list(read_inputs(tmp_path / "syncer_inputs.bin"))
    assert {"contribution", "step_time", "finished"} <= {e.kind for e in events} <= {
        "contribution", "step_time", "deadline", "finished"}
    again = replay(setup.policy, sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0, 1: 0}), events)
    assert again.decisions == rt.syncer.decisions
    assert read_decisions(tmp_path / "decisions.jsonl") == json.loads(json.dumps(list(rt.syncer.decisions)))
    for a, b in zip(again.fragments, rt.syncer.fragments):
        assert a.version == b.version and all(a.theta[k].tobytes() == b.theta[k].tobytes() for k in a.theta)


def test_slow_learner_finishes_last_and_k1_merges_without_it(world, no_leftover_threads):
    cfg, setup = variant(world, speeds=(1.0, 3.0), quorum=1)
    rt, summary = threads.run(cfg, setup, None, None)

    assert [u.ls.step for u in rt.units] == [STEPS] * M
    assert rt.finished_at[0] < rt.finished_at[1], rt.finished_at
    secs = timeline.seconds(rt.time)
    assert secs[1]["compute"] > 1.5 * secs[0]["compute"], secs  # the slowdown is real wall time
    merges = [r for r in rt.syncer.decisions if r["event"] == "merge"]
    solo = [r for r in merges if r["learners"] == [0]]
    joint = [r for r in merges if sorted(r["learners"]) == [0, 1]]
    # K = 1: the fast learner's rounds close at the grace deadline without the slow one, live and
    # missing; each learner's contributions are merged once each (the same count: the same schedule).
    assert all(r["reason"] == "deadline_passed" and r["missing"] == [1] for r in solo), solo
    assert len(solo) + len(joint) == sum(0 in r["learners"] for r in merges) == sum(1 in r["learners"] for r in merges)
    # Three times slower, learner 1 has a contribution in time for at most about a third of learner
    # 0's rounds (14 alone, 7 together when written).
    assert len(solo) > len(joint), (len(solo), len(joint))
    assert summary["token_ledger_imbalance"] == 0


def test_paced_learners_keep_the_schedule_and_merge_together(world, no_leftover_threads):
    """runtime.step_period_s: each step ends on the learner's schedule (never before it), so the
    two equal learners stay in phase and a K = 1 round takes both almost every time."""
    period = 0.1
    cfg, setup = variant(world, step_period_s=period, quorum=1)
    rt, summary = threads.run(cfg, setup, None, None)

    assert [u.ls.step for u in rt.units] == [STEPS] * M
    assert min(rt.finished_at.values()) >= STEPS * period * 0.99, rt.finished_at
    merges = [r for r in rt.syncer.decisions if r["event"] == "merge"]
    both = sum(len(r["learners"]) == M for r in merges)
    assert both >= 0.75 * len(merges), [r["learners"] for r in merges]
    assert summary["token_ledger_imbalance"] == 0


def test_full_queues_do_not_deadlock(world, no_leftover_threads):
    """Queues of one item and a synchronous quorum (K = M): every put blocks often, nothing hangs."""
    cfg, setup = variant(world, queue_size=1, quorum=M)
    rt, summary = threads.run(cfg, setup, None, None)

    assert [u.ls.step for u in rt.units] == [STEPS] * M
    assert summary["merges"] > 0 and summary["quorum_min"] == M
    assert summary["token_ledger_imbalance"] == 0


@pytest.mark.parametrize("where", ["learner", "syncer"])
def test_exception_in_a_thread_propagates_and_stops_all(world, monkeypatch, no_leftover_threads, where):
    cfg, setup = variant(world)
    raised_at = []
    if where == "learner":
        step = LearnerUnit.step

        def broken_step(self, fetch_loss=False, rows=None, defer=False):
            if self.learner == 1 and self.ls.step == 3:
                raised_at.append(time.monotonic())
                raise Boom("learner 1 broke at step 3")
            return step(self, fetch_loss, rows, defer)

        monkeypatch.setattr(LearnerUnit, "step", broken_step)
    else:
        on_contribution, calls = sync.on_contribution, []

        def broken_on_contribution(*args):
            # the syncer thread's own calls: the host's start-up pace check makes some first
            calls.append(threading.current_thread().name == "diloco-syncer")
            if sum(calls) == 3 and calls[-1]:
                raised_at.append(time.monotonic())
                raise Boom("syncer broke on the third contribution")
            return on_contribution(*args)

        monkeypatch.setattr(sync, "on_contribution", broken_on_contribution)

    began = time.monotonic()
    with pytest.raises(Boom, match="broke") as info:
        threads.run(cfg, setup, None, None)
    # every thread saw the stop within a few polls: 5 s, or as long as the start and 3 steps took
    assert time.monotonic() - raised_at[0] < load_scaled(5.0, raised_at[0] - began)
    thread = "diloco-learner-1" if where == "learner" else "diloco-syncer"
    assert any(thread in note for note in info.value.__notes__)


def test_keyboard_interrupt_in_the_main_thread_stops_all(world, no_leftover_threads):
    cfg, setup = variant(world)
    calls = []

    def interrupted_evaluate(theta):
        calls.append(time.monotonic())
        raise KeyboardInterrupt

    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        threads.run(cfg, setup, None, interrupted_evaluate)
    assert len(calls) == 1 and time.monotonic() - calls[0] < load_scaled(5.0, calls[0] - began)


def test_sigint_while_running_stops_all(world, tmp_path, no_leftover_threads):
    """A real Ctrl-C (SIGINT to the process) lands in the main thread while the learners run; each
    learner writes a final checkpoint of where it stopped."""
    # Learner 1 keeps the run going for seconds: paced at 20 x 5 ms a step whatever the machine's
    # speed (unpaced, a fast idle machine can finish the run before the Ctrl-C lands).
    cfg, setup = variant(world, speeds=(1.0, 20.0), step_period_s=0.005)
    timers, sent = [], []

    def evaluate_then_sigint(theta):
        if not timers:  # first eval (learner 0 at step 20): send Ctrl-C shortly after
            def ctrl_c():
                sent.append(time.monotonic())
                os.kill(os.getpid(), signal.SIGINT)

            timers.append(threading.Timer(0.2, ctrl_c))
            timers[-1].start()
        return 0.0

    began = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            threads.run(cfg, setup, tmp_path, evaluate_then_sigint)
    finally:
        for timer in timers:
            timer.join()
    assert sent and time.monotonic() - sent[0] < load_scaled(5.0, sent[0] - began)
    for m in range(cfg.runtime.learners):
        assert any(d.name.isdigit() for d in (tmp_path / "learners" / f"learner-{m}").iterdir())


def test_a_killed_learner_rejoins_from_its_checkpoint_under_a_new_incarnation(world, tmp_path, monkeypatch,
                                                                               no_leftover_threads):
    """kill(1) mid-run: its unsent work is lost, it restarts as incarnation 1 with the syncer's
    Theta and its own checkpointed optimizer state at the step where it stopped (13: the steps
    after its checkpoint were merged or booked lost, never trained twice), and the run finishes
    balanced."""
    cfg, setup = variant(world, restart_s=0.2, learner_checkpoint_every=5, max_rejoin_staleness=1000)
    rt = threads.Threads(cfg, setup, None, None, None, tmp_path / "learners")
    plain_step = LearnerUnit.step

    def step(unit, *args, **kwargs):
        if unit.learner == 1 and unit.ls.incarnation == 0 and unit.ls.step == 12:
            rt.kill(1)  # takes effect after this (13th) step, at the top of the learner's loop
        return plain_step(unit, *args, **kwargs)
    monkeypatch.setattr(LearnerUnit, "step", step)
    summary = rt.run()

    assert [(r.learner, r.incarnation, r.restored_from, r.step) for r in rt.rejoins] == [(1, 1, 10, 13)]
    assert [u.ls.step for u in rt.units] == [STEPS] * M and rt.units[1].ls.incarnation == 1
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    assert rt.tokens.processed == ((STEPS + 13 + STEPS - 13) * tokens_per_step,) * P
    assert summary["token_ledger_imbalance"] == 0 and sum(rt.tokens.lost) > 0
    assert rt.syncer.live == {0: 0, 1: 1}
    assert timeline.seconds(rt.time)[1]["restarting"] >= 0.2
    merges = [r for r in rt.syncer.decisions if r["event"] == "merge"]
    assert any(1 in r["learners"] for r in merges[-4:])  # the new incarnation's work is merged
    for fs in rt.syncer.fragments:  # one version at a time: none applied twice or skipped
        versions = [r["version"] for r in merges if r["fragment"] == fs.spec.index]
        assert versions == list(range(1, fs.version + 1))


def test_rejoin_at_schedule_takes_up_the_paced_step_and_skips_the_missed_ones(world, tmp_path, monkeypatch,
                                                                               no_leftover_threads):
    """Paced at 0.1 s per step, learner 1 killed after its 13th step (about 1.3 s) and back 0.5 s
    later: it keeps its step-10 checkpoint's optimizer state but resumes at the schedule's step
    (about 18, or more on a loaded machine), not 10, and skips the steps in between."""
    period = 0.1
    cfg, setup = variant(world, restart_s=0.5, learner_checkpoint_every=5, max_rejoin_staleness=1000,
                         step_period_s=period, rejoin_at="schedule")
    rt = threads.Threads(cfg, setup, None, None, None, tmp_path / "learners")
    plain_step = LearnerUnit.step

    def step(unit, *args, **kwargs):
        if unit.learner == 1 and unit.ls.incarnation == 0 and unit.ls.step == 12:
            rt.kill(1)
        return plain_step(unit, *args, **kwargs)
    monkeypatch.setattr(LearnerUnit, "step", step)
    summary = rt.run()

    (how,) = rt.rejoins
    assert how.restored_from == 10 and how.step >= int((13 * period + 0.5) / period) - 1, how
    assert [u.ls.step for u in rt.units] == [STEPS] * M
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    assert rt.tokens.processed == ((STEPS + 13 + STEPS - how.step) * tokens_per_step,) * P
    assert summary["token_ledger_imbalance"] == 0


def test_a_chaos_tape_on_the_wall_clock_shrinks_the_batch_then_kills_and_restarts(world, tmp_path, monkeypatch,
                                                                                   no_leftover_threads):
    """A hand-written tape replayed at wall_scale 1: learner 1 loses one of its 2 slices at once
    (half the batch from its first step, compiled before the clock starts), its other slice 0.05 s
    into the run (it crashes) and gets one back at 1.5 s (it restarts after restart_s and finishes
    on half the batch); learner 0 never notices. The ledger balances and the down time is booked."""
    from diloco.chaos import tapes
    cfg, setup = variant(world, restart_s=0.1)
    cfg = replace(cfg, chaos=replace(cfg.chaos, wall_scale=1.0))
    events = (tapes.Event(0.0, "slice_down", 1, 0), tapes.Event(0.05, "slice_down", 1, 1),
              tapes.Event(1.5, "slice_up", 1, 1))  # wide: a loaded machine checks late
    tape = tapes.Tape(M, 2, 100.0, (1.0, 1.0), 0.0, 0, events)
    rows = {0: set(), 1: set()}
    plain_step = LearnerUnit.step

    def step(unit, *args, **kwargs):
        rows[unit.learner].add(kwargs.get("rows"))
        return plain_step(unit, *args, **kwargs)
    monkeypatch.setattr(LearnerUnit, "step", step)
    rt = threads.Threads(cfg, setup, None, None, None, tmp_path / "learners", tape)
    summary = rt.run()

    batch = cfg.data.batch_size
    assert rows == {0: {batch}, 1: {batch // 2}}
    assert [(r.learner, r.incarnation) for r in rt.rejoins] == [(1, 1)]
    assert [u.ls.step for u in rt.units] == [STEPS] * M
    # balanced whatever the crash caught: 0.05 s in, learner 1 may not have finished a step yet,
    # and then it lost nothing (a fresh-clone run at load 2 booked its tokens "overwritten")
    assert summary["token_ledger_imbalance"] == 0 and rt.tokens.dead == frozenset({(1, 0)})
    assert timeline.seconds(rt.time)[1]["down"] >= 0.5
