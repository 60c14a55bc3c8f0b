"""Orbax checkpoints of the syncer (docs/design.md#checkpoints): Theta and the outer optimizer state of
every fragment, the broadcast references learners decode against, open rounds with the
contributions admitted into them, versions, live incarnations, sequence numbers, step-time
estimates, quarantine counts, the decision records of admissions and merges, the refusals
bounded (counts per reason and learner, the latest eventlog.RING records), the steps each
learner reported that its claims are checked against (diloco/algo/claims.py), and each fragment's
outer statistics with its last merged pseudo-gradient (diloco/algo/outer_auto.py: saved, not
recomputed, since nothing else holds it, so a restarted syncer's next cosine and momentum are the
ones it would have had).

Arrays go through Orbax (async, written to a temporary directory and renamed, so a torn
checkpoint is never listed); everything else is a JSON document saved in the same step, and both
are verified against digests saved with them (diloco/checkpoint.py): a newest checkpoint that fails
to read or to verify falls back to the previous one. The state is cut at an input
boundary, and the metadata records how many syncer inputs it has seen, so a restarted syncer
continues from exactly that input: no fragment version is applied twice or skipped.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from diloco import checkpoint
from diloco.algo import claims, outer_auto, quorum
from diloco.algo import syncer as sync
from diloco.algo.eventlog import Records, Refusals
from diloco.algo.fragments import Fragment
from diloco.runtime import ledger_ckpt

FORMAT = "diloco.syncer/1"
SYNCER_DIR = "syncer"  # <run>/syncer/: the syncer checkpoints of a threads or procs run


def _values(paths, values: dict) -> dict[str, np.ndarray]:
    return {str(i): np.asarray(values[path]) for i, path in enumerate(paths)}


def _unvalues(paths, arrays: dict) -> dict:
    return {path: np.asarray(arrays[str(i)], np.float32) for i, path in enumerate(paths)}


def _round_json(r: quorum.Round | None) -> dict | None:
    return None if r is None else r._asdict()


def _round(d: dict | None) -> quorum.Round | None:
    if d is None:
        return None
    return quorum.Round(int(d["fragment"]), d["opened_at"], tuple(int(m) for m in d["live"]),
                        tuple((int(m), t) for m, t in d["arrivals"]), tuple((int(m), t) for m, t in d["late"]),
                        d["quorum_at"], d["grace"], d["deadline"], d["closed_at"])


def to_checkpoint(st: sync.SyncerState) -> tuple[dict, dict]:
    """(arrays, meta): a pytree of numpy arrays for Orbax and a JSON-able dict for the rest."""
    arrays, frags = {}, []
    for p, fs in enumerate(st.fragments):
        paths = fs.spec.paths
        leaves = jax.tree_util.tree_leaves(fs.outer_state)
        arrays[f"f{p}"] = {
            "theta": _values(paths, fs.theta),
            "outer": {str(i): np.asarray(x) for i, x in enumerate(leaves)},
            "refs": {f"r{i}": _values(paths, v) for i, (_, v) in enumerate(fs.refs)},
            "contributions": {f"c{i}": _values(paths, c.local) for i, c in enumerate(fs.contributions)},
        }
        if fs.stats.last is not None:
            arrays[f"f{p}"]["last_delta"] = _values(paths, fs.stats.last)
        frags.append({
            "version": fs.version, "refs": [ver for ver, _ in fs.refs], "round": _round_json(fs.round),
            "norms": list(fs.norms),
            "stats": {"last_norm": fs.stats.last_norm, "seen": fs.stats.seen, "mean": fs.stats.mean},
            "contributions": [{"key": list(c.key), "base_version": c.base_version, "c_steps": c.c_steps,
                               "c_tokens": c.c_tokens, "arrived": c.arrived} for c in fs.contributions],
        })
    meta = {
        "format": FORMAT, "fragments": frags,
        "live": sorted([m, inc] for m, inc in st.live.items()),
        "last_seq": sorted([m, inc, seq] for (m, inc), seq in st.last_seq.items()),
        "held": sorted([m, list(v)] for m, v in st.held.items()),
        "step_times": {"decay": st.step_times.decay, "estimates": [list(e) for e in st.step_times.estimates]},
        "merges": st.merges, "quarantined": dict(st.quarantined), "decisions": list(st.decisions),
        "bases": sorted([*k, v] for k, v in st.bases.items()),
        "refusals": {"counts": sorted(([r, m, n] for (r, m), n in st.refusals.counts.items()),
                                      key=lambda row: (row[0], -1 if row[1] is None else row[1])),
                     "latest": list(st.refusals.latest), "total": st.refusals.total},
        "claims": claims.to_json(st.claims),
        "finished": list(st.finished),
    }
    return arrays, meta


def from_checkpoint(arrays: dict, meta: dict, policy: sync.Policy,
                    fragments: tuple[Fragment, ...]) -> sync.SyncerState:
    """The SyncerState `to_checkpoint` saw; `fragments` and `policy` come from the run's config
    (they are code, not state), and must describe the same fragmentation."""
    if meta.get("format") != FORMAT:
        raise ValueError(f"not a syncer checkpoint: format {meta.get('format')!r}, want {FORMAT!r}")
    if len(meta["fragments"]) != len(fragments):
        raise ValueError(f"checkpoint has {len(meta['fragments'])} fragments, the config makes {len(fragments)}")
    frags = []
    for p, (spec, fm) in enumerate(zip(fragments, meta["fragments"])):
        a, paths = arrays[f"f{p}"], spec.paths
        theta = _unvalues(paths, a["theta"])
        outer = a.get("outer", {})
        treedef = jax.tree_util.tree_structure(policy.outer.init(theta))
        outer_state = jax.tree_util.tree_unflatten(
            treedef, [np.asarray(outer[str(i)]) for i in range(treedef.num_leaves)])
        refs = tuple((ver, _unvalues(paths, a["refs"][f"r{i}"])) for i, ver in enumerate(fm["refs"]))
        contributions = tuple(
            sync.Contribution(tuple(c["key"]), c["base_version"], c["c_steps"], c["c_tokens"],
                              _unvalues(paths, a["contributions"][f"c{i}"]), c["arrived"])
            for i, c in enumerate(fm["contributions"]))
        stats = fm.get("stats", {})  # none before they were saved: measured afresh
        # saved only where measured; a syncer that does not measure them drops it (its memory)
        last = _unvalues(paths, a["last_delta"]) if "last_delta" in a and sync.measures(policy) else None
        frags.append(sync.FragmentState(spec, theta, outer_state, fm["version"], refs,
                                        _round(fm["round"]), contributions, tuple(fm.get("norms", ())),
                                        stats=outer_auto.Stats(last, stats.get("last_norm", 0.0),
                                                               stats.get("seen", 0), stats.get("mean", 0.0))))
    st_times = quorum.StepTimes(meta["step_times"]["decay"],
                                tuple((int(m), s) for m, s in meta["step_times"]["estimates"]))
    refused = meta.get("refusals", {"counts": [], "latest": [], "total": 0})  # none before they were bounded
    refusals = Refusals({(r, m): n for r, m, n in refused["counts"]}, tuple(refused["latest"]), refused["total"])
    return sync.SyncerState(
        tuple(frags), {m: inc for m, inc in meta["live"]},
        {(m, inc): seq for m, inc, seq in meta["last_seq"]},
        {m: tuple(v) for m, v in meta["held"]}, st_times, meta["merges"],
        dict(meta["quarantined"]), Records(meta["decisions"]),
        {(m, inc, p): v for m, inc, p, v in meta.get("bases", [])},  # none saved: every ref kept (up to history)
        refusals,
        # none saved (older checkpoints): the header's bounds only, until each learner's next merge
        claims.from_json(meta["claims"]) if "claims" in meta
        else claims.unknown({m: inc for m, inc in meta["live"]}, policy.max_steps or 0),
        tuple(int(m) for m in meta.get("finished", ())))  # none saved (older checkpoints): none finished


def pairs(d: dict) -> list:
    """A dict with int keys as JSON rows [[key, value], ...] (JSON keys are strings)."""
    return sorted([int(k), v] for k, v in d.items())


def host_out(host) -> tuple[dict, dict]:
    """(arrays, meta) of what a SyncerHost (diloco/runtime/host.py) holds besides the syncer state:
    the three ledgers and its bookkeeping of learners. The one record of a host that every
    wall-clock runtime's syncer checkpoint carries (procs restarts, threads and procs resumes)."""
    arrays, ledgers = ledger_ckpt.ledgers_out(host.tokens, host.bytes, host.time)
    meta = {"ledgers": ledgers, "stalls": host.stalls, "done": sorted(host.done),
            "finished_at": pairs(host.finished_at), "inputs_seen": host.inputs_seen,
            "incarnations": pairs(host.incarnations), "alive": sorted(host.alive),
            "refused_events": host.refused_events, "gaps": list(host.gaps.values()),
            "events_lost": host.events_lost}
    return {"ledgers": arrays}, meta


