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
    """The stand-in step of send `s`: Delta = A - theta, u = s Delta, A <- A - u, theta <- A. Returns
    what its frame encodes: (local values, the anchor before the step), whose difference is Delta."""
    p = s.fragment
    live = {path: get_path(unit.state.params, path) for path in unit.spec.fragments[p].paths}
    local = {path: np.asarray(x, np.float32) for path, x in jax.device_get(live).items()}
    before = unit.eager_anchor[p]
    u = eager.stand_in(pseudo_gradient({path: before[path] for path in local}, local), unit.spec.schedule.stand_in)
    after = eager.anchor(before, (u,))
    unit.stand_ins[s.seq] = u
    unit.eager_anchor[p] = after
    unit.state = unit.state.replace(params=unit._put(unit.state.params, live, after))
    return local, before


def apply(unit, ready: tuple[lsm.Pending, ...]) -> tuple[lsm.Pending, ...]:
    """Apply merged versions eagerly: A <- Theta_new - (stand-ins of the sends still in flight),
    theta moves by the same amount (the correction). Stand-ins of sends that left flight (answered,
    or given up) are dropped: an answered one is inside Theta now, a lost one is withdrawn.
    Nothing is overwritten, so nothing is returned for the ledger's "overwritten"."""
    flying = {f.seq: f.fragment for f in unit.ls.in_flight}
    unit.stand_ins = {seq: u for seq, u in unit.stand_ins.items() if seq in flying}
    params = unit.state.params
    for q in ready:
        p = q.fragment
        version, values = unit.latest[p]
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
