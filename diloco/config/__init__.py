"""Typed, frozen run configuration: built once from a plain dict (Hydra's output) and validated.

Nothing below this package sees a Hydra DictConfig. `from_dict` (convert.py) rejects unknown keys
and wrong types, `validate` checks cross-field constraints (checks.py); both raise ConfigError
naming the offending values, so a bad launch fails before any data is read or any device is
touched. The schema (schema.py, with schema_runtime.py) imports nothing of the rest, so there is
no import cycle.
"""

from __future__ import annotations

from diloco.config.checks import (check, chaos_errors, data_errors, diloco_errors, finetune_errors,
                                  inner_errors, model_errors, run_errors, start_errors)
from diloco.config.convert import from_dict, to_dict
from diloco.config.schema import (AuthConfig, ChaosConfig, CodecConfig, ConfigError, DataConfig, FinetuneConfig,
                                  FragmentsConfig, InnerConfig, LoraConfig, MeshConfig, ModelConfig,
                                  OuterConfig, RayConfig, RunConfig, RuntimeConfig, StoreConfig, SyncerConfig,
                                  TrainConfig, WorldConfig)

__all__ = ["AuthConfig", "ChaosConfig", "CodecConfig", "ConfigError", "DataConfig", "FinetuneConfig",
           "FragmentsConfig", "InnerConfig", "LoraConfig", "MeshConfig", "ModelConfig", "OuterConfig", "RayConfig",
           "RunConfig", "RuntimeConfig", "StoreConfig", "SyncerConfig", "TrainConfig", "WorldConfig", "from_dict",
           "load", "start_errors", "to_dict", "validate"]


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check cross-field constraints that do not depend on the machine; return cfg unchanged."""
    errors = (model_errors(cfg.model) + data_errors(cfg.data) + inner_errors(cfg.inner, cfg.run.steps)
              + diloco_errors(cfg) + chaos_errors(cfg.chaos) + finetune_errors(cfg.finetune))
    r = cfg.run
    check(errors, r.steps > 0, f"run.steps={r.steps} must be > 0")
    for name in ("log_every", "eval_every", "checkpoint_every", "eval_batches", "keep_checkpoints"):
        check(errors, getattr(r, name) >= 0, f"run.{name}={getattr(r, name)} must be >= 0")
    errors += run_errors(r)
    # With model.init_from the checkpoint's max_seq_len decides, once it is read (diloco/inputs.py).
    check(errors, cfg.model.init_from != "" or cfg.data.seq_len <= cfg.model.max_seq_len,
           f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    return cfg


def load(raw: dict) -> TrainConfig:
    """Plain dict -> validated TrainConfig."""
    return validate(from_dict(TrainConfig, raw))
