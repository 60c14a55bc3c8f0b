"""Autoregressive generation with a KV cache: one prefill over the prompts, then one position a step.

Reference: nucleus sampling from Holtzman et al., "The Curious Case of Neural Text Degeneration"
(2019), arXiv:1904.09751; the cache layout is described in docs/models.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from diloco.config import ModelConfig
from diloco.model import Model, Params
from diloco.model.transformer import Cache, head_dim


class Sampling(NamedTuple):
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no cut-off
    top_p: float = 1.0  # 1: no nucleus cut-off


class Generated(NamedTuple):
    tokens: list[list[int]]  # per prompt, the new tokens up to and without the stop token
    stopped: list[bool]  # per prompt, whether a stop token ended it
    compile_s: float  # compiling the prefill and the step (once per prompt length and cache size)
    prefill_s: float
    decode_s: float  # the steps after the first new token
    decode_tokens: int  # tokens produced in decode_s, over all rows still running

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


def sampling_errors(s: Sampling) -> list[str]:
    errors = []
    if s.temperature < 0:
        errors.append(f"temperature={s.temperature} must be >= 0 (0: greedy)")
    if s.top_k < 0:
        errors.append(f"top_k={s.top_k} must be >= 0 (0: off)")
    if not 0 < s.top_p <= 1:
        errors.append(f"top_p={s.top_p} must be in (0, 1]")
    return errors


def init_cache(cfg: ModelConfig, batch: int, length: int) -> Cache:
    """An empty cache of `length` slots per row."""
    if length > cfg.max_seq_len:
        raise ValueError(f"prompt plus new tokens is {length} positions, more than model.max_seq_len="
                         f"{cfg.max_seq_len}")
    shape = (batch, length, cfg.n_kv_heads, head_dim(cfg))
    zeros = jnp.zeros(shape, jnp.dtype(cfg.dtype))
    return {"layers": {str(i): {"k": zeros, "v": zeros} for i in range(cfg.n_layers)},
            "valid_BxS": jnp.zeros((batch, length), bool), "pos_B": jnp.zeros((batch,), jnp.int32),
            "end": jnp.zeros((), jnp.int32)}


def sample(logits_BxV: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """Next token per row: argmax at temperature 0, else a draw after top-k and top-p cut-offs."""
    if s.temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits_BxV = logits_BxV / s.temperature
    if s.top_k:
        kth_Bx1 = jax.lax.top_k(logits_BxV, min(s.top_k, logits_BxV.shape[-1]))[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
    if s.top_p < 1:
        sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
        probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is
        # still short of top_p, so the most likely token always stays.
        before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
        n_keep_B = jnp.sum(before_BxV < s.top_p, axis=-1)
        cut_Bx1 = jnp.take_along_axis(sorted_BxV, (n_keep_B - 1)[:, None], axis=-1)
        logits_BxV = jnp.where(logits_BxV < cut_Bx1, -jnp.inf, logits_BxV)
    return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)


def left_pad(prompts: Sequence[Sequence[int]], pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Prompts of different lengths as one [B, P] batch, right-aligned so every row's next token
    lands in the same cache slot, with the mask of real tokens."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    P = max(len(p) for p in prompts)
    tokens = np.full((len(prompts), P), pad, np.int32)
    mask = np.zeros((len(prompts), P), bool)
    for row, p in enumerate(prompts):
        tokens[row, P - len(p):] = p
        mask[row, P - len(p):] = True
    return tokens, mask


def generate(model: Model, cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: Sampling = Sampling(), stop_ids: Sequence[int] = (), seed: int = 0,
             params: Params | None = None, on_step: Callable[[np.ndarray], None] | None = None) -> Generated:
    """Continue each prompt by up to max_new_tokens, a row ending at its first stop token.

    on_step(tokens_B) sees each step's new tokens (for streaming output).
    """
    errors = sampling_errors(sampling) + ([] if max_new_tokens > 0 else
                                          [f"max_new_tokens={max_new_tokens} must be > 0"])
    if errors:
        raise ValueError("; ".join(errors))
    params = model.params if params is None else params
    tokens_BxP, mask_BxP = left_pad(prompts)
    B = len(prompts)
    cache = init_cache(cfg, B, tokens_BxP.shape[1] + max_new_tokens)
    stop_set = set(stop_ids)
    stop = np.asarray(sorted(stop_set) or [-1])

    def prefill(params, tokens_BxP, mask_BxP, cache, key):
        logits_BxPxV, cache = model.decode(params, tokens_BxP, mask_BxP, cache)
        return sample(logits_BxPxV[:, -1], key, sampling), cache

    def step(params, tokens_B, cache, key):
        logits_Bx1xV, cache = model.decode(params, tokens_B[:, None], jnp.ones((B, 1), bool), cache)
        return sample(logits_Bx1xV[:, 0], key, sampling), cache

    keys = jax.random.split(jax.random.key(seed), max_new_tokens)
    t0 = time.perf_counter()
    prefill_c = jax.jit(prefill).lower(params, tokens_BxP, mask_BxP, cache, keys[0]).compile()
    step_c = jax.jit(step, donate_argnums=2).lower(
        params, jnp.zeros((B,), jnp.int32), cache, keys[0]).compile()
    t1 = time.perf_counter()
    next_B, cache = prefill_c(params, tokens_BxP, mask_BxP, cache, keys[0])
    out = [np.asarray(next_B)]
    t2 = time.perf_counter()
    done_B = np.isin(out[0], stop)
    decoded = 0
    if on_step:
        on_step(out[0])
    for i in range(1, max_new_tokens):
        if done_B.all():
            break
        decoded += int((~done_B).sum())
        next_B, cache = step_c(params, next_B, cache, keys[i])
        out.append(np.asarray(next_B))
        done_B |= np.isin(out[-1], stop)
        if on_step:
            on_step(out[-1])
    t3 = time.perf_counter()
    steps_BxT = np.stack(out, axis=1)
    rows, stopped = [], []
    for row in steps_BxT.tolist():
        hits = [j for j, t in enumerate(row) if t in stop_set]
        rows.append(row[:hits[0]] if hits else row)
        stopped.append(bool(hits))
    return Generated(rows, stopped, t1 - t0, t2 - t1, t3 - t2, decoded)
