"""data=grain's learner streams: a Grain pipeline per learner (pipeline.py), or per process of a
learner's world, each reading its own part; a learner's batch at a step is still a pure function
of (seed, learner, step), and Grain's iterator states, saved in checkpoints, make reaching it cheap.

Reference: docs/data.md (sharding, resume), docs/multihost.md.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import numpy as np

from diloco.data.errors import DataError
from diloco.data.pipeline import Feed, Recipe, shard_size

log = logging.getLogger(__name__)


class GrainTrain:
    """Corpus.train of data=grain: every learner's stream (a Feed each, made on first use). In a
    learner's world of P processes (recipe.processes) each process reads its own part of the
    stream and packs its own rows (docs/data.md#sharding): a GrainTrain for one process
    (recipe.process >= 0) makes that process's rows of each batch, one for none (-1) the learner's
    whole batch, every process's rows in process order, as world.global_batch lays them out."""

    def __init__(self, recipe: Recipe, learner_batch: tuple[int, ...] = ()):
        self.recipe = recipe
        self.learner_batch = tuple(learner_batch)  # rows per step of each learner (runtime.learner_batch)
        self._feeds: dict[tuple[int, int, int], Feed] = {}  # (learner, num_learners, part)
        self._locks: dict[tuple[int, int, int], threading.Lock] = {}
        self._lock = threading.Lock()

    @property
    def parts(self) -> tuple[int, ...]:
        """The processes whose rows this makes: one's, or (process -1) every one's."""
        r = self.recipe
        return tuple(range(r.processes)) if r.process < 0 else (r.process,)

    @property
    def share(self) -> int:
        """How many processes' rows make one learner batch of batch_at's: P for one process's
        part of a world of P (the rest are the other processes'), else 1."""
        return 1 if self.recipe.process < 0 else self.recipe.processes

    def in_world(self, processes: int, process: int = -1) -> GrainTrain:
        """This stream as a learner world of `processes` processes reads it: process `process`'s
        part, or (-1) the whole batch of them all. A world of one is the stream itself."""
        if (processes, process) == (self.recipe.processes, self.recipe.process):
            return self
        if not (processes >= 1 and -1 <= process < processes):
            raise ValueError(f"process {process} of a world of {processes}")
        if self.recipe.batch_size % processes:
            raise DataError(f"data.batch_size={self.recipe.batch_size} is not divisible by the {processes} processes "
                            "of a learner's world (runtime.world.processes_per_learner): each process packs an "
                            "equal share of the learner's rows")
        return GrainTrain(self.recipe._replace(processes=processes, process=process), self.learner_batch)

    def check_learners(self, num_learners: int, processes: int | None = None) -> None:
        """Every learner's shard holds records, at least one for each process of its world
        (`processes`, else the recipe's); else the error says how many there are."""
        n, P = self.recipe.n_train, self.recipe.processes if processes is None else processes
        smallest = shard_size(n, num_learners - 1, num_learners)
        if smallest == 0:
            total = len(self.recipe.files)
            raise DataError(f"data.paths holds {n} training records ({total} in all, the last {total - n} "
                            f"held out), fewer than the {num_learners} learners: learner "
                            f"{n} would read nothing; use at most {n} learners or more records")
        if smallest < P:
            raise DataError(f"learner {num_learners - 1}'s shard of data.paths holds {smallest} training records, "
                            f"fewer than the {P} processes of its world (runtime.world.processes_per_learner), "
                            "each of which reads records of its own; use more records, fewer learners or "
                            "fewer processes per learner")

    def rows(self, learner: int) -> int:
        """A step's rows of learner: its runtime.learner_batch, else (or a later learner) data.batch_size."""
        return self.learner_batch[learner] if learner < len(self.learner_batch) else self.recipe.batch_size

    def _feed(self, learner: int, num_learners: int, part: int) -> tuple[Feed, threading.Lock]:
        key = (learner, num_learners, part)
        with self._lock:
            if key not in self._feeds:
                self.check_learners(num_learners)
                recipe = self.recipe._replace(batch_size=self.rows(learner))
                self._feeds[key] = Feed(recipe, learner, num_learners, part)
                self._locks[key] = threading.Lock()
            return self._feeds[key], self._locks[key]

    def _made(self, learner: int, num_learners: int, step: int) -> list[tuple[dict, np.ndarray]]:
        """(batch, record id of every token) of each of this stream's parts at step."""
        out = []
        for part in self.parts:
            feed, lock = self._feed(learner, num_learners, part)
            with lock:
                out.append(feed.get(step))
        return out

    def batch_at(self, *, learner: int, num_learners: int, step: int, batch_size: int) -> dict:
        """The first batch_size rows of learner's batch at step (fewer: a learner that lost
        slices): in a world of P, the first batch_size / P of each process's rows, this process's
        alone when the stream is one process's part."""
        P = self.recipe.processes
        if batch_size > self.rows(learner):
            raise DataError(f"batch_size={batch_size} is more than the {self.rows(learner)} rows a step of "
                            f"learner {learner} makes (data.batch_size or runtime.learner_batch) with data=grain")
        if batch_size % P:
            raise DataError(f"a batch of {batch_size} rows of learner {learner} does not split over the {P} "
                            "processes of its world (runtime.world.processes_per_learner), each of which packs "
                            "its own share; give every learner rows that P divides")
        made = self._made(learner, num_learners, step)
        got = [{k: v[:batch_size // P] for k, v in batch.items()} for batch, _ in made]
        return got[0] if len(got) == 1 else {k: np.concatenate([g[k] for g in got]) for k in got[0]}

    def records(self, *, learner: int, num_learners: int, step: int) -> np.ndarray:
        """The record ids whose tokens learner's batch at step holds (sorted, once each): of every
        process's rows, or of this process's alone when the stream is one process's part."""
        docs = np.concatenate([d.ravel() for _, d in self._made(learner, num_learners, step)])
        return np.unique(docs[docs >= 0])

    def positions(self, learner: int, num_learners: int, step: int) -> list[str | None]:
        """The iterator state of each part that yields learner's batch at `step` next (JSON), or
        None where unknown: what a checkpoint at that step saves."""
        out = []
        for part in self.parts:
            feed, lock = self._feed(learner, num_learners, part)
            with lock:
                out.append(feed.states.get(step))
        return out

    def position(self, learner: int, num_learners: int, step: int) -> str | None:
        """positions' one state, of a stream of one part."""
        (state,) = self.positions(learner, num_learners, step)
        return state

    def restore(self, learner: int, num_learners: int, step: int, states: str | list[str]) -> None:
        """A checkpoint's positions, one per process of the world (a world of one's state alone,
        as its checkpoints hold it): the batch at `step` is read from them, not replayed."""
        states = [states] if isinstance(states, str) else list(states)
        if len(states) != self.recipe.processes:
            raise ValueError(f"{len(states)} positions for a world of {self.recipe.processes} processes")
        for part in self.parts:
            feed, lock = self._feed(learner, num_learners, part)
            with lock:
                feed.states[step] = states[part]
                feed.pinned.add(step)

    def close(self) -> None:
        for feed in self._feeds.values():
            feed.close()


def for_process(train, index: int, processes: int):
    """What process `index` of a learner's world of `processes` trains on: its own part of
    data=grain's stream. Every other source, and a world of one, makes each batch whole (a pure
    function of the step, alike on every process) and each process places its rows of it."""
    if not isinstance(train, GrainTrain) or processes == 1:
        return train
    return train.in_world(processes, index)


def saved_position(train, learner: int, num_learners: int, step: int,
                   gather: Callable[[bytes], list[bytes]] | None = None) -> dict:
    """What a checkpoint at `step` adds to its meta: {"data": the iterator state that yields the
    batch at `step` next} for data=grain (a list of one per process in a learner's world, in
    process order), else {} (every other source is a pure function of the step alone). A process
    of a world gathers every process's with `gather` (world.all_gather: a collective, which every
    process makes, as each saves the checkpoint), so every process holds the same meta."""
    if not isinstance(train, GrainTrain):
        return {}
    states = train.positions(learner, num_learners, step)
    if train.share > 1:
        if gather is None:
            raise ValueError("a process of a learner's world saves its data position with a gather")
        states = [b.decode() or None for b in gather((states[0] or "").encode())]
    if not all(states):
        return {}
    return {"data": states[0] if len(states) == 1 else states}


def restore_position(train, learner: int, num_learners: int, step: int, meta: dict) -> None:
    """Hand a checkpoint's data=grain positions back to the stream. A meta without one (an older
    checkpoint) leaves the stream to replay from its start; so, with a warning, does one written
    by a world of another number of processes, whose parts split the stream otherwise."""
    if not isinstance(train, GrainTrain) or meta.get("data") is None:
        return
    saved = meta["data"]
    states = [saved] if isinstance(saved, str) else saved
    P = train.recipe.processes
    if isinstance(states, list) and len(states) == P and all(isinstance(s, str) for s in states):
        train.restore(learner, num_learners, step, states)
        return
    had = f"{len(states)} process(es)" if isinstance(states, list) else f"a {type(saved).__name__}"
    log.warning("learner %d: its checkpoint at step %d holds the data positions of a world of %s, and this "
                "world has %d process(es), which read other parts of the stream; reading its stream from "
                "the start to the step it resumes at", learner, step, had, P)
