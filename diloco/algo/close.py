"""Closing a fragment's round: the merged delta from the round's running sums, the outer step, the
broadcast delta Theta' - ref, finiteness and norms, spread over the host's cores
(docs/design.md#closing-a-round).

One jitted pass (`_close_leaves`) does the arithmetic. For an element-wise outer optimizer
(outer.elementwise: every value of Theta' and of its state depends only on the same value of the
inputs, and on scalars) the fragment is cut into pieces of hostpool.CHUNK values, each tensor's
whole pieces one call each and every tensor's remainder together in one more, run on the host
pool's threads. Pieces that fit in a core's cache make the pass several times cheaper than one
pass over 155 MB arrays, and the pieces are fixed, so the result never depends on the thread count.
Any other optimizer gets one call over the whole fragment.

With `stats` the pass also hands back the merged delta and its dot product with the previous
round's (`last`), which the outer statistics keep (diloco/algo/outer_auto.py): one more read of the
fragment and two more writes (the delta out of the pass, and into the kept copy). Without them (a
run's default unless outer.momentum=auto: docs/algorithm.md#outer-statistics-and-automatic-momentum)
neither is read nor written, and the results are bit-identical: the statistics only observe.

A unit-direction merge (per "tensor" or "fragment") needs each group's norm of the sums before any
piece can scale it: one float64 pass over the sums, in the same pieces, comes first.
"""

from __future__ import annotations

import math
from functools import lru_cache, partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco.algo import codec_kernels, hostpool, outer
from diloco.algo import merge as merging
from diloco.algo.fragments import Path

Values = dict[Path, np.ndarray]
Slice = tuple[int, int, int]  # (tensor index in path order, lo, hi) of the flattened tensor


class Closed(NamedTuple):
    theta: Values  # Theta' per path
    outer_state: Any  # the optimizer's new state, structured as the one passed in
    diff: Values  # Theta' - ref per path: what every broadcast encodes
    finite: bool  # the merged delta, Theta', the state and diff are all finite
    delta_norm: float  # ||merged delta|| over the fragment (float64 from float32 partial sums)
    theta_norm: float  # ||Theta'||
    delta: Values | None  # the merged delta per path (the outer step's gradient); None without stats
    dot: float  # <delta, last> over the fragment (float64 from float32 partial sums); 0 without stats


def close(opt: optax.GradientTransformation, per: str | None, sums: Values, gains: Values, theta: Values,
          outer_state: Any, prev: Values, last: Values | None = None,
          squares: dict[Path, float] | None = None, stats: bool = True) -> Closed:
    """Close one round of a fragment: `sums` are the running sums by path, `gains` its merge
    rule's float32 gain per path (merge.MergeRule), `prev` the newest ref, `last` the previous
    round's merged delta (None: zeros, a fragment's first round), `squares` the sums'
    sum_squares by path (None: taken here when the merge needs them). `stats`: hand back the
    merged delta and its dot with `last` (False: `last` is ignored, Closed.delta is None)."""
    if not stats:
        last = {}
    elif last is None:
        last = {p: np.zeros(x.shape, np.float32) for p, x in theta.items()}
    paths = sorted(theta)
    squares = None if squares is None else [squares[p] for p in paths]
    leaves, state_def = jax.tree.flatten(outer_state)
    plan = _plan(opt, len(paths))
    if len(plan.owners) != len(leaves):
        raise ValueError(f"outer state of {len(leaves)} leaves, {len(plan.owners)} expected")
    G = [np.float32(gains[p]) for p in paths]
    if not (plan.split and outer.elementwise(opt)):  # one call, every array as it is
        U = _units(per, [np.asarray(sums[p], np.float32).reshape(-1) for p in paths], squares)
        tdef = _tuple_state_def(opt, tuple(theta[p].shape for p in paths))
        new_T, new_L, new_D, new_P, finite, (dss, df), (tss, tf), dot = _close_leaves(
            opt, per, tdef, stats, tuple(sums[p] for p in paths), tuple(G), tuple(U), tuple(theta[p] for p in paths),
            tuple(prev[p] for p in paths), tuple(last[p] for p in paths if stats), tuple(leaves))
        new_T, new_D, new_P = ([np.asarray(x) for x in xs] for xs in (new_T, new_D, new_P))
        results = [(bool(finite), _square(dss, df), _square(tss, tf), float(dot))]
        new_leaves = [np.asarray(x) for x in new_L]
    else:
        new_T, new_D, new_P, new_leaves, results = _pieces(opt, per, paths, G, sums, theta, prev, last, leaves, plan,
                                                           squares, stats)
    shaped = lambda arrs: {p: a.reshape(theta[p].shape) for p, a in zip(paths, arrs)}
    return Closed(shaped(new_T), jax.tree.unflatten(state_def, new_leaves), shaped(new_D),
                  all(r[0] for r in results), math.sqrt(math.fsum(r[1] for r in results)),
                  math.sqrt(math.fsum(r[2] for r in results)), shaped(new_P) if stats else None,
                  math.fsum(r[3] for r in results))


