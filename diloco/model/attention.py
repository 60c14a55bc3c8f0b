"""Softmax attention through `jax.nn.dot_product_attention` (XLA, or cuDNN's fused kernel on a GPU),
with the explicit implementation it replaced kept as `model.attention=reference`
(docs/models.md#attention-kernels).

Reference: Vaswani et al., "Attention Is All You Need" (2017), arXiv:1706.03762; GQA from Ainslie
et al. (2023), arXiv:2305.13245; the fused kernel is FlashAttention's (Dao, 2023, arXiv:2307.08691).

Shape suffixes as in transformer.py: B batch, L query positions, S key positions, H query heads,
K key/value heads, G query heads per key/value head (H = K * G), E head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_MASKED = -1e30  # large negative rather than -inf, so fully masked rows cannot produce NaN


def reference_attention(q_BxLxHxE: jax.Array, k_BxSxKxE: jax.Array, v_BxSxKxE: jax.Array,
                        allowed_BxLxS: jax.Array | None = None) -> jax.Array:
    """Softmax attention where query head h reads key/value head h // G; position l sees s <= l,
    or exactly the key slots `allowed_BxLxS` marks. Builds the B x H x L x S float32 scores."""
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
    if allowed_BxLxS is None:
        # Query l sits at key position l + S - L, so with S == L this is the plain lower triangle.
        allowed = jnp.tril(jnp.ones((L, S), dtype=bool), k=S - L)
    else:
        allowed = allowed_BxLxS[:, None, None, :, :]
    scores_BxKxGxLxS = jnp.where(allowed, scores_BxKxGxLxS, _MASKED)
    probs_BxKxGxLxS = jax.nn.softmax(scores_BxKxGxLxS, axis=-1).astype(v_BxSxKxE.dtype)
    out_BxLxKxGxE = jnp.einsum("bkgls,bske->blkge", probs_BxKxGxLxS, v_BxSxKxE)
    return out_BxLxKxGxE.reshape(B, L, H, E)


def cudnn_fits(dtype, head_dim: int, length: int | None = None) -> bool:
    """Whether cuDNN's fused attention takes these inputs on every GPU jax supports: half-precision
    inputs, a head dim a multiple of 8 up to 128 (256 needs Hopper), and with a mask (a packed
    row's segments) an even length, since the mask reaches the kernel as a bias."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and head_dim % 8 == 0 and head_dim <= 128 and (length is None or length % 2 == 0))


def implementation(mode: str, dtype, head_dim: int, length: int, masked: bool, decoding: bool) -> str:
    """The kernel `mode` (model.attention) runs on these inputs: reference | xla | cudnn.

    auto takes cuDNN's fused kernel on a GPU where it fits and XLA's on other accelerators. On a
    CPU it takes the reference: XLA's kernel builds the same scores there in another order, so
    CPU runs (the tests' golden trajectories, make train) keep their numbers to the last bit.
    Decoding with a KV cache never takes cuDNN: a step's few queries against the cache, and the
    left-padded prompt's mask, which cuDNN would take as a dense bias, gain nothing from the
    fused kernel (docs/models.md#attention-kernels)."""
    if mode in ("reference", "xla"):
        return mode
    if mode == "cudnn":
        return "xla" if decoding else "cudnn"
    backend = jax.default_backend()
    if backend == "cpu":
        return "reference"
    masked_length = length if masked else None
    return "cudnn" if backend == "gpu" and not decoding and cudnn_fits(dtype, head_dim, masked_length) else "xla"


def attend(mode: str, q_BxLxHxE: jax.Array, k_BxSxKxE: jax.Array, v_BxSxKxE: jax.Array,
           mask_BxLxS: jax.Array | None = None, causal: bool = True, decoding: bool = False) -> jax.Array:
    """Attention of each query to the keys it may see: with `causal`, s <= l (S == L), and with
    `mask_BxLxS`, only where it is True (both: a packed row's segments, causal inside each).

    Every kernel scales by 1/sqrt(E) and takes the softmax in float32; a row that sees no key
    (padding) gets the mean of all values, never NaN."""
    L, S = q_BxLxHxE.shape[1], k_BxSxKxE.shape[1]
    if causal and L != S:
        raise ValueError(f"causal attention needs as many keys as queries, got L={L} S={S}")
    kernel = implementation(mode, q_BxLxHxE.dtype, q_BxLxHxE.shape[-1], L, mask_BxLxS is not None, decoding)
    if kernel == "reference":
        allowed = mask_BxLxS
        if causal and mask_BxLxS is not None:
            allowed = mask_BxLxS & jnp.tril(jnp.ones((L, S), dtype=bool))[None]
        return reference_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, allowed)
    mask_Bx1xLxS = None if mask_BxLxS is None else mask_BxLxS[:, None]
    return jax.nn.dot_product_attention(q_BxLxHxE, k_BxSxKxE, v_BxSxKxE, mask=mask_Bx1xLxS,
                                        is_causal=causal, implementation=kernel)
