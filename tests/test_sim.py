"""The sim runtime end to end on the tiny model: degenerate cases equal plain training and plain
averaging, merge rules per fragment kind, ledgers, determinism, heterogeneous speeds, bytes."""

import json
import math
import struct
from dataclasses import replace
from unittest import mock

import jax
import numpy as np
import pytest
from conftest import SGD, override, tiny_cfg, tiny_model

from diloco.algo import eager, ledger, messages, timeline
from diloco.algo import syncer as sync
from diloco.algo.outer import make_outer
from diloco.config import TrainConfig
from diloco.data import batch_at, load_corpus
from diloco.model import build as build_model
from diloco.model import count_params
from diloco.bandwidth.analytic import dp_bytes_per_step
from diloco.run import run_diloco
from diloco.runtime.summary import replayable
from diloco.runtime import build as setup_mod
from diloco.runtime import unit_eager
from diloco.runtime.sim.runtime import Sim
from diloco.train.trainer import compile_steps


def make_cfg(tmp, steps=6, **groups) -> TrainConfig:
    """The tests' tiny run (tests/conftest.py) with M = 2 learners of 1 device, P = 1, H = 2,
    tau = 0, K = M, inner SGD, outer average, fp32 both ways, no logs; `groups` override fields per
    config group, e.g. runtime=dict(speeds=(1.0, 2.0))."""
    cfg = tiny_cfg(tmp, data=dict(seq_len=16, batch_size=8), inner=SGD,
                   run=dict(steps=steps, log_every=0, eval_every=0, eval_batches=1),
                   fragments=dict(count=1, H=2, tau=0), outer=dict(name="average", lr=1.0, momentum=0.0),
                   codec=dict(up="fp32", down="fp32", zstd_level=0), syncer=dict(quorum=2, merge="average"))
    return override(cfg, **groups)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return load_corpus(make_cfg(tmp_path_factory.mktemp("c")).data)


@pytest.fixture(scope="module")
def model(corpus):
    return build_model(tiny_model(), corpus.vocab_size, seed=0)


@pytest.fixture(scope="module")
def build(corpus, model):
    """setup.build with each learner's jitted steps compiled once per (inner config, device) for the
    whole module: compiling is most of the cost of these tests. The inner schedule is constant, so
    run.steps does not change what is compiled."""
    cache = {}

    def cached_compile(model_, cfg, mesh):
        assert model_ is model and cfg.inner.schedule == "constant"
        key = (cfg.inner, cfg.data.batch_size, tuple(d.id for d in mesh.devices.flat))
        if key not in cache:
            cache[key] = compile_steps(model_, cfg, mesh)
        return cache[key]

    def build_setup(cfg):
        with mock.patch.object(setup_mod, "compile_steps", cached_compile):
            return setup_mod.build(cfg, corpus, model)

    build_setup.patched = lambda: mock.patch.object(setup_mod, "compile_steps", cached_compile)
    return build_setup


def run_sim(cfg, setup, before_merge=None):
    """Run to the end; `before_merge(sim)` is called before each contribution that merges (K = M)."""
    sim = Sim(cfg, setup, None, None)
    if before_merge is not None:
        plain = sim._on_contribution

        def spy(frame, sent=None):
            merges = sim.syncer.merges
            snapshot = before_merge(sim)
            plain(frame, sent)
            if sim.syncer.merges > merges:
                snapshot()
        sim._on_contribution = spy
    summary = sim.run()
    assert summary["token_ledger_imbalance"] == 0
    assert sim.tokens.in_flight == {}  # every contribution was merged or dropped
    return sim, summary


def merge_records(st: sync.SyncerState) -> list[dict]:
    return [r for r in st.decisions if r["event"] == "merge"]


def host(unit):
    params = unit.params_host()
    return {path: np.asarray(v) for path, v in _leaves(params)}


