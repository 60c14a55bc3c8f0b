"""The outer optimizer's measured statistics per fragment, and outer.momentum=auto's rule that sets
the momentum from them (docs/algorithm.md#outer-statistics-and-automatic-momentum); the step is then
lr (1 - mu) (diloco/algo/outer.py), so the momentum averages rounds and never enlarges the step.

Per merge the syncer's close returns the merged pseudo-gradient Delta_t, its norm and its dot
product with the previous one, Delta_{t-1}, kept here; so the consecutive cosine
c_t = <Delta_t, Delta_{t-1}> / (||Delta_t|| ||Delta_{t-1}||) costs one multiply-add per value in a
pass that reads Delta_t anyway. The rule (`momentum`) is a pure function of the running mean of c_t.

Reference for the idea that momentum should follow how persistent the update direction is: YellowFin
(Zhang and Mitliagkas, arXiv 1706.03471) tunes momentum from measured gradient statistics; GONO
(arXiv 2605.06575) raises Adam's momentum with the consecutive gradients' cosine and lowers it on
oscillation.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from diloco.algo.fragments import Path

Values = dict[Path, np.ndarray]


def measured(setting: str, auto_momentum: bool) -> bool:
    """syncer.outer_stats resolved: whether a run's syncer measures the consecutive cosine, keeping
    each fragment's last merged pseudo-gradient for it (a float32 copy of the model in all): "on",
    or "auto" (the default) only where outer.momentum=auto sets momenta from it; "off" never."""
    return setting == "on" or (setting == "auto" and auto_momentum)


class Rule(NamedTuple):
    """outer.momentum=auto: mu = clip(c_bar, 0, ceiling) once `after` cosines are measured, `warmup`
    before; c_bar the mean of the consecutive cosines, exponentially weighted by `beta` per merge
    and bias-corrected (an EMA started at 0 divided by 1 - beta^n, as Adam's moments are)."""

    ceiling: float = 0.9  # DiLoCo's momentum; 1 / (1 - mu) is the step's gain along a fixed direction
    warmup: float = 0.0  # make train's tuned momentum, until the statistics say more
    after: int = 2  # cosines measured before the rule takes over (the 3rd merge of a fragment on)
    beta: float = 0.8  # about the last 5 merges: a fragment of make train has 12 in all


class Stats(NamedTuple):
    """A fragment's statistics of its merged pseudo-gradients (part of the syncer's state, saved
    with its checkpoints: diloco/runtime/syncer_ckpt.py)."""

    last: Values | None = None  # Delta_{t-1}, the previous merged pseudo-gradient (None: none yet)
    last_norm: float = 0.0
    seen: int = 0  # consecutive cosines measured
    mean: float = 0.0  # their EMA, not bias-corrected (see Rule)


def cosine(dot: float, norm: float, last_norm: float) -> float | None:
    """<a, b> / (||a|| ||b||), None where it says nothing: a zero or non-finite norm or dot, or a
    value that rounding put outside [-1, 1] by more than float32's error."""
    if not (norm > 0.0 and last_norm > 0.0 and math.isfinite(dot) and math.isfinite(norm * last_norm)):
        return None
    c = dot / (norm * last_norm)
    if not math.isfinite(c) or abs(c) > 1.0 + 1e-4:
        return None
    return max(-1.0, min(1.0, c))


def observe(rule: Rule, stats: Stats, delta: Values, norm: float, dot: float) -> tuple[Stats, float | None]:
    """stats after a merge whose pseudo-gradient is `delta` (norm `norm`, `dot` with stats.last),
    and the consecutive cosine measured (None at a fragment's first merge, or none to measure)."""
    c = cosine(dot, norm, stats.last_norm) if stats.last is not None else None
    seen, mean = stats.seen, stats.mean
    if c is not None:
        seen, mean = seen + 1, rule.beta * mean + (1.0 - rule.beta) * c
    return Stats(delta, norm, seen, mean), c


def mean_cosine(rule: Rule, stats: Stats) -> float | None:
    """c_bar: the bias-corrected EMA of the consecutive cosines, None before any."""
    return stats.mean / (1.0 - rule.beta ** stats.seen) if stats.seen else None


def momentum(rule: Rule, stats: Stats) -> float:
    """The momentum of a fragment's next outer step. An EMA of decay mu weights the update k merges
    back by mu^k; if successive pseudo-gradients are correlated as an AR(1) sequence, c_k = c^k, so
    mu = c gives the momentum buffer the memory the direction itself has. A direction that reverses
    (c <= 0) gets none: momentum would carry an update the fragment has already turned from."""
    c = mean_cosine(rule, stats)
    if c is None or stats.seen < rule.after:
        return rule.warmup
    return min(max(c, 0.0), rule.ceiling)
