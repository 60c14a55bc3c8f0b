"""Snapshots of a whole sim run, so a run resumed from its latest snapshot continues exactly as the
uninterrupted run would have (docs/design.md#checkpoints).

The sim is one process with a virtual clock, so everything is captured at an event boundary: the
syncer (diloco/runtime/syncer_ckpt.py), each learner's train state, held anchors, codec residuals
and state machine, the three ledgers, the event heap with the frames in flight on every link, the
link clocks and the jitter generator. Arrays go through Orbax (atomic: a torn snapshot is never
listed); the rest is one JSON document. Both are verified against digests saved with them
(diloco/checkpoint.py), and a newest snapshot that fails to read or to verify, or lacks a field,
falls back to the previous one (docs/design.md#checkpoint-integrity).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from diloco import checkpoint
from diloco.algo import learner as lsm
from diloco.runtime import ledger_ckpt, syncer_ckpt
from diloco.runtime.ledger_ckpt import keyed as _keyed
from diloco.runtime.rejoin import Rejoin
from diloco.runtime.build import new_unit
from diloco.runtime.unit import LearnerUnit

FORMAT = "diloco.sim/1"


def _frame(x: bytes) -> np.ndarray:
    return np.frombuffer(bytes(x), np.uint8).copy()


# --- learners --------------------------------------------------------------------------------------
def _unit_out(unit: LearnerUnit) -> tuple[dict, dict]:
    state = jax.tree_util.tree_leaves(jax.device_get(unit.state))
    codec_paths = sorted(unit.codec_states)
    arrays = {
        "state": {str(i): np.asarray(x) for i, x in enumerate(state)},
        "anchors": {str(p): {str(i): np.asarray(v[path]) for i, path in enumerate(sorted(v))}
                    for p, (_, v) in unit.anchors.items()},
        "latest": {str(p): {str(i): np.asarray(v[path]) for i, path in enumerate(sorted(v))}
                   for p, (_, v) in unit.latest.items()},
        "codec": {str(i): {str(j): np.asarray(x) for j, x in enumerate(jax.tree_util.tree_leaves(unit.codec_states[path]))}
                  for i, path in enumerate(codec_paths)},
        "sent": {str(p): {str(i): np.asarray(v[path]) for i, path in enumerate(sorted(v))}
                 for p, v in unit.sent_local.items()},
        # eager outer steps: per fragment the anchor, per send in flight its stand-in (unit_eager.py)
        "eager": {str(p): {str(i): np.asarray(v[path]) for i, path in enumerate(sorted(v))}
                  for p, v in unit.eager_anchor.items()},
        "stand_ins": {str(seq): {str(i): np.asarray(v[path]) for i, path in enumerate(sorted(v))}
                      for seq, v in unit.stand_ins.items()},
        # under an outer momentum: per fragment the rebuilt momentum, per send in flight its guess
        "momenta": {str(p): {str(i): np.asarray(v[path]) for i, path in enumerate(sorted(v))}
                    for p, v in unit.momenta.items()},
        "guesses": {str(seq): {str(i): np.asarray(v[path]) for i, path in enumerate(sorted(v))}
                    for seq, v in unit.guesses.items()},
    }
    ls = unit.ls
    meta = {
        "learner": unit.learner, "incarnation": ls.incarnation, "step": ls.step, "seq": ls.seq,
        "c_steps": list(ls.c_steps), "c_tokens": list(ls.c_tokens), "versions": list(ls.versions),
        "in_flight": [list(f) for f in ls.in_flight],
        "pending": [[q.fragment, q.version, q.apply_at, list(q.answers)] for q in ls.pending],
        "anchor_versions": {str(p): v for p, (v, _) in unit.anchors.items()},
        "latest_versions": {str(p): v for p, (v, _) in unit.latest.items()},
        "codec_paths": [list(p) for p in codec_paths], "sent": sorted(unit.sent_local),
        "dropped_frames": unit.dropped_frames,
        "stand_ins": {str(seq): next(f.fragment for f in ls.in_flight if f.seq == seq) for seq in unit.stand_ins
                      if any(f.seq == seq for f in ls.in_flight)},
        "guesses": {str(seq): next(f.fragment for f in ls.in_flight if f.seq == seq) for seq in unit.guesses
                    if any(f.seq == seq for f in ls.in_flight)},
        "sends_per_merge": {str(p): k for p, k in unit.sends_per_merge.items()},
    }
    return arrays, meta


def _unit_in(setup, syncer_state, arrays: dict, meta: dict) -> LearnerUnit:
    m = meta["learner"]
    unit = new_unit(setup, m, meta["incarnation"], syncer_state, meta["step"])
    paths = {p: sorted(f.paths) for p, f in enumerate(setup.fragments)}

    def values(tree: dict, p: int) -> dict:
        return {path: np.asarray(tree[str(i)], np.float32) for i, path in enumerate(paths[p])}

    unit.anchors = {int(p): (v, values(arrays["anchors"][p], int(p))) for p, v in meta["anchor_versions"].items()}
    unit.latest = {int(p): (v, values(arrays["latest"][p], int(p))) for p, v in meta["latest_versions"].items()}
    treedef = jax.tree_util.tree_structure(unit.state)
    shardings = jax.tree_util.tree_leaves(unit.compiled.state_sharding)
    leaves = [jax.device_put(np.asarray(arrays["state"][str(i)]), s) for i, s in enumerate(shardings)]
    unit.state = jax.tree_util.tree_unflatten(treedef, leaves)
    for i, path in enumerate(tuple(p) for p in meta["codec_paths"]):
        shape = unit.latest[next(p for p, ps in paths.items() if path in ps)][1][path].shape
        init = unit.spec.up_codec.init(shape)
        saved = arrays.get("codec", {}).get(str(i), {})
        leaves = [np.asarray(saved[str(j)]) for j in range(len(jax.tree_util.tree_leaves(init)))]
        unit.codec_states[path] = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(init), leaves)
    unit.sent_local = {p: values(arrays["sent"][str(p)], p) for p in meta["sent"]}
    if unit.spec.schedule.eager:
        unit.eager_anchor = {int(p): values(v, int(p)) for p, v in arrays["eager"].items()}
        unit.stand_ins = {int(seq): values(arrays["stand_ins"][seq], p) for seq, p in meta["stand_ins"].items()}
        unit.momenta = {int(p): values(v, int(p)) for p, v in arrays.get("momenta", {}).items()}
        unit.guesses = {int(seq): values(arrays["guesses"][seq], p) for seq, p in meta.get("guesses", {}).items()}
        unit.sends_per_merge = {int(p): k for p, k in meta.get("sends_per_merge", {}).items()}
    unit.dropped_frames = meta["dropped_frames"]
    unit.ls = lsm.LearnerState(
        m, meta["incarnation"], meta["step"], meta["seq"], tuple(meta["c_steps"]), tuple(meta["c_tokens"]),
        tuple(meta["versions"]), tuple(lsm.InFlight(*f) for f in meta["in_flight"]),
        tuple(lsm.Pending(f, v, a, tuple(ans)) for f, v, a, ans in meta["pending"]))
    return unit


# --- ledgers ---------------------------------------------------------------------------------------
def _ledgers_out(host) -> tuple[dict, dict]:
    arrays, meta = ledger_ckpt.ledgers_out(host.tokens, host.bytes, host.time)
    meta.update(stalls=host.stalls, incarnations={str(m): i for m, i in host.incarnations.items()},
                alive=sorted(host.alive))
    return arrays, meta


def _ledgers_in(host, arrays: dict, meta: dict) -> None:
    host.tokens, host.bytes, host.time = ledger_ckpt.ledgers_in(arrays, meta)
    host.stalls = meta["stalls"]
    host.incarnations = {int(m): i for m, i in meta["incarnations"].items()}
    host.alive = set(meta["alive"])


# --- the whole sim ---------------------------------------------------------------------------------
def snapshot(sim) -> tuple[dict, dict]:
    """(arrays, meta) of the sim at an event boundary."""
    s_arrays, s_meta = syncer_ckpt.to_checkpoint(sim.host.state)
    l_arrays, l_meta = _ledgers_out(sim.host)
    heap, frames = [], {}
    for t, order, kind, data in sim.heap:
        data = list(data)
        for i, x in enumerate(data):
            if isinstance(x, (bytes, bytearray)):
                frames[str(len(frames))] = _frame(x)
                data[i] = {"frame": len(frames) - 1}
        heap.append([t, order, kind, data])
    units = {str(m): _unit_out(u) for m, u in enumerate(sim.units) if u is not None}
    arrays = {"syncer": s_arrays, "ledgers": l_arrays, "frames": frames,
              "units": {m: a for m, (a, _) in units.items()}}
    meta = {
        "format": FORMAT, "syncer": s_meta, "ledgers": l_meta, "heap": heap, "order": sim.order,
        "units": {m: meta for m, (_, meta) in units.items()}, "now": sim.now,
        "link_up": sim.link_up, "link_down": sim.link_down, "rng": sim.rng.bit_generator.state,
        "stalled_since": _keyed(sim.stalled_since.items()), "stall_armed": _keyed(sim.stall_armed.items()),
        "waking": sorted(sim.waking), "restarting": sorted(sim.restarting), "removed": sorted(sim.removed),
        "flushed": sorted(sim.flushed), "alive": _keyed(sim.alive.items()), "died_at": _keyed(sim.died_at.items()),
        "rejoins": [list(r) for r in sim.rejoins], "evals": [list(e) for e in sim.evals],
        "steps_done": sim.steps_done, "inputs_seen": sim.host.inputs_seen,
    }
    return arrays, meta


_FIELDS = ("syncer", "ledgers", "heap", "order", "units", "now", "link_up", "link_down", "rng",
           "stalled_since", "stall_armed", "waking", "restarting", "removed", "flushed", "alive",
           "died_at", "rejoins", "evals", "steps_done", "inputs_seen")
_UNIT_FIELDS = ("learner", "incarnation", "step", "seq", "c_steps", "c_tokens", "versions", "in_flight",
                "pending", "anchor_versions", "latest_versions", "codec_paths", "sent", "dropped_frames")


def check(arrays: dict, meta: dict) -> None:
    """Raise `checkpoint.Damaged` for a snapshot that lacks a field `restore` reads: the digests
    vouch for what was saved, this for what an old, unverified snapshot holds."""
    if meta.get("format") != FORMAT:
        raise checkpoint.Damaged(f"not a sim snapshot: format {meta.get('format')!r}, want {FORMAT!r}")
    missing = [k for k in _FIELDS if k not in meta]
    missing += [f"units/{m}/{k}" for m, um in (meta.get("units") or {}).items() for k in _UNIT_FIELDS
                if not isinstance(um, dict) or k not in um]
    missing += [k for k in ("syncer", "ledgers", "units") if not isinstance(arrays.get(k, {}), dict)]
    missing += [f"arrays units/{m}" for m in (meta.get("units") or {}) if m not in arrays.get("units", {})]
    if missing:
        raise checkpoint.Damaged(f"sim snapshot lacks {', '.join(missing[:5])}")


def restore(sim, arrays: dict, meta: dict) -> None:
    """Load a snapshot into a freshly built Sim of the same config and setup."""
    if meta.get("format") != FORMAT:
        raise ValueError(f"not a sim snapshot: format {meta.get('format')!r}, want {FORMAT!r}")
    host = sim.host
    host.state = syncer_ckpt.from_checkpoint(arrays["syncer"], meta["syncer"], host.policy, sim.setup.fragments)
    _ledgers_in(host, arrays["ledgers"], meta["ledgers"])
    host.inputs_seen = meta["inputs_seen"]
    frames = arrays.get("frames", {})
    sim.heap = [(t, order, kind, tuple(bytes(np.asarray(frames[str(x["frame"])], np.uint8).tobytes())
                                       if isinstance(x, dict) else x for x in data))
                for t, order, kind, data in meta["heap"]]
    sim.order = meta["order"]
    sim.units = [None] * sim.M
    for m, um in meta["units"].items():
        sim.units[int(m)] = _unit_in(sim.setup, host.state, arrays["units"][m], um)
    sim.now, sim.link_up, sim.link_down = meta["now"], list(meta["link_up"]), list(meta["link_down"])
    sim.rng.bit_generator.state = meta["rng"]
    sim.stalled_since = {int(m): t for m, t in meta["stalled_since"]}
    sim.stall_armed = {int(m): s for m, s in meta["stall_armed"]}
    sim.waking, sim.restarting = set(meta["waking"]), set(meta["restarting"])
    sim.removed, sim.flushed = set(meta["removed"]), set(meta["flushed"])
    sim.alive = {int(m): a for m, a in meta["alive"]}
    sim.died_at = {int(m): tuple(v) for m, v in meta["died_at"]}
    sim.rejoins = [Rejoin(*r) for r in meta["rejoins"]]
    sim.evals = [tuple(e) for e in meta["evals"]]
    sim.steps_done = meta["steps_done"]
    for m in range(sim.M):  # a no-op but for a snapshot saved before the syncer kept the finished set
        sim._maybe_finish(m)


class SimSnapshots:
    """Orbax snapshots of a sim run every `every` inner steps (summed over learners)."""

    def __init__(self, directory: Path | None, every: int, keep: int = 2, fail_s: float = 0.0):
        """fail_s: run.checkpoint_fail_s (a failed save is logged and retried, checkpoint.Saves)."""
        self.every = every if directory is not None else 0
        self.manager = checkpoint.open_manager(directory, keep) if self.every else None
        self.saves = checkpoint.Saves(self.manager, "sim snapshot", fail_s) if self.every else None
        self.next_at = every

    def maybe_save(self, sim, final: bool = False) -> None:
        """Save when `every` more steps are done, or now if `final` (an interrupted run)."""
        if final and self.every and sim.steps_done not in self.manager.all_steps():
            self.next_at = sim.steps_done
        if self.every and sim.steps_done >= self.next_at:
            self.next_at = (sim.steps_done // self.every + 1) * self.every
            arrays, meta = snapshot(sim)
            self.saves.save(sim.steps_done, arrays, meta)  # a failure is logged; the next is the retry

    def latest(self) -> tuple[dict, dict] | None:
        """(arrays, meta) of the newest usable snapshot, or None."""
        if self.manager is None:
            return None
        self.saves.settle(fatal=False)

        def read(step: int) -> tuple[dict, dict]:
            arrays, meta = checkpoint.restore_untyped(self.manager, step)
            check(arrays, meta)
            return arrays, meta

        found = checkpoint.newest(self.manager, read, "sim snapshot")
        return None if found is None else found[1]

    def close(self) -> None:
        if self.saves is not None:
            self.saves.close()
