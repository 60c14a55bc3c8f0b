"""Orbax checkpoints of pytree states: async, atomic, keep the last k, restore into abstract targets,
every one verified against digests written with it.

Orbax writes each step into a temporary directory and renames it when complete, so a torn
checkpoint is never listed. What Orbax does not catch is damage after the rename (a flipped byte
in a data file restores as a wrong value, an edited JSON field restores as edited), so `save`
writes a digest of every array and of the meta next to them, and every restore checks it
(docs/design.md#checkpoint-integrity). `newest` is the one fallback rule: a step that fails to
read or to verify is skipped with a warning naming it, and the next older one is tried. `Saves` is
the one rule for a save that fails: logged, retried at the next, fatal only after
run.checkpoint_fail_s seconds without a commit.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)
DIGEST = "diloco.digest/1"  # blake2b-128 per array (dtype, shape, bytes) and over the canonical meta
T = TypeVar("T")


class Damaged(ValueError):
    """A checkpoint whose arrays or meta differ from what was saved, or that lacks a field."""


class CheckpointsFailing(RuntimeError):
    """No checkpoint of a manager committed for longer than run.checkpoint_fail_s."""


class Newer(Exception):
    """A sound checkpoint from past the point where its reader goes on: one a learner saved after
    the last step the syncer booked (the final one of a stop), or one a resume undid. Skipped as
    expected, not reported as damage (docs/design.md#checkpoint-integrity)."""


def open_manager(directory: str | Path, keep: int, async_save: bool = True,
                 clean: bool = True) -> ocp.CheckpointManager:
    """A CheckpointManager over `directory`; the caller closes it (it owns background threads).

    A process killed mid-save leaves `<step>.orbax-checkpoint-tmp-*`: never listed as a step, but
    kept on disk for the rest of the run, so the next owner of the directory removes it here
    (`clean`; of several processes saving into one directory, only the first may)."""
    root = Path(directory)
    if clean and root.is_dir():
        for torn in root.glob("*.orbax-checkpoint-tmp*"):
            log.warning("removing torn checkpoint %s (a save that never finished)", torn)
            shutil.rmtree(torn, ignore_errors=True)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep or None,
        enable_async_checkpointing=async_save,
        create=True,
    )
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


