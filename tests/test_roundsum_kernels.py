"""The numba passes of the round sums (diloco/algo/roundsum.py, codec_kernels.py) against the numpy
code they replaced, kept here as the reference: deltas and sum updates bit for bit, norms within
NORM_RTOL of a float64 reference (the numpy norms were float32 dots, the kernels sum exact float64
squares), finite whenever the true norm is and inf for a non-finite value; and a whole syncer round
within ROUND_TOL of the same round folded by the numpy code."""

import math

import numpy as np
import pytest

from diloco.algo import codec_specs, payloads, quorum, roundsum
from diloco.algo import syncer as sync
from diloco.algo.fragments import Fragment
from diloco.algo.outer import make_outer
from syncer_frames import publishes, raw_frame

NORM_RTOL = 1e-6  # measured: 9e-15 against the float64 reference here, the numpy float32 dots 8e-8
ROUND_TOL = 1e-5  # of the step max |Theta' - Theta| (measured 2.8e-7): only RDA's norms differ
CHUNK = 1 << 16  # the numpy code's slice length
SIZES = [0, 1, 7, 16, 17, CHUNK, CHUNK + 3, 3 * CHUNK + 5]


# The numpy code before the kernels (roundsum at commit 1d226a6), verbatim in substance.
def np_ss(c):
    with np.errstate(over="ignore", invalid="ignore"):
        q = float(np.dot(c, c))
    if math.isfinite(q) and q >= 2.0**-80:
        return q
    if q == 0.0 and not c.any():
        return 0.0
    if not math.isfinite(q) and not np.isfinite(c).all():
        return math.inf
    f = np.float32(2.0**-80 if not math.isfinite(q) else 2.0**80)
    x = c * f
    return float(np.dot(x, x)) / float(f) ** 2


def np_delta(anchor, ref, wire):
    d, a, r = wire.reshape(-1), np.asarray(anchor).reshape(-1), np.asarray(ref).reshape(-1)
    wire_ss, delta_ss = [], []
    with np.errstate(over="ignore", invalid="ignore"):
        for lo in range(0, d.size, CHUNK):
            c = d[lo:lo + CHUNK]
            wire_ss.append(np_ss(c))
            np.subtract(r[lo:lo + CHUNK], c, out=c)
            np.subtract(a[lo:lo + CHUNK], c, out=c)
            delta_ss.append(np_ss(c))
    return wire, math.sqrt(math.fsum(wire_ss)), math.sqrt(math.fsum(delta_ss))


