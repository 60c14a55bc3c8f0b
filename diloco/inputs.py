"""What a run starts from: its config with an imported checkpoint's shape filled in, the data, and
the model, built the same way by every process of a run (docs/design.md#fine-tuning).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

from diloco.config import ConfigError, TrainConfig, start_errors
from diloco.data import Corpus, load_corpus
from diloco.model import Model, abstract_params, build, lora, with_params


class Inputs(NamedTuple):
    cfg: TrainConfig  # model: the checkpoint's shape when model.init_from is set
    corpus: Corpus
    model: Model  # with finetune.lora.rank > 0: params are the adapters, the checkpoint's frozen
    pretrained: Any  # diloco.hf.Pretrained of model.init_from (its model the full one), or None


def load_checkpoint(cfg: TrainConfig, weights: bool = True):
    """(cfg with model.init_from's shape, its Pretrained), or (cfg, None) for a random init.
    The weights are read to host memory (numpy, hf.HOST), never through a device: whoever trains
    places them straight into its own shardings; `weights=False` reads none (hf.load).
    ConfigError, naming the value, for a path that is missing or not a checkpoint this code reads,
    for data.source=sft without one, or for a data.seq_len beyond the checkpoint's context."""
    errors = start_errors(cfg)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    path = cfg.model.init_from
    if not path:
        return cfg, None
    from diloco import hf

    try:
        # The run's model.dtype stays a choice of the run: it is the compute dtype, not the weights'.
        pre = hf.load(hf.resolve(path), shardings=hf.HOST, dtype=cfg.model.dtype, weights=weights)
    except (hf.CheckpointError, OSError) as e:
        raise ConfigError(f"model.init_from={path!r} cannot be read as a checkpoint: {e}") from None
    # So are how the inner step computes: attention kernel, remat, loss chunk (docs/models.md).
    knobs = {k: getattr(cfg.model, k) for k in ("attention", "remat", "loss_chunk")}
    if any(getattr(pre.config, k) != v for k, v in knobs.items()):
        own = dataclasses.replace(pre.config, **knobs)
        pre = pre._replace(config=own, model=with_params(own, pre.vocab_size, pre.model.params))
    model = dataclasses.replace(pre.config, init_from=path)
    if pre.tokenizer is None:
        raise ConfigError(f"model.init_from={path!r} has no tokenizer (tokenizer.json), so no text can be "
                          "encoded for it")
    if cfg.data.source == "sft" and pre.tokenizer.chat_template is None:
        raise ConfigError(f"model.init_from={path!r} has no chat template (tokenizer_config.json or "
                          "chat_template.jinja), which data.source=sft renders conversations with")
    if cfg.data.seq_len > model.max_seq_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the max_seq_len={model.max_seq_len} of "
                          f"model.init_from={path!r}")
    return dataclasses.replace(cfg, model=model), pre


def load_inputs(cfg: TrainConfig, weights: bool = True) -> Inputs:
    """The resolved config, the corpus (encoded with the checkpoint's tokenizer when there is one)
    and the model: the checkpoint's weights, or a random init from run.seed; with
    finetune.lora.rank > 0 the checkpoint frozen and LoRA adapters as the params that train.
    `weights=False`: the model's params are shapes only (a procs child reads Theta_0 from the
    store, diloco/runtime/procs/theta0.py); the frozen checkpoint of a LoRA run is still read."""
    weights = weights or cfg.finetune.lora.rank > 0
    cfg, pre = load_checkpoint(cfg, weights)
    corpus = load_corpus(cfg.data, None if pre is None else pre.tokenizer, cfg.run.seed)
    if hasattr(corpus.train, "in_world"):  # data=grain: every learner's shard holds records for its processes
        diloco = cfg.algo == "diloco"
        processes = cfg.runtime.world.processes_per_learner if diloco else 1
        corpus.train.check_learners(cfg.runtime.learners if diloco else 1, processes)
        # read as the learners' worlds read it: each process its own part (docs/data.md#sharding)
        corpus = dataclasses.replace(corpus, train=corpus.train.in_world(processes))
    if pre is not None:
        model = pre.model
    elif weights:
        model = build(cfg.model, corpus.vocab_size, cfg.run.seed)
    else:
        model = with_params(cfg.model, corpus.vocab_size, abstract_params(cfg.model, corpus.vocab_size))
    if cfg.finetune.lora.rank > 0:  # start_errors: only with model.init_from
        model = lora.adapt(cfg.finetune.lora, model)
    return Inputs(cfg, corpus, model, pre)


def full_params(inputs: Inputs, params: dict) -> dict:
    """The full model's params of a run's trained `params` (the adapters merged into the checkpoint
    under LoRA), in the tree of `abstract_params(cfg.model, vocab)`."""
    lo = inputs.cfg.finetune.lora
    if lo.rank == 0:
        return params
    # On the host: trained params may be sharded over a mesh the checkpoint's arrays are not on.
    return lora.merge(lo, inputs.pretrained.model.params, jax.device_get(params))
