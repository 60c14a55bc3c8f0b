"""Batches as pure functions of (seed, learner, step): resuming a run needs no saved data state.

Reference: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models"
(arXiv 2311.08105), Algorithm 1: each of the k workers trains on its own data shard D_i.
"""

from __future__ import annotations

import numpy as np

from diloco.data import sft
from diloco.data.errors import DataError
from diloco.data.stream import GrainTrain


def shard_bounds(n_tokens: int, num_learners: int) -> list[tuple[int, int]]:
    """[lo, hi) of each learner's contiguous shard; the shards tile [0, n_tokens) without overlap."""
    if num_learners < 1:
        raise DataError(f"num_learners={num_learners} must be >= 1")
    cuts = [m * n_tokens // num_learners for m in range(num_learners + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def batch_at(tokens: np.ndarray, *, seed: int, learner: int, num_learners: int, step: int,
             batch_size: int, seq_len: int, shard_block: int = 0) -> np.ndarray:
    """int32 [batch_size, seq_len + 1]: windows drawn uniformly from inside learner's shard.

    shard_block = 0: the shard is one contiguous quarter (for 4 learners) of the stream.
    shard_block = N > 0: the stream is cut into blocks of N tokens dealt round-robin, block b to
    learner b mod num_learners, and every window lies inside one of the learner's blocks. Both
    keep the shards disjoint; blocks spread each shard over the whole corpus, so on a corpus whose
    parts differ (Shakespeare's plays follow one another) every learner sees the same mixture.

    The generator is keyed by (seed, learner, step) through numpy's SeedSequence, so a step's
    batch is the same whenever it is asked for, and learners never share a stream.
    """
    if not 0 <= learner < num_learners:
        raise DataError(f"learner={learner} is not in [0, num_learners={num_learners})")
    if seed < 0 or step < 0 or batch_size < 1 or seq_len < 1:
        raise DataError(f"need seed >= 0, step >= 0, batch_size >= 1, seq_len >= 1; got seed={seed}, "
                        f"step={step}, batch_size={batch_size}, seq_len={seq_len}")
    width = seq_len + 1
    rng = np.random.default_rng([seed, learner, step])
    if shard_block > 0:
        starts = _block_starts(rng, len(tokens), learner, num_learners, shard_block, width, batch_size)
    else:
        lo, hi = shard_bounds(len(tokens), num_learners)[learner]
        if hi - lo < width:
            raise DataError(f"shard {learner} of {num_learners} has {hi - lo} tokens "
                            f"({len(tokens)} train tokens in all), fewer than seq_len+1={width}; "
                            f"use fewer learners, a shorter seq_len or more data")
        starts = lo + rng.integers(0, hi - lo - width + 1, size=batch_size)
    return np.asarray(tokens[starts[:, None] + np.arange(width)], dtype=np.int32)


def _block_starts(rng: np.random.Generator, n_tokens: int, learner: int, num_learners: int,
                  block: int, width: int, batch_size: int) -> np.ndarray:
    """Window starts inside learner's blocks (b = learner, learner + M, ...); the tail shorter
    than one block is left out, so every block is equally likely and holds whole windows."""
    n_blocks = n_tokens // block
    if block < width or n_blocks < num_learners:
        raise DataError(f"data.shard_block={block} must hold a window (seq_len+1={width}) and cut "
                        f"the {n_tokens} train tokens into at least num_learners={num_learners} "
                        f"blocks; use a block in [{width}, {n_tokens // num_learners}] or 0")
    mine = np.arange(learner, n_blocks, num_learners)
    blocks = mine[rng.integers(0, len(mine), size=batch_size)]
    return blocks * block + rng.integers(0, block - width + 1, size=batch_size)