def _leaves(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def test_one_learner_H1_is_plain_training(tmp_path, build, corpus, model):
    """M = 1, H = 1, tau = 0, P = 1, inner SGD, outer average, fp32: DiLoCo is ordinary training."""
    cfg = make_cfg(tmp_path, steps=5, runtime=dict(learners=1), fragments=dict(H=1), syncer=dict(quorum=1))
    setup = build(cfg)
    sim, summary = run_sim(cfg, setup)
    assert summary["merges"] == 5 and summary["stalls"] == 5  # tau = 0: waits after every send
    compiled = setup.compiled[0]
    state = compiled.init(jax.device_put(model.params, compiled.state_sharding.params))
    for step in range(5):  # what train_dp feeds its one trainer
        batch = batch_at(corpus.train, seed=cfg.run.seed, learner=0, num_learners=1, step=step,
                         batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len)
        state, _ = compiled.train_step(state, jax.device_put(batch, compiled.batch_sharding))
    plain = dict(_leaves(jax.device_get(state.params)))
    theta = sync.theta(sim.syncer)
    assert set(theta) == set(plain)
    for path in plain:
        np.testing.assert_allclose(theta[path], plain[path], rtol=1e-6, atol=1e-6, err_msg=str(path))
    moved = max(float(np.abs(theta[p] - setup.theta0[0][p]).max()) for p in theta)
    assert moved > 1e-3  # it did train
    unit_params = host(sim.units[0])
    assert all(unit_params[p].tobytes() == theta[p].tobytes() for p in theta)  # alpha = 0: overwritten


def test_sign_through_a_learner_unit(tmp_path, build):
    """A real inner step moves the learner from Theta by -d; outer SGD lr 0.5 then puts Theta half way
    towards the learner, so the merged delta was +d."""
    cfg = make_cfg(tmp_path, runtime=dict(learners=1), fragments=dict(H=1), syncer=dict(quorum=1))
    setup = build(cfg)
    pol = setup.policy._replace(outer=make_outer("sgd", lr=0.5, momentum=0.0))
    st = sync.init(pol, setup.fragments, setup.theta0, {0: 0})
    unit = setup_mod.new_unit(setup, 0, 0, st)
    (frame,) = unit.step().frames
    local = host(unit)
    st, actions = sync.on_contribution(pol, st, frame, now=1.0)
    assert sum(isinstance(a, sync.Publish) for a in actions) == 1
    theta0, theta1 = setup.theta0[0], sync.theta(st)
    d = {p: theta0[p] - local[p] for p in theta0}
    norm = math.sqrt(sum(float(np.sum(np.square(v.astype(np.float64)))) for v in d.values()))
    assert norm > 1e-3
    assert merge_records(st)[0]["delta_norm"] == pytest.approx(norm, rel=1e-5)
    for p in theta0:
        np.testing.assert_allclose(theta1[p], theta0[p] - 0.5 * d[p], rtol=1e-6, atol=1e-7)


def test_average_outer_gives_the_mean_of_the_learners_params(tmp_path, build):
    """K = M = 2, P = 1, tau = 0, outer average, fp32: at every merge Theta becomes the mean of the two
    learners' params (both stalled right after sending), and each learner then holds Theta exactly."""
    cfg = make_cfg(tmp_path, steps=6)
    checked = []

    def before_merge(sim):
        params = [host(u) for u in sim.units]

        def after():
            theta = sync.theta(sim.syncer)
            for p in theta:
                np.testing.assert_allclose(theta[p], (params[0][p] + params[1][p]) / 2, rtol=1e-6, atol=1e-7)
            assert any(not np.array_equal(params[0][p], params[1][p]) for p in theta)  # different shards
            checked.append(sim.syncer.merges)
        return after

    sim, summary = run_sim(cfg, build(cfg), before_merge)
    assert checked == [1, 2, 3]  # steps / H merges, each over both learners
    assert [r["learners"] for r in merge_records(sim.syncer)] == [[0, 1]] * 3
    theta = sync.theta(sim.syncer)
    for u in sim.units:
        assert all(host(u)[p].tobytes() == theta[p].tobytes() for p in theta)
    assert summary["tokens_merged_share"] == 1.0  # tau = 0: no token is overwritten, every one merged


def test_merge_rule_per_fragment_kind_and_the_token_ledger(tmp_path, build, monkeypatch):
    """Embedding fragments average, the others RDA; every sent contribution has exactly one outcome, and
    the tokens sent are the tokens merged plus the tokens dropped (other than overwritten)."""
    cfg = make_cfg(tmp_path, steps=8, fragments=dict(count=2, tau=1), syncer=dict(quorum=1, merge="rda"),
                   codec=dict(up="int8", down="int8", zstd_level=1),
                   runtime=dict(speeds=(1.0, 1.5), jitter=0.1))
    setup = build(cfg)
    assert [f.embedding for f in setup.fragments] == [False, True]
    sent, outcomes = [], []
    plain_send = ledger.send

    def send(led, learner, incarnation, fragment, seq):
        led = plain_send(led, learner, incarnation, fragment, seq)
        sent.append(led.in_flight[(learner, incarnation, seq)][1])
        return led
    monkeypatch.setattr(ledger, "send", send)
    plain_resolve = ledger.resolve
    monkeypatch.setattr(ledger, "resolve", lambda led, key, outcome, into=None: (
        outcomes.append((key, outcome)), plain_resolve(led, key, outcome, into))[1])
    sim, summary = run_sim(cfg, setup)
    records = merge_records(sim.syncer)
    assert {r["method"] for r in records if r["fragment"] == 1} == {"average"}
    assert {r["method"] for r in records if r["fragment"] == 0} == {"rda"}
    tok = sim.tokens
    assert len(sent) == len(outcomes) == len({k for k, _ in outcomes}) == 2 * 8 // 1  # one send per step
    assert sum(o == "merged" for _, o in outcomes) == sum(len(r["learners"]) for r in records)
    dropped = {r: sum(row) for r, row in tok.dropped.items()}
    overwritten = dropped.pop("overwritten", 0)
    assert sum(tok.merged) + sum(dropped.values()) == sum(sent) > 0
    assert sum(tok.processed) == sum(sent) + overwritten + sum(ledger.outstanding(tok))
    assert sum(tok.processed) == 2 * 8 * 2 * cfg.data.batch_size * cfg.data.seq_len  # M steps P tokens
    assert summary["tokens_processed"] == 2 * 8 * cfg.data.batch_size * cfg.data.seq_len


def test_same_seed_is_bit_identical_and_another_seed_changes_the_tape(tmp_path, build):
    cfg = make_cfg(tmp_path, steps=6, fragments=dict(count=2, tau=1), syncer=dict(quorum=1),
                   runtime=dict(jitter=0.3, seed=5))
    setup = build(cfg)
    a, sa = run_sim(cfg, setup)
    b, sb = run_sim(cfg, setup)
    assert a.syncer.decisions == b.syncer.decisions and len(a.syncer.decisions) > 0
    ta, tb = sync.theta(a.syncer), sync.theta(b.syncer)
    assert all(ta[p].tobytes() == tb[p].tobytes() for p in ta)
    assert replayable(sa) == replayable(sb)  # the syncer's real seconds aside
    other = replace(cfg, runtime=replace(cfg.runtime, seed=6))
    c, _ = run_sim(other, build(other))
    assert c.syncer.decisions != a.syncer.decisions


def stall_seconds(sim, m):
    return timeline.seconds(sim.time)[m]["stall"]


def test_heterogeneous_speeds_K1_without_grace_never_stalls(tmp_path, build):
    """Learner 1 takes twice as long per step. K = 1 with no grace window: nobody waits for anybody."""
    cfg = make_cfg(tmp_path, steps=8, fragments=dict(count=2, tau=1), syncer=dict(quorum=1, gamma=0.0),
                   runtime=dict(speeds=(1.0, 2.0)))
    sim, summary = run_sim(cfg, build(cfg))
    assert summary["stalls"] == 0 and stall_seconds(sim, 0) == stall_seconds(sim, 1) == 0.0
    assert summary["goodput"] == 1.0
    assert {len(r["learners"]) for r in merge_records(sim.syncer)} == {1}
    assert summary["clock_s"] == pytest.approx(16.0, abs=0.1)  # the slow learner's 8 steps


def test_heterogeneous_speeds_K1_with_default_grace_never_stalls_the_fast_learner(tmp_path, build):
    cfg = make_cfg(tmp_path, steps=8, fragments=dict(count=2, tau=1), syncer=dict(quorum=1),
                   runtime=dict(speeds=(1.0, 2.0)))
    sim, _ = run_sim(cfg, build(cfg))
    assert stall_seconds(sim, 0) == 0.0


def test_deferring_other_merges_and_keeping_the_overlap_overwrites_no_progress(tmp_path, build):
    """Out-of-phase learners at K = 1: by default each learner overwrites its unsent progress with
    the other's merges (booked "overwritten"). With keep_overlap (rebasing onto others' merges, or
    deferring them) every token a learner processes reaches the syncer."""
    def run(**fragments):
        cfg = make_cfg(tmp_path, steps=12, fragments=dict(count=2, tau=1, **fragments),
                       syncer=dict(quorum=1, gamma=0.0, anchor="base"), runtime=dict(speeds=(1.0, 1.7)))
        sim, summary = run_sim(cfg, build(cfg))
        return sum(sim.tokens.dropped.get("overwritten", ())), summary["tokens_merged_share"]

    lost_now, share_now = run()
    lost_deferred, share_deferred = run(others="defer", keep_overlap=True)
    lost_rebased, share_rebased = run(keep_overlap=True)  # others' merges: progress rebased onto them
    assert lost_now > 0 and lost_deferred == lost_rebased == 0
    assert share_deferred == share_rebased == 1.0 > share_now


def test_heterogeneous_speeds_K_equals_M_stalls_the_fast_learner(tmp_path, build):
    cfg = make_cfg(tmp_path, steps=8, fragments=dict(count=2, tau=1), syncer=dict(quorum=2),
                   runtime=dict(speeds=(1.0, 2.0)))
    sim, summary = run_sim(cfg, build(cfg))
    assert stall_seconds(sim, 0) > 5.0 and stall_seconds(sim, 1) == 0.0
    assert summary["stalls"] > 0 and summary["goodput"] < 0.9
    assert {len(r["learners"]) for r in merge_records(sim.syncer)} == {2}


@pytest.mark.parametrize("fragments, syncer", [(dict(tau=0, keep_overlap=True), {}),
                                               (dict(tau=1, keep_overlap=True), {}),
                                               (dict(tau=4, eager=True), dict(anchor="base"))])
def test_a_learner_that_finished_no_longer_holds_a_quorum_below_K(tmp_path, build, fragments, syncer):
    """K = 2 of 3 learners, one three times slower: once the fast two have finished, the slow one's
    rounds wait for nobody else (docs/algorithm.md#finished-learners). Counted as expected, the
    finished learners kept every later round below quorum, and the slow learner's last steps were
    never merged. keep_overlap: the slow learner's unsent progress would otherwise be overwritten
    by the fast pair's merges (booked so, a loss of its own: test_deferring_other_merges_...)."""
    cfg = make_cfg(tmp_path, steps=12, fragments=dict(count=1, **fragments), syncer=dict(quorum=2, **syncer),
                   runtime=dict(learners=3, speeds=(1.0, 1.0, 3.0)))
    sim, summary = run_sim(cfg, build(cfg))
    assert summary["tokens_merged_share"] == 1.0
    assert sim.syncer.finished == (0, 1, 2) and all(fs.round is None or fs.round.closed_at is not None
                                                     for fs in sim.syncer.fragments)
    merges = merge_records(sim.syncer)
    assert [r["learners"] for r in merges[-2:]] == [[2], [2]]  # its tail, merged alone (K clamped)


def test_a_learner_waiting_for_its_last_answer_has_not_finished(tmp_path, build):
    """Without the final sync, tau = 0, K = 2: after its last step learner 0 waits for the merge of
    its last send, which waits for learner 1's. Told finished then, it would be sent no broadcast and
    stall until its stall limit (8 s booked); it is told once the answer has woken it."""
    cfg = make_cfg(tmp_path, steps=8, fragments=dict(count=1, tau=0, final_sync=False), syncer=dict(quorum=2))
    sim, _ = run_sim(cfg, build(cfg))
    assert sim.syncer.finished == (0, 1)
    assert stall_seconds(sim, 0) == stall_seconds(sim, 1) < 0.5 * cfg.runtime.step_time


def test_bytes_are_the_serialized_frames_and_int4_payloads_are_analytic(tmp_path, build):
    """int4 without zstd: per tensor n / 2 bytes of codes plus a 4-byte scale per 64-value block."""
    cfg = make_cfg(tmp_path, steps=4, fragments=dict(count=2, tau=1), syncer=dict(quorum=1),
                   codec=dict(up="int4", down="int8", zstd_level=0))
    setup = build(cfg)
    up, down = [], []
    sim = Sim(cfg, setup, None, None)
    plain_contribution, plain_transmit = sim._on_contribution, sim.host.transport

    def on_contribution(frame, sent=None):
        up.append(frame)
        plain_contribution(frame, sent)

    def transmit(m, frame, fragment, full):
        down.append(frame)
        plain_transmit(m, frame, fragment, full)
    publishes = []
    sim._on_contribution, sim.host.transport, sim.host.on_publish = on_contribution, transmit, publishes.append
    summary = sim.run()
    assert len(up) == 2 * 4  # P = H: one send per learner per step
    assert summary["bytes_up"] == sum(map(len, up))
    # a broadcast per learner still training: the last merge comes after learner 0 finished
    assert summary["bytes_down"] == sum(map(len, down)) and len(publishes) == sim.syncer.merges
    assert [sorted(a.frames) for a in publishes] == [[0, 1]] * (sim.syncer.merges - 1) + [[1]]
    sizes = {p: int(np.prod(v.shape)) for frag in setup.theta0 for p, v in frag.items()}
    for frame in up:
        h = messages.decode(frame).header
        (hlen,) = struct.unpack_from("<I", frame, 4)
        n = [sizes[tuple(t["path"])] for t in h["tensors"]]
        assert [t["nbytes"] for t in h["tensors"]] == [math.ceil(k / 2) + 4 * math.ceil(k / 64) for k in n]
        assert len(frame) == 8 + hlen + h["payload_len"]
        assert hlen == len(json.dumps(h, separators=(",", ":")).encode())
        assert h["codec"] == "int4"


def test_run_diloco_reports_bytes_against_data_parallel(tmp_path, build, corpus, model):
    cfg = make_cfg(tmp_path, steps=4, runtime=dict(learner_checkpoint_every=2))
    with build.patched():
        summary = run_diloco(cfg, corpus, model, tmp_path)
    dp = 2 * 2 * 4 * dp_bytes_per_step(count_params(model.params), 2)  # both directions, M = 2, 4 steps
    assert dp_bytes_per_step(10, 2) == 20.0  # bf16 ring all-reduce: 2 (M-1)/M x 2 bytes per value
    assert summary["dp_bytes_same_steps"] == int(dp)
    assert summary["dp_bytes_over_diloco"] == pytest.approx(dp / (summary["bytes_up"] + summary["bytes_down"]))
    assert summary["merges"] == 2 and summary["token_ledger_imbalance"] == 0
    evals = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r["kind"] == "eval"]
    assert evals[-1]["eval_loss"] == summary["eval_loss"] and evals[-1]["merges"] == 2
    # No failure tape, so no sim learner can die and rejoin: no learner checkpoints are written.
    assert not (tmp_path / "learners").exists()


