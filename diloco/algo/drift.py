"""The drift monitor of a Decoupled DiLoCo run (docs/finetuning.md#drift-monitor): how far the global
model moved from the base per fragment, and how much the learners' pseudo-gradients of one round
agree, both from what the syncer already holds (a round's running sums and norms; Theta and
Theta_0), with no extra pass over the wire.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from diloco.algo import roundsum
from diloco.algo.merge import MergeRule


def agreement(rs: roundsum.RoundSum, rule: MergeRule, clips: Sequence[float],
              squares: Sequence[float] | None = None) -> float | None:
    """The mean cosine between the vectors a round folds into its sum, v_m = k_m delta_m (per
    tensor k_mt from the merge rule, times the clip factor where the rule folds it in):

        cos = (||sum_m v_m||^2 - sum_m ||v_m||^2) / ((sum_m ||v_m||)^2 - sum_m ||v_m||^2),

    since ||sum_m v_m||^2 = sum_m ||v_m||^2 + 2 sum_{m<m'} ||v_m|| ||v_m'|| cos(v_m, v_m'): the
    mean of the pairwise cosines weighted by ||v_m|| ||v_m'||, which is their plain mean when the
    ||v_m|| are equal (RDA at equal token weights) and the cosine itself for two learners. Under
    `average` and `rda_fragment` v_m is a multiple of delta_m, so these are the pseudo-gradients'
    cosines; under per-tensor `rda` the cosines of their per-tensor directions. None with fewer
    than two contributions (or a zero one). One norm pass over the sums, nothing else, and none
    when the caller has their `squares` (sum of squares per tensor, None for a None sum): the
    syncer takes them once for this and the close's unit merge."""
    if len(rs.parts) < 2:
        return None
    lengths = []
    for part, clip in zip(rs.parts, clips):
        k = rule.coefficients(part.weight, part.norms)
        c = clip if rule.clip_rebuilds else 1.0
        lengths.append(math.sqrt(math.fsum((kt * c * n) ** 2 for kt, n in zip(k, part.norms))))
    if not all(0.0 < x < math.inf for x in lengths):
        return None
    if squares is None:
        squares = [roundsum.norm(s) ** 2 if s is not None else 0.0 for s in rs.sums]
    total = math.fsum(z * z * sq for s, z, sq in zip(rs.sums, rs.scales, squares) if s is not None)
    own = math.fsum(x * x for x in lengths)
    # sum over m < m' of 2 ||v_m|| ||v_m'||, summed pair by pair: (sum ||v||)^2 - own cancels to 0
    # when one vector dwarfs the rest (a fuzzed 1e19 against 0.07 divided by zero)
    pairs = math.fsum(2.0 * a * b for i, a in enumerate(lengths) for b in lengths[i + 1:])
    cosine = (total - own) / pairs if pairs > 0 else math.nan
    # the numerator cancels the same way: a value rounding put outside [-1, 1] says nothing
    if not math.isfinite(cosine) or abs(cosine) > 1.0 + 1e-6:
        return None
    return max(-1.0, min(1.0, cosine))


def distance(theta: Mapping, base: Mapping, fragments) -> list[dict]:
    """Per fragment: ||Theta_p - Theta_0,p|| (l2) and that over ||Theta_0,p|| (rel; None where
    the base is zero, as LoRA's B matrices start)."""
    out = []
    for f in fragments:
        d2 = b2 = 0.0
        for path in f.paths:
            a, b = np.asarray(theta[path], np.float64), np.asarray(base[path], np.float64)
            d2 += float(np.sum((a - b) ** 2))
            b2 += float(np.sum(b * b))
        out.append({"fragment": f.index, "l2": math.sqrt(d2), "rel": math.sqrt(d2 / b2) if b2 > 0 else None})
    return out


def summary(theta: Mapping, base: Mapping, fragments) -> dict:
    """The summary's distance fields: per fragment, and the largest of each (None where none)."""
    per = distance(theta, base, fragments)
    rel = [d["rel"] for d in per if d["rel"] is not None]
    return {"drift": per, "drift_rel_max": max(rel) if rel else None,
            "drift_l2_max": max(d["l2"] for d in per) if per else None}
