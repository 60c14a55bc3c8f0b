"""data=grain's pipeline: records read by index in a learner's seeded order, tokenised on the fly,
packed into rows with segment ids by Grain, and a Feed that positions it at a step.

Reference: docs/data.md (formats, sharding, shuffling, packing, resume).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, NamedTuple

import numpy as np

from diloco.data import sft
from diloco.data.errors import DataError
from diloco.data.records import FileSet

log = logging.getLogger(__name__)

SHUFFLE_BLOCK = 1024  # records of a learner's shard shuffled together: reads stay near each other
EPOCHS = 1 << 20  # the stream repeats its shard, reshuffled each pass; enough passes for any run
KEEP_STATES = 8  # iterator states a feed keeps of the steps it made last (besides restored ones)


class Recipe(NamedTuple):
    """Everything a learner's stream is made of; pickled into Grain's worker processes."""

    files: FileSet
    n_train: int  # records [0, n_train) train; the rest are held out
    encode: Callable[[str], np.ndarray] | None  # text -> int32 ids; None: records are ids already
    chat: Any  # the checkpoint's tokenizer when records are conversations (data.chat_field), else None
    text_field: str
    chat_field: str
    width: int  # seq_len + 1 tokens a row
    too_long: str  # truncate | drop | split
    on_bad: str  # error | skip
    vocab_size: int
    seed: int
    batch_size: int  # the learner's rows a step, over all the processes of its world
    workers: int
    # A learner's world of `processes` processes: each reads every processes-th record of the
    # learner's order and packs batch_size / processes rows (docs/data.md#sharding). `process`: the
    # one this GrainTrain reads for (stream.py), or -1 for all of them, the learner's whole batch.
    processes: int = 1
    process: int = -1


def document(r: Recipe, i: int) -> sft.Example | None:
    """Record i as token ids and the mask of the tokens the loss counts (all of a text; the
    assistant's of a conversation); None for one with nothing to train on, or a bad one skipped."""
    try:
        rec = r.files.read(i)
        if isinstance(rec, np.ndarray):
            ids, mask = rec.astype(np.int32), None
        elif r.chat is not None:
            messages = rec.get(r.chat_field) if isinstance(rec, dict) else None
            if not isinstance(messages, list):
                raise DataError(f"{r.files.describe(i)}: field {r.chat_field!r} is "
                                f"{type(messages).__name__}, not a list of messages; set data.chat_field")
            ex = sft.render(r.chat, sft._conversation({"messages": messages}, r.files.describe(i)))
            ids, mask = ex.ids, ex.mask
        else:
            text = rec if isinstance(rec, str) else rec.get(r.text_field)
            if not isinstance(text, str):
                found = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                raise DataError(f"{r.files.describe(i)}: no string field {r.text_field!r} (found {found}); "
                                "set data.text_field")
            ids, mask = r.encode(text), None
        if len(ids) and (ids.min() < 0 or ids.max() >= r.vocab_size):
            raise DataError(f"{r.files.describe(i)}: token ids span [{ids.min()}, {ids.max()}], outside "
                            f"the vocabulary of {r.vocab_size}; set data.vocab_size")
    except DataError:
        if r.on_bad == "error":
            raise
        return None
    return sft.Example(ids, np.ones(len(ids), bool) if mask is None else mask)


def pieces(r: Recipe, ex: sft.Example) -> list[sft.Example]:
    """A document as the segments it becomes: cut to a row (truncate), left out (drop) or cut
    into row-long pieces (split) when longer than one; a piece with nothing to predict is left out."""
    w = r.width
    if len(ex.ids) <= w:
        out = [ex]
    elif r.too_long == "truncate":
        out = [sft.Example(ex.ids[:w], ex.mask[:w])]
    elif r.too_long == "drop":
        out = []
    else:
        out = [sft.Example(ex.ids[k:k + w], ex.mask[k:k + w]) for k in range(0, len(ex.ids), w)]
    return [e for e in out if len(e.ids) > 1 and e.mask[1:].any()]


def shard_size(n_train: int, learner: int, num_learners: int) -> int:
    """Records of learner's shard: record j is learner (j mod M)'s, so shards are disjoint."""
    return max(0, (n_train - learner + num_learners - 1) // num_learners)


class Order:
    """The k-th record of learner m's stream: its shard in a seeded order per pass, shuffled
    in blocks of SHUFFLE_BLOCK consecutive records (the blocks' order, then the records'
    within each), so a pass reads each region of the files once (docs/data.md#shuffling)."""

    def __init__(self, seed: int, learner: int, num_learners: int, n_train: int):
        self.seed, self.m, self.M = seed, learner, num_learners
        self.n = shard_size(n_train, learner, num_learners)
        self._cache: dict = {}

    def _perm(self, epoch: int, block: int):
        """block -1: the pass's block order with each block's size and end; else block's order."""
        key = (epoch, block)
        if key not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            if block < 0:
                blocks = np.random.default_rng([self.seed, self.m, epoch]).permutation(-(-self.n // SHUFFLE_BLOCK))
                sizes = np.minimum(SHUFFLE_BLOCK, self.n - blocks * SHUFFLE_BLOCK)
                self._cache[key] = (blocks, sizes, np.cumsum(sizes))
            else:
                size = min(SHUFFLE_BLOCK, self.n - block * SHUFFLE_BLOCK)
                self._cache[key] = np.random.default_rng([self.seed, self.m, epoch, block]).permutation(size)
        return self._cache[key]

    def __call__(self, k: int) -> int:
        epoch, r = divmod(int(k), self.n)
        blocks, sizes, ends = self._perm(epoch, -1)
        j = int(np.searchsorted(ends, r, side="right"))
        b = int(blocks[j])
        local = b * SHUFFLE_BLOCK + int(self._perm(epoch, b)[r - (ends[j] - sizes[j])])
        return self.m + local * self.M


class _Read:
    """index in a process's part of the stream -> (record id, example) or None: part p of P reads
    the learner's records p, p + P, p + 2P, ... of its order (P = 1: all of them, in order);
    picklable for Grain's workers."""

    def __init__(self, recipe: Recipe, order: Order, part: int):
        self.recipe, self.order, self.part = recipe, order, part

    def __call__(self, k):
        i = self.order(self.part + self.recipe.processes * k)
        ex = document(self.recipe, i)
        return None if ex is None else (i, ex)


def _split_transform(recipe: Recipe):
    import grain.experimental as ge

    class Split(ge.FlatMapTransform):
        max_fan_out = 1  # not read by the iterator form of flat_map

        def flat_map(self, element):
            i, ex = element
            return [{"tokens": e.ids, "mask": e.mask, "doc": np.full(len(e.ids), i, np.int64)}
                    for e in pieces(recipe, ex)]

    return Split()


def dataset(recipe: Recipe, learner: int, num_learners: int, part: int = 0):
    """The Grain pipeline of learner m (of process `part` of its world's recipe.processes):
    ordered records read and tokenised, cut to rows, packed first fit into rows of `width` tokens
    (segment ids and positions per document), batched by the part's rows; with data.workers > 0,
    made by that many worker processes."""
    import grain
    import grain.experimental as ge

    order, parts = Order(recipe.seed, learner, num_learners, recipe.n_train), recipe.processes
    rows = recipe.batch_size // parts
    ds = grain.MapDataset.range(order.n * EPOCHS // parts).map(_Read(recipe, order, part))
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=64))
    ds = ge.FlatMapIterDataset(ds, _split_transform(recipe))
    w = recipe.width
    ds = ge.FirstFitPackIterDataset(ds, length_struct={"tokens": w, "mask": w, "doc": w},
                                    num_packing_bins=max(rows, 8), seed=recipe.seed + learner)
    ds = ds.batch(rows, drop_remainder=True)
    if recipe.workers > 0:
        _grain_flags()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=recipe.workers))
    return ds


def _grain_flags() -> None:
    """Grain's worker processes read absl flags, which a program that never ran absl.app has not
    parsed: take their defaults."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def as_batch(packed: dict) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Grain's packed batch as the train step's (diloco/data/sft.py Rows' fields) and the record
    id of every token (-1 on padding)."""
    seg = packed["tokens_segment_ids"].astype(np.int32)
    targets = packed["mask"][:, 1:].astype(bool) & (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    batch = {"tokens": packed["tokens"].astype(np.int32), "segments": seg,
             "positions": packed["tokens_positions"].astype(np.int32), "targets": targets}
    return batch, np.where(seg > 0, packed["doc"], -1)


class Feed:
    """One learner's stream (one process's part of it, in a world), positioned: the batch at a
    step comes from the live iterator when asked in order, else from the newest iterator state at
    or before it (restored from a checkpoint, or kept) played forward, else from the start. Not
    thread-safe (GrainTrain locks)."""

    def __init__(self, recipe: Recipe, learner: int, num_learners: int, part: int = 0):
        self.recipe, self.learner, self.M, self.part = recipe, learner, num_learners, part
        self.ds = dataset(recipe, learner, num_learners, part)
        self.it, self.at = None, 0  # the iterator yields the batch of step `at` next
        self.states: dict[int, str] = {}  # step -> JSON state of an iterator about to yield it
        self.pinned: set[int] = set()  # restored states, kept
        self.made: dict[int, tuple[dict, np.ndarray]] = {}  # the last steps' batches and record ids

    def get(self, step: int) -> tuple[dict, np.ndarray]:
        if step not in self.made:
            ahead = any(self.at < s <= step for s in self.states)  # a state nearer than the iterator
            if self.it is None or not self.at <= step or ahead:
                self._seek(step)
            while self.at <= step:
                self.made[self.at] = as_batch(next(self.it))
                self.at += 1
                self.states[self.at] = json.dumps(self.it.get_state())
                self._trim()
        return self.made[step]

    def _trim(self) -> None:
        for d, keep in ((self.made, 4), (self.states, KEEP_STATES)):  # the latest made, by insertion
            for s in [k for k in d if k not in self.pinned][:-keep]:
                del d[s]

    def _seek(self, step: int) -> None:
        self.close()
        self.it, self.at = iter(self.ds), 0
        best = max((s for s in self.states if s <= step), default=None)
        if best is not None:
            try:
                self.it.set_state(json.loads(self.states[best]))
                self.at = best
            except Exception as e:  # noqa: BLE001 - a state of another pipeline: replay instead
                log.warning("learner %d%s: its data position at step %d does not fit this pipeline (%s: %s); "
                            "reading its stream from the start to step %d", self.learner, self.where(), best,
                            type(e).__name__, e, step)
                self.close()
                self.it, self.at = iter(self.ds), 0

    def where(self) -> str:
        """' (process p of P)' for a process's part of a learner's stream, else ''."""
        return "" if self.recipe.processes == 1 else f" (process {self.part} of {self.recipe.processes})"

    def close(self) -> None:
        if self.it is not None and hasattr(self.it, "close"):
            self.it.close()
        self.it = None

