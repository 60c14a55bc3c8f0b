"""Pseudo-gradients and the rules that merge them, token-weighted: averaging or RDA, one
`MergeRule` each in the registry MERGES (docs/algorithm.md#merge).

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), section 4 and appendix D.2.

Everything is computed in float32 whatever the wire precision was (section 5). Deltas are any
pytrees of equal structure: a fragment as returned by `fragments.extract`, or whole params.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial, reduce
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Tree = Any


def pseudo_gradient(global_params: Tree, local_params: Tree) -> Tree:
    """delta = global - local: the one place that defines the sign.

    A learner that moved downhill from Theta gives a delta pointing uphill, i.e. a gradient, so the
    outer optimizer descends along -delta (DiLoCo, arXiv 2311.08105, Algorithm 1).
    """
    def minus(g, l):
        # Host arrays stay on the host (a learner encoding its contribution); anything else is JAX.
        if isinstance(g, np.ndarray) and isinstance(l, np.ndarray):
            return np.asarray(g, np.float32) - np.asarray(l, np.float32)
        return jnp.asarray(g, jnp.float32) - jnp.asarray(l, jnp.float32)

    return jax.tree.map(minus, global_params, local_params)


def token_weight(c_tokens: float, c_steps: float) -> float:
    """w = c_tokens**2 / c_steps = tokens x (tokens per step); 0 when no step was taken.

    A learner that just rejoined (small counters), ran slow (few steps) or lost devices (fewer
    tokens per step) counts less (section 4).
    """
    if c_tokens < 0 or c_steps < 0:
        raise ValueError(f"counters must be non-negative, got c_tokens={c_tokens}, c_steps={c_steps}")
    if c_steps == 0:
        return 0.0
    return float(c_tokens) ** 2 / float(c_steps)


def _normalized(deltas: Sequence[Tree], weights: Sequence[float]) -> jax.Array:
    """Weights divided by their sum, in float64 before the cast: raw token weights reach ~1e12."""
    if len(deltas) != len(weights):
        raise ValueError(f"{len(deltas)} deltas but {len(weights)} weights")
    w = np.asarray(weights, dtype=np.float64)
    if w.size == 0:
        raise ValueError("nothing to merge: no contributions (the caller must not merge an empty set)")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"weights must be finite and non-negative, got {list(weights)}")
    total = float(w.sum())
    if total <= 0.0:
        raise ValueError(
            f"total weight is 0 over {len(weights)} contributions (weights {list(weights)}):"
            " nothing to merge, the caller must skip this round"
        )
    return jnp.asarray(w / total, jnp.float32)


@jax.jit
def _average(deltas: tuple[Tree, ...], w: jax.Array) -> Tree:
    # A fused weighted sum; no stacked (M, ...) copy of the deltas.
    return jax.tree.map(
        lambda *vs: sum(w[i] * jnp.asarray(v, jnp.float32) for i, v in enumerate(vs)), *deltas
    )


def weighted_average(deltas: Sequence[Tree], weights: Sequence[float]) -> Tree:
    """sum_m w_m delta_m / sum_m w_m, leaf by leaf (the merge for embedding fragments)."""
    return _average(tuple(deltas), _normalized(deltas, weights))


def _scaled_sumsq(leaves: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(ss, f): the sum of squares of leaves x f, with f a power of two that keeps it finite and
    normal whenever the true norm is, so the norm is sqrt(ss) / f (evaluate that in float64 when
    the norm itself may pass 3.4e38).

    Squares overflow float32 from |x| ~ 1.8e19 (a finite 1e30 gave inf, and RDA NaN) and underflow
    below ~1e-19 (a direction lost to unit(0) = 0). So values with max |x| outside 2^+-40 are
    scaled by 2^-+80, a power of two, hence exact; dividing by max |x| instead would not do: XLA on
    CPU flushes subnormals, and 1 / 3e38 is one. In between f = 1, the plain sum of squares.
    """
    top = reduce(jnp.maximum, [jnp.max(jnp.abs(x), initial=0.0) for x in leaves], jnp.float32(0.0))
    f = jnp.where(top > 2.0**40, jnp.float32(2.0**-80),
                  jnp.where(top < 2.0**-40, jnp.float32(2.0**80), jnp.float32(1.0)))
    return sum(jnp.sum(jnp.square(x * f)) for x in leaves), f


