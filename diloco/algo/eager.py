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
from typing import NamedTuple

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


class Momentum(NamedTuple):
    """The syncer's outer momentum as a learner follows it: b <- mu b + g at every merge of
    pseudo-gradient g; Nesterov moves Theta by lr (g + mu b), heavy ball by lr b. `share` is
    fragments.eager_share: the part of the merged g the learner's own Delta stands in for."""

    lr: float
    mu: float
    nesterov: bool
    share: float


def momentum_of(name: str, lr: float, momentum, share: float) -> Momentum | None:
    """Momentum a learner can follow, or None where the zero-state gain is the whole stand-in:
    `average` and momentum 0 have none, `delayed_nesterov` steps only every N arrivals and
    momentum=auto sets mu per merge from statistics the learner never sees."""
    if name not in ("nesterov", "sgd") or isinstance(momentum, str) or not momentum > 0.0:
        return None
    return Momentum(float(lr), float(momentum), name == "nesterov", float(share))


def carried(mom: Momentum, b: Values | None) -> dict:
    """What the next merge moves Theta by whatever it merges, from the momentum b it starts with:
    lr mu^2 b (Nesterov), lr mu b (heavy ball). The stand-in adds it to s Delta."""
    k = mom.lr * mom.mu * (mom.mu if mom.nesterov else 1.0)
    return {} if b is None else {path: np.asarray(k * x, np.float32) for path, x in b.items()}


def pushed(mom: Momentum, b: Values | None, g: Values) -> dict:
    """b after a merge of pseudo-gradient g: g + mu b (b None: zero)."""
    if b is None:
        return {path: np.asarray(x, np.float32) for path, x in g.items()}
    return {path: np.asarray(g[path] + mom.mu * b[path], np.float32) for path in g}


def pushed_part(mom: Momentum, b: Values | None, g: Values, share: float) -> dict:
    """b after `share` of a merge of pseudo-gradient g, b + share (g + mu b - b): the expected
    momentum when a send is one of 1 / share sends the syncer sums into one merge (share 1: pushed)."""
    if share == 1.0:
        return pushed(mom, b, g)
    if b is None:
        return {path: np.asarray(share * np.asarray(x, np.float32), np.float32) for path, x in g.items()}
    keep = 1.0 - share + share * mom.mu
    return {path: np.asarray(keep * b[path] + share * g[path], np.float32) for path in g}


def merged(mom: Momentum, b: Values | None, g: Values) -> tuple[dict, dict]:
    """One merge of pseudo-gradient g from momentum b: (the move, before - after, b after)."""
    after = pushed(mom, b, g)
    if mom.nesterov:
        return {path: np.asarray(mom.lr * (g[path] + mom.mu * after[path]), np.float32) for path in g}, after
    return {path: np.asarray(mom.lr * x, np.float32) for path, x in after.items()}, after


def rebuilt(mom: Momentum, b: Values | None, move: Values, guesses: list[Values | None]) -> dict:
    """The syncer's momentum after len(guesses) merges that moved Theta by `move` (before - after)
    from momentum b. Each merge's pseudo-gradient is taken as its guess (the learner's own for a
    send it answered; None: zero) plus one offset c common to all, solved so the moves add up to
    `move` (they are linear in c). One merge, Nesterov: move / lr = (1 + mu) g + mu^2 b, so an error
    in b shrinks by mu / (1 + mu) < 1/2 each merge."""
    guessed, unit, total, per_c = b, None, None, 0.0
    for g in guesses:
        g = {path: np.zeros_like(x, np.float32) for path, x in move.items()} if g is None else g
        step, guessed = merged(mom, guessed, g)
        total = step if total is None else {path: total[path] + step[path] for path in step}
        one, unit = merged(mom, unit, {(): np.float32(1.0)})
        per_c += float(one[()])
    c = {path: (np.asarray(move[path], np.float32) - total[path]) / np.float32(per_c) for path in move}
    return {path: np.asarray(guessed[path] + unit[()] * c[path], np.float32) for path in move}