def host_in(host, state: sync.SyncerState, arrays: dict, meta: dict) -> None:
    """Put a restored syncer state and what `host_out` saw back into `host`. Checkpoints written
    before incarnations and the alive set were saved take them from the state's live set."""
    host.adopt(state)
    host.tokens, host.bytes, host.time = ledger_ckpt.ledgers_in(arrays.get("ledgers", {}), meta["ledgers"])
    host.stalls, host.inputs_seen = meta["stalls"], meta["inputs_seen"]
    host.done, host.finished_at = set(meta["done"]), dict(meta["finished_at"])
    if "incarnations" in meta:
        host.incarnations, host.alive = dict(meta["incarnations"]), set(meta["alive"])
    host.refused_events = meta.get("refused_events", 0)
    host.gaps = {(g["learner"], g["incarnation"]): g for g in meta.get("gaps", [])}
    host.events_lost = list(meta.get("events_lost", []))
    host.finish_done()


class SyncerCheckpoints:
    """Save every `every` merges (and on demand); restore the newest readable one. async_save=False
    where other threads of the process save Orbax checkpoints too (threads: they race otherwise,
    see diloco/runtime/rejoin.py). fail_s: run.checkpoint_fail_s (checkpoint.Saves)."""

    def __init__(self, directory: Path, every: int, keep: int = 2, async_save: bool = True, fail_s: float = 0.0):
        self.every = every
        self.manager = checkpoint.open_manager(directory, keep, async_save=async_save)
        self.saves = checkpoint.Saves(self.manager, "syncer checkpoint", fail_s)
        self._last_merges = 0

    def maybe_save(self, st: sync.SyncerState, inputs_seen: int) -> bool:
        if self.every <= 0 or st.merges - self._last_merges < self.every:
            return False
        self.save(st, inputs_seen)
        return True

    def save(self, st: sync.SyncerState, inputs_seen: int, step: int | None = None,
             extra: tuple[dict, dict] | None = None) -> bool:
        """Start an async save tagged with the number of syncer inputs delivered so far (also the
        Orbax step unless `step` is given); `extra` (arrays, meta) is the runtime's own bookkeeping,
        saved in the same step under "extra". True if the save started. A failed save (a full
        disk, an async commit that failed) is logged and the run goes on: the previous checkpoint
        still stands, and the next save is the retry (checkpoint.Saves)."""
        arrays, meta = to_checkpoint(st)
        meta["inputs_seen"] = inputs_seen
        if extra is not None:
            arrays["extra"], meta["extra"] = extra
        step = inputs_seen if step is None else step
        if not self.saves.save(step, arrays, meta):
            return False
        self._last_merges = st.merges
        return True

    def latest(self, policy: sync.Policy, fragments: tuple[Fragment, ...]) -> tuple[sync.SyncerState, int] | None:
        """(state, inputs_seen) of the newest readable checkpoint, or None."""
        found = self.latest_raw(policy, fragments)
        return None if found is None else (found[0], int(found[2]["inputs_seen"]))

    def latest_raw(self, policy: sync.Policy,
                   fragments: tuple[Fragment, ...]) -> tuple[sync.SyncerState, dict, dict] | None:
        """(state, arrays, meta) of the newest usable checkpoint (arrays and meta as saved, with
        "extra" if the save had it), or None. A step that fails to read, to verify against its
        digests or to rebuild a syncer (a missing field) is skipped with a warning naming it, and the
        next older one is tried (docs/design.md#checkpoint-integrity)."""
        self.saves.settle(fatal=False)

        def read(step: int):
            arrays, meta = checkpoint.restore_untyped(self.manager, step)
            if not isinstance(meta.get("inputs_seen"), int) or meta["inputs_seen"] < 0:
                raise checkpoint.Damaged(f"inputs_seen is {meta.get('inputs_seen')!r}, not a count")
            return from_checkpoint(arrays, meta, policy, fragments), arrays, meta

        found = checkpoint.newest(self.manager, read, "syncer checkpoint")
        return None if found is None else found[1]

    def close(self) -> None:
        self.saves.close()

