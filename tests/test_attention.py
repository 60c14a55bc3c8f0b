"""model.attention: jax.nn.dot_product_attention (xla, and cudnn's choice) against the explicit
reference implementation, for causal training, packed segments, KV-cache decoding, GQA and every
family's variants; the kernel choice and its refusals."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

from diloco.config import ConfigError, ModelConfig
from diloco.config.checks import ATTENTION_KERNELS, model_errors
from diloco.model import build, with_params
from diloco.model.attention import attend, cudnn_fits, implementation, reference_attention
from diloco.model.generate import init_cache, left_pad

VOCAB = 97
TINY = tiny_model(d_model=64)
# Our decoder and each imported family's variants (docs/models.md): Qwen3's qk-norm and own head dim,
# Qwen2's qkv bias, GPT-2's LayerNorm, GELU, biases and learned positions, Llama 3.1's RoPE scaling.
FAMILIES = {
    "ours": TINY,
    "mha": dataclasses.replace(TINY, n_kv_heads=4),
    "mqa": dataclasses.replace(TINY, n_kv_heads=1),
    "qwen3": dataclasses.replace(TINY, family="qwen3", qk_norm=True, head_dim=8),
    "qwen2": dataclasses.replace(TINY, family="qwen2", qkv_bias=True),
    "gpt2": dataclasses.replace(TINY, family="gpt2", n_kv_heads=4, norm="layer", mlp="gelu", positions="learned",
                                qkv_bias=True, o_bias=True, mlp_bias=True, tie_embeddings=False),
    "llama31": dataclasses.replace(TINY, family="llama", rope_scaling="llama3", rope_original_max_len=16),
}
# Stated tolerance of xla against reference in float32: the two differ only in scaling the scores by
# 1/sqrt(E) (a multiply) or dividing by sqrt(E), and in their masking constant (-0.7 x float32 max
# against -1e30; both make exp underflow to 0), so the logits agree to float32 rounding.
F32_TOL = dict(rtol=1e-5, atol=1e-5)


def _pair(cfg: ModelConfig, kernel: str, seed: int = 0):
    """The reference model and the same params under `kernel`."""
    ref = build(dataclasses.replace(cfg, attention="reference"), VOCAB, seed)
    return ref, with_params(dataclasses.replace(cfg, attention=kernel), VOCAB, ref.params)


def _qkv(seed: int, B=2, L=12, S=12, H=4, K=2, E=16, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    # Large values make attention peaked, so a wrong mask cannot hide in near-uniform probabilities.
    return (3 * jax.random.normal(kq, (B, L, H, E))).astype(dtype), \
        (3 * jax.random.normal(kk, (B, S, K, E))).astype(dtype), jax.random.normal(kv, (B, S, K, E)).astype(dtype)


@pytest.mark.parametrize("K", [4, 2, 1])
def test_xla_causal_equals_the_reference_for_mha_gqa_and_mqa(K):
    q, k, v = _qkv(0, K=K)
    np.testing.assert_allclose(attend("xla", q, k, v), reference_attention(q, k, v), **F32_TOL)


def test_xla_masked_and_fully_masked_rows_equal_the_reference_without_nan():
    q, k, v = _qkv(1)
    mask_BxLxS = jax.random.bernoulli(jax.random.key(2), 0.6, (2, 12, 12))
    mask_BxLxS = mask_BxLxS.at[0, 3].set(False)  # a row that sees nothing, as padding does
    got = attend("xla", q, k, v, mask_BxLxS, causal=False)
    np.testing.assert_allclose(got, reference_attention(q, k, v, mask_BxLxS), **F32_TOL)
    # A row seeing nothing averages every value, as the reference does, instead of NaN.
    np.testing.assert_allclose(got[0, 3], jnp.broadcast_to(v[0].mean(0).repeat(2, axis=0), (4, 16)), **F32_TOL)
    # Mask and causal together: the reference of their intersection.
    both = mask_BxLxS & jnp.tril(jnp.ones((1, 12, 12), bool))
    np.testing.assert_allclose(attend("xla", q, k, v, mask_BxLxS, causal=True),
                               reference_attention(q, k, v, both), **F32_TOL)


def test_bfloat16_xla_is_within_bf16_rounding_of_the_reference():
    q, k, v = _qkv(3, dtype=jnp.bfloat16)
    got = attend("xla", q, k, v).astype(jnp.float32)
    want = reference_attention(q, k, v).astype(jnp.float32)
    # Both take the softmax in float32 and multiply by bf16 probabilities: a few bf16 ulps apart.
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_logits_under_xla_equal_the_reference_for_every_family(family):
    ref, xla = _pair(FAMILIES[family], "xla")
    tokens = jax.random.randint(jax.random.key(4), (2, 24), 0, VOCAB)
    np.testing.assert_allclose(jax.jit(xla.apply)(xla.params, tokens),
                               jax.jit(ref.apply)(ref.params, tokens), **F32_TOL)


@pytest.mark.parametrize("family", ["ours", "qwen3", "gpt2"])
def test_packed_segments_under_xla_equal_the_reference(family):
    ref, xla = _pair(FAMILIES[family], "xla")
    tokens = jax.random.randint(jax.random.key(5), (2, 20), 0, VOCAB)
    # Row 0: segments of 7 and 9 tokens then 4 pads; row 1: one of 20.
    segments = jnp.array([[1] * 7 + [2] * 9 + [0] * 4, [1] * 20])
    positions = jnp.array([list(range(7)) + list(range(9)) + [0] * 4, list(range(20))])
    got = jax.jit(xla.packed)(xla.params, tokens, segments, positions)
    want = jax.jit(ref.packed)(ref.params, tokens, segments, positions)
    assert bool(jnp.all(jnp.isfinite(got)))
    np.testing.assert_allclose(got, want, **F32_TOL)
    # And each example's logits are those it has alone (the segment mask works under xla too).
    alone = xla.apply(xla.params, tokens[:1, 7:16])
    np.testing.assert_allclose(got[0, 7:16], alone[0], **F32_TOL)


@pytest.mark.parametrize("family", ["ours", "qwen3", "mqa", "gpt2"])
def test_kv_cache_decode_under_xla_equals_the_reference(family):
    cfg = FAMILIES[family]
    ref, xla = _pair(cfg, "xla")
    tokens_BxP, mask_BxP = left_pad([[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]])
    step_Bx1 = jnp.array([[1], [2], [3]])
    out = {}
    for name, model in (("ref", ref), ("xla", xla)):
        cache = init_cache(cfg, 3, 10)
        prefill, cache = jax.jit(model.decode)(model.params, tokens_BxP, mask_BxP, cache)
        step, cache = jax.jit(model.decode)(model.params, step_Bx1, jnp.ones((3, 1), bool), cache)
        out[name] = (prefill, step)
    for got, want in zip(out["xla"], out["ref"]):
        np.testing.assert_allclose(got, want, **F32_TOL)
    # The decoded step's logits are what apply gives at that position of the unpadded prompt.
    full = xla.apply(xla.params, jnp.array([[11, 12, 2]]))
    np.testing.assert_allclose(out["xla"][1][1, 0], full[0, -1], **F32_TOL)


def test_gradients_under_xla_equal_the_reference():
    ref, xla = _pair(FAMILIES["qwen3"], "xla")
    tokens = jax.random.randint(jax.random.key(6), (2, 17), 0, VOCAB)

    def loss(model):
        return lambda p: jnp.mean(jax.nn.log_softmax(model.apply(p, tokens[:, :-1]))[..., 0])

    got, want = (jax.jit(jax.grad(loss(m)))(m.params) for m in (xla, ref))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-7)


def test_auto_keeps_the_reference_on_cpu_and_decoding_never_takes_cudnn():
    assert jax.default_backend() == "cpu"
    # On a CPU XLA's kernel computes the same scores in another order: auto keeps the reference's bits.
    assert implementation("auto", jnp.bfloat16, 64, 128, masked=False, decoding=False) == "reference"
    assert implementation("xla", jnp.bfloat16, 64, 128, masked=False, decoding=True) == "xla"
    assert implementation("reference", jnp.bfloat16, 64, 128, masked=False, decoding=True) == "reference"
    assert implementation("cudnn", jnp.bfloat16, 64, 128, masked=True, decoding=False) == "cudnn"
    assert implementation("cudnn", jnp.bfloat16, 64, 1, masked=True, decoding=True) == "xla"


def test_auto_on_accelerators_takes_cudnn_where_it_fits_and_xla_elsewhere(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert implementation("auto", jnp.bfloat16, 64, 128, masked=False, decoding=False) == "cudnn"
    assert implementation("auto", jnp.bfloat16, 64, 127, masked=True, decoding=False) == "xla"
    assert implementation("auto", jnp.float32, 64, 128, masked=False, decoding=False) == "xla"
    assert implementation("auto", jnp.bfloat16, 64, 128, masked=True, decoding=True) == "xla"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert implementation("auto", jnp.bfloat16, 64, 128, masked=False, decoding=False) == "xla"


def test_the_default_model_on_cpu_computes_exactly_what_the_reference_does():
    ref, auto = _pair(TINY, "auto")
    tokens = jax.random.randint(jax.random.key(8), (2, 24), 0, VOCAB)
    np.testing.assert_array_equal(jax.jit(auto.apply)(auto.params, tokens), jax.jit(ref.apply)(ref.params, tokens))


def test_cudnn_fits_half_precision_head_dims_of_eight_and_even_masked_lengths():
    assert cudnn_fits(jnp.bfloat16, 64) and cudnn_fits(jnp.float16, 128)
    assert not cudnn_fits(jnp.float32, 64)  # cuDNN's flash kernel takes half precision only
    assert not cudnn_fits(jnp.bfloat16, 20)  # head dim not a multiple of 8
    assert not cudnn_fits(jnp.bfloat16, 256)  # Hopper only
    assert cudnn_fits(jnp.bfloat16, 64, 128) and not cudnn_fits(jnp.bfloat16, 64, 127)


def test_causal_attention_needs_as_many_keys_as_queries():
    q, k, v = _qkv(7, L=3, S=5)
    with pytest.raises(ValueError, match="L=3 S=5"):
        attend("xla", q, k, v)


def test_config_refuses_unknown_kernels_cudnn_in_float32_and_cudnn_without_a_gpu():
    assert ATTENTION_KERNELS == ("auto", "xla", "cudnn", "reference")
    assert any("model.attention='flash' not in auto|xla|cudnn|reference" in e
               for e in model_errors(dataclasses.replace(TINY, attention="flash")))
    assert "model.attention=cudnn needs model.dtype=bfloat16, got 'float32'" in \
        model_errors(dataclasses.replace(TINY, attention="cudnn"))
    assert any("multiple of 8" in e for e in model_errors(
        dataclasses.replace(TINY, attention="cudnn", dtype="bfloat16", head_dim=12)))
    good = dataclasses.replace(TINY, attention="cudnn", dtype="bfloat16")
    assert model_errors(good) == []
    # Whether a GPU is there is known where the model is built, at start-up.
    with pytest.raises(ConfigError, match="model.attention=cudnn needs a GPU, but jax runs on 'cpu'"):
        build(good, VOCAB, seed=0)
