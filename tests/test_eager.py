"""Eager outer steps (docs/algorithm.md#eager-outer-steps): the math by hand, the learner state
machine with tau >= H, a threads run, and the config rules. The sim runs (M = 1 lossless, tau = 0,
two learners) are at the end of tests/test_sim.py, which compiles the tiny steps once for all."""

import numpy as np
import pytest
from conftest import diloco_world, override, tiny_cfg
from syncer_frames import E, THETA0, frame, merges, policy, publishes, shifted, start

from diloco.algo import eager, ledger
from diloco.algo import learner as lsm
from diloco.algo import syncer as sync
from diloco.algo.fragments import make_schedule
from diloco.algo.outer import make_outer
from diloco.bandwidth.utilisation import Method, Workload, by_depth, utilisation
from diloco.config import ConfigError
from diloco.runtime import syncer_ckpt, threads

EAGER = dict(eager=True)
BASE = dict(anchor="base")


def test_two_learners_by_hand():
    """Theta = 10, outer SGD lr 0.5, M = 2, eager_share 1/2 (the paper's rule), so s = 0.25. Learner 0 reaches 9 (Delta 1), learner 1
    reaches 7 (Delta 3). Their stand-ins 0.25 and 0.75 put them at 9.75 and 9.25; they move on by
    -0.5 and -1. The merge (mean Delta 2) gives Theta = 9; the corrections are merged change (-1)
    minus stand-in: -0.75 and -0.25, so they hold 8.5 and 8.0."""
    s = eager.stand_in_scale(make_outer("sgd", lr=0.5, momentum=0.0), 1 / 2)
    assert s == 0.25
    theta = {("w",): np.float32(10.0)}
    out = []
    for local, later in ((9.0, -0.5), (7.0, -1.0)):
        u = eager.stand_in({("w",): theta[("w",)] - np.float32(local)}, s)
        a = eager.anchor(theta, (u,))
        out.append((float(a[("w",)]), a, float(a[("w",)]) + later))
    assert [o[0] for o in out] == [9.75, 9.25]
    merged = {("w",): np.float32(10.0 - 0.5 * (1.0 + 3.0) / 2)}
    after = eager.anchor(merged, ())
    held = [float(eager.moved(np.float32(x), a[("w",)], after[("w",)])) for _, a, x in out]
    assert held == [8.5, 8.0]
    assert [h - x for h, (_, _, x) in zip(held, out)] == [-0.75, -0.25]


def test_the_gain_is_read_off_each_outer_optimizer():
    assert eager.gain(make_outer("average")) == 1.0
    assert eager.gain(make_outer("sgd", lr=0.5, momentum=0.9)) == pytest.approx(0.5)
    assert eager.gain(make_outer("nesterov", lr=0.7, momentum=0.9)) == pytest.approx(0.7 * 1.9)
    assert eager.gain(make_outer("delayed_nesterov", lr=0.7, momentum=0.9, N=4)) == pytest.approx(0.7 / 4)
    assert eager.stand_in_scale(make_outer("average"), 1 / 4) == 0.25


def test_the_state_machine_overlaps_rounds_of_one_fragment():
    """P = 1, H = 2, tau = 4: round 2 leaves before round 1's merge is applied; counters count from
    the last send; the merge is applied tau steps after the send it answers and both sends older than
    the merge leave flight; nothing is overwritten."""
    with pytest.raises(ValueError, match="tau >= H needs eager"):
        make_schedule(1, 2, tau=4)
    sch = make_schedule(1, 2, tau=4, eager=True, stand_in=0.5)
    st = lsm.init(0, 0, (0,))
    for _ in range(2):
        st, sends = lsm.after_step(st, sch, tokens=10)
    assert [s.seq for s in sends] == [1] and sends[0].c_steps == 2 and st.c_steps == (0,)
    st = lsm.on_fragment(st, sch, 0, 1, frozenset({(0, 0, 1)}))  # round 1 merged, due at step 2 + 4
    for _ in range(2):
        st, sends = lsm.after_step(st, sch, tokens=10)
    assert [s.seq for s in sends] == [2] and sends[0].c_steps == 2 and sends[0].c_tokens == 20
    assert lsm.to_apply(st, sch)[1] == () and lsm.blocking(st, sch) is None
    st, _ = lsm.after_step(st, sch, tokens=10)
    st, _ = lsm.after_step(st, sch, tokens=10)  # step 6: round 3 left
    st, ready = lsm.to_apply(st, sch)
    assert [(q.version, q.answers, q.kept) for q in ready] == [(1, (1,), True)]
    assert [f.seq for f in st.in_flight] == [2, 3] and st.versions == (1,) and st.c_steps == (0,)
    # flush sends the progress since the last send although the fragment is in flight
    st, _ = lsm.after_step(st, sch, tokens=10)
    assert [s.c_steps for s in lsm.flush(st, eager=True)[1]] == [1] and lsm.flush(st)[1] == ()


