"""Decoder-only pre-norm transformer (RMSNorm, RoPE, grouped-query attention, SwiGLU) in Flax NNX.

Reference: the Llama architecture, Touvron et al., "LLaMA: Open and Efficient Foundation Language
Models" (2023), arXiv:2302.13971; RoPE from Su et al. (2021), arXiv:2104.09864; GQA from Ainslie
et al. (2023), arXiv:2305.13245; SwiGLU from Shazeer (2020), arXiv:2002.05202.

Shape suffixes: B batch, L query positions, S key positions, D d_model, H query heads, K key/value
heads, G query heads per key/value head (H = K * G), E head dim, F d_ff, V vocabulary.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from diloco.config import ModelConfig

INIT_STD = 0.02  # GPT-2 / Llama convention for embeddings and hidden projections
_MASKED = -1e30  # large negative rather than -inf, so fully masked rows cannot produce NaN


def rotary(x_BxLxHxE: jax.Array, positions_L: jax.Array, theta: float) -> jax.Array:
    """Rotate channel pairs (i, i + E/2) by position * theta^(-2i/E), the half-split RoPE layout."""
    half = x_BxLxHxE.shape[-1] // 2
    inv_freq_half = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_LxE2 = positions_L.astype(jnp.float32)[:, None] * inv_freq_half[None, :]
    # Broadcast over batch and heads; the rotation is done in float32 so bf16 keeps exact angles.
    cos_1xLx1xE2 = jnp.cos(angle_LxE2)[None, :, None, :]
    sin_1xLx1xE2 = jnp.sin(angle_LxE2)[None, :, None, :]
    x1, x2 = jnp.split(x_BxLxHxE.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos_1xLx1xE2 - x2 * sin_1xLx1xE2,
                           x2 * cos_1xLx1xE2 + x1 * sin_1xLx1xE2], axis=-1)
    return out.astype(x_BxLxHxE.dtype)


def causal_attention(q_BxLxHxE: jax.Array, k_BxSxKxE: jax.Array, v_BxSxKxE: jax.Array) -> jax.Array:
    """Softmax attention where query head h reads key/value head h // G; position l sees s <= l."""
    B, L, H, E = q_BxLxHxE.shape
    K = k_BxSxKxE.shape[2]
    S = k_BxSxKxE.shape[1]
    G = H // K
    # Grouping query heads instead of repeating K/V keeps memory at K heads (the point of GQA).
    q_BxLxKxGxE = q_BxLxHxE.reshape(B, L, K, G, E)
    # Scores and softmax in float32 whatever the compute dtype: bf16 logits lose the small
    # differences that decide attention at long range.
    scores_BxKxGxLxS = jnp.einsum("blkge,bske->bkgls", q_BxLxKxGxE, k_BxSxKxE,
                                  preferred_element_type=jnp.float32) / math.sqrt(E)
    # Query l sits at key position l + S - L, so with S == L this is the plain lower triangle.
    causal_LxS = jnp.tril(jnp.ones((L, S), dtype=bool), k=S - L)
    scores_BxKxGxLxS = jnp.where(causal_LxS, scores_BxKxGxLxS, _MASKED)
    probs_BxKxGxLxS = jax.nn.softmax(scores_BxKxGxLxS, axis=-1).astype(v_BxSxKxE.dtype)
    out_BxLxKxGxE = jnp.einsum("bkgls,bske->blkge", probs_BxKxGxLxS, v_BxSxKxE)
    return out_BxLxKxGxE.reshape(B, L, H, E)


def _linear(d_in: int, d_out: int, std: float, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
                      kernel_init=nnx.initializers.normal(std), rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.rope_theta = cfg.rope_theta
        # Residual-branch outputs are scaled down so the residual stream's variance does not grow
        # with depth (GPT-2, Radford et al. 2019, section 2.3).
        out_std = INIT_STD / math.sqrt(2 * cfg.n_layers)
        self.wq = _linear(cfg.d_model, self.n_heads * self.head_dim, INIT_STD, dtype, rngs)
        self.wk = _linear(cfg.d_model, self.n_kv_heads * self.head_dim, INIT_STD, dtype, rngs)
        self.wv = _linear(cfg.d_model, self.n_kv_heads * self.head_dim, INIT_STD, dtype, rngs)
        self.wo = _linear(self.n_heads * self.head_dim, cfg.d_model, out_std, dtype, rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        B, L, _ = x_BxLxD.shape
        E = self.head_dim
        positions_L = jnp.arange(L)
        q_BxLxHxE = rotary(self.wq(x_BxLxD).reshape(B, L, self.n_heads, E), positions_L, self.rope_theta)
        k_BxLxKxE = rotary(self.wk(x_BxLxD).reshape(B, L, self.n_kv_heads, E), positions_L, self.rope_theta)
        v_BxLxKxE = self.wv(x_BxLxD).reshape(B, L, self.n_kv_heads, E)
        out_BxLxHxE = causal_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE)
        return self.wo(out_BxLxHxE.reshape(B, L, self.n_heads * E))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        out_std = INIT_STD / math.sqrt(2 * cfg.n_layers)
        self.w_gate = _linear(cfg.d_model, cfg.d_ff, INIT_STD, dtype, rngs)
        self.w_up = _linear(cfg.d_model, cfg.d_ff, INIT_STD, dtype, rngs)
        self.w_down = _linear(cfg.d_ff, cfg.d_model, out_std, dtype, rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        h_BxLxF = jax.nn.silu(self.w_gate(x_BxLxD)) * self.w_up(x_BxLxD)
        return self.w_down(h_BxLxF)


def _rms_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype),
                       param_dtype=jnp.float32, rngs=rngs)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = _rms_norm(cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = _rms_norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD))
        return x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD))


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.max_seq_len = cfg.max_seq_len
        self.n_layers = cfg.n_layers
        self.embed = nnx.Embed(vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                               embedding_init=nnx.initializers.normal(INIT_STD), rngs=rngs)
        # String keys "0", "1", ... make the params a plain dict of str keys with no conversion at
        # the split boundary (nnx.List would give integer keys).
        self.blocks = nnx.Dict({str(i): Block(cfg, rngs) for i in range(cfg.n_layers)})
        self.final_norm = _rms_norm(cfg, rngs)
        self.lm_head = None if cfg.tie_embeddings else _linear(cfg.d_model, vocab_size, INIT_STD, dtype, rngs)

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        L = tokens_BxL.shape[1]
        if L > self.max_seq_len:
            raise ValueError(f"sequence length {L} exceeds model.max_seq_len={self.max_seq_len}")
        x_BxLxD = self.embed(tokens_BxL)
        for i in range(self.n_layers):
            x_BxLxD = self.blocks[str(i)](x_BxLxD)
        x_BxLxD = self.final_norm(x_BxLxD)
        if self.lm_head is None:
            logits_BxLxV = self.embed.attend(x_BxLxD)
        else:
            logits_BxLxV = self.lm_head(x_BxLxD)
        return logits_BxLxV.astype(jnp.float32)