# --- digests ---------------------------------------------------------------------------------------
def _path(path) -> str:
    """A leaf's path as "a/b/0": the same for the saved tree (dataclasses, tuples, NamedTuples) and
    for the dicts and lists an untyped restore gives back."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _array_digest(x) -> str:
    a = np.ascontiguousarray(np.asarray(x))
    h = hashlib.blake2b(digest_size=16)
    # dtype.name tells bfloat16 from other 2-byte types, which share dtype.str ("<V2")
    h.update(f"{a.dtype.name}|{a.dtype.str}|{a.shape}|".encode())
    h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()


def _canonical(meta: dict) -> bytes:
    # Round-trip first: JSON turns tuples into lists and int keys into strings, as the restored
    # meta has them, so the digest of the saved and of the restored meta agree.
    return json.dumps(json.loads(json.dumps(meta)), sort_keys=True, separators=(",", ":")).encode()


def digests(state: Any, meta: dict) -> dict:
    """The integrity record of (state, meta): a digest per array leaf, keyed by its path, and one
    over the canonical meta together with those, so an edit of either or of the record shows."""
    host = jax.device_get(state)
    arrays = {_path(p): _array_digest(x) for p, x in jax.tree_util.tree_leaves_with_path(host)}
    whole = hashlib.blake2b(_canonical({"meta": meta, "arrays": arrays}), digest_size=16).hexdigest()
    return {"format": DIGEST, "arrays": arrays, "meta": whole}


def verify(state: Any, meta: dict, record: Any) -> None:
    """Raise `Damaged` naming what differs between (state, meta) and the record saved with them."""
    kind = record.get("format") if isinstance(record, dict) else type(record).__name__
    if kind != DIGEST:
        raise Damaged(f"integrity record of format {kind!r}, want {DIGEST!r}")
    saved = record.get("arrays")
    if not isinstance(saved, dict):
        raise Damaged("integrity record without array digests")
    now = digests(state, meta)
    missing, extra = sorted(set(saved) - set(now["arrays"])), sorted(set(now["arrays"]) - set(saved))
    if missing or extra:
        raise Damaged(f"arrays differ from those saved: missing {missing[:3]}, unexpected {extra[:3]}")
    wrong = sorted(p for p, d in now["arrays"].items() if saved[p] != d)
    if wrong:
        raise Damaged(f"digest mismatch of {len(wrong)} array(s), e.g. {wrong[0]!r}")
    if record.get("meta") != now["meta"]:
        raise Damaged("digest mismatch of the meta (its JSON was changed)")


# --- save and restore ------------------------------------------------------------------------------
def save(manager: ocp.CheckpointManager, step: int, state: Any, meta: dict | None = None) -> None:
    """Start saving `state` (any pytree) and a small JSON `meta` at `step`, with their digests;
    returns before the write ends (the digests are taken now, from a host copy)."""
    # A copy taken now: the caller goes on changing the lists it passed (a sim's link clocks, say)
    # while the write runs in the background, and a meta written after such a change would no
    # longer match the digest taken here, so the checkpoint would be refused as damaged.
    meta = json.loads(json.dumps(meta or {}))
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        meta=ocp.args.JsonSave(meta),
        integrity=ocp.args.JsonSave(digests(state, meta)),
    ))


class Saves:
    """A manager's saves, none of whose failures stops a run by itself (docs/design.md#checkpoint-integrity).

    Orbax commits an async save in a background thread and raises its failure only from the next
    wait for it (before the next save, a restore or the close), where it used to abort that save or,
    at the close, the run. Here a save that fails to start or to commit is logged and the next save
    is the retry; only when none has committed for `fail_s` seconds (0: never) does the next
    attempt raise CheckpointsFailing. `clock` is for tests."""

    def __init__(self, manager: ocp.CheckpointManager, what: str, fail_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.manager, self.what, self.fail_s, self.clock = manager, what, fail_s, clock
        self.since = clock()  # when the newest save known to have committed started, or the start
        self.pending: tuple[int, float] | None = None  # (step, started at) of a save not yet known done
        self.failures = 0

    def save(self, step: int, state: Any, meta: dict | None = None) -> bool:
        """Start saving (state, meta) at `step` (`save`) once the previous one has settled; True if
        it started. A failure is logged; CheckpointsFailing if none has committed for too long."""
        self.settle()
        started = self.clock()
        try:
            save(self.manager, step, state, meta)
        except Exception as err:  # noqa: BLE001 - a full disk, a torn directory: the next save retries
            self._failed(step, err)
            return False
        self.pending = (step, started)
        if not self.manager.is_saving_in_progress():  # a synchronous save: committed already
            self.settle()
        return True

    def settle(self, fatal: bool = True) -> None:
        """Wait for the save in flight. A commit that failed is logged (and its step is gone from the
        manager's list); fatal=False never raises (a close at the end of a run)."""
        pending, self.pending = self.pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as err:  # noqa: BLE001 - a failed commit is a failed save, not a crash
            self._failed(None if pending is None else pending[0], err, fatal)
            return
        if pending is not None:
            self.since = pending[1]

    def _failed(self, step: int | None, err: BaseException, fatal: bool = True) -> None:
        self.failures += 1
        quiet = self.clock() - self.since
        log.error("%s %s step %s failed (%s: %s); %d failed so far, none committed for %.0f s; the next "
                  "save retries", self.what, self.manager.directory, step, type(err).__name__, err,
                  self.failures, quiet)
        if fatal and self.fail_s and quiet > self.fail_s:
            raise CheckpointsFailing(
                f"no {self.what} could be written to {self.manager.directory} for {quiet:.0f} s "
                f"(run.checkpoint_fail_s={self.fail_s:g}; {self.failures} saves failed, the last with "
                f"{type(err).__name__}: {err}): check the disk or the store, or raise run.checkpoint_fail_s "
                f"(0: never fail)") from err

    def close(self) -> None:
        """Settle the last save (a failure logged, never raised) and close the manager."""
        self.settle(fatal=False)
        self.manager.close()


def abstract_like(state: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a concrete or eval_shape'd state: a restore target."""
    def leaf(x):
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(leaf, state)


def _restore(manager: ocp.CheckpointManager, step: int, state_args) -> tuple[Any, dict]:
    """(state, meta) at `step`, verified against its digests; one of the checkpoints written before
    they existed (no "integrity" item) is returned unverified, with a warning."""
    signed = (Path(manager.directory) / str(step) / "integrity").exists()
    items = dict(state=state_args, meta=ocp.args.JsonRestore())
    if signed:
        items["integrity"] = ocp.args.JsonRestore()
    restored = manager.restore(step, args=ocp.args.Composite(**items))
    state, meta = restored["state"], restored["meta"]
    if not isinstance(meta, dict):
        raise Damaged(f"meta is a {type(meta).__name__}, not a JSON object")
    if signed:
        verify(state, meta, restored["integrity"])
    else:
        log.warning("checkpoint %s step %d carries no digest (written before checkpoints had one): "
                    "restored unverified", manager.directory, step)
    return state, dict(meta)


def restore(manager: ocp.CheckpointManager, step: int, target: Any) -> tuple[Any, dict]:
    """Restore (state, meta) at `step` into the structure, dtypes and shardings of `target`."""
    return _restore(manager, step, ocp.args.StandardRestore(abstract_like(target)))


def restore_untyped(manager: ocp.CheckpointManager, step: int) -> tuple[Any, dict]:
    """(state, meta) at `step` as saved: host numpy arrays in the saved tree, for states whose
    structure depends on what the run did (open rounds, learners that joined)."""
    state, meta = _restore(manager, step, ocp.args.StandardRestore())
    return jax.tree.map(np.asarray, state), meta


def newest(manager: ocp.CheckpointManager, read: Callable[[int], T], what: str = "checkpoint") -> tuple[int, T] | None:
    """(step, read(step)) of the newest step that `read` accepts, or None if none does.

    `read` raises for a step it cannot use: unreadable files, a digest mismatch, a missing field, a
    state from another run. That step is skipped with a warning naming it and why, so a damaged
    newest checkpoint costs the work since the previous one instead of the run."""
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            return step, read(step)
        except Newer as err:  # a normal resume finds these: information, not a failure
            log.info("%s %s step %d skipped: %s; trying an older one", what, manager.directory, step, err)
        except Exception as err:  # noqa: BLE001 - any failure means "try the previous one"
            close_abandoned_reads(err)
            log.warning("%s %s step %d unusable (%s: %s); trying an older one", what, manager.directory,
                        step, type(err).__name__, err)
    return None


def _dropped(*args, **kwargs) -> None:
    """What a read finishing after its loop closed calls back: nothing is waiting for it."""


def close_abandoned_reads(err: BaseException) -> int:
    """Close the reads Orbax left suspended when a restore failed with `err`; how many there were.

    Orbax runs each restore on an event loop of its own and closes that loop as soon as one read
    fails, leaving the other reads of the step suspended forever. Their coroutines catch
    BaseException, so when the garbage collector later closes them each raises again, and Python
    prints an `Exception ignored` traceback per shard wherever the program is by then; and each
    read tensorstore finishes after the close calls the loop back from its own thread, printing
    "Event loop is closed" (docs/design.md#checkpoint-integrity). The closed loop is a local of a
    frame `err` passed through: its pending tasks are closed here, and its call-backs dropped."""
    loops, seen, todo = [], set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        todo += [e.__cause__, e.__context__]
        tb = e.__traceback__
        while tb is not None:
            for value in tb.tb_frame.f_locals.values():
                if isinstance(value, asyncio.AbstractEventLoop) and value.is_closed() and value not in loops:
                    loops.append(value)
            tb = tb.tb_next
    closed = 0
    for loop in loops:
        loop.call_soon_threadsafe = _dropped  # this one closed loop's, not the class's
        for task in asyncio.all_tasks(loop):
            # A closed loop cannot cancel a task; closing its coroutine is what cancelling would do,
            # and the task itself is then garbage that must not report itself as destroyed pending.
            task._log_destroy_pending = False
            try:
                task.get_coro().close()
            except Exception:  # noqa: BLE001, S110 - Orbax re-raises the close as its read error
                pass
            closed += 1
    return closed


def restore_latest(manager: ocp.CheckpointManager, target: Any,
                   check: Callable[[int, Any, dict], None] | None = None) -> tuple[int, Any, dict] | None:
    """The newest usable checkpoint as (step, state, meta), or None if there is none. `check(step,
    state, meta)` raises for one the caller cannot use (a missing field, one from the future)."""
    def read(step: int):
        state, meta = restore(manager, step, target)
        if check is not None:
            check(step, state, meta)
        return state, meta

    found = newest(manager, read)
    return None if found is None else (found[0], *found[1])
