"""Deferred encode (docs/design.md#deferred-encode): a learner that encodes each step's
contributions after dispatching the next step sends exactly the bytes it would have sent at once,
error-feedback residuals and applies of the fragment it just sent included."""

import jax
import numpy as np
import pytest
from conftest import diloco_world, tiny_cfg

from diloco.algo import syncer as sync
from diloco.algo.fragments import make_schedule
from diloco.config import MeshConfig, TrainConfig
from diloco.runtime import build as build_setup


def one_learner_config(tmp, devices: int = 1, mesh: MeshConfig = MeshConfig()) -> TrainConfig:
    """A tiny sim run of one learner (int4 + error feedback + zstd up, P = H = 2, tau 1) whose
    units the twin tests drive by hand; shared with tests/test_device_codecs.py."""
    return tiny_cfg(tmp, data=dict(seq_len=16, batch_size=4, synthetic_tokens=20_000), inner=dict(warmup_steps=0),
                    run=dict(steps=40, log_every=0, eval_every=0, eval_batches=8), fragments=dict(H=2),
                    codec=dict(up="int4", error_feedback=True, zstd_level=1, down="int8"), mesh=mesh,
                    runtime=dict(learners=1, devices_per_learner=devices))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    cfg = one_learner_config(tmp_path_factory.mktemp("defer"))
    return cfg, diloco_world(cfg)[2]


@pytest.mark.parametrize("device", [True, False], ids=["device", "host"])
@pytest.mark.parametrize("tau,loss_every", [(0, 0), (0, 3), (1, 3)])
def test_deferred_frames_are_the_immediate_frames_byte_for_byte(world, tau, loss_every, device):
    """Two twins of learner 0 fed the same broadcasts (a K = 1 syncer merging the immediate twin's
    frames at once): every deferred frame, loss, residual and parameter equals the immediate one.
    With tau = 0 each merge is applied before the next step, so every apply meets the deferred
    send of its own fragment: a host encode encodes it first, against the anchor it was sent
    from; a device encode took that anchor when the step was dispatched."""
    cfg, setup = world
    setup = setup._replace(spec=setup.spec._replace(schedule=make_schedule(2, 2, tau), device_encode=device))
    state = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0})
    now, deferred = build_setup.new_unit(setup, 0, 0, state), build_setup.new_unit(setup, 0, 0, state)
    sent, late, settled = [], [], 0
    for i in range(12):
        fetch = bool(loss_every) and i % loss_every == 0
        now.apply_due()
        before = deferred.deferred and deferred._deferred[0].frames
        deferred.apply_due()
        settled += bool(deferred.deferred and deferred._deferred[0].frames and not before)
        a = now.step(fetch_loss=fetch)
        b = deferred.step(fetch_loss=fetch, defer=True)
        assert b.frames == () and b.loss is None and b.sends == a.sends and b.tokens == a.tokens
        if i:
            late.append(deferred.finish())
        sent.append((a.frames, a.loss))
        for frame in a.frames:
            state, actions = sync.on_contribution(setup.policy, state, frame, float(i))
            for action in actions:
                if isinstance(action, sync.Publish):
                    for unit in (now, deferred):
                        unit.receive(action.frames[0])
    late.append(deferred.finish())
    assert deferred.deferred == 0 and (settled > 0) == (tau == 0 and not device)  # the apply-before-finish path
    assert sum(len(f) for f, _ in sent) >= 10
    for (frames_a, loss_a), (frames_b, loss_b) in zip(sent, late, strict=True):
        assert frames_a == frames_b
        assert loss_a == loss_b
    assert now.codec_states and set(now.codec_states) == set(deferred.codec_states)
    assert (now.device_codec is not None) == device
    for path, residual in now.codec_states.items():
        for x, y in zip(jax.tree.leaves(residual), jax.tree.leaves(deferred.codec_states[path]), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(*(jax_leaves(u) for u in (now, deferred))):
        np.testing.assert_array_equal(x, y)


def test_flush_encodes_what_is_deferred_first(world):
    cfg, setup = world
    state = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0})
    unit = build_setup.new_unit(setup, 0, 0, state)
    steps = [unit.step(defer=True) for _ in range(3)]
    final = unit.flush()
    assert unit.deferred == 3 and all(d.frames is not None for d in unit._deferred)
    frames = [unit.finish()[0] for _ in steps]
    assert [len(f) for f in frames] == [len(r.sends) for r in steps] and sum(map(len, frames)) >= 1
    assert unit.deferred == 0 and final.tokens == 0


def jax_leaves(unit):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(unit.state.params))]