def test_unit_applies_broadcast_deltas_and_drops_what_it_cannot_decode(tmp_path, build):
    """int8 broadcasts: the unit rebuilds the syncer's reference bit for bit and overwrites its params
    with it (alpha = 0) or mixes (alpha = 0.5); repeats are ignored, undecodable frames dropped."""
    from diloco.algo.fragments import make_schedule
    from diloco.runtime.unit import LearnerUnit
    cfg = make_cfg(tmp_path, runtime=dict(learners=1), fragments=dict(H=1), syncer=dict(quorum=1),
                   codec=dict(down="int8"))
    setup = build(cfg)
    st = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0})
    for incarnation, alpha in enumerate((0.0, 0.5)):  # the second unit is a restart of learner 0
        spec = setup.spec._replace(schedule=make_schedule(1, 1, tau=0, alpha=alpha))
        anchors = {0: st.fragments[0].refs[-1]}
        unit = LearnerUnit(spec, 0, incarnation, setup.compiled[0], anchors, step=st.fragments[0].version)
        (frame,) = unit.step().frames
        local = host(unit)
        st, _ = sync.on_live_change(setup.policy, st, {0: incarnation}, now=float(unit.ls.step))
        st, actions = sync.on_contribution(setup.policy, st, frame, now=float(unit.ls.step))
        (pub,) = [a for a in actions if isinstance(a, sync.Publish)]
        # The first incarnation gets a delta against the version it holds; a restarted incarnation
        # holds an unknown version as far as the syncer knows, so it gets a full copy.
        assert pub.full == (() if incarnation == 0 else (0,))
        version, ref = st.fragments[0].refs[-1]
        assert unit.receive(pub.frames[0]) == (0, version)
        assert unit.receive(pub.frames[0]) is None and unit.dropped_frames == 0  # a repeat: ignored
        corrupt = bytearray(pub.frames[0])
        corrupt[-1] ^= 1
        assert unit.receive(bytes(corrupt)) is None and unit.dropped_frames == 1
        h = messages.decode(pub.frames[0]).header
        h.pop("payload_len"), h.pop("checksum")
        future = messages.encode(dict(h, version=version + 2, delta_against=version + 1),
                                 messages.decode(pub.frames[0]).payload)
        assert unit.receive(future) is None and unit.dropped_frames == 2  # not against what it holds
        assert unit.blocking() is None
        (applied,) = unit.apply_due()
        assert (applied.fragment, applied.version) == (0, version)
        assert unit.anchors[0][0] == unit.ls.versions[0] == version
        params = host(unit)
        for p in ref:
            assert unit.anchors[0][1][p].tobytes() == ref[p].tobytes()
            if alpha == 0.0:
                assert params[p].tobytes() == ref[p].tobytes()
            else:
                np.testing.assert_allclose(params[p], 0.5 * local[p] + 0.5 * ref[p], rtol=1e-6, atol=1e-7)


