"""Closing a fragment's round in the syncer: the admitted contributions' running sums, clipping,
the merge and outer step (one jitted pass, diloco/algo/close.py), dropping a contribution that
would make Theta non-finite, and the decision record (docs/algorithm.md#merge).

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), section 4.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from diloco.algo import close as closing
from diloco.algo import merge as merging
from diloco.algo import claims, drift, messages, outer, outer_auto, quorum, roundsum
from diloco.algo import syncer_publish as publishing
from diloco.algo.codecs import NonFiniteError
from diloco.algo.syncer_state import (
    Contribution, FragmentState, Outcome, Policy, Publish, SyncerState, anchor_of, decision_record, expected,
    measures, merge_rule, quarantine, with_fragment,
)


def prepare(cfg: Policy, fs: FragmentState, c: Contribution) -> tuple[list, tuple[float, ...]]:
    """c's deltas (fresh arrays, path order) against the anchor of fs's round, and their norms."""
    anchor = anchor_of(cfg, fs, c.base_version)
    deltas, norms = [], []
    for path in fs.theta:
        if isinstance(c.local, roundsum.Local):  # the same arithmetic as at its arrival, bit for bit
            d, _, n = roundsum.delta(anchor[path], c.local.ref[path], c.local.wire(path))
        else:  # restored from a checkpoint as local values: anchor - local, the same bits again
            d, n = roundsum.delta_of_local(anchor[path], c.local[path])
        deltas.append(d)
        norms.append(n)
    return deltas, tuple(norms)


def summed(cfg: Policy, fs: FragmentState, earlier: Contribution, later: Contribution) -> Contribution:
    """An eager learner's repeat (Policy.eager): one contribution whose pseudo-gradient is the sum of
    both, over both one's steps and tokens. Each was taken against an anchor its previous send's
    stand-in moved, so neither holds the other's progress (docs/algorithm.md#eager-outer-steps);
    without eager steps the later one holds the earlier one's and replaces it instead."""
    deltas, _ = prepare(cfg, fs, earlier)
    local = roundsum.Summed(later.local, dict(zip(fs.theta, deltas)))
    return later._replace(c_steps=earlier.c_steps + later.c_steps, c_tokens=earlier.c_tokens + later.c_tokens,
                          local=local)


def round_sums(cfg: Policy, fs: FragmentState, inside, scales=None) -> roundsum.RoundSum:
    """The running sums of `inside`: fs.sums when they are exactly those, else rebuilt by folding
    them again in order (REPEAT, overflow, clipped averages, a restored checkpoint: all rare)."""
    keys = tuple(c.key for c in inside)
    if scales is None and fs.sums is not None and fs.sums.keys == keys:
        return fs.sums
    rule = merge_rule(cfg, fs)
    rs = roundsum.empty(fs.theta)
    for i, c in enumerate(inside):
        deltas, norms = prepare(cfg, fs, c)
        rs = roundsum.fold(rs, c.key, merging.token_weight(c.c_tokens, c.c_steps), deltas, norms, rule,
                           1.0 if scales is None else scales[i])
    return rs


def merge_round(cfg: Policy, st: SyncerState, p: int, decision: quorum.Decision,
           now: float) -> tuple[SyncerState, tuple]:
    fs = st.fragments[p]
    inside = [c for c in fs.contributions if c.key[0] in decision.admitted]
    rs = round_sums(cfg, fs, inside)
    fs = fs._replace(round=None, contributions=(), sums=None)
    st = with_fragment(st, p, fs)
    rule = merge_rule(cfg, fs)
    scales, clipped = _clipped(cfg, fs, inside, rs)
    if rule.clip_rebuilds and clipped:  # a clipped delta is in the sum whole: sum again, scaled
        rs = round_sums(cfg, fs, inside, scales)
    dropped: tuple = ()
    while True:
        weights = [merging.token_weight(c.c_tokens, c.c_steps) for c in inside]
        if not inside or sum(weights) <= 0:  # nothing with weight: no step, nothing published
            return st, dropped + tuple(Outcome(c.key, "excluded") for c in inside)
        # the sums' squares, once for the agreement and the unit merge (only where either needs them)
        squares = (closing.sum_squares([s if s is not None else np.zeros(0, np.float32) for s in rs.sums])
                   if rule.per is not None or len(rs.parts) > 1 else None)
        cosine = drift.agreement(rs, rule, scales, squares)  # before the close, which may reuse the sums' buffers
        stepped = _step(cfg, st, fs, p, rs, weights, scales, rule, tuple(c.key for c in inside), squares)
        if stepped is not None:
            break
        # Non-finite: drop the largest pseudo-gradient (every one was finite, so only size can
        # overflow) and merge the rest; Theta, its optimizer state and the version stay as they were.
        worst = max(range(len(inside)), key=lambda i: scales[i] * rs.parts[i].norm)
        c = inside.pop(worst)
        del scales[worst]
        rs = round_sums(cfg, fs, inside, scales if rule.clip_rebuilds else None)
        st, quarantined = quarantine(st, "overflow", c.key, now, f"merging it into fragment {p} "
                                      f"version {fs.version + 1} would make Theta non-finite")
        dropped += quarantined
    st, publish, delta_norm, update_cos, momentum = stepped
    record = {
        **decision_record("merge", decision, None), "version": fs.version + 1, "method": rule.name,
        "learners": [c.key[0] for c in inside], "weights": weights,
        "staleness": [fs.version - c.base_version for c in inside],
        "delta_norm": delta_norm, "clipped": [c.key[0] for c in inside if c.key in clipped],
        "cosine": cosine,  # the drift monitor's agreement of this round's pseudo-gradients (algo/drift.py)
    }
    if measures(cfg):  # with the fragment's previous merged pseudo-gradient (algo/outer_auto.py)
        record["update_cos"] = update_cos
    if momentum is not None:  # outer.momentum=auto: the momentum this step used
        record["momentum"] = momentum
    st = st._replace(merges=st.merges + 1, decisions=st.decisions.add(record),
                     claims=claims.merged(st.claims, [(*c.key[:2], p) for c in inside]))
    return st, dropped + (publish,) + tuple(Outcome(c.key, "merged") for c in inside)


