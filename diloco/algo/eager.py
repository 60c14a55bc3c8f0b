"""Eager outer steps: a learner's own pseudo-gradient stands in for the merged one until that arrives
(docs/algorithm.md#eager-outer-steps).

Reference: Kale, Douillard and Donchev, "Eager Updates For Overlapped Communication and Computation
in DiLoCo" (arXiv 2502.12996).

A learner keeps, per fragment, an anchor A = Theta_held - sum of the stand-ins u_i of its sends still
in flight. It sends Delta = A - theta (the progress since its last send), moves A by that send's
stand-in u = s Delta and puts theta at the new A. When a merged version arrives, A is rebuilt from
it, and theta moves by the same amount as A: the correction, merged change minus the stand-ins it
answers. Pure numpy on {path: array} dicts; diloco/runtime/unit.py moves the arrays.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import optax

Values = Mapping[tuple[str, ...], np.ndarray]


def gain(opt: optax.GradientTransformation) -> float:
    """What the outer optimizer moves Theta by, per unit of a fresh pseudo-gradient, from a zero state:
    lr for SGD, lr (1 + momentum) for Nesterov, 1 for averaging, lr / N for Delayed Nesterov (N > 1).
    Read off the optimizer itself, so every entry of diloco.algo.outer.OUTER has one."""
    zero = np.zeros((), np.float32)
    updates, _ = opt.update(np.ones((), np.float32), opt.init(zero), zero)
    return float(-np.asarray(updates))


def stand_in_scale(opt: optax.GradientTransformation, share: float) -> float:
    """s in u = s Delta_m: the outer step's gain times the share of the merged pseudo-gradient the
    learner's own stands in for (fragments.eager_share): 1, its own for the whole merge; 1/M, its
    own part only (the paper's (1/M) Delta_m^(t), the others' part coming with the correction)."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"eager share {share!r} must lie in (0, 1]")
    return gain(opt) * share


def stand_in(delta: Values, scale: float) -> dict:
    """u = scale * Delta: what the learner expects its own contribution to move Theta by."""
    return {path: np.asarray(scale * np.asarray(d, np.float32), np.float32) for path, d in delta.items()}


def anchor(theta: Values, stand_ins: Iterable[Values]) -> dict:
    """A = Theta - sum of the stand-ins not yet answered. With none it is Theta itself, bit for bit."""
    out = {path: np.asarray(x, np.float32) for path, x in theta.items()}
    for u in stand_ins:
        out = {path: np.asarray(x - u[path], np.float32) for path, x in out.items()}
    return out


def moved(local: np.ndarray, before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """theta when the anchor moves from `before` to `after`: the new anchor plus the progress made
    since the last send (local - before). With no progress (local == before) it is `after` exactly."""
    return np.asarray(after + (np.asarray(local, np.float32) - before), np.float32)
