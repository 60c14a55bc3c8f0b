"""model.remat: every policy gives the same loss and gradients, keeps less for the backward pass
than none, and each preset names one."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
import yaml

from diloco.config import ModelConfig, from_dict
from diloco.config.checks import REMAT_NAMES, model_errors
from diloco.model import build, with_params
from diloco.model.transformer import REMAT_POLICIES
from diloco.train.step import make_loss

VOCAB = 64
TINY = tiny_model(n_layers=3, d_ff=64)
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "model"


def _grad(cfg: ModelConfig, params, batch):
    model = with_params(cfg, VOCAB, params)
    return jax.jit(jax.value_and_grad(lambda p: make_loss(model)(p, batch)[0]))(params)


def test_the_config_names_every_policy_the_model_has():
    assert tuple(REMAT_POLICIES) == REMAT_NAMES == ("none", "full", "dots")
    assert any("model.remat='some' not in none|full|dots" in e
               for e in model_errors(dataclasses.replace(TINY, remat="some")))


@pytest.mark.parametrize("base", [TINY, dataclasses.replace(TINY, family="qwen3", qk_norm=True, head_dim=16,
                                                            tie_embeddings=False)])
def test_every_policy_gives_the_loss_and_gradients_of_none(base):
    params = build(base, VOCAB, seed=0).params
    batch = jax.random.randint(jax.random.key(1), (4, 33), 0, VOCAB)
    want_v, want_g = _grad(base, params, batch)
    for policy in ("full", "dots"):
        got_v, got_g = _grad(dataclasses.replace(base, remat=policy), params, batch)
        # Recomputing the forward pass repeats the same float32 operations.
        np.testing.assert_allclose(got_v, want_v, rtol=1e-6)
        for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-8)


def test_packed_rows_under_remat_give_the_gradients_of_none():
    params = build(TINY, VOCAB, seed=2).params
    tokens = jax.random.randint(jax.random.key(3), (2, 17), 0, VOCAB)
    batch = {"tokens": tokens, "segments": jnp.array([[1] * 9 + [2] * 6 + [0] * 2, [1] * 17]),
             "positions": jnp.array([list(range(9)) + list(range(6)) + [0, 0], list(range(17))]),
             "targets": jnp.ones((2, 16), bool)}

    def grads(cfg):
        model = with_params(cfg, VOCAB, params)
        return jax.jit(jax.grad(lambda p: make_loss(model, sft=True)(p, batch)[0]))(params)

    for g, w in zip(jax.tree.leaves(grads(dataclasses.replace(TINY, remat="full"))), jax.tree.leaves(grads(TINY))):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-8)


def test_each_policy_keeps_what_it_says_for_the_backward_pass():
    # What jax saves for the backward pass: the leaves of the vjp closure (the residuals), before
    # any compiler schedules them (XLA:CPU's scheduler hides remat's saving in the compiled
    # memory, docs/experiments.md#inner-step-memory).
    cfg = dataclasses.replace(TINY, d_ff=96)  # a width no other array has (V = L = 64)
    B, L, F = 8, 64, cfg.d_ff
    K, G = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads
    params = build(cfg, VOCAB, seed=0).params
    batch = jnp.zeros((B, L + 1), jnp.int32)

    def saved(policy):
        model = with_params(dataclasses.replace(cfg, remat=policy), VOCAB, params)
        # Shapes only: jax.eval_shape traces the vjp without computing it.
        leaves = jax.eval_shape(lambda p: jax.tree.leaves(jax.vjp(lambda q: make_loss(model)(q, batch)[0], p)[1]),
                                params)
        return {x.shape for x in leaves}, sum(x.size * x.dtype.itemsize for x in leaves)

    (none, none_bytes), (dots, dots_bytes), (full, full_bytes) = (saved(p) for p in ("none", "dots", "full"))
    scores, mlp = (B, K, G, L, L), (B, L, F)  # the reference attention's scores; the MLP's up/gate
    assert scores in none and mlp in none
    assert scores not in dots and mlp in dots  # projections kept, attention recomputed
    assert scores not in full and mlp not in full  # only each block's input kept
    assert full_bytes < dots_bytes < none_bytes, (none_bytes, dots_bytes, full_bytes)


def test_every_preset_names_a_policy_and_the_accelerator_ones_rematerialise():
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        cfg = from_dict(ModelConfig, yaml.safe_load(path.read_text()))
        assert cfg.remat in REMAT_NAMES, path
        # The accelerator presets (bfloat16) hold long sequences through many blocks; the CPU ones
        # (float32) do not, and keep every activation.
        assert (cfg.remat != "none") == (cfg.dtype == "bfloat16"), (cfg.name, cfg.remat)
