"""Per-learner batch sizes (runtime.learner_batch, docs/algorithm.md#unequal-hardware): the auto
rule by hand, the start-up checks, each learner stepping its own rows in sim, the merge weighing
them (tokens x tokens per step), the ledgers balancing, and the memory estimate per learner."""

import numpy as np
import pytest
from conftest import SGD, override, tiny_cfg
from test_sim import build, corpus, make_cfg, merge_records, model, run_sim  # noqa: F401

from diloco.algo import messages, payloads, timeline
from diloco.algo import syncer as sync
from diloco.config import ConfigError
from diloco.config.learner_batch import auto_batches, learner_batches
from diloco.runtime import build as setup_mod
from diloco.train import footprint


def test_auto_shares_the_fleets_rows_by_inverse_speed():
    """M x batch rows split in proportion to 1 / speed, in multiples of the learner's devices, by
    largest remainder: worked by hand."""
    assert auto_batches((1.0, 1.0, 1.0, 1.0), 8, 2) == (8, 8, 8, 8)  # equal speeds: today's batches
    assert auto_batches((1.0, 1.0, 1.0), 12, 4) == (12, 12, 12)
    # 16 units of 2 rows: ideal 5.33, 5.33, 2.67, 2.67 -> floors 5, 5, 2, 2; the 2 left go to the .67s
    assert auto_batches((1.0, 1.0, 2.0, 2.0), 8, 2) == (10, 10, 6, 6)
    # 32 units of 1 row: 10.67, 10.67, 5.33, 5.33 -> 10, 10, 5, 5; the 2 left to the .67s
    assert auto_batches((1.0, 1.0, 2.0, 2.0), 8, 1) == (11, 11, 5, 5)
    assert auto_batches((2.0, 1.0), 8, 1) == (5, 11)
    # every learner keeps one unit, however slow: 4 units, 1 each
    assert auto_batches((1.0, 1.0, 1.0, 100.0), 2, 2) == (2, 2, 2, 2)
    # a floor of 1 taken beyond the share comes off the largest excess: 8 units, ideal 7.92 and 0.08
    assert auto_batches((1.0, 100.0), 4, 1) == (7, 1)
    for speeds in ((1.0, 3.0), (1.0, 1.3, 2.0, 2.7, 0.5)):
        assert sum(auto_batches(speeds, 8, 2)) == len(speeds) * 8


def test_learner_batches_from_the_config(tmp_path):
    base = tiny_cfg(tmp_path, runtime=dict(learners=4))
    assert learner_batches(base) == (16, 16, 16, 16)
    assert learner_batches(override(base, runtime=dict(learner_batch=(8, 8, 24, 24)))) == (8, 8, 24, 24)
    auto = override(base, runtime=dict(learner_batch="auto", speeds=(1.0, 1.0, 2.0, 2.0)))
    assert learner_batches(auto) == auto_batches((1.0, 1.0, 2.0, 2.0), 16, 1) == (21, 21, 11, 11)
    # under a generated tape its speeds (chaos.speeds, cycled) are the runtime's, so auto reads them
    taped = override(auto, chaos=dict(enabled=True, speeds=(2.0, 1.0)))
    assert learner_batches(taped) == (11, 21, 11, 21)


@pytest.mark.parametrize("runtime, needle", [
    (dict(learner_batch=(8, 8, 8)), "runtime.learner_batch=[8, 8, 8] has 3 entries for runtime.learners=2"),
    (dict(learner_batch=(8, 0)), "runtime.learner_batch=[8, 0]: [0] must be positive"),
    (dict(learner_batch=(4, 6), devices_per_learner=4),
     "[6] must be positive multiples of runtime.devices_per_learner=4"),
    (dict(learner_batch="fast"), "runtime.learner_batch='fast' must be auto or a list"),
])
def test_bad_learner_batches_are_refused_naming_the_values(tmp_path, runtime, needle):
    base = tiny_cfg(tmp_path, runtime=dict(devices_per_learner=1))
    with pytest.raises(ConfigError) as e:
        override(base, runtime=runtime)
    assert needle in str(e.value)


def test_auto_with_a_tape_file_is_refused(tmp_path):
    tape = tmp_path / "tape.json"
    tape.write_text("{}")
    with pytest.raises(ConfigError, match="chaos.tape_file=.* give the batches as a list"):
        tiny_cfg(tmp_path, runtime=dict(learner_batch="auto"), chaos=dict(enabled=True, tape_file=str(tape)))


