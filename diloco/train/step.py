"""Pure train and eval steps over a params pytree, built by factories and jitted by the caller."""

from __future__ import annotations

from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

Apply = Callable[[dict, jax.Array], jax.Array]


@flax.struct.dataclass
class TrainState:
    """Everything one trainer (or one learner) carries from step to step."""

    step: jax.Array  # int32 scalar: inner steps taken
    params: dict
    opt_state: optax.OptState


def init_state(params: dict, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def next_token_loss(apply: Apply, params: dict, batch_BxL1: jax.Array) -> jax.Array:
    """Mean cross-entropy (nats/token) of predicting batch[:, 1:] from batch[:, :-1]."""
    inputs_BxL, targets_BxL = batch_BxL1[:, :-1], batch_BxL1[:, 1:]
    logits_BxLxV = apply(params, inputs_BxL).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, targets_BxL).mean()


def masked_next_token_loss(packed: Callable, params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
    """(mean cross-entropy over the trained targets only, their count) of a packed fine-tuning
    batch (diloco/data/sft.py): tokens, segments, positions [B, L + 1] and targets [B, L]."""
    tokens = batch["tokens"]
    logits_BxLxV = packed(params, tokens[:, :-1], batch["segments"][:, :-1], batch["positions"][:, :-1])
    ce_BxL = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV.astype(jnp.float32), tokens[:, 1:])
    weight_BxL = batch["targets"].astype(jnp.float32)
    count = weight_BxL.sum()
    return (ce_BxL * weight_BxL).sum() / jnp.maximum(count, 1.0), count


def make_loss(apply: Apply, packed: Callable | None = None) -> Callable:
    """(params, batch) -> (mean cross-entropy over the batch's trained tokens, their count). With
    `packed` (Model.packed) a batch is packed fine-tuning rows and only the assistant's tokens
    count; without, a [B, L + 1] window array of which every next token does."""
    if packed is not None:
        return lambda params, batch: masked_next_token_loss(packed, params, batch)
    return lambda params, batch: (next_token_loss(apply, params, batch),
                                  jnp.asarray(batch[:, 1:].size, jnp.float32))


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