def test_replaying_the_recorded_inputs_rebuilds_the_syncer_exactly(tmp_path, build):
    """The syncer is a pure function of its inputs: the inputs log written by the sim, fed to a
    fresh syncer, gives the same Theta bit for bit and the same decision tape."""
    from diloco.algo.replay import replay
    from diloco.runtime import sim as sim_mod
    from diloco.runtime.runlog import read_decisions, read_inputs

    cfg = make_cfg(tmp_path, steps=8, fragments=dict(count=2, H=4, tau=1), syncer=dict(quorum=1),
                   runtime=dict(speeds=(1.0, 1.7), jitter=0.2),
                   codec=dict(up="int4", down="int8", zstd_level=1))
    setup = build(cfg)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    done, _ = sim_mod.run(cfg, setup, run_dir, None)
    events = list(read_inputs(run_dir / "syncer_inputs.bin"))
    assert {e.kind for e in events} >= {"contribution", "step_time"}
    fresh = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0, 1: 0})
    again = replay(setup.policy, fresh, events)
    assert again.decisions == done.syncer.decisions
    assert read_decisions(run_dir / "decisions.jsonl") == json.loads(json.dumps(list(done.syncer.decisions)))
    for a, b in zip(again.fragments, done.syncer.fragments):
        assert a.version == b.version
        for path in a.theta:
            np.testing.assert_array_equal(a.theta[path], b.theta[path])