@pytest.mark.slow  # compiles the tiny step at two batch shapes (10-20 s on 2 loaded cores)
def test_each_learner_steps_its_own_rows_and_twice_the_batch_weighs_four_times(tmp_path, build):
    """Learner 1 has twice learner 0's rows; learner 0's chips are twice as slow per row (speed 2 at
    half the rows), so their steps take the same modelled second. Each
    learner trains on its own rows; every merge weighs learner 1 by 4: twice the tokens over the
    same steps, w = c_tokens^2 / c_steps (docs/algorithm.md#token-weights). The ledger balances
    (run_sim) and the processed tokens are each learner's rows x steps."""
    steps, L = 6, 16
    cfg = make_cfg(tmp_path, steps=steps, runtime=dict(learner_batch=(4, 8), speeds=(2.0, 1.0)))
    setup = build(cfg)
    assert setup.spec.learner_batch == (4, 8) and setup.policy.step_tokens == 8 * L
    sim, summary = run_sim(cfg, setup)
    assert [u.tokens_per_step for u in sim.units] == [4 * L, 8 * L]
    assert summary["tokens_processed"] == steps * (4 + 8) * L
    seconds = timeline.seconds(sim.time)
    assert seconds[0]["compute"] == seconds[1]["compute"] == steps * cfg.runtime.step_time
    records = merge_records(sim.syncer)
    assert len(records) == steps // cfg.fragments.H
    for r in records:
        w = dict(zip(r["learners"], r["weights"]))
        assert w[1] == pytest.approx(4 * w[0]) and w[0] == pytest.approx(cfg.fragments.H * (4 * L) ** 2)


@pytest.mark.slow  # compiles the tiny step at two batch shapes (10-20 s on 2 loaded cores)
def test_twice_the_batch_is_twice_the_tokens_and_four_times_the_weight_in_the_merged_update(tmp_path, build):
    """Through the syncer: one step of each learner (H = 1, outer average at lr 1), learner 1 of
    twice the rows; its frame claims twice the tokens over the same one step, and the new Theta is
    Theta_0 - (w0 d0 + w1 d1) / (w0 + w1) with w1 = 4 w0, d the pseudo-gradients the frames carry."""
    cfg = make_cfg(tmp_path, runtime=dict(learner_batch=(4, 8)), fragments=dict(H=1))
    setup = build(cfg)
    st = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0, 1: 0})
    frames = [setup_mod.new_unit(setup, m, 0, st).step().frames[0] for m in (0, 1)]
    heads = [messages.decode(f).header for f in frames]
    assert [h["c_steps"] for h in heads] == [1, 1]
    assert [h["c_tokens"] for h in heads] == [4 * 16, 8 * 16]
    for f in frames:
        st, _ = sync.on_contribution(setup.policy, st, f, 0.0)
    assert st.merges == 1
    theta = sync.theta(st)
    expected_shape = {p: (v.shape, np.float32) for p, v in setup.theta0[0].items()}
    deltas = [payloads.unpack_fragment(h, messages.decode(f).payload, None, expected_shape)
              for h, f in zip(heads, frames)]
    for path, x0 in setup.theta0[0].items():
        want = x0 - (1 * deltas[0][path] + 4 * deltas[1][path]) / 5
        np.testing.assert_allclose(theta[path], want, rtol=1e-5, atol=1e-6, err_msg=str(path))


@pytest.mark.slow  # compiles the tiny step at two batch shapes (10-20 s on 2 loaded cores)
def test_equal_learner_batches_are_todays_run_bit_for_bit(tmp_path, build):
    """runtime.learner_batch=[B, B] is the default () exactly: the same steps, times and Theta."""
    cfg = make_cfg(tmp_path, steps=4, runtime=dict(speeds=(1.0, 1.5), jitter=0.2))
    a, sa = run_sim(cfg, build(cfg))
    same = override(cfg, runtime=dict(learner_batch=(8, 8)))
    b, sb = run_sim(same, build(same))
    assert a.syncer.decisions == b.syncer.decisions and a.now == b.now
    ta, tb = sync.theta(a.syncer), sync.theta(b.syncer)
    assert all(ta[p].tobytes() == tb[p].tobytes() for p in ta)


def test_the_spec_and_policy_carry_each_learners_rows(tmp_path):
    """Fast (no model): a unit's rows are its learner's, a learner a tape adds beyond them takes
    data.batch_size, and a claim may reach the largest learner's batch (the syncer's bound)."""
    from diloco.runtime.unit import UnitSpec

    cfg = make_cfg(tmp_path, runtime=dict(learner_batch=(4, 12)))
    spec = UnitSpec(None, 0, 2, cfg.data.batch_size, cfg.data.seq_len, (), None, None, "fp32",
                    learner_batch=learner_batches(cfg))
    assert [spec.rows_of(m) for m in range(3)] == [4, 12, cfg.data.batch_size]
    assert setup_mod.policy(cfg).step_tokens == 12 * cfg.data.seq_len
    assert setup_mod.policy(make_cfg(tmp_path)).step_tokens == cfg.data.batch_size * cfg.data.seq_len


