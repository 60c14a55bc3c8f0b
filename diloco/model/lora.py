"""LoRA with a frozen random A (FFA-LoRA): a `Model` whose params are the trained Bs only, the
checkpoint's weights and the As closed over (docs/design.md#lora).

Reference: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models" (2021),
arXiv:2106.09685; Sun et al., "Improving LoRA in Privacy-preserving Federated Learning" (ICLR
2024), arXiv:2403.12313, which freezes A so that averaging the Bs averages the updates A B.

Layout: nnx.Linear computes x @ W with W [d_in, d_out], so a target's weight is
W + (alpha / rank) A B with A [d_in, rank] (frozen) and B [rank, d_out] (trained, initially 0).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from diloco.config import ConfigError, LoraConfig
from diloco.config.checks import LORA_TARGETS
from diloco.model import Model, Params

Path = tuple[str, ...]  # a projection's params path, ("blocks", "0", "attn", "wq")


def target_paths(cfg: LoraConfig, base: Params) -> tuple[Path, ...]:
    """Every adapted projection, block by block in the order of LORA_TARGETS (the order keys A)."""
    blocks = base["blocks"]
    names = [n for n in LORA_TARGETS if n in cfg.targets]
    absent = [n for n in names if LORA_TARGETS[n][1] not in blocks["0"][LORA_TARGETS[n][0]]]
    if absent:
        have = [n for n in LORA_TARGETS if LORA_TARGETS[n][1] in blocks["0"][LORA_TARGETS[n][0]]]
        raise ConfigError(f"finetune.lora.targets={list(cfg.targets)}: this model has no {absent} projection "
                          f"(it has {'|'.join(have)})")
    return tuple(("blocks", i) + LORA_TARGETS[n] for i in sorted(blocks, key=int) for n in names)


def _at(tree: Params, path: Path):
    for k in path:
        tree = tree[k]
    return tree


def frozen_a(cfg: LoraConfig, base: Params) -> dict[Path, jax.Array]:
    """A of each target, [d_in, rank] float32, a pure function of (finetune.lora, the shapes).

    Entries are N(0, 1 / d_in): A's columns are then nearly orthonormal (A^T A = I + O(1/sqrt(d_in))),
    so A B has about the norm of B and x A the scale of x, and alpha / rank alone sets the update's size.
    """
    key = jax.random.key(cfg.seed)
    out = {}
    for n, path in enumerate(target_paths(cfg, base)):
        d_in = _at(base, path)["kernel"].shape[0]
        out[path] = jax.random.normal(jax.random.fold_in(key, n), (d_in, cfg.rank), jnp.float32) / math.sqrt(d_in)
    return out


def init_adapters(cfg: LoraConfig, base: Params) -> Params:
    """The trained params: {"blocks": {i: {group: {projection: {"lora_b": [rank, d_out] zeros}}}}}.
    B = 0, so training starts from the checkpoint's function exactly."""
    tree: Params = {}
    for path in target_paths(cfg, base):
        node = tree
        for k in path:
            node = node.setdefault(k, {})
        node["lora_b"] = jnp.zeros((cfg.rank, _at(base, path)["kernel"].shape[1]), jnp.float32)
    return tree


def merge(cfg: LoraConfig, base: Params, adapters: Params, a: dict[Path, jax.Array] | None = None) -> Params:
    """The full model's params: each target's kernel W + (alpha / rank) A B, everything else as in
    `base`. What a LoRA model computes with, and what its export writes."""
    a = frozen_a(cfg, base) if a is None else a
    scale = cfg.alpha / cfg.rank

    def leaf(path, w):
        names = tuple(k.key for k in path)
        if names[-1] != "kernel" or names[:-1] not in a:
            return w
        b = _at(adapters, names[:-1])["lora_b"]
        # HIGHEST: accelerators would otherwise multiply float32 in reduced precision (TF32, bf16 passes).
        return w + scale * jnp.matmul(a[names[:-1]], b, precision=jax.lax.Precision.HIGHEST)

    return jax.tree_util.tree_map_with_path(leaf, base)


def adapt(cfg: LoraConfig, base: Model) -> Model:
    """`base` with its weights frozen: params are the adapters, and apply, packed, features and
    decode run the base model on the merged weights, so no optimizer state, fragment, merge or
    wire byte is ever spent on the frozen weights. They are the returned model's `frozen`, and
    `thaw` rebuilds its functions over a frozen tree given as an argument: the compiled steps
    (train/trainer.py) take them that way, one copy on a mesh for every step compiled on it, where
    a closure would embed them as constants in each compiled program."""
    if cfg.rank <= 0:
        raise ValueError(f"finetune.lora.rank={cfg.rank}: adapt needs rank > 0 (0 is a full fine-tune)")
    a = frozen_a(cfg, base.params)

    def over(frozen: Params) -> Model:
        def full(adapters: Params) -> Params:
            return merge(cfg, frozen, adapters, a)

        def apply(adapters, tokens_BxL):
            return base.apply(full(adapters), tokens_BxL)

        def decode(adapters, tokens_BxL, mask_BxL, cache):
            return base.decode(full(adapters), tokens_BxL, mask_BxL, cache)

        def packed(adapters, tokens_BxL, segments_BxL, positions_BxL):
            return base.packed(full(adapters), tokens_BxL, segments_BxL, positions_BxL)

        def features(adapters, tokens_BxL, segments_BxL=None, positions_BxL=None):
            return base.features(full(adapters), tokens_BxL, segments_BxL, positions_BxL)

        return Model(apply=apply, params=init_adapters(cfg, frozen),
                     decode=None if base.decode is None else decode,
                     packed=None if base.packed is None else packed,
                     features=None if base.features is None else features, frozen=frozen, thaw=over)

    return over(base.params)
