"""One decoder-only pre-norm transformer in Flax NNX, configured into Llama, Mistral, Qwen2/3 or GPT-2.

Reference: the Llama architecture, Touvron et al., "LLaMA: Open and Efficient Foundation Language
Models" (2023), arXiv:2302.13971; RoPE from Su et al. (2021), arXiv:2104.09864; GQA from Ainslie
et al. (2023), arXiv:2305.13245; SwiGLU from Shazeer (2020), arXiv:2002.05202; GPT-2 from Radford
et al. (2019). The variants each family needs are ModelConfig fields (docs/models.md).

Shape suffixes: B batch, L query positions, S key positions, D d_model, H query heads, K key/value
heads, G query heads per key/value head (H = K * G), E head dim, F d_ff, V vocabulary.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from diloco.config import ModelConfig
from diloco.model.attention import attend

INIT_STD = 0.02  # GPT-2 / Llama convention for embeddings and hidden projections

# model.remat: what each block keeps from its forward pass for the backward one
# (docs/models.md#remat). "dots" keeps the projections' outputs (matmuls without batch dimensions)
# and recomputes the attention scores, norms and activations; "full" keeps only the block's input.
REMAT_POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}

# A KV cache (diloco/model/generate.py) is a dict: "layers" {str(i): {"k", "v": BxSxKxE}}, "valid_BxS"
# (which slots hold a real token), "pos_B" (real tokens so far per row) and "end" (next free slot).
Cache = dict


def head_dim(cfg: ModelConfig) -> int:
    return cfg.head_dim or cfg.d_model // cfg.n_heads


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """Angular frequency of each rotated channel pair, [E/2] float32, after any context scaling."""
    half = head_dim(cfg) // 2
    inv_freq_half = cfg.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if cfg.rope_scaling == "none":
        return inv_freq_half
    # Llama 3.1's extension (Meta's reference code, `apply_scaling`): wavelengths shorter than
    # original/high_freq_factor are kept, longer than original/low_freq_factor divided by the
    # factor, and the band between interpolated linearly in original/wavelength.
    wavelen = 2 * math.pi / inv_freq_half
    low_wavelen = cfg.rope_original_max_len / cfg.rope_low_freq_factor
    high_wavelen = cfg.rope_original_max_len / cfg.rope_high_freq_factor
    smooth = ((cfg.rope_original_max_len / wavelen - cfg.rope_low_freq_factor)
              / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor))
    smoothed = (1 - smooth) * inv_freq_half / cfg.rope_factor + smooth * inv_freq_half
    scaled = jnp.where(wavelen > low_wavelen, inv_freq_half / cfg.rope_factor, inv_freq_half)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rotary(x_BxLxHxE: jax.Array, positions: jax.Array, theta: float = 10000.0,
           inv_freq_half: jax.Array | None = None) -> jax.Array:
    """Rotate channel pairs (i, i + E/2) by position * inv_freq[i] (theta^(-2i/E) unless given),
    the half-split RoPE layout; positions are [L] (every row alike) or [B, L]."""
    half = x_BxLxHxE.shape[-1] // 2
    if inv_freq_half is None:
        inv_freq_half = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.multiply.outer(positions.astype(jnp.float32), inv_freq_half)  # positions' shape + [E/2]
    angle_BxLxE2 = angle if angle.ndim == 3 else angle[None]
    # Broadcast over heads; the rotation is done in float32 so bf16 keeps exact angles.
    cos_Bx1xLx1xE2 = jnp.cos(angle_BxLxE2)[:, :, None, :]
    sin_Bx1xLx1xE2 = jnp.sin(angle_BxLxE2)[:, :, None, :]
    x1, x2 = jnp.split(x_BxLxHxE.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos_Bx1xLx1xE2 - x2 * sin_Bx1xLx1xE2,
                           x2 * cos_Bx1xLx1xE2 + x1 * sin_Bx1xLx1xE2], axis=-1)
    return out.astype(x_BxLxHxE.dtype)


def _linear(d_in: int, d_out: int, std: float, dtype, rngs: nnx.Rngs, bias: bool = False) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=jnp.float32,
                      kernel_init=nnx.initializers.normal(std), rngs=rngs)


def _norm(cfg: ModelConfig, width: int, rngs: nnx.Rngs) -> nnx.Module:
    if cfg.norm == "layer":
        # Two-pass variance, as PyTorch's LayerNorm computes it.
        return nnx.LayerNorm(width, epsilon=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype),
                             param_dtype=jnp.float32, use_fast_variance=False, rngs=rngs)
    return nnx.RMSNorm(width, epsilon=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype),
                       param_dtype=jnp.float32, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = head_dim(cfg)
        self.rope_theta = cfg.rope_theta
        self.use_rope = cfg.positions == "rope"
        self.scaled_rope = cfg.rope_scaling != "none"
        self.cfg = cfg  # static: rope_inv_freq reads the scaling fields at trace time
        self.kernel = cfg.attention  # static: model.attention, resolved per call (diloco/model/attention.py)
        # Residual-branch outputs are scaled down so the residual stream's variance does not grow
        # with depth (GPT-2, Radford et al. 2019, section 2.3).
        out_std = INIT_STD / math.sqrt(2 * cfg.n_layers)
        E = self.head_dim
        self.wq = _linear(cfg.d_model, self.n_heads * E, INIT_STD, dtype, rngs, cfg.qkv_bias)
        self.wk = _linear(cfg.d_model, self.n_kv_heads * E, INIT_STD, dtype, rngs, cfg.qkv_bias)
        self.wv = _linear(cfg.d_model, self.n_kv_heads * E, INIT_STD, dtype, rngs, cfg.qkv_bias)
        self.wo = _linear(self.n_heads * E, cfg.d_model, out_std, dtype, rngs, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = _norm(cfg, E, rngs)
            self.k_norm = _norm(cfg, E, rngs)

    def __call__(self, x_BxLxD: jax.Array, positions: jax.Array, cache: Cache | None = None,
                 mask_BxLxS: jax.Array | None = None, causal: bool = True) -> tuple[jax.Array, Cache | None]:
        """positions: [L] or [B, L]. Position l sees s <= l (`causal`) where `mask_BxLxS` allows.
        With `cache` ({"k", "v"} of this layer, written at slot `cache["end"]`), the new keys join
        the cached ones and `mask_BxLxS` alone says who sees whom."""
        B, L, _ = x_BxLxD.shape
        E = self.head_dim
        q_BxLxHxE = self.wq(x_BxLxD).reshape(B, L, self.n_heads, E)
        k_BxLxKxE = self.wk(x_BxLxD).reshape(B, L, self.n_kv_heads, E)
        v_BxLxKxE = self.wv(x_BxLxD).reshape(B, L, self.n_kv_heads, E)
        if hasattr(self, "q_norm"):
            q_BxLxHxE, k_BxLxKxE = self.q_norm(q_BxLxHxE), self.k_norm(k_BxLxKxE)
        if self.use_rope:
            inv_freq = rope_inv_freq(self.cfg) if self.scaled_rope else None
            q_BxLxHxE = rotary(q_BxLxHxE, positions, self.rope_theta, inv_freq)
            k_BxLxKxE = rotary(k_BxLxKxE, positions, self.rope_theta, inv_freq)
        if cache is not None:
            start = (0, cache["end"], 0, 0)
            cache = {"k": jax.lax.dynamic_update_slice(cache["k"], k_BxLxKxE.astype(cache["k"].dtype), start),
                     "v": jax.lax.dynamic_update_slice(cache["v"], v_BxLxKxE.astype(cache["v"].dtype), start),
                     "end": cache["end"]}
            k_BxLxKxE, v_BxLxKxE = cache["k"], cache["v"]
        out_BxLxHxE = attend(self.kernel, q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, mask_BxLxS, causal,
                             decoding=cache is not None)
        return self.wo(out_BxLxHxE.reshape(B, L, self.n_heads * E)), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        out_std = INIT_STD / math.sqrt(2 * cfg.n_layers)
        self.gated = cfg.mlp == "swiglu"
        if self.gated:
            self.w_gate = _linear(cfg.d_model, cfg.d_ff, INIT_STD, dtype, rngs, cfg.mlp_bias)
        self.w_up = _linear(cfg.d_model, cfg.d_ff, INIT_STD, dtype, rngs, cfg.mlp_bias)
        self.w_down = _linear(cfg.d_ff, cfg.d_model, out_std, dtype, rngs, cfg.mlp_bias)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        if self.gated:
            h_BxLxF = jax.nn.silu(self.w_gate(x_BxLxD)) * self.w_up(x_BxLxD)
        else:
            # GPT-2's "gelu_new" is the tanh approximation.
            h_BxLxF = jax.nn.gelu(self.w_up(x_BxLxD), approximate=True)
        return self.w_down(h_BxLxF)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = _norm(cfg, cfg.d_model, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = _norm(cfg, cfg.d_model, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_BxLxD: jax.Array, positions: jax.Array, cache: Cache | None = None,
                 mask_BxLxS: jax.Array | None = None, causal: bool = True) -> tuple[jax.Array, Cache | None]:
        h_BxLxD, cache = self.attn(self.attn_norm(x_BxLxD), positions, cache, mask_BxLxS, causal)
        x_BxLxD = x_BxLxD + h_BxLxD
        return x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD)), cache


def project(h_NxD: jax.Array, table: jax.Array, tied: bool, dtype) -> jax.Array:
    """Logits [..., V] float32 of hidden states against the output head: the tied embedding
    [V, D] or lm_head's kernel [D, V], multiplied in the compute dtype and accumulated in float32.
    The one head of apply, packed, decode and the chunked loss (diloco/train/step.py)."""
    h_NxD, table = h_NxD.astype(dtype), table.astype(dtype)
    return jnp.dot(h_NxD, table.T if tied else table, preferred_element_type=jnp.float32)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.max_seq_len = cfg.max_seq_len
        self.n_layers = cfg.n_layers
        self.remat = cfg.remat  # static: model.remat, the policy of each block under jax.grad
        self.embed = nnx.Embed(vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                               embedding_init=nnx.initializers.normal(INIT_STD), rngs=rngs)
        # String keys "0", "1", ... make the params a plain dict of str keys with no conversion at
        # the split boundary (nnx.List would give integer keys).
        self.blocks = nnx.Dict({str(i): Block(cfg, rngs) for i in range(cfg.n_layers)})
        self.final_norm = _norm(cfg, cfg.d_model, rngs)
        self.lm_head = None if cfg.tie_embeddings else _linear(cfg.d_model, vocab_size, INIT_STD, dtype, rngs)
        if cfg.positions == "learned":
            self.pos_embed = nnx.Embed(cfg.max_seq_len, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                                       embedding_init=nnx.initializers.normal(INIT_STD / 2), rngs=rngs)

    def _hidden(self, tokens_BxL: jax.Array, positions: jax.Array, cache: Cache | None = None,
                mask_BxLxS: jax.Array | None = None, causal: bool = True) -> tuple[jax.Array, dict]:
        """Final-norm hidden states [B, L, D] in the compute dtype, and with `cache` its new layers."""
        x_BxLxD = self.embed(tokens_BxL)
        if hasattr(self, "pos_embed"):
            x_BxLxD = x_BxLxD + jnp.broadcast_to(self.pos_embed(positions), x_BxLxD.shape)  # positions [L] or [B, L]

        def block_out(block: Block, x_BxLxD, positions, mask_BxLxS):
            return block(x_BxLxD, positions, None, mask_BxLxS, causal)[0]

        if cache is None and REMAT_POLICIES[self.remat] is not None:
            block_out = nnx.remat(block_out, policy=REMAT_POLICIES[self.remat])
        layers = {}
        for i in range(self.n_layers):
            if cache is None:
                x_BxLxD = block_out(self.blocks[str(i)], x_BxLxD, positions, mask_BxLxS)
                continue
            layer = {**cache["layers"][str(i)], "end": cache["end"]}
            x_BxLxD, layer = self.blocks[str(i)](x_BxLxD, positions, layer, mask_BxLxS, causal)
            layers[str(i)] = {"k": layer["k"], "v": layer["v"]}
        return self.final_norm(x_BxLxD), layers

    def head(self):
        """h_NxD -> logits_NxV float32 over this model's output head (`project`), closed over the
        head's weight array only, so it can run inside jax.lax.map and jax.checkpoint."""
        tied = self.lm_head is None
        table = self.embed.embedding[...] if tied else self.lm_head.kernel[...]
        dtype = self.embed.dtype
        return lambda h_NxD: project(h_NxD, table, tied, dtype)

    def features(self, tokens_BxL: jax.Array, segments_BxL: jax.Array | None = None,
                 positions_BxL: jax.Array | None = None):
        """(hidden states [B, L, D] before the head, the head `h -> logits`): what a loss that
        never holds all B x L x V logits at once needs (diloco/train/step.py).

        With `segments_BxL` the rows pack several examples (diloco/data/sft.py): position l
        attends to s <= l of its own segment only (segment 0 is padding, seen by no one), and
        each example's positions (positions_BxL) restart at 0, so every example's logits are those
        it would have alone."""
        L = tokens_BxL.shape[1]
        if L > self.max_seq_len:
            raise ValueError(f"sequence length {L} exceeds model.max_seq_len={self.max_seq_len}")
        if segments_BxL is None:
            return self._hidden(tokens_BxL, jnp.arange(L))[0], self.head()
        same_BxLxL = (segments_BxL[:, :, None] == segments_BxL[:, None, :]) & (segments_BxL[:, None, :] > 0)
        return self._hidden(tokens_BxL, positions_BxL, None, same_BxLxL)[0], self.head()

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        h_BxLxD, head = self.features(tokens_BxL)
        return head(h_BxLxD)

    def packed(self, tokens_BxL: jax.Array, segments_BxL: jax.Array, positions_BxL: jax.Array) -> jax.Array:
        """Logits of rows packing several examples (`features` says how they attend)."""
        h_BxLxD, head = self.features(tokens_BxL, segments_BxL, positions_BxL)
        return head(h_BxLxD)

    def decode(self, tokens_BxL: jax.Array, mask_BxL: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        """Logits of L new tokens per row given everything in `cache`, and the cache with them.

        mask_BxL marks real tokens; a left-padded prompt's pads take no slot anyone attends to and
        no position, so each row's positions count its own real tokens from 0.
        """
        L = tokens_BxL.shape[1]
        S = cache["valid_BxS"].shape[1]
        mask_BxL = mask_BxL.astype(bool)
        end = cache["end"]
        positions_BxL = jnp.maximum(cache["pos_B"][:, None] + jnp.cumsum(mask_BxL, axis=1) - 1, 0)
        valid_BxS = jax.lax.dynamic_update_slice(cache["valid_BxS"], mask_BxL, (0, end))
        slot_L = end + jnp.arange(L)
        allowed_BxLxS = (jnp.arange(S)[None, None, :] <= slot_L[None, :, None]) & valid_BxS[:, None, :]
        h_BxLxD, layers = self._hidden(tokens_BxL, positions_BxL, cache, allowed_BxLxS, causal=False)
        new = {"layers": layers, "valid_BxS": valid_BxS,
               "pos_B": cache["pos_B"] + jnp.sum(mask_BxL, axis=1, dtype=jnp.int32), "end": end + L}
        return self.head()(h_BxLxD), new