def _norm(tree: Tree) -> jax.Array:
    """The L2 norm in float32, finite whenever the true norm is (below 3.4e38); see _scaled_sumsq."""
    ss, f = _scaled_sumsq([jnp.asarray(x, jnp.float32) for x in jax.tree.leaves(tree)])
    return jnp.sqrt(ss) / f


def _unit(tree: Tree, norm: jax.Array) -> Tree:
    """tree / norm, and exactly 0 when the norm is 0 (unit(0) = 0, no NaN)."""
    safe = jnp.where(norm > 0, norm, 1.0)
    return jax.tree.map(lambda x: jnp.where(norm > 0, jnp.asarray(x, jnp.float32) / safe, 0.0), tree)


def _rda_group(deltas: Sequence[Tree], w: jax.Array) -> Tree:
    """RDA over one group (a tensor, or a whole fragment): norms and directions averaged apart."""
    norms = jnp.stack([_norm(d) for d in deltas])
    radius = jnp.dot(w, norms)
    units = [_unit(d, n) for d, n in zip(deltas, norms)]
    direction = jax.tree.map(lambda *us: sum(w[i] * u for i, u in enumerate(us)), *units)
    return jax.tree.map(lambda x: radius * x, _unit(direction, _norm(direction)))


@partial(jax.jit, static_argnames="per")
def _rda(deltas: tuple[Tree, ...], w: jax.Array, per: str) -> Tree:
    if per == "fragment":
        return _rda_group(deltas, w)
    return jax.tree.map(lambda *vs: _rda_group(vs, w), *deltas)


def rda(deltas: Sequence[Tree], weights: Sequence[float], per: str = "tensor") -> Tree:
    """Radial-directional averaging (appendix D.2).

    RDA = (sum w ||v|| / sum w) * unit(sum w unit(v) / sum w), with unit(0) = 0. Pseudo-gradients of
    different learners are nearly orthogonal, so a plain average of M deltas of norm R has norm
    about R / sqrt(M); RDA keeps norm R. Norms are taken per tensor (default) or over the whole
    fragment (per="fragment"); which one the paper uses is not public, hence the knob.
    """
    if per not in ("tensor", "fragment"):
        raise ValueError(f"rda per={per!r}; choose 'tensor' or 'fragment'")
    return _rda(tuple(deltas), _normalized(deltas, weights), per)


def rda_fragment(deltas: Sequence[Tree], weights: Sequence[float]) -> Tree:
    """RDA with norms over the whole fragment."""
    return rda(deltas, weights, per="fragment")


def fragment_norm(norms: Sequence[float]) -> float:
    """The norm over a fragment from its norms per tensor (float64; inf if any is not finite)."""
    return math.sqrt(math.fsum(n * n for n in norms)) if all(map(math.isfinite, norms)) else math.inf


class MergeRule(NamedTuple):
    """One merge rule, as the syncer streams it (docs/algorithm.md#merge).

    The syncer never holds a round's deltas as a list: each admitted delta_m is folded into one
    running sum per tensor, sum_m k_mt delta_mt (diloco/algo/roundsum.py), and the close turns
    the sums into the merged delta, g_t x sum_t or g_t x unit(sum_t) (`merge_sums`).

    coefficients(weight, norms): k_mt of one contribution, per tensor, from its token weight and
        its ||delta_m|| per tensor (all float64); 0 leaves that tensor out.
    gains(weights, clips, norms, scales): g_t, per tensor, from every contribution's token weight,
        clip factor and norms per tensor, and each sum's float64 scale z_t (sum_t = z_t S_t, and
        z_t is 0 while nothing was folded into it).
    per: how the close takes the sums: None, g x sum; "tensor", g x unit(sum) per tensor;
        "fragment", g x unit(sum) over the whole fragment.
    clip_rebuilds: a clip factor (docs/algorithm.md#robust-merges) multiplies the coefficients,
        so a clipped round folds its deltas again; False where `gains` applies it (RDA: a clip
        scales a norm, never a direction).
    reference(deltas, weights): the same merge over a list of deltas, what tests hold the
        streamed one to.
    """

    name: str
    coefficients: Callable[[float, tuple[float, ...]], tuple[float, ...]]
    gains: Callable[[Sequence[float], Sequence[float], Sequence[tuple[float, ...]], Sequence[float]],
                    tuple[float, ...]]
    per: str | None
    clip_rebuilds: bool
    reference: Callable[[Sequence[Tree], Sequence[float]], Tree]


