"""The corpus of data=grain: the files opened and checked, the tokenizer chosen (or a BPE trained
on the leading records, cached), held-out rows packed, and the learners' streams (stream.py).

Reference: docs/data.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from diloco.data import remote, sft, sources
from diloco.data.errors import DataError
from diloco.data.pipeline import Recipe, document, pieces
from diloco.data.records import FileSet
from diloco.data.store import build_atomically
from diloco.data.stream import GrainTrain
from diloco.data.tokenizer import byte_tokenizer, load_bpe, save_bpe, train_bpe

log = logging.getLogger(__name__)

PROBE = 32  # records of each file read through the whole path at start-up: bad input fails there
VAL_RECORDS = 4096  # held-out records packed at most (the eval reads run.eval_batches batches)
BPE_TRAIN_CHARS = 32 << 20  # text a data.tokenizer=bpe is trained on, from the leading records
UNIGRAM_RECORDS = 2000  # train records the unigram baseline is counted over


def local_paths(patterns: tuple[str, ...], data_dir: str | Path) -> list[Path]:
    """data.paths as local files: a file:// URL is a local path; the objects of an s3:// or gs://
    URL are copied into data_dir first (remote.py)."""
    local, fetched = [], []
    for p in patterns:
        if p.startswith("file://"):
            p = p[len("file://"):]
        elif remote.is_remote(p):
            fetched += remote.fetch(p, data_dir)
            continue
        elif "://" in p:
            raise DataError(f"data.paths entry {p!r}: data=grain reads local paths, file://, s3:// or gs:// URLs")
        local.append(p)
    return sorted(set(fetched) | set(sources.resolve_paths(tuple(local)) if local else ()))


def load(cfg, checkpoint_tok: Any, seed: int = 0):
    """(train: GrainTrain, val: sft.Rows, vocab_size, tokenizer, sample) of data=grain: sample is
    the trained ids of the leading train records, for the unigram baseline. seed: run.seed, which
    orders the stream."""
    if not cfg.paths:  # the preset composes without them; the command line names them
        raise DataError("data.source=grain needs data.paths: files or globs (docs/data.md)")
    files = local_paths(cfg.paths, cfg.data_dir)
    columns = (cfg.chat_field,) if cfg.chat_field else (cfg.text_field,)
    fileset = FileSet(files, cfg.format, columns, cfg.record)
    for f, reader in zip(files, fileset.readers):
        if len(reader) == 0:
            raise DataError(f"{f} holds no records (empty, or cut short: an ArrayRecord file without "
                            "its footer reads as empty); rewrite it or drop it from data.paths")
    n = len(fileset)
    n_val = max(1, int(n * cfg.val_fraction))
    if n - n_val < 1:
        raise DataError(f"data.paths holds {n} record(s): none left to train on after holding out "
                        f"data.val_fraction={cfg.val_fraction} (at least one); add records")
    if cfg.chat_field and checkpoint_tok is None:
        raise DataError(f"data.chat_field={cfg.chat_field!r} renders conversations with a chat template: "
                        "give model.init_from=<hf folder | .gguf file | smollm2>")
    pretokenised = cfg.record == "tokens" and any(k == "arrayrecord" for k in fileset.kinds)
    if checkpoint_tok is not None:
        tokenizer = checkpoint_tok.for_training()
    elif cfg.tokenizer == "byte":
        tokenizer = byte_tokenizer()
    else:
        tokenizer = _bpe(cfg, fileset, files, n - n_val)
    vocab = cfg.vocab_size if pretokenised and cfg.vocab_size else tokenizer.vocab_size
    recipe = Recipe(fileset, n - n_val, tokenizer.encode, checkpoint_tok if cfg.chat_field else None,
                    cfg.text_field, cfg.chat_field, cfg.seq_len + 1, cfg.too_long, cfg.on_bad, vocab, seed,
                    cfg.batch_size, cfg.workers)
    _probe(recipe)
    val_examples = [p for i in range(n - n_val, min(n, n - n_val + VAL_RECORDS))
                    for ex in [document(recipe, i)] if ex is not None for p in pieces(recipe, ex)]
    if not val_examples:
        raise DataError(f"the {n_val} held-out records of data.paths have nothing to train on once cut to "
                        f"rows of data.seq_len+1={cfg.seq_len + 1} tokens; raise data.val_fraction")
    val, _ = sft.pack(val_examples, cfg.seq_len, "truncate")
    sample = [ex.ids[1:][ex.mask[1:]] for i in range(min(n - n_val, UNIGRAM_RECORDS))
              for ex in [document(recipe, i)] if ex is not None]
    sample = np.concatenate(sample) if sample else np.zeros(0, np.int32)
    return GrainTrain(recipe), val, vocab, tokenizer, sample


def _probe(recipe: Recipe) -> None:
    """Read the first PROBE records of every file through the whole path, so a missing field, bad
    JSON or UTF-8, or an id outside the vocabulary is an error at start-up naming the file; records
    that will be skipped (data.on_bad=skip) or dropped (data.too_long=drop, or nothing to predict)
    are counted there and said in a warning, as a sample of what the stream will leave out."""
    fs = recipe.files
    read = skipped = dropped = 0
    for f in range(len(fs.files)):
        for i in range(int(fs.starts[f]), min(int(fs.starts[f + 1]), int(fs.starts[f]) + PROBE)):
            ex = document(recipe, i)
            read += 1
            skipped += ex is None
            dropped += ex is not None and not pieces(recipe, ex)
    if skipped or dropped:
        log.warning("data=grain: of the first %d records of data.paths' files, %d are skipped as bad "
                    "(data.on_bad=skip) and %d dropped (longer than a row of data.seq_len+1=%d with "
                    "data.too_long=%s, or nothing to predict)", read, skipped, dropped, recipe.width,
                    recipe.too_long)


def _bpe(cfg, fileset: FileSet, files: list[Path], n_train: int):
    """A BPE of data.bpe_vocab_size trained on the leading train records' text (up to
    BPE_TRAIN_CHARS), cached under data.data_dir by the files and settings it depends on, so every
    process of a run (procs) and every rerun reads the same one."""
    key = {"files": [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files], "n_train": n_train,
           "text_field": cfg.text_field, "record": cfg.record, "format": cfg.format, "vocab": cfg.bpe_vocab_size}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cfg.data_dir) / "tokens" / f"grain-bpe{cfg.bpe_vocab_size}-{digest}"
    path = root / "tokenizer.json"
    if not path.is_file():
        texts, size = [], 0
        for i in range(n_train):
            rec = fileset.read(i)
            text = rec if isinstance(rec, str) else rec.get(cfg.text_field) if isinstance(rec, dict) else None
            if isinstance(text, str):
                texts.append(text)
                size += len(text)
            if size >= BPE_TRAIN_CHARS:
                break
        if not texts:
            raise DataError(f"data.tokenizer=bpe found no text in field {cfg.text_field!r} of data.paths "
                            "to train on; set data.text_field, or data.record=tokens for token ids")
        hf_tok = train_bpe("\n\n".join(texts), cfg.bpe_vocab_size)
        root.parent.mkdir(parents=True, exist_ok=True)
        build_atomically(root, lambda tmp: save_bpe(hf_tok, tmp / "tokenizer.json"))
    return load_bpe(path, cfg.bpe_vocab_size)
