"""Data layer: text or synthetic tokens, cached as zarr3 arrays, cut into stateless batches.

Reference: docs/design.md#data (the data position is a pure function of learner and step).
"""

from diloco.data.batches import (assistant_tokens, batch_at, batch_share, eval_batches, held_out, shard_bounds,
                                 target_tokens, train_batch, trained_tokens)
from diloco.data.corpus import Corpus, load_corpus, unigram_loss
from diloco.data.errors import DataError
from diloco.data.tokenizer import Tokenizer, byte_tokenizer

__all__ = [
    "Corpus",
    "DataError",
    "Tokenizer",
    "assistant_tokens",
    "batch_at",
    "batch_share",
    "byte_tokenizer",
    "eval_batches",
    "held_out",
    "load_corpus",
    "shard_bounds",
    "target_tokens",
    "train_batch",
    "trained_tokens",
    "unigram_loss",
]