@pytest.mark.slow  # 35 s, most of it compiling; the sim's eager tests are in tests/test_sim.py
def test_threads_runs_eager_steps(tmp_path):
    """The threads runtime drives the same unit: an eager run with tau = 2H trains and balances."""
    cfg = tiny_cfg(tmp_path, "threads", run=dict(steps=16, eval_every=16),
                   fragments=dict(tau=8, **EAGER), syncer=BASE)
    _, _, setup, evaluate_global, initial = diloco_world(cfg)
    rt, summary = threads.run(cfg, setup, tmp_path, evaluate_global)
    assert [u.ls.step for u in rt.units] == [16, 16]
    assert summary["token_ledger_imbalance"] == 0 and summary["merges"] > 0
    assert summary["eval_loss"] < initial


@pytest.mark.parametrize("groups, message", [
    (dict(fragments=dict(tau=4)), r"fragments.tau=4 must be in \[0, fragments.H=4\) \(tau >= H needs fragments.eager=true\)"),
    (dict(fragments=dict(tau=8, eager=True)), "fragments.eager=true needs syncer.anchor=base"),
    (dict(fragments=dict(eager=True, keep_overlap=True), syncer=BASE), "fragments.keep_overlap=True"),
    (dict(fragments=dict(eager=True, eager_share=0.0), syncer=BASE), r"fragments.eager_share=0.0 must be in \(0, 1\]"),
])
def test_config_refuses_with_the_values(tmp_path, groups, message):
    with pytest.raises(ConfigError, match=message):
        override(tiny_cfg(tmp_path), **groups)
    assert override(tiny_cfg(tmp_path), fragments=dict(tau=8, eager=True), syncer=BASE).fragments.tau == 8


