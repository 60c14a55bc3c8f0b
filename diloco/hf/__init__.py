"""Pretrained checkpoints in and out: Hugging Face folders and GGUF files <-> our NNX decoder.

`resolve(name)` turns a checkpoint argument (smollm2, a run directory, a path) into a path;
`load(path)` gives a `Pretrained` (the pure model, its ModelConfig, vocabulary size and
tokenizer); `save(path, ...)` writes a folder that transformers loads. docs/models.md says which
families and formats are supported and how each tensor is mapped.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NamedTuple

import jax

from diloco.config import ModelConfig
from diloco.hf import safetensors_file
from diloco.hf.convert import HOST, check_fits, export_tensors, load_params
from diloco.hf.families import family_for_export, family_of_config
from diloco.hf.source import CheckpointError
from diloco.pretrained import resolve  # noqa: F401 (hf.resolve: the name rule, kept where config checks can read it)
from diloco.model import Model, Params, abstract_params, with_params

__all__ = ["HOST", "CheckpointError", "Pretrained", "load", "resolve", "save"]

GGUF_MAGIC = b"GGUF"


class Pretrained(NamedTuple):
    model: Model  # apply(params, tokens_BxL) -> logits_BxLxV, params, decode (KV cache)
    config: ModelConfig
    vocab_size: int
    tokenizer: Any  # diloco.hf.tokenizer.HFTokenizer, or None for a folder without tokenizer.json
    path: str


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable JSON ({err})") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load(path: str | Path, shardings: Any = None, dtype: str | None = None, weights: bool = True) -> Pretrained:
    """Import a checkpoint folder (config.json + safetensors) or a .gguf file.

    Weights become float32 master params, each placed with `shardings` as it is read (see
    diloco.hf.convert.load_params; HOST keeps them numpy); `dtype` overrides the compute dtype
    (float32 | bfloat16). `weights=False` checks every tensor's shape but reads none: the model's
    params are then ShapeDtypeStructs (a procs child, which takes Theta_0 from the store).
    """
    from diloco.hf.tokenizer import from_parts, load_tokenizer

    path = Path(path)
    if path.is_file():
        if not _is_gguf(path):
            raise CheckpointError(f"{path}: not a GGUF file (a checkpoint is a folder with config.json, "
                                  "or a .gguf file)")
        from diloco.hf.gguf_file import read_gguf

        ckpt = read_gguf(path)
        hf_config, source = ckpt.config, ckpt.tensors
        tokenizer = from_parts(ckpt.tokenizer, ckpt.tokenizer_config, ckpt.generation_config)
    elif path.is_dir():
        if not (path / "config.json").exists():
            raise CheckpointError(f"{path}: no config.json (not a Hugging Face checkpoint folder)")
        hf_config = _read_json(path / "config.json")
        source = safetensors_file.SafetensorsFolder(path)
        tokenizer = load_tokenizer(path)
    else:
        raise CheckpointError(f"{path}: no such file or folder")
    family = family_of_config(hf_config, str(path))
    cfg, vocab = family.from_hf(hf_config)
    if dtype is not None:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    if tokenizer is not None and tokenizer.vocab_size > vocab:
        # Embedding lookups clamp out-of-range ids silently, so this would generate garbage.
        raise CheckpointError(f"{path}: the tokenizer has {tokenizer.vocab_size} ids but the model's "
                              f"embedding only {vocab} rows")
    if weights:
        params = load_params(source, family, cfg, vocab, shardings)
    else:
        check_fits(source, family, cfg, vocab)
        params = abstract_params(cfg, vocab)
    return Pretrained(with_params(cfg, vocab, params), cfg, vocab, tokenizer, str(path))


def save(path: str | Path, config: ModelConfig, params: Params, tokenizer: Any = None,
         dtype: str = "float32", max_shard_bytes: int = 0) -> Path:
    """Export params as a Hugging Face folder (config.json, safetensors in `dtype`, generation
    config, tokenizer files) that transformers' AutoModelForCausalLM loads; returns the folder."""
    from diloco.hf.tokenizer import save_tokenizer

    folder = Path(path)
    family = family_for_export(config)
    vocab = int(jax.tree_util.tree_leaves(params["embed"])[0].shape[0])
    hf_config = {"architectures": [family.architecture], **family.to_hf(config, vocab),
                 "torch_dtype": dtype, "dtype": dtype}
    generation = {}
    if tokenizer is not None:
        hf_config.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                         pad_token_id=tokenizer.pad_id)
        generation = {"bos_token_id": tokenizer.bos_id,
                      "eos_token_id": list(tokenizer.stop_ids) if len(tokenizer.stop_ids) > 1 else tokenizer.eos_id,
                      "pad_token_id": tokenizer.pad_id}
    folder.mkdir(parents=True, exist_ok=True)
    # Stale shards of an earlier export would be listed by nobody but still confuse readers.
    for old in [*folder.glob("model*.safetensors"), folder / safetensors_file.INDEX]:
        old.unlink(missing_ok=True)
    safetensors_file.write(folder, export_tensors(family, config, params), dtype, max_shard_bytes)
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    (folder / "generation_config.json").write_text(
        json.dumps({k: v for k, v in generation.items() if v is not None}, indent=2) + "\n")
    if tokenizer is not None:
        save_tokenizer(tokenizer, folder)
    return folder