def _clipped(cfg: Policy, fs: FragmentState, inside: list[Contribution],
             rs: roundsum.RoundSum) -> tuple[list[float], set[tuple[int, int, int]]]:
    """Each delta's clip factor: with norm per step (over at most cfg.clip_span steps) above cfg.clip
    x the median of the fragment's recent nonzero ones it is scaled down onto that bar (direction
    kept); and the keys scaled."""
    recent = [n for n in fs.norms if n > 0]
    scales = [1.0] * len(inside)
    if cfg.clip <= 0 or not recent:
        return scales, set()
    bar = cfg.clip * float(np.median(recent))
    clipped = set()
    for i, (c, part) in enumerate(zip(inside, rs.parts)):
        allowed = bar * max(c.c_steps if cfg.clip_span is None else min(c.c_steps, cfg.clip_span), 1)
        if part.norm > allowed:
            scales[i] = float(np.float32(allowed / part.norm))  # the float32 factor a delta was scaled by
            clipped.add(c.key)
    return scales, clipped


def _step(cfg: Policy, st: SyncerState, fs: FragmentState, p: int, rs: roundsum.RoundSum,
          weights: list[float], scales: list[float], rule: merging.MergeRule,
          keys: tuple[tuple[int, int, int], ...], squares: list[float] | None = None
          ) -> tuple[SyncerState, Publish, float, float | None, float | None] | None:
    """Merge, take the outer step and publish: (state, publish, ||merged delta||, its cosine with the
    previous one, the momentum set by outer.momentum=auto or None); None if anything published or
    kept would be non-finite (an encoder would refuse it, and a non-finite Theta never recovers)."""
    if not all(math.isfinite(part.norm) for part in rs.parts):  # a delta overflowed float32 itself
        return None
    waited = len(expected(st, {k[0] for k in keys}))  # live, less those that finished and are not in
    live = len(keys) / waited if cfg.scale == "live" and len(keys) < waited else 1.0
    gains = [g * live for g in rule.gains(weights, scales, [part.norms for part in rs.parts], rs.scales)]
    sums = {path: (s if s is not None else np.zeros(x.shape, np.float32))
            for (path, x), s in zip(fs.theta.items(), rs.sums)}
    with np.errstate(over="ignore"):  # a gain past float32 is inf: non-finite, refused below
        gains = {path: np.float32(g) for path, g in zip(fs.theta, gains)}
    momentum, state = None, fs.outer_state
    if cfg.auto is not None:
        momentum = outer_auto.momentum(cfg.auto, fs.stats)
        state = outer.with_momentum(state, momentum)
    squares = None if squares is None else dict(zip(fs.theta, squares))  # rs.sums' order is fs.theta's
    done = closing.close(cfg.outer, rule.per, sums, gains, fs.theta, state, fs.refs[-1][1], fs.stats.last, squares,
                         stats=measures(cfg))
    if not done.finite:
        return None
    stats, update_cos = fs.stats, None  # not measured: nothing kept
    if measures(cfg):
        stats, update_cos = outer_auto.observe(cfg.auto or outer_auto.Rule(), fs.stats, done.delta, done.delta_norm,
                                               done.dot)
    fs = fs._replace(theta=done.theta, outer_state=jax.tree.map(np.asarray, done.outer_state),
                     version=fs.version + 1, theta_norm=done.theta_norm, stats=stats)
    try:
        st, publish = publishing.publish(cfg, st, fs, p, keys, done.diff)
    except (NonFiniteError, messages.MessageError):  # the broadcast codec's rounding overflowed
        return None
    return st, publish, done.delta_norm, update_cos, momentum