def eval_batches(tokens: np.ndarray, *, batch_size: int, seq_len: int, n: int) -> list[np.ndarray]:
    """n batches of int32 [batch_size, seq_len + 1] at evenly spaced fixed starts.

    When the tokens hold fewer than n * batch_size disjoint windows, n shrinks to the number of
    whole batches that fit (at least one, whose windows then overlap), so a short validation
    split is not counted many times over.
    """
    width = seq_len + 1
    if len(tokens) < width:
        raise DataError(f"validation split has {len(tokens)} tokens, fewer than "
                        f"seq_len+1={width}; raise data.val_fraction or use more data")
    if n <= 0:
        return []
    disjoint = len(tokens) // width
    n = min(n, max(1, disjoint // batch_size))
    starts = np.linspace(0, len(tokens) - width, n * batch_size).round().astype(np.int64)
    windows = np.asarray(tokens[starts[:, None] + np.arange(width)], dtype=np.int32)
    return list(windows.reshape(n, batch_size, width))


# The one rule, whatever the source, by which the data-parallel trainer and every learner draw
# their batches, count what they train on and cut the held-out set.
def train_batch(train, *, seed: int, learner: int, num_learners: int, step: int, batch_size: int,
                seq_len: int, shard_block: int = 0):
    """The batch of `learner` at `step`: windows of a token stream (batch_at, int32 [B, L + 1]),
    or packed rows (diloco/data/sft.py, a dict). A pure function of (seed, learner,
    step) either way, from disjoint shards; so are data.source=grain's packed rows (stream.py),
    which its Grain iterators reach from the nearest saved position."""
    if isinstance(train, GrainTrain):
        return train.batch_at(learner=learner, num_learners=num_learners, step=step, batch_size=batch_size)
    if isinstance(train, sft.Rows):
        return sft.batch_at(train, seed=seed, learner=learner, num_learners=num_learners, step=step,
                            batch_size=batch_size)
    return batch_at(train, seed=seed, learner=learner, num_learners=num_learners, step=step,
                    batch_size=batch_size, seq_len=seq_len, shard_block=shard_block)


def batch_share(train) -> int:
    """How many processes' rows make one learner batch of train_batch's: P for a process of a
    learner's world of P reading its own part of data=grain's stream (docs/data.md#sharding),
    which places its rows with world.global_batch; 1 when every process makes the whole batch."""
    return train.share if isinstance(train, GrainTrain) else 1


def trained_tokens(batch) -> int:
    """Tokens a batch trains on: the positions the step computes, B x L, of windows and of packed
    rows alike (prompt and padding included: the FLOPs are spent on every one). What the records,
    the ledgers, the merge weights, tokens/s and MFU count (docs/design.md#fine-tuning)."""
    if isinstance(batch, dict):
        return int(batch["targets"].size)
    return int(batch[:, 1:].size)


def target_tokens(batch) -> int:
    """Tokens whose loss counts: every predicted token of a window; of packed rows, only the
    assistant's (the masked loss's weight, reported as assistant_tokens)."""
    if isinstance(batch, dict):
        return int(batch["targets"].sum())
    return int(batch[:, 1:].size)


def assistant_tokens(train, *, seed: int, steps: list[int], batch_size: int | tuple[int, ...]) -> int:
    """The assistant tokens (target_tokens) in the batches of learner m's first steps[m] steps,
    for every learner m of len(steps), of batch_size rows (or batch_size[m]: runtime.learner_batch):
    what a fine-tuning run's loss was taken over, a pure function of the data and the step
    counts, so a resumed or replayed run reports it alike."""
    rows = (batch_size,) * len(steps) if isinstance(batch_size, int) else batch_size
    return sum(target_tokens(train_batch(train, seed=seed, learner=m, num_learners=len(steps), step=s,
                                         batch_size=rows[m], seq_len=0))
               for m, n in enumerate(steps) for s in range(n))


def held_out(val, *, batch_size: int, seq_len: int, n: int) -> list:
    """The fixed batches every eval of a run reads: windows of the validation stream, or the
    held-out conversations' packed rows."""
    if isinstance(val, sft.Rows):
        return sft.eval_batches(val, batch_size=batch_size, n=n)
    return eval_batches(val, batch_size=batch_size, seq_len=seq_len, n=n)