def test_sim_learners_share_one_sub_mesh_and_one_compiled_step(tmp_path, corpus, model):
    """sim steps its learners one after another, so all M share learner 0's devices and one
    compiled step (docs/design.md#sim): one compile for the run, not one per learner; threads keeps
    a sub-mesh each. sim needs only devices_per_learner devices."""
    cfg = make_cfg(tmp_path, steps=2, runtime=dict(learners=3, devices_per_learner=2))
    setup = setup_mod.build(cfg, corpus, model)
    assert len(setup.compiled) == 1
    sim = Sim(cfg, setup, None, None)
    sim.run()
    assert setup.compiled[0].train_step._cache_size() == 1
    devices = set(jax.devices()[:2])
    assert all(x.sharding.device_set == devices for u in sim.units for x in jax.tree.leaves(u.state.params))
    threads = replace(cfg, runtime=replace(cfg.runtime, kind="threads"))
    assert len(setup_mod.learner_meshes(threads)) == 3
    wide = replace(cfg, runtime=replace(cfg.runtime, learners=8, devices_per_learner=8))
    setup_mod.check_devices(wide)  # 8 learners of 8 devices: only 8 devices needed in sim
    with pytest.raises(setup_mod.ConfigError, match="devices_per_learner=16, but only 8 devices"):
        setup_mod.check_devices(replace(cfg, runtime=replace(cfg.runtime, devices_per_learner=16)))


