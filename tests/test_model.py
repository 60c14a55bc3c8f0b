"""Model tests: analytic parameter counts, causality, RoPE relativity, GQA against a reference."""

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
import yaml
from flax import nnx

from diloco.config.checks import model_errors
from diloco.config import ConfigError, ModelConfig, from_dict
from diloco.model import abstract_params, build, count_params, is_embedding
from diloco.model.transformer import Attention, rotary

VOCAB = 256
TINY = tiny_model(d_model=64, d_ff=192, max_seq_len=128)  # wider than the runs' tiny model; shared with the hf tests
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "model"


@pytest.fixture(scope="module")
def tiny():
    model = build(TINY, VOCAB, seed=0)
    return model, jax.jit(model.apply)


def _tokens(seed: int, shape=(2, 16)) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 0, VOCAB, dtype=jnp.int32)


def _paths(params) -> list[tuple[str, ...]]:
    return [tuple(k.key for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def test_output_shape_and_dtype(tiny):
    model, apply = tiny
    logits_BxLxV = apply(model.params, _tokens(0))
    assert logits_BxLxV.shape == (2, 16, VOCAB)
    assert logits_BxLxV.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits_BxLxV)))


def test_params_are_plain_float32_dict_with_str_keys(tiny):
    model, _ = tiny
    for path in _paths(model.params):
        assert all(isinstance(k, str) for k in path), path
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(model.params))
    assert ("blocks", "1", "attn", "wq", "kernel") in _paths(model.params)


def test_causal_changing_token_t_leaves_earlier_logits_unchanged(tiny):
    model, apply = tiny
    tokens = _tokens(1)
    t = 9
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % VOCAB)
    before, after = apply(model.params, tokens), apply(model.params, changed)
    np.testing.assert_array_equal(before[:, :t], after[:, :t])
    # The edit must be visible from position t on, or the check above would be vacuous.
    assert float(jnp.max(jnp.abs(before[:, t:] - after[:, t:]))) > 1e-3


def test_rope_scores_depend_only_on_relative_position():
    q_1x1x1xE, k_1x1x1xE = jax.random.normal(jax.random.key(2), (2, 1, 1, 1, 16))

    def score(i, j):
        q = rotary(q_1x1x1xE, jnp.array([i]), theta=10000.0)
        k = rotary(k_1x1x1xE, jnp.array([j]), theta=10000.0)
        return float(jnp.sum(q * k))

    for i, j, s in [(3, 1, 5), (0, 7, 11), (20, 20, 100)]:
        assert score(i, j) == pytest.approx(score(i + s, j + s), rel=1e-4, abs=1e-4)
    # A different offset must change the score, and position 0 is the identity.
    assert abs(score(3, 1) - score(3, 2)) > 1e-3
    np.testing.assert_allclose(rotary(q_1x1x1xE, jnp.array([0]), 10000.0), q_1x1x1xE)


