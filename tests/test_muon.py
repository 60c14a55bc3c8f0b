"""inner.optimizer=muon: Muon's update of a known matrix computed by hand (Newton-Schulz acts on
each singular value alone), AdamW's update on embeddings and norm scales, a sim run resumed from a
snapshot that ends bit for bit where the uninterrupted one does, and every runtime training with it
(docs/algorithm.md#muon-inner-optimizer)."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import diloco_world, tiny_cfg
from test_sim import build, corpus, make_cfg, model  # noqa: F401  (fixtures)

from diloco.config import InnerConfig
from diloco.train.optim import make_optimizer, muon_labels

# Constant rate, no clipping or decay: the update is lr times Muon's direction alone.
MUON = InnerConfig(optimizer="muon", lr=0.5, schedule="constant", warmup_steps=0, clip_norm=0.0,
                   weight_decay=0.0, muon_rms=0.2)
NS = (3.4445, -4.7750, 2.0315)  # optax's Newton-Schulz quintic coefficients (Keller Jordan's)


def test_muon_orthogonalises_a_known_matrix_by_hand():
    """G = R diag(4, 1) with R a rotation: SVD U = R, S = (4, 1), V = I. The first step's momentum
    is a positive multiple of G; Frobenius normalisation gives singular values (4, 1) / sqrt(17),
    and each Newton-Schulz step maps every singular value s to a s + b s^3 + c s^5, keeping U and V.
    The update is -lr * 0.2 * sqrt(2) * R diag(s_5)."""
    c, s = np.cos(0.3), np.sin(0.3)
    R = np.array([[c, -s], [s, c]], np.float32)
    G = R @ np.diag([4.0, 1.0]).astype(np.float32)
    params = {"w": jnp.zeros((2, 2))}
    opt = make_optimizer(MUON, 10)
    updates, _ = opt.update({"w": jnp.asarray(G)}, opt.init(params), params)

    sv = np.array([4.0, 1.0]) / np.sqrt(17.0)
    for _ in range(5):
        sv = NS[0] * sv + NS[1] * sv**3 + NS[2] * sv**5
    expected = -0.5 * 0.2 * np.sqrt(2.0) * R @ np.diag(sv)
    np.testing.assert_allclose(np.asarray(updates["w"]), expected, rtol=1e-4, atol=1e-6)
    # Near-orthogonal: both singular values pulled into Muon's band around 1 from 4:1 apart.
    assert 0.6 < sv.min() and sv.max() < 1.3


def test_embeddings_and_vectors_take_adamws_update_matrices_muons():
    """Embedding and norm scale get exactly what inner=adamw gives them; a hidden matrix does not."""
    params = {"embed": {"embedding": jnp.ones((8, 4))}, "blocks": {"0": {"attn_norm": {"scale": jnp.ones(4)},
                                                                          "mlp": {"w_up": {"kernel": jnp.ones((4, 6))}}}}}
    assert jax.tree.leaves(muon_labels(params)) == ["adam", "muon", "adam"]  # sorted: blocks..., embed
    grads = jax.tree.map(lambda p: jnp.arange(p.size, dtype=jnp.float32).reshape(p.shape) / p.size + 0.1, params)
    cfg = replace(MUON, weight_decay=0.1)
    muon, adamw = make_optimizer(cfg, 10), make_optimizer(replace(cfg, optimizer="adamw"), 10)
    um, _ = muon.update(grads, muon.init(params), params)
    ua, _ = adamw.update(grads, adamw.init(params), params)
    np.testing.assert_array_equal(um["embed"]["embedding"], ua["embed"]["embedding"])
    np.testing.assert_array_equal(um["blocks"]["0"]["attn_norm"]["scale"], ua["blocks"]["0"]["attn_norm"]["scale"])
    assert not np.allclose(um["blocks"]["0"]["mlp"]["w_up"]["kernel"], ua["blocks"]["0"]["mlp"]["w_up"]["kernel"])


def test_muon_fields_are_checked_with_their_values(tmp_path):
    from diloco.config import ConfigError
    with pytest.raises(ConfigError, match=r"inner.muon_beta=1.0 must be in \[0, 1\)"):
        tiny_cfg(tmp_path, inner=dict(optimizer="muon", muon_beta=1.0))
    with pytest.raises(ConfigError, match=r"inner.optimizer='lion' not in adamw\|sgd\|muon"):
        tiny_cfg(tmp_path, inner=dict(optimizer="lion"))


# Constant schedule: test_sim's `build` fixture compiles each learner's step once for the module.
RUN_MUON = dict(optimizer="muon", lr=1e-2, schedule="constant", warmup_steps=0)


def test_a_checkpointed_muon_state_continues_bit_identically(tmp_path):
    """A TrainState with Muon's and AdamW's moments through an Orbax checkpoint (what a dp run, a
    procs or threads learner saves) restores into the same tree, and two more steps from it equal
    two more steps of the state that never left memory, bit for bit."""
    from diloco import checkpoint
    from diloco.train.step import init_state

    params = {"embed": {"embedding": jnp.ones((8, 4))}, "blocks": {"0": {"attn_norm": {"scale": jnp.ones(4)},
                                                                          "mlp": {"w_up": {"kernel": jnp.ones((4, 6))}}}}}
    opt = make_optimizer(replace(MUON, weight_decay=0.1, clip_norm=1.0), 10)
    loss = lambda p: sum(jnp.sum(jnp.sin(x * (i + 1.0))) for i, x in enumerate(jax.tree.leaves(p)))

    @jax.jit
    def step(state):
        updates, opt_state = opt.update(jax.grad(loss)(state.params), state.opt_state, state.params)
        return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                             opt_state=opt_state)

    state = step(step(init_state(params, opt)))
    manager = checkpoint.open_manager(tmp_path / "ckpt", keep=1, async_save=False)
    checkpoint.save(manager, 2, state)
    manager.wait_until_finished()
    restored, _ = checkpoint.restore(manager, 2, state)
    manager.close()
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for x, y in zip(jax.tree.leaves(step(step(state))), jax.tree.leaves(step(step(restored)))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow  # 11 s here (compiling the learners' steps); the fast checks are above
def test_sim_trains_with_muon(tmp_path, build):
    from diloco.runtime import sim
    cfg = make_cfg(tmp_path, steps=12, inner=RUN_MUON, run=dict(eval_every=12, out_dir=str(tmp_path / "run")))
    rt, summary = sim.run(cfg, build(cfg), tmp_path / "run", None)
    assert summary["merges"] == 6 and summary["token_ledger_imbalance"] == 0
    states = jax.tree.leaves(rt.units[0].state.opt_state, is_leaf=lambda s: isinstance(s, optax.contrib.MuonState))
    assert any(isinstance(s, optax.contrib.MuonState) for s in states)


@pytest.mark.slow  # 5 to 15 s here (three sim runs)
def test_a_resumed_muon_learner_continues_bit_identically(tmp_path, build):
    """Sim snapshots carry each learner's Muon and AdamW state: a run cut at 10 of 24 inner steps
    and resumed ends with the uninterrupted run's Theta and learner states, bit for bit."""
    from diloco.algo import syncer as sync
    from diloco.runtime import sim

    def cfg_for(name, resume=False):
        return make_cfg(tmp_path, steps=12, inner=RUN_MUON,
                        run=dict(checkpoint_every=2, out_dir=str(tmp_path / name), resume=resume))

    whole = cfg_for("whole")
    setup = build(whole)
    a, _ = sim.run(whole, setup, tmp_path / "whole", None)
    sim.run(cfg_for("cut"), setup, tmp_path / "cut", None, stop=lambda s: s.steps_done >= 10)
    c, _ = sim.run(cfg_for("cut", resume=True), setup, tmp_path / "cut", None)
    for x, y in zip(sync.theta(a.syncer).values(), sync.theta(c.syncer).values()):
        np.testing.assert_array_equal(x, y)
    for ua, uc in zip(a.units, c.units):
        assert ua.ls == uc.ls
        for x, y in zip(jax.tree.leaves(ua.state), jax.tree.leaves(uc.state)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert int(a.units[0].state.step) == 12


def _muon_cfg(tmp, kind, **groups):
    return tiny_cfg(tmp, kind, inner=dict(optimizer="muon", lr=1e-2), **groups)


@pytest.mark.slow  # 17 s here; the learner loop is sim's (tested above), the wall clock's own start is this
def test_threads_trains_with_muon(tmp_path):
    from diloco.runtime import threads
    cfg = _muon_cfg(tmp_path, "threads", run=dict(steps=12, eval_every=0))
    _, _, setup, evaluate_global, initial = diloco_world(cfg)
    rt, summary = threads.run(cfg, setup, tmp_path / "run", evaluate_global)
    assert summary["merges"] > 0 and summary["token_ledger_imbalance"] == 0
    assert summary["eval_loss"] < initial - 0.3, (summary["eval_loss"], initial)


@pytest.mark.slow  # spawns a syncer and two learner processes (about 40 s here)
def test_procs_trains_with_muon(tmp_path):
    from diloco.runtime import procs
    cfg = _muon_cfg(tmp_path, "procs", run=dict(steps=12, eval_every=0))
    _, _, setup, evaluate_global, initial = diloco_world(cfg)
    (tmp_path / "run").mkdir(exist_ok=True)
    rt, summary = procs.run(cfg, setup, tmp_path / "run", evaluate_global)
    assert rt.finished["complete"] and rt.finished["steps"] == {"0": 12, "1": 12}
    assert summary["merges"] > 0 and summary["eval_loss"] < initial - 0.3, (summary["eval_loss"], initial)
