"""What scripts/evaluate.py does: the loss of a trained or imported model, in nats per token and bits
per byte, on a run's own validation split or on any text files (docs/models.md#evaluating-a-model).

Bits per byte divide out the tokenizer, so a byte-level run and a BPE run (or two checkpoints with
different vocabularies) are compared on the same text: bits/byte = nats/token / ln 2 / (UTF-8
bytes per token of that text).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import yaml

from diloco.config import ConfigError, DataConfig, from_dict
from diloco.data import held_out, load_corpus, target_tokens
from diloco.data.corpus import val_bytes_per_token
from diloco.data.errors import DataError
from diloco.data.sources import files_text, resolve_paths
from diloco.hf import CheckpointError, Pretrained, load, resolve
from diloco.train.step import make_loss


@dataclass(frozen=True)
class EvaluateConfig:
    checkpoint: str = ""  # a run directory, a Hugging Face folder, a .gguf file, or "smollm2"
    paths: tuple[str, ...] = ()  # text files (.txt, .jsonl); () = the run's own validation split
    text_field: str = "text"  # the field of each .jsonl line holding its text
    seq_len: int = 0  # tokens of context per window; 0 = the run's data.seq_len, else min(model, 1024)
    batch_size: int = 8
    max_tokens: int = 0  # 0 = every token of the text files
    dtype: str = "float32"
    tasks: tuple[str, ...] = ()  # downstream task files (lm-eval .yaml, BIG-bench .json): scored instead of the loss
    num_fewshot: int = -1  # few-shot examples per prompt; -1 = each task's own num_fewshot
    limit: int = 0  # score the first `limit` test documents of each task; 0 = all
    output: str = ""  # a path to write the task results to as JSON; "" = none
    compare: tuple[str, ...] = ()  # score files (output= files, task_score.json): each against the first


def parse(raw: dict) -> EvaluateConfig:
    cfg = from_dict(EvaluateConfig, raw)
    errors = []
    if cfg.compare:  # a comparison of saved scores loads no model
        missing = [p for p in cfg.compare if not Path(p).is_file()]
        if missing or len(cfg.compare) < 2:
            raise ConfigError(f"invalid evaluate config:\n  compare={list(cfg.compare)} needs two or more existing "
                              f"score files{': not found: ' + ', '.join(missing) if missing else ''}")
        return cfg
    if not cfg.checkpoint:
        errors.append("checkpoint= is required: a run directory, a Hugging Face folder, a .gguf file or smollm2")
    for name in ("seq_len", "max_tokens"):
        if getattr(cfg, name) < 0:
            errors.append(f"{name}={getattr(cfg, name)} must be >= 0")
    if cfg.batch_size <= 0:
        errors.append(f"batch_size={cfg.batch_size} must be > 0")
    if cfg.num_fewshot < -1:
        errors.append(f"num_fewshot={cfg.num_fewshot} must be >= 0 (or -1: each task's own)")
    if cfg.limit < 0:
        errors.append(f"limit={cfg.limit} must be >= 0 (0: every document)")
    missing = [t for t in cfg.tasks if not Path(t).is_file()]
    if missing:
        errors.append(f"tasks: {', '.join(missing)} not found")
    if cfg.dtype not in ("float32", "bfloat16"):
        errors.append(f"dtype={cfg.dtype!r} not in float32|bfloat16")
    if errors:
        raise ConfigError("invalid evaluate config:\n  " + "\n  ".join(errors))
    return cfg


def bits_per_byte(nats_per_token: float, bytes_per_token: float) -> float:
    return nats_per_token / math.log(2) / bytes_per_token


def windows(tokens: np.ndarray, seq_len: int, batch_size: int) -> list[np.ndarray]:
    """Batches of [B, seq_len + 1] windows overlapping by one token, so every token up to the last
    whole window is predicted exactly once, the first excepted; the last batch may be smaller."""
    starts = range(0, max(len(tokens) - 1, 0), seq_len)
    rows = [tokens[s:s + seq_len + 1] for s in starts if len(tokens[s:s + seq_len + 1]) == seq_len + 1]
    return [np.stack(rows[i:i + batch_size]) for i in range(0, len(rows), batch_size)]


def mean_loss(pre: Pretrained, batches: list) -> float:
    """Token-weighted mean next-token loss over `batches` (nats/token): of windows, every next
    token; of packed fine-tuning rows (dicts), the assistant's tokens only, as training counts
    them (make_loss, the trainer's own rule)."""
    sft = bool(batches) and isinstance(batches[0], dict)
    loss = jax.jit(make_loss(pre.model, sft, pre.config.loss_chunk))
    total = count = 0.0
    for b in batches:
        value, n = loss(pre.model.params, b)
        total += float(value) * float(n)
        count += float(n)
    return total / max(count, 1.0)


def _run_dir(checkpoint: str) -> Path | None:
    path = Path(checkpoint)
    return path if path.is_dir() and (path / "config.yaml").exists() else None


def run(cfg: EvaluateConfig, out=sys.stdout) -> dict:
    """Evaluate; print and return {"tokens", "nats_per_token", "bits_per_byte", ...}, or with
    tasks= the downstream scores {"tasks": [...]} (diloco/evaluation/harness.py)."""
    if cfg.compare:
        from diloco.evaluation.paired import compare
        return {"compare": compare(cfg.compare, out)}
    if cfg.tasks:
        from diloco.evaluation.harness import run_tasks  # harness imports this package
        return run_tasks(cfg, out)
    pre = load(resolve(cfg.checkpoint), dtype=cfg.dtype)
    run_dir = _run_dir(cfg.checkpoint)
    if not cfg.paths:
        if run_dir is None:
            raise ConfigError(f"checkpoint={cfg.checkpoint!r} is not a run directory, so give text to "
                              "evaluate on: paths='[notes/*.txt]'")
        result = _on_validation_split(pre, run_dir, cfg)
    else:
        result = _on_files(pre, cfg)
    result["checkpoint"] = cfg.checkpoint
    bpb = "" if result["bits_per_byte"] is None else f", {result['bits_per_byte']:.4f} bits/byte"
    print(f"{result['text']}: {result['tokens']:,} tokens, loss {result['nats_per_token']:.4f} nats/token{bpb}",
          file=out)
    return result


def _on_validation_split(pre: Pretrained, run_dir: Path, cfg: EvaluateConfig) -> dict:
    """The exact batches the run evaluated on (diloco.run.global_evaluator), so a run's model
    evaluates here to the eval loss its summary reports: windows of the validation stream, or
    the held-out conversations of a fine-tuning run with its masked loss."""
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    data = from_dict(DataConfig, saved["data"], "data")
    # A run from model.init_from encoded its data with the checkpoint's tokenizer, which its
    # exported model carries (diloco/inputs.py).
    corpus = load_corpus(data, pre.tokenizer if saved["model"].get("init_from") else None)
    batches = held_out(corpus.val, batch_size=data.batch_size, seq_len=cfg.seq_len or data.seq_len,
                       n=saved["run"]["eval_batches"])
    nats = mean_loss(pre, batches)
    per_token = val_bytes_per_token(corpus)
    return {"text": f"{run_dir} validation split ({corpus.name})", "tokens": sum(map(target_tokens, batches)),
            "nats_per_token": nats, "bits_per_byte": None if per_token is None else bits_per_byte(nats, per_token)}


def _on_files(pre: Pretrained, cfg: EvaluateConfig) -> dict:
    if pre.tokenizer is None:
        raise CheckpointError(f"{pre.path} has no tokenizer.json, so text cannot be encoded")
    files = resolve_paths(cfg.paths)
    text = files_text(files, cfg.text_field)
    tokens = np.asarray(pre.tokenizer.encode(text), np.int32)
    if cfg.max_tokens:
        tokens = tokens[:cfg.max_tokens + 1]
    seq_len = cfg.seq_len or min(pre.config.max_seq_len, 1024)
    if seq_len > pre.config.max_seq_len:
        raise ConfigError(f"seq_len={seq_len} exceeds the model's max_seq_len={pre.config.max_seq_len}")
    batches = windows(tokens, seq_len, cfg.batch_size)
    if not batches:
        raise DataError(f"{len(tokens)} tokens of text: fewer than seq_len+1={seq_len + 1}; lower seq_len=")
    nats = mean_loss(pre, batches)
    predicted = sum(b[:, 1:].size for b in batches)
    covered = pre.tokenizer.decode([int(t) for t in tokens[:predicted + 1]])
    per_token = len(covered.encode("utf-8")) / (predicted + 1)
    return {"text": f"{len(files)} file(s)", "tokens": int(predicted), "nats_per_token": nats,
            "bits_per_byte": bits_per_byte(nats, per_token)}
