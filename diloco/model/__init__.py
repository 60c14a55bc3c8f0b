"""The one boundary where the NNX model becomes a pure `apply(params, tokens)` over a plain dict.

Reference: Flax NNX functional API (nnx.split / nnx.merge),
https://flax.readthedocs.io/en/latest/nnx_basics.html#the-flax-functional-api
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
from flax import nnx

from diloco.config.checks import model_errors
from diloco.config import ConfigError, ModelConfig
from diloco.model.transformer import Transformer

Params = dict[str, Any]  # nested dicts with str keys; leaves are float32 jax arrays

# Top-level params entries holding a vocabulary-sized matrix: merged by plain averaging downstream.
_EMBEDDING_KEYS = ("embed", "lm_head")


class Model(NamedTuple):
    apply: Callable[[Params, jax.Array], jax.Array]  # (params, tokens_BxL int32) -> logits_BxLxV f32
    params: Params
    # (params, tokens_BxL, mask_BxL, cache) -> (logits_BxLxV, cache): incremental decoding with a
    # KV cache (diloco/model/generate.py)
    decode: Callable | None = None
    # (params, tokens_BxL, segments_BxL, positions_BxL) -> logits_BxLxV: rows packing several
    # examples, attention kept inside each (fine-tuning, diloco/data/sft.py)
    packed: Callable | None = None
    # (params, tokens_BxL, segments_BxL | None, positions_BxL | None) -> (hidden_BxLxD, head): the
    # final-norm hidden states and the head h_NxD -> logits_NxV float32 that apply and packed end
    # with, for a loss that computes the logits a chunk at a time (diloco/train/step.py)
    features: Callable | None = None
    # Weights that never train (a LoRA model's checkpoint, diloco/model/lora.py), None when every
    # weight trains; thaw(frozen) is this model with its functions over the given frozen tree, so a
    # compiled step can take the frozen weights as an argument instead of embedding them as
    # constants (docs/design.md#lora).
    frozen: Params | None = None
    thaw: Callable[[Params], "Model"] | None = None


def _split(cfg: ModelConfig, vocab_size: int, seed: int) -> tuple[nnx.GraphDef, Params]:
    graphdef, state = nnx.split(Transformer(cfg, vocab_size, nnx.Rngs(seed)))
    return graphdef, nnx.to_pure_dict(state)


def _check(cfg: ModelConfig, vocab_size: int) -> None:
    errors = model_errors(cfg)
    if cfg.attention == "cudnn" and jax.default_backend() != "gpu":
        # Here, not in model_errors: whether a GPU is present is known only where jax runs.
        errors.append(f"model.attention=cudnn needs a GPU, but jax runs on {jax.default_backend()!r} here "
                      "(auto takes cuDNN wherever a GPU can run it, xla runs anywhere)")
    if vocab_size <= 0:
        errors.append(f"vocab_size={vocab_size} must be > 0")
    if errors:
        raise ConfigError("invalid model config:\n  " + "\n  ".join(errors))


def build(cfg: ModelConfig, vocab_size: int, seed: int) -> Model:
    """Initialise params for `cfg` with `seed` and return them with the pure apply function."""
    _check(cfg, vocab_size)
    # Initialised op by op rather than under jit: XLA compiles each random draw slowly on CPU, and
    # eager kernels are cached per shape, so later builds (other seeds, dtypes) reuse them.
    graphdef, params = _split(cfg, vocab_size, seed)
    return _model(graphdef, params)


def _model(graphdef: nnx.GraphDef, params: Params) -> Model:
    def apply(params: Params, tokens_BxL: jax.Array) -> jax.Array:
        # A fresh module per call: nothing is mutated, so apply is pure under jit, grad and sharding.
        return nnx.merge(graphdef, params)(tokens_BxL)

    def features(params: Params, tokens_BxL: jax.Array, segments_BxL: jax.Array | None = None,
                 positions_BxL: jax.Array | None = None):
        return nnx.merge(graphdef, params).features(tokens_BxL, segments_BxL, positions_BxL)

    def decode(params: Params, tokens_BxL: jax.Array, mask_BxL: jax.Array, cache: dict):
        return nnx.merge(graphdef, params).decode(tokens_BxL, mask_BxL, cache)

    def packed(params: Params, tokens_BxL: jax.Array, segments_BxL: jax.Array, positions_BxL: jax.Array):
        return nnx.merge(graphdef, params).packed(tokens_BxL, segments_BxL, positions_BxL)

    return Model(apply=apply, params=params, decode=decode, packed=packed, features=features)


def with_params(cfg: ModelConfig, vocab_size: int, params: Params) -> Model:
    """The model of `cfg` around given params (an imported checkpoint), nothing initialised.

    The params must have exactly the tree of `abstract_params(cfg, vocab_size)`.
    """
    _check(cfg, vocab_size)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, vocab_size, nnx.Rngs(0))))
    return _model(graphdef, params)


def abstract_params(cfg: ModelConfig, vocab_size: int) -> Params:
    """Shapes and dtypes of `build(cfg, vocab_size, seed).params`, without allocating them."""
    _check(cfg, vocab_size)
    return jax.eval_shape(lambda: _split(cfg, vocab_size, 0)[1])


def count_params(params: Params) -> int:
    """Number of scalars in a params pytree (arrays or ShapeDtypeStructs)."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(params))


def is_embedding(path: tuple[Any, ...]) -> bool:
    """True for the token embedding and an untied lm_head.

    `path` holds str keys, or the DictKey entries of jax.tree_util.tree_flatten_with_path.
    """
    names = tuple(getattr(k, "key", k) for k in path)
    return len(names) > 0 and names[0] in _EMBEDDING_KEYS