# --- eager outer steps (docs/algorithm.md#eager-outer-steps; tests/test_eager.py has the rest) ---


def test_one_learner_lossless_is_plain_training_and_every_correction_is_zero(tmp_path, build, corpus, model):
    """M = 1, outer average (s = 1), fp32, tau = 3 > H = 2: the stand-in is the whole pseudo-gradient, so a
    send leaves the learner where it is and every merge corrects it by zero (to rounding). The learner
    trains as if alone and uninterrupted, and Theta ends where plain training does."""
    cfg = make_cfg(tmp_path, steps=12, runtime=dict(learners=1), fragments=dict(H=2, tau=3, eager=True),
                   syncer=dict(quorum=1, anchor="base"))
    setup = build(cfg)
    sim, summary = run_sim(cfg, setup)
    assert summary["merges"] == 6 and summary["stalls"] == 0 and summary["tokens_merged_share"] == 1.0
    compiled = setup.compiled[0]
    state = compiled.init(jax.device_put(model.params, compiled.state_sharding.params))
    for step in range(12):
        batch = batch_at(corpus.train, seed=cfg.run.seed, learner=0, num_learners=1, step=step,
                         batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len)
        state, _ = compiled.train_step(state, jax.device_put(batch, compiled.batch_sharding))
    plain = dict(_leaves(jax.device_get(state.params)))
    theta, local = sync.theta(sim.syncer), host(sim.units[0])
    for path in plain:
        np.testing.assert_allclose(theta[path], plain[path], rtol=1e-5, atol=1e-6, err_msg=str(path))
        np.testing.assert_allclose(local[path], plain[path], rtol=1e-5, atol=1e-6, err_msg=str(path))
    assert max(float(np.abs(theta[p] - setup.theta0[0][p]).max()) for p in theta) > 1e-3  # it trained
    assert sim.units[0].ls.versions[0] >= 3  # merges were applied while later rounds were in flight