def _pieces(opt, per, paths, G, sums, theta, prev, last, leaves, plan, squares, stats):
    """The close of an element-wise optimizer in pieces on the host pool: (Theta', diff, delta (no
    arrays without stats), the state's leaves, each call's (finite, delta norm^2, Theta' norm^2,
    <delta, last>))."""
    flat = lambda tree: [np.asarray(tree[p], np.float32).reshape(-1) for p in paths]  # views
    S, T, R = flat(sums), flat(theta), flat(prev)
    P = flat(last) if stats else [np.zeros(0, np.float32)] * len(paths)  # never read without stats
    sizes = [x.size for x in T]
    L = [np.asarray(x, np.float32).reshape(-1) if o is not None else x for x, o in zip(leaves, plan.owners)]
    U = _units(per, S, squares)
    bulk, rest = _slices(sizes, hostpool.CHUNK)
    new_T, new_D = [hostpool.aligned_empty(n) for n in sizes], [hostpool.aligned_empty(n) for n in sizes]
    new_P = [hostpool.aligned_empty(n) for n in sizes] if stats else []
    new_L = [hostpool.aligned_empty(sizes[o]) if o is not None else None for o in plan.owners]

    def call(group: list[Slice]):
        where = _leaf_map(plan, _plan(opt, len(group)), [t for t, _, _ in group])
        cut = lambda arrs: tuple(arrs[t][lo:hi] for t, lo, hi in group)
        state_in = tuple(L[i] if o is None else L[i][group[o][1]:group[o][2]] for i, o in where)
        tdef = _tuple_state_def(opt, tuple((hi - lo,) for _, lo, hi in group))
        theta_k, leaves_k, diff_k, delta_k, finite, (dss, df), (tss, tf), dot = _close_leaves(
            opt, per, tdef, stats, cut(S), tuple(G[t] for t, _, _ in group), tuple(U[t] for t, _, _ in group),
            cut(T), cut(R), cut(P) if stats else (), state_in)
        for j, (t, lo, hi) in enumerate(group):
            np.copyto(new_T[t][lo:hi], np.asarray(theta_k[j]))
            np.copyto(new_D[t][lo:hi], np.asarray(diff_k[j]))
            if stats:
                np.copyto(new_P[t][lo:hi], np.asarray(delta_k[j]))
        scalars = []
        for (i, o), x in zip(where, leaves_k):
            if o is None:
                scalars.append((i, np.asarray(x)))
            else:
                np.copyto(new_L[i][group[o][1]:group[o][2]], np.asarray(x))
        return (bool(finite), _square(dss, df), _square(tss, tf), float(dot)), scalars

    groups = [[s] for s in bulk] + ([rest] if rest else [])
    out = hostpool.run([partial(call, g) for g in groups], parallel=len(groups) > 1)
    for i, x in out[0][1] if out else ():
        new_L[i] = x  # every call steps the scalars (a step count) alike: the first call's are the state's
    new_leaves = [x.reshape(leaves[i].shape) if plan.owners[i] is not None else x for i, x in enumerate(new_L)]
    return new_T, new_D, new_P, new_leaves, [r for r, _ in out]


def _square(ss, f) -> float:
    """The float64 square of the norm a scaled square sum (ss, f) of merge._scaled_sumsq stands for."""
    return float(ss) / float(f) ** 2


def _slices(sizes: list[int], chunk: int) -> tuple[list[Slice], list[Slice]]:
    """(whole pieces of `chunk` values, one call each; every tensor's remainder, one call in all)."""
    bulk = [(t, lo, lo + chunk) for t, n in enumerate(sizes) for lo in range(0, n - n % chunk, chunk)]
    rest = [(t, n - n % chunk, n) for t, n in enumerate(sizes) if n % chunk]
    return bulk, rest


