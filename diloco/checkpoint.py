"""Orbax checkpoints of pytree states: async, atomic, keep the last k, restore into abstract targets.

Orbax writes each step into a temporary directory and renames it when complete, so a torn
checkpoint is never listed; `restore_latest` still falls back to older steps if one fails to read.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


def open_manager(directory: str | Path, keep: int, async_save: bool = True) -> ocp.CheckpointManager:
    """A CheckpointManager over `directory`; the caller closes it (it owns background threads).

    A process killed mid-save leaves `<step>.orbax-checkpoint-tmp-*`: never listed as a step, but
    kept on disk for the rest of the run, so the next owner of the directory removes it here."""
    root = Path(directory)
    if root.is_dir():
        for torn in root.glob("*.orbax-checkpoint-tmp*"):
            log.warning("removing torn checkpoint %s (a save that never finished)", torn)
            shutil.rmtree(torn, ignore_errors=True)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep or None,
        enable_async_checkpointing=async_save,
        create=True,
    )
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def save(manager: ocp.CheckpointManager, step: int, state: Any, meta: dict | None = None) -> None:
    """Start saving `state` (any pytree) and a small JSON `meta` at `step`; returns before the write ends."""
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        meta=ocp.args.JsonSave(meta or {}),
    ))


def abstract_like(state: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a concrete or eval_shape'd state: a restore target."""
    def leaf(x):
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(leaf, state)


def restore(manager: ocp.CheckpointManager, step: int, target: Any) -> tuple[Any, dict]:
    """Restore (state, meta) at `step` into the structure, dtypes and shardings of `target`."""
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_like(target)),
        meta=ocp.args.JsonRestore(),
    ))
    return restored["state"], dict(restored["meta"] or {})


def restore_untyped(manager: ocp.CheckpointManager, step: int) -> tuple[Any, dict]:
    """(state, meta) at `step` as saved: host numpy arrays in the saved tree, for states whose
    structure depends on what the run did (open rounds, learners that joined)."""
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    return jax.tree.map(np.asarray, restored["state"]), dict(restored["meta"] or {})


def restore_latest(manager: ocp.CheckpointManager, target: Any) -> tuple[int, Any, dict] | None:
    """The newest readable checkpoint as (step, state, meta), or None if there is none.

    A checkpoint that fails to read (corrupt files) is skipped with a warning, so a damaged latest
    step costs the work since the previous one instead of the run.
    """
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            state, meta = restore(manager, step, target)
        except Exception as err:  # noqa: BLE001 - any read failure means "try the previous one"
            log.warning("checkpoint step %d unreadable (%s: %s); trying an older one",
                        step, type(err).__name__, err)
            continue
        return step, state, meta
    return None
