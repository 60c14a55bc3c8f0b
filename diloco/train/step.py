"""Pure train and eval steps over a params pytree, built by factories and jitted by the caller."""

from __future__ import annotations

from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from diloco.model import Model


@flax.struct.dataclass
class TrainState:
    """Everything one trainer (or one learner) carries from step to step."""

    step: jax.Array  # int32 scalar: inner steps taken
    params: dict
    opt_state: optax.OptState


def init_state(params: dict, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def cross_entropy(head: Callable, h_BxLxD: jax.Array, targets_BxL: jax.Array, chunk: int = 0) -> jax.Array:
    """Per-token cross-entropy [B, L] float32 of `targets_BxL` under the logits head(h_BxLxD).

    With 0 < chunk < L the logits are computed for `chunk` positions of every row at a time
    (B x chunk x V float32, logsumexp per chunk) under jax.lax.map, and each chunk is recomputed
    in the backward pass (jax.checkpoint), so neither pass holds all B x L x V of them
    (docs/models.md#attention-remat-and-the-chunked-loss). The last chunk is padded.
    """
    B, L, D = h_BxLxD.shape
    if chunk <= 0 or chunk >= L:
        return optax.softmax_cross_entropy_with_integer_labels(head(h_BxLxD), targets_BxL)
    n = -(-L // chunk)
    pad = n * chunk - L
    # Chunks cut along the sequence keep the batch axis whole, so a batch-sharded h stays sharded.
    h_nxBxCxD = jnp.pad(h_BxLxD, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, D).transpose(1, 0, 2, 3)
    t_nxBxC = jnp.pad(targets_BxL, ((0, 0), (0, pad))).reshape(B, n, chunk).transpose(1, 0, 2)

    @jax.checkpoint
    def one(xs):
        h_BxCxD, t_BxC = xs
        return optax.softmax_cross_entropy_with_integer_labels(head(h_BxCxD), t_BxC)

    ce_nxBxC = jax.lax.map(one, (h_nxBxCxD, t_nxBxC))
    return ce_nxBxC.transpose(1, 0, 2).reshape(B, n * chunk)[:, :L]


def next_token_loss(model: Model, params: dict, batch_BxL1: jax.Array, chunk: int = 0) -> tuple[jax.Array, jax.Array]:
    """(mean cross-entropy (nats/token) of predicting batch[:, 1:] from batch[:, :-1], its count)."""
    h_BxLxD, head = model.features(params, batch_BxL1[:, :-1])
    ce_BxL = cross_entropy(head, h_BxLxD, batch_BxL1[:, 1:], chunk)
    return ce_BxL.mean(), jnp.asarray(ce_BxL.size, jnp.float32)


def masked_next_token_loss(model: Model, params: dict, batch: dict, chunk: int = 0) -> tuple[jax.Array, jax.Array]:
    """(mean cross-entropy over the trained targets only, their count) of a packed fine-tuning
    batch (diloco/data/sft.py): tokens, segments, positions [B, L + 1] and targets [B, L]."""
    tokens = batch["tokens"]
    h_BxLxD, head = model.features(params, tokens[:, :-1], batch["segments"][:, :-1], batch["positions"][:, :-1])
    ce_BxL = cross_entropy(head, h_BxLxD, tokens[:, 1:], chunk)
    weight_BxL = batch["targets"].astype(jnp.float32)
    count = weight_BxL.sum()
    return (ce_BxL * weight_BxL).sum() / jnp.maximum(count, 1.0), count


def make_loss(model: Model, sft: bool = False, chunk: int = 0) -> Callable:
    """(params, batch) -> (mean cross-entropy over the batch's trained tokens, their count). With
    `sft` a batch is packed fine-tuning rows and only the assistant's tokens count; without, a
    [B, L + 1] window array of which every next token does. `chunk`: model.loss_chunk."""
    if sft:
        return lambda params, batch: masked_next_token_loss(model, params, batch, chunk)
    return lambda params, batch: next_token_loss(model, params, batch, chunk)


def make_train_step(loss: Callable, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule | None = None):
    """(state, batch) -> (state, metrics) for a `loss` of make_loss. Pure; the caller jits it with
    shardings and donation."""

    def train_step(state: TrainState, batch):
        (value, _), grads = jax.value_and_grad(lambda p: loss(p, batch), has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": value, "grad_norm": optax.global_norm(grads)}
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(loss: Callable):
    """(params, batch) -> (mean loss over its trained tokens, their count), for a token-weighted
    mean over batches."""

    def eval_step(params: dict, batch):
        return loss(params, batch)

    return eval_step
