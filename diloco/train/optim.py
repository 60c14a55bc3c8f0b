"""The inner optimizer: AdamW (or SGD) with warmup + cosine decay and global-norm clipping.

DiLoCo (arXiv 2311.08105, section 3) keeps an AdamW inner optimizer per learner; the schedule runs
over the whole run, never reset by merges.
"""

from __future__ import annotations

import jax
import optax

from diloco.config import InnerConfig


def lr_schedule(cfg: InnerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at total_steps."""
    if cfg.schedule == "constant":
        # A linear schedule holds its end value after the transition: warmup, then constant.
        start = 0.0 if cfg.warmup_steps else cfg.lr
        return optax.linear_schedule(start, cfg.lr, max(cfg.warmup_steps, 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if cfg.warmup_steps else cfg.lr,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(total_steps, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def step_lr(cfg: InnerConfig, total_steps: int):
    """The learning rate a learner's `step`-th step (1-based, as its train records count) took: the
    schedule at the optimizer count before it, which is the learner's step count (a rejoin sets
    both). The metrics' lr series (docs/design.md#metrics-series)."""
    schedule = lr_schedule(cfg, total_steps)
    return lambda step: float(schedule(step - 1))


def _decay_mask(params):
    # Norm scales and other vectors are not decayed: decay on them only fights the normalisation.
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: InnerConfig, total_steps: int) -> optax.GradientTransformation:
    schedule = lr_schedule(cfg, total_steps)
    if cfg.optimizer == "sgd":
        core = optax.sgd(schedule)
    else:
        core = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay, mask=_decay_mask)
    if cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), core)
    return core
