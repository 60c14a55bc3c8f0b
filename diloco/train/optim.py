"""The inner optimizer: AdamW (or SGD, or Muon) with warmup + cosine decay and global-norm clipping.

DiLoCo (arXiv 2311.08105, section 3) keeps an AdamW inner optimizer per learner; the schedule runs
over the whole run, never reset by merges. MuLoCo (arXiv 2505.23725) swaps in Muon for the hidden
matrices (docs/algorithm.md#muon-inner-optimizer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon
from optax.transforms import MaskedNode

from diloco.config import InnerConfig
from diloco.model import is_embedding


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


def muon_labels(params):
    """'muon' for the hidden matrices, 'adam' for the rest: embeddings and an untied head (their
    rows are looked up, not multiplied as a whole; MuLoCo and Muon's authors keep them on AdamW)
    and every vector (norm scales, biases)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: "muon" if p.ndim == 2 and not is_embedding(path) else "adam", params)


def _muon(cfg: InnerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """Muon for the matrices optax.partition hands it (the others arrive as MaskedNode):
    orthogonalised Nesterov momentum, scaled to an RMS of cfg.muon_rms per matrix
    (0.2 * sqrt(max(fan_in, fan_out)), arXiv 2502.16982) so AdamW's lr and decoupled weight decay
    carry over, then decayed and scaled by the schedule as AdamW is."""
    dims = lambda tree: jax.tree.map(lambda x: x if isinstance(x, MaskedNode) else MuonDimensionNumbers(),
                                     tree, is_leaf=lambda x: isinstance(x, MaskedNode))
    rms = optax.stateless(lambda u, _: jax.tree.map(
        lambda x: x * (cfg.muon_rms * jnp.sqrt(float(max(x.shape)))), u))
    return optax.chain(
        scale_by_muon(ns_steps=cfg.muon_ns_steps, beta=cfg.muon_beta, eps=cfg.eps, weight_dimension_numbers=dims),
        rms, optax.add_decayed_weights(cfg.weight_decay), optax.scale_by_learning_rate(schedule))


def make_optimizer(cfg: InnerConfig, total_steps: int) -> optax.GradientTransformation:
    schedule = lr_schedule(cfg, total_steps)
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=_decay_mask)
    if cfg.optimizer == "sgd":
        core = optax.sgd(schedule)
    elif cfg.optimizer == "muon":
        core = optax.partition({"muon": _muon(cfg, schedule), "adam": adamw}, muon_labels)
    else:
        core = adamw
    if cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), core)
    return core