def test_tau_zero_is_todays_synchronous_rule_bit_for_bit(tmp_path, build):
    """tau = 0: the learner stalls right after each send, so the correction lands on the stand-in
    with no progress in between and the learner holds the merged Theta exactly, as when overwritten."""
    runs = []
    for frag in (dict(), dict(eager=True)):
        cfg = make_cfg(tmp_path / str(len(runs)), steps=6, fragments=frag, syncer=dict(anchor="base"))
        sim, summary = run_sim(cfg, build(cfg))
        runs.append((sync.theta(sim.syncer), [host(u) for u in sim.units], summary["merges"]))
    (theta_a, units_a, merges_a), (theta_b, units_b, merges_b) = runs
    assert merges_a == merges_b == 3
    assert all(theta_a[p].tobytes() == theta_b[p].tobytes() for p in theta_a)
    for a, b in zip(units_a, units_b):
        assert all(a[p].tobytes() == b[p].tobytes() for p in a)


def test_two_learners_overlapping_a_whole_round_balance_their_tokens(tmp_path, build):
    """M = 2, tau = 3 > H = 2 with eager steps: every contribution is merged, nothing overwritten, and the
    learners' own progress since their last send survives each merge (they differ from Theta)."""
    cfg = make_cfg(tmp_path, steps=8, fragments=dict(H=2, tau=3, eager=True), syncer=dict(anchor="base"),
                   outer=dict(name="sgd", lr=0.8))
    sim, summary = run_sim(cfg, build(cfg))
    assert summary["merges"] == 4 and summary["tokens_merged_share"] == 1.0
    for u in sim.units:  # the anchor is the held version less the stand-ins of the sends in flight
        flying = [f.seq for f in u.ls.in_flight]
        assert u.ls.versions[0] >= 2 and len(flying) >= 1 and sorted(u.stand_ins) == flying
        a = eager.anchor(u.anchors[0][1], [u.stand_ins[seq] for seq in flying])
        assert all(a[p].tobytes() == u.eager_anchor[0][p].tobytes() for p in a)
        assert any(not np.array_equal(a[p], u.anchors[0][1][p]) for p in a)


def test_one_learner_under_outer_momentum_is_never_corrected(tmp_path, build, monkeypatch):
    """M = 1, outer Nesterov lr 0.7 momentum 0.9, fp32, tau = 3 > H = 2: each stand-in carries the
    momentum the answering merge will (rebuilt from the versions applied), so every correction, the
    anchor's move at an apply, is zero to rounding. With the zero-state gain alone it is not."""
    cfg = make_cfg(tmp_path, steps=8, runtime=dict(learners=1), fragments=dict(H=2, tau=3, eager=True),
                   syncer=dict(quorum=1, anchor="base"), outer=dict(name="nesterov", lr=0.7, momentum=0.9))
    setup = build(cfg)
    assert setup.spec.eager_momentum == eager.Momentum(0.7, 0.9, True, 1.0)
    plain = eager.moved
    worst = []

    def spy(local, before, after):
        worst[-1] = max(worst[-1], float(np.abs(after - before).max() / np.abs(before).max()))
        return plain(local, before, after)

    monkeypatch.setattr(eager, "moved", spy)
    for spec in (setup.spec, setup.spec._replace(eager_momentum=None)):
        worst.append(0.0)
        _, summary = run_sim(cfg, setup._replace(spec=spec))
        assert summary["merges"] == 4 and summary["tokens_merged_share"] == 1.0
    assert worst[0] < 1e-6 and worst[1] > 1e-3, worst


