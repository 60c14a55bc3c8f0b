"""Syncer checkpoints: a restore equals the state saved, and a syncer restarted from a checkpoint
and fed the inputs after it ends bit-identical to the uninterrupted one (no version applied twice
or skipped). A torn newest checkpoint falls back to the previous one; a failed save is survived."""

import json
import shutil

import numpy as np
import pytest

from diloco.algo import syncer as sync
from diloco.algo.replay import replay
from diloco.runtime.sim.runtime import Sim
from diloco.runtime.syncer_ckpt import SyncerCheckpoints, from_checkpoint, to_checkpoint
from test_sim import build, corpus, make_cfg, model  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, build):
    """A K = 1 streaming run with grace, momentum and int8 broadcasts, and all its syncer inputs."""
    tmp = tmp_path_factory.mktemp("rec")
    cfg = make_cfg(tmp, steps=24, fragments=dict(count=2, H=4, tau=1), syncer=dict(quorum=1),
                   outer=dict(name="nesterov", lr=0.7, momentum=0.9),
                   codec=dict(up="int4", down="int8"), runtime=dict(speeds=(1.0, 1.3)))
    setup = build(cfg)
    inputs = []
    sim = Sim(cfg, setup, None, None, inputs)
    sim.run()
    start = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0, 1: 0})
    return setup, start, inputs, sim.syncer


def assert_same(a: sync.SyncerState, b: sync.SyncerState):
    assert a.merges == b.merges and a.live == b.live and a.last_seq == b.last_seq and a.held == b.held
    assert a.step_times == b.step_times and a.quarantined == b.quarantined and a.finished == b.finished
    assert json.loads(json.dumps(list(a.decisions))) == json.loads(json.dumps(list(b.decisions)))
    assert a.refusals.counts == b.refusals.counts and a.refusals.total == b.refusals.total
    assert json.loads(json.dumps(a.refusals.latest)) == json.loads(json.dumps(b.refusals.latest))
    for fa, fb in zip(a.fragments, b.fragments):
        assert fa.version == fb.version and fa.round == fb.round
        assert [v for v, _ in fa.refs] == [v for v, _ in fb.refs]
        for x, y in [(fa.theta, fb.theta)] + [(ra, rb) for (_, ra), (_, rb) in zip(fa.refs, fb.refs)]:
            for path in x:
                np.testing.assert_array_equal(x[path], y[path])
        for x, y in zip(np.concatenate([np.ravel(l) for l in _leaves(fa.outer_state)]),
                        np.concatenate([np.ravel(l) for l in _leaves(fb.outer_state)])):
            assert x == y
        assert [c[:4] + c[5:] for c in fa.contributions] == [c[:4] + c[5:] for c in fb.contributions]


def _leaves(tree):
    import jax
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_restart_from_a_checkpoint_equals_the_uninterrupted_syncer(tmp_path, recorded):
    setup, start, inputs, final = recorded
    assert final.merges > 4
    # cut where a round is open with admitted contributions (a grace window running): the hard case
    mid, cut = start, 0
    while cut < len(inputs) and not (cut > len(inputs) // 3 and any(fs.contributions for fs in mid.fragments)):
        mid, cut = replay(setup.policy, mid, inputs[cut:cut + 1]), cut + 1
    assert any(fs.contributions for fs in mid.fragments), "no input boundary with an open round"
    ckpts = SyncerCheckpoints(tmp_path / "syncer", every=1)
    ckpts.save(mid, cut)
    restored, seen = ckpts.latest(setup.policy, setup.fragments)
    ckpts.close()
    assert seen == cut
    assert_same(restored, mid)
    resumed = replay(setup.policy, restored, inputs[seen:])
    assert_same(resumed, final)
    for fs in resumed.fragments:  # versions advanced one at a time: none applied twice or skipped
        versions = [r["version"] for r in resumed.decisions if r["event"] == "merge" and r["fragment"] == fs.spec.index]
        assert versions == list(range(1, fs.version + 1))


def test_every_cut_round_trips_in_memory(recorded):
    setup, start, inputs, _ = recorded
    st = start
    for i, event in enumerate(inputs):
        st = replay(setup.policy, st, [event])
        if i % 7 == 0:
            arrays, meta = to_checkpoint(st)
            assert_same(from_checkpoint(arrays, json.loads(json.dumps(meta)), setup.policy, setup.fragments), st)


def test_a_torn_newest_checkpoint_falls_back_to_the_previous(tmp_path, recorded):
    setup, start, inputs, _ = recorded
    ckpts = SyncerCheckpoints(tmp_path / "syncer", every=1, keep=3)
    older = replay(setup.policy, start, inputs[:10])
    ckpts.save(older, 10)
    ckpts.save(replay(setup.policy, older, inputs[10:20]), 20)
    ckpts.manager.wait_until_finished()
    newest = tmp_path / "syncer" / "20"
    for f in newest.rglob("*"):  # tear every data file of the newest checkpoint
        if f.is_file() and "meta" not in str(f):
            f.write_bytes(b"torn")
    restored, seen = ckpts.latest(setup.policy, setup.fragments)
    assert seen == 10
    assert_same(restored, older)
    ckpts.close()


def test_a_failed_save_is_logged_and_the_syncer_goes_on(tmp_path, recorded, caplog):
    setup, start, inputs, _ = recorded
    ckpts = SyncerCheckpoints(tmp_path / "syncer", every=1)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    ckpts.manager.save = full_disk
    ckpts.save(replay(setup.policy, start, inputs[:5]), 5)
    assert "No space left on device" in caplog.text
    ckpts.manager.wait_until_finished()
    assert ckpts.latest(setup.policy, setup.fragments) is None
    shutil.rmtree(tmp_path / "syncer", ignore_errors=True)


def test_a_checkpoint_of_another_layout_is_refused(recorded):
    setup, start, _, _ = recorded
    arrays, meta = to_checkpoint(start)
    with pytest.raises(ValueError, match="fragments"):
        from_checkpoint(arrays, meta, setup.policy, setup.fragments[:1])
    with pytest.raises(ValueError, match="format"):
        from_checkpoint(arrays, {**meta, "format": "x"}, setup.policy, setup.fragments)