def np_axpy(d, old, a, old_scaled):
    tmp = np.empty(min(CHUNK, d.size), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for lo in range(0, d.size, CHUNK):
            c, o = d[lo:lo + CHUNK], old[lo:lo + CHUNK]
            t = tmp[:c.size]
            if old_scaled:
                np.multiply(o, a, out=t)
                np.add(c, t, out=c)
            else:
                np.multiply(c, a, out=c)
                np.add(c, o, out=c)


def ref_norm(x):
    """||x|| in float64 from float64 values, scaled by a power of two so no square leaves float64's
    range; inf if a value is not finite."""
    x = np.asarray(x, np.float64).reshape(-1)
    if not np.isfinite(x).all():
        return math.inf
    top = float(np.max(np.abs(x), initial=0.0))
    if top == 0.0:
        return 0.0
    f = 2.0 ** -math.frexp(top)[1]
    return math.sqrt(math.fsum((x * f) ** 2)) / f


def triple(rng, n, scale):
    a = (rng.standard_normal(n) * scale).astype(np.float32)
    r = a + (rng.standard_normal(n) * scale * 1e-2).astype(np.float32)
    w = (rng.standard_normal(n) * scale * 1e-2).astype(np.float32)
    return a, r, w


def check_delta(a, r, w):
    d_np, nw_np, nd_np = np_delta(a, r, w.copy())
    d, nw, nd = roundsum.delta(a, r, w.copy())
    np.testing.assert_array_equal(d, d_np)
    assert d.dtype == np.float32
    for got, old, x in ((nw, nw_np, w), (nd, nd_np, d_np)):
        want = ref_norm(x)
        if math.isinf(want):
            assert got == math.inf and old == math.inf
        else:
            assert math.isfinite(got)
            assert got == pytest.approx(want, rel=NORM_RTOL, abs=0.0)
    return d, nw, nd


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale", [1e-2, 1.0, 1e-30, 1e30, 1e-42, 3e36])
def test_delta_is_numpys_and_norms_are_float64s(n, scale):
    # 1e30 and 3e36: float32 squares overflow; 1e-30 and 1e-42 (subnormal): they underflow
    check_delta(*triple(np.random.default_rng(n), n, scale))


@pytest.mark.parametrize("n", [1, 7, CHUNK + 3])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", ["wire", "ref", "anchor"])
def test_a_non_finite_value_gives_an_inf_norm(n, bad, where):
    a, r, w = triple(np.random.default_rng(n), n, 1e-2)
    {"wire": w, "ref": r, "anchor": a}[where][n // 2] = bad
    _, nw, nd = check_delta(a, r, w)
    assert nd == math.inf
    assert (nw == math.inf) == (where == "wire")


def test_a_delta_that_overflows_float32_gives_an_inf_norm():
    a = np.full(9, 3e38, np.float32)
    r = np.full(9, -3e38, np.float32)
    w = np.zeros(9, np.float32)
    d, nw, nd = check_delta(a, r, w)
    assert np.isinf(d).all() and nw == 0.0 and nd == math.inf


def test_norms_of_mixed_magnitudes_and_zeros():
    rng = np.random.default_rng(1)
    n = CHUNK + 3
    w = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    w[:CHUNK // 2] *= np.float32(1e-35)  # a slice of tiny values next to ordinary ones
    w[-5:] = np.float32(2e19)  # squares past float32's max
    check_delta(np.zeros(n, np.float32), np.zeros(n, np.float32), w)
    z = np.zeros(n, np.float32)
    assert roundsum.delta(z, z, z.copy())[1:] == (0.0, 0.0)
    assert roundsum.norm(z) == 0.0


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale", [1e-3, 1e-30, 1e30])
def test_norm_matches_float64(n, scale):
    x = (np.random.default_rng(n).standard_normal(n) * scale).astype(np.float32)
    assert roundsum.norm(x) == pytest.approx(ref_norm(x), rel=NORM_RTOL, abs=0.0)
    assert roundsum.norm(x.reshape(-1, 1)[::-1]) == pytest.approx(ref_norm(x), rel=NORM_RTOL, abs=0.0)
    if n:
        x[n - 1] = np.nan
        assert roundsum.norm(x) == math.inf


def test_delta_reads_read_only_and_shaped_inputs():
    a, r, w = triple(np.random.default_rng(2), 6 * 11, 1.0)
    a, r, w = a.reshape(6, 11), r.reshape(6, 11), w.reshape(6, 11)
    a.flags.writeable = r.flags.writeable = False
    want = np_delta(a, r, w.copy())
    d = w.copy()
    got = roundsum.delta(a, r, d)
    assert got[0] is d and d.shape == (6, 11)
    np.testing.assert_array_equal(got[0], want[0])
    same = roundsum.delta(a, a, w.copy())  # anchor and ref one array (anchor="base", current base)
    np.testing.assert_array_equal(same[0], np_delta(a, a, w.copy())[0])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("old_scaled", [True, False])
@pytest.mark.parametrize("a", [0.37, 2.0**40, 2.0**-40, 1.0 - 2.0**-24])
def test_axpy_is_numpys(n, old_scaled, a):
    rng = np.random.default_rng(n)
    d = rng.standard_normal(n).astype(np.float32)
    old = (rng.standard_normal(n) * 1e3).astype(np.float32)
    if n > 3:
        old[3] = np.float32(3e38)  # an overflow, as at the close
    want, got = d.copy(), d.copy()
    np_axpy(want, old, np.float32(a), old_scaled)
    roundsum._axpy(got, old, np.float32(a), old_scaled)
    np.testing.assert_array_equal(got, want)


def _round(M, method, seed):
    """Theta after one round of M int4 contributions (the syncer's own path)."""
    rng = np.random.default_rng(seed)
    paths = (("l", "a"), ("l", "b"), ("l", "c"))
    theta = {paths[0]: rng.standard_normal((300, 257), np.float32) * 0.1,
             paths[1]: rng.standard_normal((48,), np.float32) * 0.1,
             paths[2]: rng.standard_normal((CHUNK + 3,), np.float32) * 0.1}
    pol = sync.Policy(quorum.GraceConfig(K=M, gamma=0.0), make_outer("nesterov"), method, method,
                      down_codec=codec_specs.codec_from_spec("int8"), down_spec="int8", up_spec="int4")
    st = sync.init(pol, (Fragment(0, paths, sum(x.size for x in theta.values()), False),), (theta,),
                   {m: 0 for m in range(M)})
    codec = codec_specs.codec_from_spec("int4")
    for m in range(M):
        diff = {p: rng.standard_normal(x.shape, np.float32) * np.float32(1e-2 * (1 + m)) for p, x in theta.items()}
        tensors, payload, _ = payloads.pack_fragment(diff, codec)
        fr = raw_frame(tensors, payload, learner=m, seq=1, base_version=0, c_steps=4, c_tokens=4 * (8 + 3 * m),
                       spec="int4")
        st, actions = sync.on_contribution(pol, st, fr, float(m))
    assert len(publishes(actions)) == 1
    return theta, st.fragments[0].theta


@pytest.mark.parametrize("method", ["average", "rda", "rda_fragment"])
def test_a_round_matches_the_numpy_fold(method, monkeypatch):
    before, got = _round(5, method, 0)
    with monkeypatch.context() as mp:
        mp.setattr(roundsum, "delta", np_delta)
        mp.setattr(roundsum, "_axpy", np_axpy)
        _, want = _round(5, method, 0)
    step = max(float(np.max(np.abs(want[p] - before[p]))) for p in want)
    err = max(float(np.max(np.abs(got[p] - want[p]))) for p in want)
    assert step > 0 and err <= ROUND_TOL * step, f"off by {err:.3g}, {err / step:.3g} of the step"
    if method == "average":  # norms do not enter an average: the same bits
        for p in want:
            np.testing.assert_array_equal(got[p], want[p])