def test_an_eager_learner_sending_twice_into_one_open_round_has_both_merged(tmp_path, build):
    """M = K = 2, learner 1 three times slower, tau = 4 > H = 2 with eager steps: a round waits for
    learner 1 while learner 0 sends again (repeats). The sends are merged as one, their steps and
    tokens added (docs/algorithm.md#eager-outer-steps). With t tokens per step a contribution's
    weight is tokens^2 / steps = steps x t^2, so the merges' weights count every step each learner
    trained, less those still in flight at the end (learner 1's last round waits for learner 0,
    which has finished); with the newer send replacing the older they fell short."""
    cfg = make_cfg(tmp_path, steps=12, runtime=dict(speeds=(1.0, 3.0)), fragments=dict(H=2, tau=4, eager=True),
                   syncer=dict(anchor="base"))
    sim = Sim(cfg, build(cfg), None, None)
    summary = sim.run()
    assert any(r["event"] == "arrival" and r["reason"] == "repeat" and r["key"][0] == 0 for r in sim.syncer.decisions)
    assert summary["token_ledger_imbalance"] == 0 and sum(map(sum, sim.tokens.dropped.values())) == 0
    t = cfg.data.batch_size * cfg.data.seq_len
    steps = [sum(tokens for (m, _, _), (_, tokens) in sim.tokens.in_flight.items() if m == learner) / t
             for learner in (0, 1)]
    for r in sim.syncer.decisions:
        if r["event"] == "merge":
            for m, w in zip(r["learners"], r["weights"]):
                steps[m] += w / t**2
    assert steps == pytest.approx([u.ls.step for u in sim.units]) and steps == pytest.approx([12, 12])


def test_an_eager_learner_whose_sends_a_merge_sums_carries_the_momentum_once(tmp_path, build, monkeypatch):
    """M = K = 2, learner 1 three times slower, tau = 4 > H = 2, Nesterov lr 0.7 momentum 0.9: each merge
    sums two or three of learner 0's sends (syncer_merge.summed), and carries lr mu^2 b once. Once an
    apply has shown that, each send's stand-in adds its part of the carried move, not the whole, so
    learner 0's corrections (the anchor's move at an apply) stay well under the zero-state gain's;
    carried in full by every send they were as large (docs/algorithm.md#eager-outer-steps)."""
    cfg = make_cfg(tmp_path, steps=40, runtime=dict(speeds=(1.0, 3.0)), fragments=dict(H=2, tau=4, eager=True),
                   syncer=dict(anchor="base"), outer=dict(name="nesterov", lr=0.7, momentum=0.9))
    setup = build(cfg)
    plain = unit_eager.apply
    ratios = []

    def spy(unit, ready, *left):
        if unit.learner != 0:
            return plain(unit, ready, *left)
        before, (_, held) = dict(unit.eager_anchor[0]), unit.anchors[0]
        out = plain(unit, ready, *left)
        new = unit.anchors[0][1]
        size = lambda d: math.sqrt(sum(float(np.sum(np.square(x))) for x in d.values()))
        ratios[-1].append(size({p: unit.eager_anchor[0][p] - before[p] for p in new})
                          / size({p: held[p] - new[p] for p in new}))
        return out

    monkeypatch.setattr(unit_eager, "apply", spy)
    for spec in (setup.spec, setup.spec._replace(eager_momentum=None)):
        ratios.append([])
        sim = Sim(cfg, setup._replace(spec=spec), None, None)
        sim.run()
        assert any(r["reason"] == "repeat" for r in sim.syncer.decisions if r["event"] == "arrival")
    momentum, zero_state = (float(np.median(r[1:])) for r in ratios)  # the first apply has learnt nothing yet
    assert momentum < 0.6 * zero_state, (ratios, momentum, zero_state)