def sum_squares(S: list[np.ndarray]) -> list[float]:
    """Each array's float64 sum of squares, in pieces on the host pool. The syncer takes them once
    per round, for the unit merge's norms and the drift monitor's agreement (diloco/algo/drift.py)."""
    S = [np.asarray(x, np.float32).reshape(-1) for x in S]
    tasks = [(t, lo, hi) for t, x in enumerate(S) for lo, hi in hostpool.pieces(x.size)]
    # a fragment under one piece in all is summed on this thread (the pool's start-up would cost more)
    parts = hostpool.run([lambda t=t, lo=lo, hi=hi: codec_kernels.sumsq(S[t][lo:hi]) for t, lo, hi in tasks],
                         parallel=sum(x.size for x in S) > hostpool.CHUNK)
    squares = [0.0] * len(S)
    for (t, _, _), ss in zip(tasks, parts):  # in piece order: the same sum whatever the threads
        squares[t] += ss
    return squares


def _units(per: str | None, S: list[np.ndarray],
           squares: list[float] | None = None) -> list[tuple[np.float32, np.float32]]:
    """Each tensor's (f, safe) for merge.merge_sums: from the float64 norm of its sum (per
    "tensor") or of the fragment's (per "fragment"); unused without a unit merge. `squares`: the
    sums' sum_squares when the caller has them."""
    if per is None:
        return [(np.float32(1.0), np.float32(1.0))] * len(S)
    squares = sum_squares(S) if squares is None else squares
    if per == "fragment":
        return [merging.unit_scale(math.sqrt(sum(squares)))] * len(S)
    return [merging.unit_scale(math.sqrt(ss)) for ss in squares]


class _Plan(NamedTuple):
    owners: tuple[int | None, ...]  # per leaf of the state over k tensors: its tensor, or None (a scalar)
    kinds: tuple[int, ...]  # per leaf: its rank among the leaves of the same owner (None: the scalars)
    split: bool  # every tensor owns the same kinds of leaf, and nothing else is in the state


@lru_cache(maxsize=256)
def _plan(opt: optax.GradientTransformation, k: int) -> _Plan:
    """Which tensor each leaf of opt's state over k tensors belongs to, found from the shapes of
    a state over tensors of distinct sizes (tensor i of i + 1 values)."""
    state = jax.eval_shape(opt.init, tuple(jax.ShapeDtypeStruct((i + 1,), jnp.float32) for i in range(k)))
    shapes = [x.shape for x in jax.tree.leaves(state)]
    owners = tuple(None if s == () else s[0] - 1 if len(s) == 1 and 0 < s[0] <= k else -1 for s in shapes)
    seen: dict[int | None, int] = {}
    kinds = []
    for o in owners:
        kinds.append(seen.get(o, 0))
        seen[o] = kinds[-1] + 1
    split = -1 not in owners and len({seen.get(t, 0) for t in range(k)}) <= 1
    return _Plan(owners, tuple(kinds), split)


def _leaf_map(full: _Plan, sub: _Plan, tensors: list[int]) -> list[tuple[int, int | None]]:
    """For each leaf of the state over a group of slices (of `tensors`, in order): (the index of
    the fragment state's leaf it is cut from, its slot in the group or None for a scalar)."""
    index = {(o, kind): i for i, (o, kind) in enumerate(zip(full.owners, full.kinds))}
    return [(index[(None if o is None else tensors[o], kind)], o) for o, kind in zip(sub.owners, sub.kinds)]


@lru_cache(maxsize=1024)
def _tuple_state_def(opt: optax.GradientTransformation, shapes: tuple[tuple[int, ...], ...]):
    """The structure of opt's state over a tuple of arrays of these shapes (no values built)."""
    return jax.tree.structure(jax.eval_shape(opt.init, tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)))


@partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _close_leaves(opt, per, state_def, stats, sums, gains, units, theta, prev, last, state_leaves):
    outer_state = jax.tree.unflatten(state_def, state_leaves)
    delta = merging.merge_sums(sums, gains, per, units)
    new_theta, new_state = outer.outer_step(opt, theta, outer_state, delta)
    diff = tuple(t - r for t, r in zip(new_theta, prev))
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x))
                                for x in jax.tree.leaves((delta, new_theta, new_state, diff))]))
    # float32 partial sums (a non-finite one makes the cosine unmeasured, never the merge refused);
    # without stats the delta is no output, so XLA never writes it out of the fused pass
    dot = sum(jnp.vdot(d, p) for d, p in zip(delta, last)) if stats else jnp.float32(0.0)
    return (new_theta, tuple(jax.tree.leaves(new_state)), diff, tuple(delta) if stats else (), finite,
            merging._scaled_sumsq(jax.tree.leaves(delta)), merging._scaled_sumsq(jax.tree.leaves(new_theta)), dot)
