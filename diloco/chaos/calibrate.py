"""Fit the goodput simulator's time constants on the paper's two data-parallel rows only
(Decoupled DiLoCo, Table 1; docs/experiments.md#goodput-at-millions-of-chips), then predict Decoupled DiLoCo untuned.

scipy is not a dependency: a golden-section search on a log scale fits the restart time and a
Nelder-Mead simplex on log scales the reconfiguration and repair times. Every evaluation reuses
the same seeds (common random numbers), so the objective is a smooth function of the constants.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import numpy as np

from diloco.chaos.goodput import Constants, average

PAPER_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
# Goodput at MTBI 1 year per chip. dp and elastic_dp are fitted; diloco M = 8 is the check.
PAPER = {
    ("dp", 1): (0.72, 0.57, 0.38, 0.27, 0.18),
    ("elastic_dp", 1): (0.88, 0.80, 0.69, 0.58, 0.40),
    ("diloco", 8): (0.98, 0.96, 0.94, 0.88, 0.80),
}
FITTED = (("dp", 1), ("elastic_dp", 1))
# search ranges (seconds): wide enough that no fit sits on a bound
RESTART_RANGE = (1.0, 3600.0)
RECONFIG_RANGE = (0.1, 600.0)
REPAIR_RANGE = (1.0, 1.0e6)


def row(mode: str, c: Constants, chips: tuple[int, ...], horizon_s: float, seeds: int,
        learners: int = 1) -> np.ndarray:
    """Simulated goodput of one mode at every chip count."""
    return np.array([average(mode, n, c, horizon_s, seeds, learners).goodput for n in chips])


def golden(f: Callable[[float], float], lo: float, hi: float, tol: float = 2e-3) -> float:
    """Minimiser of a unimodal f on [lo, hi], searched on a log scale to relative `tol`."""
    a, b = math.log(lo), math.log(hi)
    r = (math.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = b - r * (b - a), a + r * (b - a)
    f1, f2 = f(math.exp(x1)), f(math.exp(x2))
    while b - a > tol:
        if f1 <= f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - r * (b - a)
            f1 = f(math.exp(x1))
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + r * (b - a)
            f2 = f(math.exp(x2))
    return math.exp((a + b) / 2.0)


def sse(sim: np.ndarray, target: tuple[float, ...]) -> float:
    """Sum of squared errors in goodput points: the fits are least squares over a row's cells."""
    return float(np.sum((100.0 * (sim - np.asarray(target))) ** 2))


def fit_dp(base: Constants, horizon_s: float, seeds: int, chips: tuple[int, ...] = PAPER_CHIPS,
           target: tuple[float, ...] = PAPER[("dp", 1)]) -> Constants:
    """restart_s from the no-elasticity row."""

    def err(x: float) -> float:
        return sse(row("dp", replace(base, restart_s=x), chips, horizon_s, seeds), target)

    return replace(base, restart_s=golden(err, *RESTART_RANGE))


def fit_reconfig(base: Constants, horizon_s: float, seeds: int, chips: tuple[int, ...] = PAPER_CHIPS,
                 target: tuple[float, ...] = PAPER[("elastic_dp", 1)]) -> Constants:
    """reconfig_s alone from the elastic row, repair_s held (the profile over repair times)."""

    def err(x: float) -> float:
        return sse(row("elastic_dp", replace(base, reconfig_s=x), chips, horizon_s, seeds), target)

    return replace(base, reconfig_s=golden(err, *RECONFIG_RANGE, tol=5e-3))


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, step: float = 0.7,
                tol: float = 2e-3, max_evals: int = 200) -> np.ndarray:
    """Minimiser of f near x0 (Nelder-Mead simplex). Used for the two elastic constants, whose
    least-squares valley is diagonal (a shorter pause trades against more slices down), where
    alternating one-dimensional searches crawl."""
    simplex = [np.asarray(x0, float)] + [x0 + step * e for e in np.eye(len(x0))]
    values = [f(x) for x in simplex]
    evals = len(values)
    while evals < max_evals:
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if max(np.abs(x - simplex[0]).max() for x in simplex[1:]) < tol:
            break
        centre = np.mean(simplex[:-1], axis=0)
        worst = simplex[-1]
        xr = centre + (centre - worst)
        fr = f(xr)
        evals += 1
        if fr < values[0]:
            xe = centre + 2.0 * (centre - worst)
            fe = f(xe)
            evals += 1
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = centre + 0.5 * (worst - centre) if fr >= values[-1] else centre + 0.5 * (xr - centre)
            fc = f(xc)
            evals += 1
            if fc < min(fr, values[-1]):
                simplex[-1], values[-1] = xc, fc
            else:  # shrink towards the best point
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
                evals += len(simplex) - 1
    return simplex[int(np.argmin(values))]


def fit_elastic(base: Constants, horizon_s: float, seeds: int, chips: tuple[int, ...] = PAPER_CHIPS,
                target: tuple[float, ...] = PAPER[("elastic_dp", 1)], restarts: int = 6,
                tol: float = 5e-3) -> Constants:
    """reconfig_s and repair_s from the elastic row, searched on log scales within their ranges."""

    def at(x: np.ndarray) -> Constants:
        return replace(base, reconfig_s=float(np.clip(math.exp(x[0]), *RECONFIG_RANGE)),
                       repair_s=float(np.clip(math.exp(x[1]), *REPAIR_RANGE)))

    def err(x: np.ndarray) -> float:
        return sse(row("elastic_dp", at(x), chips, horizon_s, seeds), target)

    # The objective is slightly jagged (a pause boundary moving past an event shifts later pauses)
    # and flat along repair_s, where a simplex can stall; restarting it from its best point until
    # a restart no longer improves is the usual remedy.
    x = np.log([base.reconfig_s, base.repair_s])
    best = err(x)
    for _ in range(restarts):
        x_new = nelder_mead(err, x, tol=tol)
        new = err(x_new)
        if new >= best - 1e-3 * max(best, 1.0):
            x, best = (x_new, new) if new < best else (x, best)
            break
        x, best = x_new, new
    return at(x)


def calibrate(base: Constants, horizon_s: float, seeds: int, restarts: int = 6) -> Constants:
    """All three time constants, each from its own data-parallel row; nothing from DiLoCo.

    The search starts from base's reconfig_s and repair_s."""
    return fit_elastic(fit_dp(base, horizon_s, seeds), horizon_s, seeds, restarts=restarts)
