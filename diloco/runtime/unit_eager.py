"""A learner unit's two eager moves: the stand-in step at a send, the correction at an apply
(docs/algorithm.md#eager-outer-steps; the math is diloco/algo/eager.py).

Reference: Kale, Douillard and Donchev, "Eager Updates For Overlapped Communication and Computation
in DiLoCo" (arXiv 2502.12996).

Kept out of diloco/runtime/unit.py, which calls these with itself: they read and write the unit's
params, `eager_anchor` (per fragment, the anchor A) and `stand_ins` (per send in flight, by seq).
Everything stays on the host: eager units encode there (unit.py turns the device encoder off).
"""

from __future__ import annotations

import jax
import numpy as np

from diloco.algo import eager
from diloco.algo import learner as lsm
from diloco.algo.fragments import get_path
from diloco.algo.merge import pseudo_gradient


def send(unit, s: lsm.Send) -> tuple[dict, dict]:
    """The stand-in step of send `s`: Delta = A - theta, u = s Delta (plus, under an outer momentum,
    the move it carries into the answering merge), A <- A - u, theta <- A. Returns what its frame
    encodes: (local values, the anchor before the step), whose difference is Delta."""
    p = s.fragment
    live = {path: get_path(unit.state.params, path) for path in unit.spec.fragments[p].paths}
    local = {path: np.asarray(x, np.float32) for path, x in jax.device_get(live).items()}
    before = unit.eager_anchor[p]
    delta = pseudo_gradient({path: before[path] for path in local}, local)
    u = eager.stand_in(delta, unit.spec.schedule.stand_in)
    mom = unit.spec.eager_momentum
    if mom is not None:  # the momentum as the merge answering s will find it: the held one, pushed by
        b, part = _momentum_before(unit, p)  # each send still in flight before s
        if b is not None:  # a merge carries it once, whatever number of sends it sums: each its part
            k = eager.carried(mom, b)
            u = {path: np.asarray(x + part * k[path], np.float32) for path, x in u.items()}
        unit.guesses[s.seq] = eager.stand_in(delta, mom.share)
    after = eager.anchor(before, (u,))
    unit.stand_ins[s.seq] = u
    unit.eager_anchor[p] = after
    unit.state = unit.state.replace(params=unit._put(unit.state.params, live, after))
    return local, before


def _momentum_before(unit, p: int) -> tuple[dict | None, float]:
    """Fragment p's outer momentum rebuilt up to the held version, pushed by the guessed merged
    pseudo-gradient of each of its sends in flight, in order: one merge each, or 1/k of one where the
    last apply showed k of its sends summed into one merge (a round held open by a slow quorum,
    syncer_merge.summed); None: zero. With it that part, 1/k, of a merge this send stands for."""
    flying = {f.seq for f in unit.ls.in_flight if f.fragment == p}
    b = unit.momenta.get(p)
    share = 1.0 / unit.sends_per_merge.get(p, 1.0)
    for seq in sorted(unit.guesses):
        if seq in flying:
            b = eager.pushed_part(unit.spec.eager_momentum, b, unit.guesses[seq], share)
    return b, share


def apply(unit, ready: tuple[lsm.Pending, ...], left: tuple[lsm.InFlight, ...] = ()) -> tuple[lsm.Pending, ...]:
    """Apply merged versions eagerly: A <- Theta_new - (stand-ins of the sends still in flight),
    theta moves by the same amount (the correction). Stand-ins of sends that left flight (answered,
    or given up) are dropped: an answered one is inside Theta now, a lost one is withdrawn.
    Nothing is overwritten, so nothing is returned for the ledger's "overwritten"."""
    flying = {f.seq: f.fragment for f in unit.ls.in_flight}
    unit.stand_ins = {seq: u for seq, u in unit.stand_ins.items() if seq in flying}
    guessed, unit.guesses = unit.guesses, {seq: g for seq, g in unit.guesses.items() if seq in flying}
    mom = unit.spec.eager_momentum
    params = unit.state.params
    for q in ready:
        p = q.fragment
        version, values = unit.latest[p]
        if mom is not None:  # the syncer's momentum after the version applied, from the move it made
            unit.momenta[p] = _rebuilt(unit, q, version, values, guessed)
            if q.answers:  # the merges took in len(q.answers) contributions of these sends, repeats summed
                sends = sum(1 for f in left if f.fragment == p and f.seq <= max(q.answers))
                unit.sends_per_merge[p] = max(1.0, sends / len(q.answers))
        unit.anchors[p] = (version, values)
        before = unit.eager_anchor[p]
        after = eager.anchor(values, [u for seq, u in sorted(unit.stand_ins.items()) if flying[seq] == p])
        unit.eager_anchor[p] = after
        olds = {path: get_path(params, path) for path in after}
        locals_ = jax.device_get(olds)
        params = unit._put(params, olds, {path: eager.moved(locals_[path], before[path], after[path])
                                          for path in after})
    unit.state = unit.state.replace(params=params)
    return ()


def _rebuilt(unit, q: lsm.Pending, version: int, values: dict, guessed: dict) -> dict:
    """Fragment q's momentum once `version` (`values`) is applied: the held one taken through the merges
    since the held version, guessed as this learner's own sends they answered where there is one
    merge per answered send, else all alike (eager.rebuilt)."""
    held_version, held = unit.anchors[q.fragment]
    n = max(version - held_version, 1)
    own = [guessed.get(seq) for seq in q.answers]
    guesses = own if len(own) == n and None not in own else [None] * n
    move = {path: np.asarray(held[path], np.float32) - np.asarray(values[path], np.float32) for path in values}
    return eager.rebuilt(unit.spec.eager_momentum, unit.momenta.get(q.fragment), move, guesses)