def test_a_tape_shrinks_each_learners_own_batch():
    """On the wall clock (threads, procs) a learner short of slices computes its own rows' share,
    and compiles those shapes before the clock starts."""
    from diloco.chaos import tapes
    from diloco.runtime.walltape import WallTape

    tape = tapes.Tape(2, 2, 100.0, (1.0, 1.0), 0.0, 0, (tapes.Event(0.0, "slice_down", 0, 0),
                                                         tapes.Event(0.0, "slice_down", 1, 0)))
    wall = WallTape(tape, 1.0, (4, 12), 2)
    assert [wall.rows(m, 1.0) for m in (0, 1)] == [2, 6]
    assert [wall.smaller_batches(m) for m in (0, 1)] == [(2,), (6,)]


def test_memory_estimate_per_learner(tmp_path):
    """A learner's device peak is at its own rows (the largest by default); learners stepping at
    once on devices of their own (threads) hold each its own step's activations."""
    base = tiny_cfg(tmp_path, kind="threads", runtime=dict(learners=2), data=dict(batch_size=8), inner=SGD)
    uneven = override(base, runtime=dict(learner_batch=(4, 20)))
    params, vocab = 10_000, 16
    def act(cfg, **kw):
        return footprint.estimate(cfg, params, vocab, platform="cpu", **kw).parts["activations"]
    assert act(uneven) == act(override(base, data=dict(batch_size=20)))
    assert act(uneven, rows=4) == act(override(base, data=dict(batch_size=4))) < act(uneven)
    def step(cfg):
        return footprint.host_estimate(cfg, params, vocab, platform="cpu").parts["a step"]
    # activations are linear in rows: 4 + 20 rows at once hold what 2 x 12 do
    assert step(uneven) == pytest.approx(step(override(base, data=dict(batch_size=12))))
    assert step(uneven) > step(base)
    # sim steps one learner at a time: its peak is the largest learner's step
    sim = dict(kind="sim")
    at_20 = override(base, runtime=sim, data=dict(batch_size=20))
    assert step(override(uneven, runtime=sim)) == pytest.approx(step(at_20))


@pytest.mark.slow  # a threads run of the tiny model: about 20 s
def test_threads_learners_step_their_own_rows_and_balance(tmp_path):
    """threads: each learner's thread steps its own batch shape (compiled in its warm-up), every
    step booked once at its own tokens, the ledger balanced."""
    from conftest import diloco_world

    from diloco.runtime import threads

    steps, rows = 12, (8, 16)
    cfg = tiny_cfg(tmp_path, "threads", run=dict(steps=steps, eval_every=0), runtime=dict(learner_batch=rows))
    _, _, setup, evaluate_global, _ = diloco_world(cfg)
    rt, summary = threads.run(cfg, setup, tmp_path, evaluate_global)
    assert [u.tokens_per_step for u in rt.units] == [b * cfg.data.seq_len for b in rows]
    P = len(setup.fragments)
    assert rt.tokens.processed == (steps * sum(rows) * cfg.data.seq_len,) * P
    assert summary["token_ledger_imbalance"] == 0 and summary["merges"] > 0


@pytest.mark.slow  # a procs run of the tiny model: about 40 s
def test_procs_learner_processes_step_their_own_rows_and_balance(tmp_path):
    """procs: every learner process builds its own unit from the config, at its own rows; the
    syncer process checks each step event's tokens against that learner's batch."""
    from conftest import diloco_world

    from diloco.runtime import procs

    steps, rows = 10, (8, 16)
    cfg = tiny_cfg(tmp_path, "procs", run=dict(steps=steps, eval_every=0), runtime=dict(learner_batch=rows))
    _, _, setup, evaluate_global, _ = diloco_world(cfg)
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    rt, summary = procs.run(cfg, setup, run_dir, evaluate_global)
    assert rt.finished["complete"] and rt.finished["steps"] == {"0": steps, "1": steps}
    P = len(setup.fragments)
    assert rt.finished["tokens"]["processed"] == P * steps * sum(rows) * cfg.data.seq_len
    assert summary["token_ledger_imbalance"] == 0 and summary["merges"] > 0