def _reference_attention(w, x_BxLxD, n_heads, n_kv_heads, theta):
    """Per-head causal attention written independently: complex-number RoPE, repeated K/V heads."""
    B, L, D = x_BxLxD.shape
    E = D // n_heads
    q = (x_BxLxD @ w["wq"]["kernel"]).reshape(B, L, n_heads, E)
    k = (x_BxLxD @ w["wk"]["kernel"]).reshape(B, L, n_kv_heads, E)
    v = (x_BxLxD @ w["wv"]["kernel"]).reshape(B, L, n_kv_heads, E)
    freq = theta ** (-2.0 * np.arange(E // 2) / E)
    phase = np.exp(1j * np.arange(L)[:, None] * freq[None, :])[None, :, None, :]

    def rope(x):
        z = (x[..., : E // 2] + 1j * x[..., E // 2:]) * phase
        return np.concatenate([z.real, z.imag], axis=-1)

    q, k = rope(np.asarray(q, np.float64)), rope(np.asarray(k, np.float64))
    repeat = n_heads // n_kv_heads
    k, v = np.repeat(k, repeat, axis=2), np.repeat(np.asarray(v, np.float64), repeat, axis=2)
    scores = np.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(E)
    scores = np.where(np.tril(np.ones((L, L), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhe->bqhe", probs, v).reshape(B, L, D)
    return out @ np.asarray(w["wo"]["kernel"], np.float64)


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_attention_matches_reference_mha_and_gqa(n_kv_heads):
    cfg = dataclasses.replace(TINY, n_kv_heads=n_kv_heads)
    graphdef, state = nnx.split(Attention(cfg, nnx.Rngs(3)))
    # Large inputs give peaked attention, so RoPE and masking errors cannot hide in near-uniform
    # probabilities (with std-0.02 weights and unit inputs the scores would all be ~0).
    x_BxLxD = 10.0 * jax.random.normal(jax.random.key(4), (2, 12, cfg.d_model))
    out, _ = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, jnp.arange(x.shape[1])))(state, x_BxLxD)
    weights = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(state))
    expected = _reference_attention(weights, np.asarray(x_BxLxD, np.float64), cfg.n_heads, n_kv_heads,
                                    cfg.rope_theta)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-6)


def test_tied_and_untied_counts_differ_by_vocab_times_d_model():
    tied = count_params(abstract_params(TINY, VOCAB))
    untied = count_params(abstract_params(dataclasses.replace(TINY, tie_embeddings=False), VOCAB))
    assert untied - tied == VOCAB * TINY.d_model


def test_count_params_matches_formula_for_tiny(tiny):
    model, _ = tiny
    d, f, n = TINY.d_model, TINY.d_ff, TINY.n_layers
    e = d // TINY.n_heads
    attn = d * TINY.n_heads * e * 2 + d * TINY.n_kv_heads * e * 2  # wq, wo; wk, wv
    per_layer = attn + 3 * d * f + 2 * d  # SwiGLU and two RMSNorm scales
    expected = VOCAB * d + n * per_layer + d
    assert count_params(model.params) == expected == 115_008
    assert count_params(abstract_params(TINY, VOCAB)) == expected


def test_initial_loss_is_close_to_log_vocab(tiny):
    model, apply = tiny
    tokens = _tokens(5, (8, 33))
    logits = apply(model.params, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits)
    loss = -float(jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)))
    assert abs(loss - math.log(VOCAB)) < 0.3, (loss, math.log(VOCAB))


def test_apply_under_jit_and_grad_gives_finite_nonzero_gradients(tiny):
    model, _ = tiny
    tokens = _tokens(6, (2, 17))

    def loss_fn(params):
        logp = jax.nn.log_softmax(model.apply(params, tokens[:, :-1]))
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(model.params)
    assert bool(jnp.isfinite(loss))
    assert jax.tree.structure(grads) == jax.tree.structure(model.params)
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        name = jax.tree_util.keystr(path)
        assert bool(jnp.all(jnp.isfinite(g))), name
        assert float(jnp.max(jnp.abs(g))) > 0, name


def test_apply_with_sharded_params_matches_unsharded(tiny):
    model, apply = tiny
    # Auto axes, as diloco.train.mesh builds them; every matrix sharded on its first axis (the
    # vocabulary axis for the embedding), vectors replicated, as an FSDP layout would.
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.tree.map(
        lambda a: jax.device_put(a, jax.NamedSharding(mesh, jax.P("fsdp") if a.ndim == 2 else jax.P())),
        model.params)
    tokens = _tokens(7)
    np.testing.assert_allclose(apply(sharded, tokens), apply(model.params, tokens), rtol=1e-5, atol=1e-5)


def test_is_embedding_flags_exactly_the_vocabulary_matrices():
    tied = [p for p in _paths(abstract_params(TINY, VOCAB)) if is_embedding(p)]
    assert tied == [("embed", "embedding")]
    untied_params = abstract_params(dataclasses.replace(TINY, tie_embeddings=False), VOCAB)
    untied = [p for p in _paths(untied_params) if is_embedding(p)]
    assert sorted(untied) == [("embed", "embedding"), ("lm_head", "kernel")]
    # DictKey paths straight from tree_flatten_with_path are accepted too.
    flagged = [p for p, _ in jax.tree_util.tree_flatten_with_path(untied_params)[0] if is_embedding(p)]
    assert len(flagged) == 2


def test_same_seed_same_params_different_seed_different(tiny):
    model, _ = tiny
    again, other = build(TINY, VOCAB, seed=0), build(TINY, VOCAB, seed=1)
    for a, b, c in zip(*(jax.tree_util.tree_leaves(m.params) for m in (model, again, other))):
        np.testing.assert_array_equal(a, b)
    kernels = [(a, c) for a, c in zip(jax.tree_util.tree_leaves(model.params),
                                      jax.tree_util.tree_leaves(other.params)) if a.ndim == 2]
    assert all(not np.array_equal(a, c) for a, c in kernels)


def test_bfloat16_compute_returns_float32_logits_close_to_float32(tiny):
    model, apply = tiny
    bf16 = build(dataclasses.replace(TINY, dtype="bfloat16"), VOCAB, seed=0)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(bf16.params))
    tokens = _tokens(8)
    logits = jax.jit(bf16.apply)(bf16.params, tokens)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, apply(model.params, tokens), atol=0.1)


def test_build_fails_loudly_on_bad_config_and_long_sequences(tiny):
    with pytest.raises(ConfigError, match="n_heads=4 is not divisible by model.n_kv_heads=3"):
        build(dataclasses.replace(TINY, n_kv_heads=3), VOCAB, seed=0)
    model, _ = tiny
    with pytest.raises(ValueError, match="exceeds model.max_seq_len=128"):
        jax.eval_shape(model.apply, model.params, jax.ShapeDtypeStruct((1, 129), jnp.int32))


# Expected parameter counts: CPU presets with the byte vocabulary, 1b with a 32k BPE vocabulary,
# 135m (SmolLM2-135M's shape) with its 49,152-token one.
PRESET_RANGES = {"tiny": (256, 0.08e6, 0.15e6), "small": (256, 0.8e6, 1.2e6),
                 "base10m": (256, 8e6, 12e6), "1b": (32768, 0.9e9, 1.1e9), "135m": (49152, 0.13e9, 0.14e9),
                 "360m": (49152, 0.36e9, 0.37e9), "llama3_1b": (128256, 1.2e9, 1.3e9),
                 "llama3_8b": (128256, 8.0e9, 8.1e9)}


@pytest.mark.parametrize("name", sorted(PRESET_RANGES))
def test_preset_loads_validates_and_has_the_stated_size(name):
    raw = yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())
    cfg = from_dict(ModelConfig, raw)
    assert cfg.name == name
    assert model_errors(cfg) == []
    vocab, low, high = PRESET_RANGES[name]
    n = count_params(abstract_params(cfg, vocab))
    assert low <= n <= high, (name, n)
    # The count stated in the file's header comment is the measured one.
    assert f"{n:,}" in (CONFIG_DIR / f"{name}.yaml").read_text().splitlines()[0]


def test_presets_cover_every_file_and_small_equals_the_defaults():
    assert sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) == sorted(PRESET_RANGES)
    small = from_dict(ModelConfig, yaml.safe_load((CONFIG_DIR / "small.yaml").read_text()))
    assert small == ModelConfig()
