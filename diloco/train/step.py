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


def make_train_step(apply: Apply, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule | None = None):
    """(state, batch) -> (state, metrics). Pure; the caller jits it with shardings and donation."""

    def train_step(state: TrainState, batch_BxL1: jax.Array):
        loss, grads = jax.value_and_grad(lambda p: next_token_loss(apply, p, batch_BxL1))(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.global_norm(grads)}
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(apply: Apply):
    """(params, batch) -> mean next-token loss."""

    def eval_step(params: dict, batch_BxL1: jax.Array) -> jax.Array:
        return next_token_loss(apply, params, batch_BxL1)

    return eval_step
