"""A fragment round's running FP32 sum: each admitted contribution is folded in as it arrives, so
closing the round is one pass whatever the number of learners (docs/algorithm.md#merge).

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), section 4 and appendix D.2.

What a merge needs of its contributions is, per tensor, one weighted sum and a few scalars: its
rule (a `merge.MergeRule` in merge.MERGES) gives each delta's coefficient per tensor, e.g.

* `average`: w_m, so the sum is sum_m w_m delta_m;
* `rda`: w_m / ||delta_m||, so the sum is sum_m w_m unit(delta_m) (the radius, a weighted mean of
  norms, needs every ||delta_m||);
* `rda_fragment`: the same with one norm over the whole fragment.

A `RoundSum` holds exactly that: per tensor an array S and a float64 scale z with sum = z S, and
per contribution its token weight and its norm per tensor (`Part`). Folding delta with coefficient
k is one pass written over the delta's own buffer, S' = delta + (z / k) S with z' = k, so the old
S is never written: a state holding it keeps it.
Weights are never normalised while folding (their total is unknown until the round closes); the
scale z carries them, so no coefficient is ever larger than 2^40 and none overflows.

Clipping (docs/algorithm.md#robust-merges) scales a contribution by s_m <= 1: under RDA that only
scales its norm (its unit is unchanged), so it costs nothing; under `average` (any rule with
`clip_rebuilds`) the sum is rebuilt with the scales folded into the coefficients, as it is when a
REPEAT replaces a contribution or an `overflow` drops one: the syncer folds the kept payloads
again. Those are rare; the fold is not.

Deltas are float32 whatever the wire precision was. Norms are float64 sums of the values' exact
float64 squares, finite whenever the true norm is (no float32 square overflows or underflows
there), and inf when a value is not finite. The passes are numba loops (codec_kernels.py): the
delta and both its norms in one pass over the tensor, the sum update in one more.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np
from diloco.algo import codec_specs, hostpool
from diloco.algo.merge import MergeRule, fragment_norm
from diloco.algo.codec_base import Codec

Path = tuple
Values = Mapping[Path, np.ndarray]
_LIMIT = 2.0**40  # largest multiplier a fold applies to the old sum; beyond it the new one is scaled


class Part(NamedTuple):
    """One folded contribution: its key, token weight and ||delta|| per tensor (float64; inf if
    the delta itself overflowed float32)."""

    key: tuple[int, int, int]
    weight: float
    norms: tuple[float, ...]

    @property
    def norm(self) -> float:
        return fragment_norm(self.norms)


class RoundSum(NamedTuple):
    """The open round's sums: per tensor (in the fragment's path order) S and z with sum = z S;
    S is None while no coefficient of that tensor was nonzero."""

    parts: tuple[Part, ...] = ()
    sums: tuple[np.ndarray | None, ...] = ()
    scales: tuple[float, ...] = ()

    @property
    def keys(self) -> tuple[tuple[int, int, int], ...]:
        return tuple(p.key for p in self.parts)


def empty(paths: Iterable[Path]) -> RoundSum:
    n = len(tuple(paths))
    return RoundSum((), (None,) * n, (0.0,) * n)


class Local(Mapping):
    """A contribution's local values, ref[base] - decode(payload), decoded on demand from the
    payload it came in (a fraction of the fp32 bytes): what an open round keeps of a contribution
    instead of a full fp32 copy. A Mapping, so a checkpoint saves it like a dict of arrays."""

    def __init__(self, ref: Values, codec: Codec, tensors: list, payload: bytes):
        self.ref, self.codec, self.tensors, self.payload = ref, codec, tensors, payload
        self._at, offset = {}, 0
        for t in tensors:
            self._at[tuple(t["path"])] = (offset, t["nbytes"], tuple(t["shape"]))
            offset += t["nbytes"]

    def wire(self, path: Path) -> np.ndarray:
        """The decoded payload delta of one tensor, float32, a fresh writable array."""
        offset, nbytes, shape = self._at[path]
        return owned(self.codec.decode(self.payload[offset:offset + nbytes], shape))

    def __getitem__(self, path: Path) -> np.ndarray:
        return self.ref[path] - self.wire(path)

    def __iter__(self):
        return iter(self.ref)

    def __len__(self) -> int:
        return len(self.ref)


class Summed(Local):
    """Two contributions of one eager learner as one (docs/algorithm.md#eager-outer-steps): the
    later one's payload delta plus `earlier`, the earlier one's pseudo-gradient per path (fp32,
    taken against the round's anchor when the later one arrived). Its local values are
    ref[later's base] - (earlier + later's delta), so under syncer.anchor=base its pseudo-gradient
    is the sum of the two, and a checkpoint saves it as any Local."""

    def __init__(self, later: Local, earlier: Values):
        self.ref, self.later, self.earlier = later.ref, later, earlier

    def wire(self, path: Path) -> np.ndarray:
        return add_into(self.earlier[path], self.later.wire(path))


def local(ref: Values, header: Mapping[str, Any], payload: bytes) -> Local:
    return Local(ref, codec_specs.codec_from_spec(header["codec"]), header["tensors"], payload)


def owned(x: np.ndarray) -> np.ndarray:
    """x itself if the fold may write over it (contiguous float32, writable), else a copy."""
    x = np.asarray(x)
    if x.dtype == np.float32 and x.flags.c_contiguous and x.flags.writeable:
        return x
    return np.array(x, np.float32, order="C")


_KERNELS = None


def _kernels():
    """diloco.algo.codec_kernels, imported on first use, as codecs.py does: importing the syncer
    does not load numba."""
    global _KERNELS
    if _KERNELS is None:
        from diloco.algo import codec_kernels

        _KERNELS = codec_kernels
    return _KERNELS


def warm() -> None:
    """Compile the fold's kernels now, or load them from numba's cache, for the 1-D float32 arrays
    every fold passes them. A wall-clock syncer host calls this before its clock starts, as
    learners compile their steps first: a procs syncer otherwise spent 0.9 s of the run's clock on
    its first arrival, long enough to reorder the first round's arrivals."""
    k = _kernels()
    x = np.zeros(2 * 16 + 1, np.float32)  # whole lanes and a tail, as any tensor has
    k.sumsq(x)
    k.delta_sumsq(x, x.copy(), x.copy())
    k.axpy(x.copy(), x, np.float32(1.0), True)


def _flat(x) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).reshape(-1)


def _root(ss: float) -> float:
    # a nan sum is a nan or an inf - inf among the values: a non-finite norm either way, inf
    return math.sqrt(ss) if math.isfinite(ss) else math.inf


def _total(partials: list[float]) -> float:
    # The float64 sum of squares of a whole array from those of its hostpool.CHUNK pieces, exactly
    # rounded (fsum), so it depends on the piece size alone, never on how many threads summed them;
    # an array of one piece keeps the kernel's own sum.
    return partials[0] if len(partials) == 1 else math.fsum(partials)


def _sumsq(flat: np.ndarray) -> float:
    x, k = _flat(flat), _kernels()
    return _total(hostpool.each(x.size, lambda lo, hi: k.sumsq(x[lo:hi]))) if x.size else k.sumsq(x)


def norm(x: np.ndarray) -> float:
    """||x|| of a float32 array as a float64, finite whenever the true norm is."""
    return _root(_sumsq(x))


def delta(anchor: np.ndarray, ref: np.ndarray, wire: np.ndarray) -> tuple[np.ndarray, float, float]:
    """(delta, ||wire||, ||delta||) with delta = anchor - (ref - wire) exactly as
    merge.pseudo_gradient(anchor, local) of local = ref - wire computes it, written over `wire`
    (which must be `owned`). One pass: both norms are summed while the values are in registers."""
    a, r, d, k = _flat(anchor), _flat(ref), wire.reshape(-1), _kernels()
    if not d.size:
        return wire, 0.0, 0.0
    sums = hostpool.each(d.size, lambda lo, hi: k.delta_sumsq(a[lo:hi], r[lo:hi], d[lo:hi]))
    return wire, _root(_total([w for w, _ in sums])), _root(_total([x for _, x in sums]))


def add_into(a: np.ndarray, x: np.ndarray) -> np.ndarray:
    """a + x in float32, written over x (or over a copy of it if it is not `owned`)."""
    x = owned(x)
    a, flat = _flat(a), x.reshape(-1)
    hostpool.each(flat.size, lambda lo, hi: np.add(a[lo:hi], flat[lo:hi], out=flat[lo:hi]))
    return x


def delta_of_local(anchor: np.ndarray, local_values: np.ndarray) -> tuple[np.ndarray, float]:
    """(anchor - local, its norm), for a contribution restored with its local values only."""
    with np.errstate(over="ignore", invalid="ignore"):
        d = np.subtract(np.asarray(anchor, np.float32), np.asarray(local_values, np.float32))
    return d, norm(d)


def fold(rs: RoundSum, key, weight: float, deltas: list[np.ndarray], norms: tuple[float, ...],
         rule: MergeRule, scale: float = 1.0) -> RoundSum:
    """rs with one more contribution: `deltas` (per tensor, in path order; written over, never
    kept elsewhere) times the rule's coefficients, `scale` (a clip factor) folded into them."""
    sums, scales = list(rs.sums), list(rs.scales)
    for t, (d, k) in enumerate(zip(deltas, rule.coefficients(weight, norms))):
        k *= scale
        if not k > 0.0:  # weight 0 or a zero direction: it adds exactly nothing
            continue
        if sums[t] is None:
            sums[t], scales[t] = d, k
        elif scales[t] / k <= _LIMIT:  # S' = delta + (z / k) S, z' = k
            _axpy(d.reshape(-1), sums[t].reshape(-1), np.float32(scales[t] / k), old_scaled=True)
            sums[t], scales[t] = d, k
        else:  # this one is negligible next to the sum: S' = S + (k / z) delta, z' = z
            _axpy(d.reshape(-1), sums[t].reshape(-1), np.float32(k / scales[t]), old_scaled=False)
            sums[t] = d
    return RoundSum(rs.parts + (Part(key, float(weight), tuple(norms)),), tuple(sums), tuple(scales))


def _axpy(d: np.ndarray, old: np.ndarray, a: np.float32, old_scaled: bool) -> None:
    """d = d + a old (old_scaled) or d = a d + old, over d, in float32 (a multiply, then an add,
    each rounded, as numpy's two passes did) and in one pass. An overflow shows at the close."""
    d, old, a, k = d.reshape(-1), _flat(old), np.float32(a), _kernels()
    hostpool.each(d.size, lambda lo, hi: k.axpy(d[lo:hi], old[lo:hi], a, bool(old_scaled)))
