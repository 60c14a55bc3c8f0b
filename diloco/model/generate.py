"""Autoregressive generation with a KV cache: the prefill over the prompts and the whole decode loop
(a `lax.while_loop` over new tokens, sampling inside) are one compiled program, so a call costs one
dispatch, not one per token.

Reference: nucleus sampling from Holtzman et al., "The Curious Case of Neural Text Degeneration"
(2019), arXiv:1904.09751; the cache layout is described in docs/models.md.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from diloco.config import ModelConfig
from diloco.model import Model, Params
from diloco.model.transformer import Cache, head_dim


# Prompt lengths and new-token counts round up to a multiple of this (within model.max_seq_len), so
# calls of nearby sizes share one compiled prefill and loop; the extra slots are pads no one sees.
BUCKET = 32
NO_TOKEN = -1  # what a row's output holds after its stop token


class Sampling(NamedTuple):
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no cut-off
    top_p: float = 1.0  # 1: no nucleus cut-off


class Generated(NamedTuple):
    tokens: list[list[int]]  # per prompt, the new tokens up to and without the stop token
    stopped: list[bool]  # per prompt, whether a stop token ended it
    compile_s: float  # compiling the program (near 0 when these shapes were compiled)
    run_s: float  # the one dispatch: prompts in, every new token back on the host
    new_tokens: int  # tokens produced by rows still running (a row's stop token counts; pads after it do not)

    @property
    def tokens_per_s(self) -> float:
        """New tokens over the whole call, the prefill included (benchmarks/decode.py separates the two)."""
        return self.new_tokens / self.run_s if self.run_s > 0 else float("nan")


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


def left_pad(prompts: Sequence[Sequence[int]], pad: int = 0, width: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Prompts of different lengths as one [B, P] batch, right-aligned so every row's next token
    lands in the same cache slot, with the mask of real tokens. P is the longest prompt, or `width`
    if that is more."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    P = max(width, *(len(p) for p in prompts))
    tokens = np.full((len(prompts), P), pad, np.int32)
    mask = np.zeros((len(prompts), P), bool)
    for row, p in enumerate(prompts):
        tokens[row, P - len(p):] = p
        mask[row, P - len(p):] = True
    return tokens, mask


def buckets(prompt_len: int, new_tokens: int, max_seq_len: int) -> tuple[int, int]:
    """(prompt width, new-token slots): each rounded up to a multiple of BUCKET, both together
    within max_seq_len, and never below the sizes asked for."""
    if prompt_len + new_tokens > max_seq_len:
        raise ValueError(f"prompt plus new tokens is {prompt_len + new_tokens} positions, more than "
                         f"model.max_seq_len={max_seq_len}")
    up = lambda n: -(-n // BUCKET) * BUCKET  # noqa: E731
    slots = min(up(new_tokens), max_seq_len - prompt_len)
    return min(up(prompt_len), max_seq_len - slots), slots


def _prefill(params, tokens_BxP, mask_BxP, key, *, decode, cfg, sampling, length):
    """The first new token per row, and the cache of `length` slots holding the prompts."""
    cache = init_cache(cfg, tokens_BxP.shape[0], length)
    logits_BxPxV, cache = decode(params, tokens_BxP, mask_BxP, cache)
    return sample(logits_BxPxV[:, -1], key, sampling), cache


@functools.partial(jax.jit, static_argnames=("decode", "sampling", "on_step"), donate_argnames="cache")
def _decode_loop(params, first_B, cache, keys_T, stop_S, n_new, *, decode, sampling, on_step):
    """Tokens 1 .. n_new - 1 after `first_B` in one program: out_BxT (NO_TOKEN after a row's stop
    token and past the last step), the steps taken, the tokens produced by rows still running, and
    the cache (returned so the donated one is updated in place rather than copied into the loop).

    keys_T[i] draws token i, as a host loop over jax.random.split(key, T) would. A row that has
    stopped keeps being fed its own samples, as every row is computed alike; only its output is
    masked. The loop ends when every row has stopped or n_new tokens are out."""
    B, T = first_B.shape[0], keys_T.shape[0]
    ones_Bx1 = jnp.ones((B, 1), bool)

    def running(carry):
        i, _, done_B, *_ = carry
        return (i < n_new) & ~jnp.all(done_B)

    def step(carry):
        i, tokens_B, done_B, cache, out_BxT, decoded = carry
        logits_Bx1xV, cache = decode(params, tokens_B[:, None], ones_Bx1, cache)
        tokens_B = sample(logits_Bx1xV[:, 0], keys_T[i], sampling)
        _stream(on_step, tokens_B)
        out_BxT = jax.lax.dynamic_update_slice(out_BxT, jnp.where(done_B, NO_TOKEN, tokens_B)[:, None], (0, i))
        decoded = decoded + jnp.sum(~done_B, dtype=jnp.int32)
        return i + 1, tokens_B, done_B | jnp.isin(tokens_B, stop_S), cache, out_BxT, decoded

    out_BxT = jnp.full((B, T), NO_TOKEN, jnp.int32).at[:, 0].set(first_B)
    carry = (jnp.int32(1), first_B, jnp.isin(first_B, stop_S), cache, out_BxT, jnp.int32(0))
    steps, _, _, cache, out_BxT, decoded = jax.lax.while_loop(running, step, carry)
    return out_BxT, steps, decoded, cache


def _stream(on_step, tokens_B):
    if on_step is not None:  # streaming: one host callback a token, in order
        io_callback(lambda t: on_step(np.asarray(t)), None, tokens_B, ordered=True)


@functools.partial(jax.jit, static_argnames=("decode", "cfg", "sampling", "length", "on_step"))
def _generate(params, tokens_BxP, mask_BxP, seed, stop_S, n_new, *, decode, cfg, sampling, length, on_step):
    """The prefill and the decode loop as one program: out_BxT, the steps taken, and the tokens
    produced by running rows after the first (see _decode_loop). Token i is drawn with key i of
    jax.random.split(key(seed), slots)."""
    keys_T = jax.random.split(jax.random.key(seed), length - tokens_BxP.shape[1])
    first_B, cache = _prefill(params, tokens_BxP, mask_BxP, keys_T[0], decode=decode, cfg=cfg,
                              sampling=sampling, length=length)
    _stream(on_step, first_B)
    return _decode_loop(params, first_B, cache, keys_T, stop_S, n_new, decode=decode, sampling=sampling,
                        on_step=on_step)[:3]


def generate(model: Model, cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: Sampling = Sampling(), stop_ids: Sequence[int] = (), seed: int = 0,
             params: Params | None = None, on_step: Callable[[np.ndarray], None] | None = None) -> Generated:
    """Continue each prompt by up to max_new_tokens, a row ending at its first stop token.

    on_step(tokens_B) sees each step's new tokens (for streaming output); it runs as a host
    callback inside the loop, so it costs a device-to-host round trip a token.
    """
    errors = sampling_errors(sampling) + ([] if max_new_tokens > 0 else
                                          [f"max_new_tokens={max_new_tokens} must be > 0"])
    if errors:
        raise ValueError("; ".join(errors))
    params = model.params if params is None else params
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width, slots = buckets(max(map(len, prompts)), max_new_tokens, cfg.max_seq_len)
    tokens_BxP, mask_BxP = left_pad(prompts, width=width)
    stop_set = set(stop_ids)
    stop_S = np.asarray(sorted(stop_set) or [NO_TOKEN], np.int32)

    args = (params, tokens_BxP, mask_BxP, np.uint32(seed), stop_S, np.int32(max_new_tokens))
    t0 = time.perf_counter()
    program = _generate.lower(*args, decode=model.decode, cfg=cfg, sampling=sampling, length=width + slots,
                              on_step=on_step).compile()
    t1 = time.perf_counter()
    out_BxT, steps, decoded = jax.device_get(program(*args))
    run_s = time.perf_counter() - t1
    steps_BxT = out_BxT[:, :steps]
    rows, stopped = [], []
    for row in steps_BxT.tolist():
        hits = [j for j, t in enumerate(row) if t in stop_set]
        rows.append(row[:hits[0]] if hits else row)
        stopped.append(bool(hits))
    return Generated(rows, stopped, t1 - t0, run_s, len(rows) + int(decoded))