def _weight_coefficients(weight, norms):
    return (weight,) * len(norms)


def _mean_gains(weights, clips, norms, scales):  # sum = z S, merged = sum / total weight
    total = math.fsum(weights)
    return tuple(z / total for z in scales)


def _unit_coefficients(weight, norms):  # w_m unit(delta_m), per tensor
    return tuple(weight / n if 0.0 < n < math.inf else 0.0 for n in norms)


def _radii(weights, clips, norms, scales):
    """The radius per tensor: the normalised-weight mean of the (clipped) norms, in float64."""
    total = math.fsum(weights)
    return tuple(math.fsum(w * s * n[t] for w, s, n in zip(weights, clips, norms)) / total
                 for t in range(len(scales)))


def _fragment_unit_coefficients(weight, norms):  # w_m unit(delta_m), over the fragment
    total = fragment_norm(norms)
    k = weight / total if 0.0 < total < math.inf else 0.0
    return (k,) * len(norms)


def _fragment_radius(weights, clips, norms, scales):
    total = math.fsum(weights)
    r = math.fsum(w * s * fragment_norm(n) for w, s, n in zip(weights, clips, norms)) / total
    return (r,) * len(scales)


# Every reader (config checks, the round sums, the syncer) looks rules up here, so an entry added
# here is a rule the whole run can use.
MERGES: dict[str, MergeRule] = {r.name: r for r in (
    MergeRule("average", _weight_coefficients, _mean_gains, None, True, weighted_average),
    MergeRule("rda", _unit_coefficients, _radii, "tensor", False, rda),
    MergeRule("rda_fragment", _fragment_unit_coefficients, _fragment_radius, "fragment", False, rda_fragment),
)}


def rule(name: str) -> MergeRule:
    """The rule registered as `name` in MERGES."""
    if name not in MERGES:
        raise ValueError(f"unknown merge method {name!r}; choose from {sorted(MERGES)}")
    return MERGES[name]


def merge(deltas: Sequence[Tree], weights: Sequence[float], method: str) -> Tree:
    """Merge the deltas of one fragment round with the named rule's reference merge.

    Raises ValueError when there is nothing to merge or the weights sum to 0: skipping the round
    is the caller's decision, never a silent zero update.
    """
    return rule(method).reference(deltas, weights)


def merge_sums(sums: Tree, gains: Tree, per: str | None, units: Tree) -> Tree:
    """The merged delta of a round from its running sums (diloco/algo/roundsum.py) and the gains
    of its rule (MergeRule): gain x sum (per=None; averaging: gain = the sum's scale / total
    weight), or gain x unit(sum) (RDA: gain = the radius), unit per tensor (per="tensor") or over
    the fragment (per="fragment"), unit(0) = 0. `units` holds each sum's (f, safe) of unit_scale,
    from the norm of its group taken beforehand (the close may see a piece of a tensor only).
    Traced inside the syncer's jitted close (diloco/algo/close.py)."""
    sums = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), sums)
    if per is None:
        return jax.tree.map(lambda g, x: g * x, gains, sums)
    # safe is 0 for a zero sum (unit 0) and NaN for a sum that overflowed (a non-finite merge)
    # (a pair per leaf of gains: units has gains' structure as a prefix)
    return jax.tree.map(lambda g, x, u: g * jnp.where(u[1] == 0, 0.0, (x * u[0]) / u[1]), gains, sums, units)


def unit_scale(norm: float) -> tuple[np.float32, np.float32]:
    """(f, safe) with unit(x) = (x f) / safe for a group of float64 norm `norm`: f a power of two
    that brings the norm into [1, 2) (so x f cannot overflow and safe = norm f is a normal float32),
    kept within float32's normal powers; (1, 0) for a zero norm, (1, NaN) for a non-finite one.
    Scaling by a power of two is exact, so (x f) / safe rounds as x / norm would."""
    if norm == 0.0:
        return np.float32(1.0), np.float32(0.0)
    if not math.isfinite(norm):
        return np.float32(1.0), np.float32(np.nan)
    k = min(max(1 - math.frexp(norm)[1], -126), 126)  # norm = m 2^e, m in [0.5, 1)
    return np.float32(2.0 ** k), np.float32(norm * 2.0 ** k)


def global_norm(tree: Tree) -> float:
    """sqrt of the sum of squares over all leaves, as a Python float (for merge records)."""
    return math.sqrt(float(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree))))