@pytest.mark.parametrize("tau", [0, 2, 3, 4, 5, 6, 8, 9, 10, 12])
def test_utilisation_of_an_overlap_deeper_than_H(tau):
    """One layer, one fragment each H = 4 steps of 1 s, a free link with a 10 s round trip D. A sync
    stalls the step tau + 1 after it for what the overlap does not hide; with tau >= H the stalls of
    the q = tau // H syncs sent in between also count, so each period stalls x = (D - tau) / (q + 1)
    and utilisation = H / (H + x): 1 once tau covers the round trip (tau = 10)."""
    w = Workload(params=1.0, step_time=1.0, layers=1, datacenters=2, latency=5.0)
    m = Method("eager", H=4, P=1, tau=tau, bits=1)
    stall = max(0.0, (10.0 - tau) / (tau // 4 + 1))
    for periods in (4, 12):
        assert utilisation(w, m, 1e6, periods) == pytest.approx(4 / (4 + stall), rel=1e-12)


def test_eager_rows_gain_on_a_slow_link():
    """10B parameters over 8 sites, 0.8 s steps, P = H = 24, int4: at 2 Gbit/s and a 0.5 s hop latency
    (7 s round trip, about 9 steps) tau = 2 stalls; tau = 12 hides it all, and deeper overlaps keep it."""
    w = Workload(params=1e10, step_time=0.8, layers=48, datacenters=8, latency=0.5)
    rows = by_depth(w, 2.0, (2, 12, 24, 48))
    assert rows[2] < rows[12] and rows[12] <= rows[24] + 1e-12 and rows[24] <= rows[48] + 1e-12
    # Without latency that link is too slow for the bytes: no depth of overlap buys anything.
    slow = by_depth(Workload(params=1e10, step_time=0.8, layers=48, datacenters=8), 2.0, (2, 48, 96))
    assert slow[48] == pytest.approx(slow[2], rel=1e-9) and slow[96] == pytest.approx(slow[2], rel=1e-9)


def _two_sends_in_one_round(eager_repeat: bool):
    """K = M = 2, outer average, merge average, fp32, syncer.anchor=base. Learner 0 sends fragment 1
    twice while learner 1 has not sent (the round stays open): Delta_1 = 1 x (1, 2, 3, 4), then from
    its moved anchor Delta_2 = 2 x (1, 2, 3, 4), each 2 steps of 16 tokens. Learner 1 sends
    Delta_B = -1 x (1, 2, 3, 4), 2 steps of 16 tokens. The token ledger books every send and outcome."""
    pol = policy(K=2, anchor="base", eager=eager_repeat)
    st, led = start(pol), ledger.token_ledger(2)
    ref = THETA0[1]
    sends = ((0, 1, 1.0), (0, 2, 2.0), (1, 1, -1.0))
    for learner, seq, by in sends:
        for _ in range(2):
            led = ledger.process(led, learner, 0, 8)
        led = ledger.send(led, learner, 0, 1, seq)
    actions = ()
    for t, (learner, seq, by) in enumerate(sends):  # each a Delta against base version 0
        st, out = sync.on_contribution(pol, st, frame(shifted(ref, -by), ref, learner=learner, seq=seq, fragment=1,
                                                      c_steps=2, c_tokens=16), float(t))
        actions += out
    for a in actions:
        if isinstance(a, sync.Outcome):
            led = ledger.resolve(led, a.key, a.outcome, a.into)
    return st, led, actions


def test_an_eager_learners_two_sends_in_one_round_are_both_merged():
    """Each eager send is a pseudo-gradient against an anchor its stand-in moved, so the newer one
    does not hold the older one's progress (docs/algorithm.md#eager-outer-steps): the repeat adds
    them, one contribution of Delta_1 + Delta_2 over 4 steps and 32 tokens (weight 32^2 / 4 = 256,
    learner 1's 16^2 / 2 = 128). Theta moves by (256 x 3 + 128 x (-1)) / 384 = 5/3 x (1, 2, 3, 4);
    today's plain rule, the newer replacing the older, moved it by (2 - 1) / 2 and lost Delta_1.
    Every token is merged once and the ledger balances."""
    st, led, actions = _two_sends_in_one_round(True)
    assert sync.Outcome((0, 0, 1), "carried", (0, 0, 2)) in actions
    (pub,) = publishes(actions)
    assert pub.merged == ((0, 0, 2), (1, 0, 1))  # learner 0's older send leaves flight with it
    (rec,) = merges(st)
    assert rec["weights"] == [256.0, 128.0]
    np.testing.assert_allclose(st.fragments[1].theta[E], THETA0[1][E] - 5 / 3 * np.arange(1, 5), rtol=1e-6)
    ledger.check_balance(led)
    assert led.merged[1] == led.processed[1] == 48 and ledger.outstanding(led)[1] == 0
    # Without eager steps the newer send holds the older one's progress: it replaces it, as before.
    st, led, _ = _two_sends_in_one_round(False)
    np.testing.assert_allclose(st.fragments[1].theta[E], THETA0[1][E] - 0.5 * np.arange(1, 5), rtol=1e-6)
    ledger.check_balance(led)


def test_a_checkpoint_of_a_round_holding_an_eager_repeat_resumes_bit_identical():
    """The summed contribution saves as its local values (ref - (Delta_1 + Delta_2)); the restored
    syncer takes its pseudo-gradient from them and merges exactly as the uninterrupted one."""
    pol = policy(K=2, anchor="base", eager=True)
    ref = THETA0[1]
    st = start(pol)
    for seq, by in ((1, 1.0), (2, 2.0)):
        st, _ = sync.on_contribution(pol, st, frame(shifted(ref, -by), ref, seq=seq, fragment=1), float(seq))
    arrays, meta = syncer_ckpt.to_checkpoint(st)
    restored = syncer_ckpt.from_checkpoint(arrays, meta, pol, tuple(fs.spec for fs in st.fragments))
    (c,) = restored.fragments[1].contributions
    assert (c.key, c.c_steps, c.c_tokens) == ((0, 0, 2), 2, 16)
    last = frame(shifted(ref, 1.0), ref, learner=1, fragment=1, c_steps=2, c_tokens=16)  # weight 128, as the sum
    st, _ = sync.on_contribution(pol, st, last, 3.0)
    restored, _ = sync.on_contribution(pol, restored, last, 3.0)
    assert st.fragments[1].theta[E].tobytes() == restored.fragments[1].theta[E].tobytes()
    np.testing.assert_allclose(st.fragments[1].theta[E], ref[E] - np.arange(1, 5), rtol=1e-6)  # (3 - 1) / 2


@pytest.mark.parametrize("name", ["nesterov", "sgd"])
def test_the_stand_in_carries_the_outer_momentum_the_merge_will(name):
    """One learner, share 1, fp32, tau = H: each send leaves while the one before is in flight. Its
    momentum rebuilt from the moves it applied, pushed by the send in flight, gives a stand-in equal
    to the move the syncer's optax step then makes; the zero-state gain alone misses mu^2 lr b
    (Nesterov) or mu lr b (heavy ball), most of the move once the momentum has built up."""
    opt = make_outer(name, lr=0.7, momentum=0.9)
    mom = eager.momentum_of(name, 0.7, 0.9, 1.0)
    s = eager.stand_in_scale(opt, 1.0)
    rng = np.random.default_rng(0)
    theta = {("w",): rng.normal(size=8).astype(np.float32)}
    state = opt.init(theta)
    held, b, flying, misses = dict(theta), None, None, []
    for k in range(8):
        delta = {("w",): (rng.normal(size=8) * 0.1 + 0.3).astype(np.float32)}  # a steady direction
        b_now = b if flying is None else eager.pushed(mom, b, flying)
        u = eager.stand_in(delta, s)
        u = {p: u[p] + eager.carried(mom, b_now)[p] for p in u} if b_now is not None else u
        updates, state = opt.update(delta, state, theta)  # the merge answering this send
        theta = {p: np.asarray(theta[p] + updates[p], np.float32) for p in theta}
        np.testing.assert_allclose(u[("w",)], -np.asarray(updates[("w",)]), rtol=2e-5, atol=1e-6)
        misses.append(float(np.abs(eager.stand_in(delta, s)[("w",)] + np.asarray(updates[("w",)])).max()))
        if k > 0:  # the merge answering the previous send is applied now, this one stays in flight
            b = eager.rebuilt(mom, b, {p: before[p] - after[p] for p in theta}, [None])
        before, after, flying = held, dict(theta), delta
        held = after
    assert misses[0] < 1e-6 and misses[-1] > 0.5 * float(np.abs(updates[("w",)]).max())
    for name, momentum in (("nesterov", "auto"), ("average", 0.9), ("delayed_nesterov", 0.9), ("nesterov", 0.0)):
        assert eager.momentum_of(name, 0.7, momentum, 1.0) is None  # the zero-state gain alone


@pytest.mark.parametrize("name", ["nesterov", "sgd"])
def test_the_momentum_rebuilt_over_two_merges_is_optaxs(name):
    """An apply spanning two merges, each answering one send, with the guesses exact (M = 1, share 1,
    fp32): the momentum rebuilt from the one move equals optax's trace after both; and a partial push
    of share 1 is the whole one, bit for bit."""
    opt = make_outer(name, lr=0.7, momentum=0.9)
    mom = eager.momentum_of(name, 0.7, 0.9, 1.0)
    rng = np.random.default_rng(1)
    theta = {("w",): rng.normal(size=8).astype(np.float32)}
    state, b = opt.init(theta), None
    for _ in range(4):
        before = dict(theta)
        gs = [{("w",): (rng.normal(size=8) * 0.1 + 0.3).astype(np.float32)} for _ in range(2)]
        for g in gs:
            updates, state = opt.update(g, state, theta)
            theta = {p: np.asarray(theta[p] + updates[p], np.float32) for p in theta}
        b = eager.rebuilt(mom, b, {p: before[p] - theta[p] for p in theta}, gs)
        np.testing.assert_allclose(b[("w",)], state[0].trace[("w",)], rtol=2e-6, atol=1e-6)
    whole, part = eager.pushed(mom, b, gs[0]), eager.pushed_part(mom, b, gs[0], 1.0)
    assert whole[("w",)].tobytes() == part[("w",)].tobytes()
