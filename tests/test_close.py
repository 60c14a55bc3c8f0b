"""The close of a round in pieces (diloco/algo/close.py): what it computes equals one pass over the
whole fragment, whatever the thread count, for every element-wise outer optimizer and merge kind;
an optimizer that couples values is never cut."""

import math

import jax
import numpy as np
import optax
import pytest

from diloco.algo import close, hostpool, outer
from diloco.algo.merge import unit_scale

C = hostpool.CHUNK
# whole pieces, a remainder, a tensor of exactly one piece, small and scalar-shaped ones
SHAPES = {("a",): (2, C + 3), ("b",): (C,), ("c",): (5, 7), ("d",): (), ("e",): (C + 1,)}
OPTIMIZERS = [("nesterov", dict(lr=0.7, momentum=0.9)), ("sgd", dict(lr=1.0, momentum=0.5)),
              ("average", {}), ("delayed_nesterov", dict(lr=0.7, momentum=0.9, N=2))]


def _fragment(seed: int, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    draw = lambda s, k=1.0: (rng.standard_normal(s) * k).astype(np.float32)
    theta = {p: draw(s) for p, s in SHAPES.items()}
    sums = {p: draw(s, 3.0 * scale) for p, s in SHAPES.items()}
    prev = {p: theta[p] + draw(s, 0.01) for p, s in SHAPES.items()}
    gains = {p: np.float32(0.25 + 0.5 * i) for i, p in enumerate(sorted(SHAPES))}
    return theta, sums, prev, gains


def _state(opt, theta, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: np.asarray(x) + rng.standard_normal(np.shape(x)).astype(np.float32)
                        if np.asarray(x).dtype == np.float32 else np.asarray(x) + 1, opt.init(theta))


def _whole(monkeypatch, *args):
    with monkeypatch.context() as m:
        m.setattr(outer, "elementwise", lambda opt: False)
        return close.close(*args)


def _same(a: close.Closed, b: close.Closed, rtol: float = 0.0):
    """Bit for bit (rtol 0), or within a few roundings at the scale of the tensor's largest value
    (a value near 0 comes out of a cancellation of larger ones), the norms within rtol."""
    def equal(x, y, scale):
        if rtol == 0:
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(x, y, rtol=0, atol=4 * float(np.spacing(np.max(np.abs(scale), initial=1e-30))))
    for p in a.theta:
        equal(a.theta[p], b.theta[p], a.theta[p])
        equal(a.diff[p], b.diff[p], a.theta[p])
        assert a.theta[p].shape == b.theta[p].shape == SHAPES[p]
    for x, y in zip(jax.tree.leaves(a.outer_state), jax.tree.leaves(b.outer_state)):
        assert np.shape(x) == np.shape(y)
        equal(x, y, x)
    assert jax.tree.structure(a.outer_state) == jax.tree.structure(b.outer_state)
    assert a.finite == b.finite
    assert a.delta_norm == pytest.approx(b.delta_norm, rel=rtol, abs=0)
    assert a.theta_norm == pytest.approx(b.theta_norm, rel=rtol, abs=0)


# every optimizer with the plain merge; the unit merges (a norm pass first) with Nesterov
CASES = [(name, kw, None) for name, kw in OPTIMIZERS] + [(*OPTIMIZERS[0], per) for per in ("tensor", "fragment")]


@pytest.mark.parametrize("name,kw,per", CASES)
def test_pieces_compute_what_one_pass_over_the_fragment_does(monkeypatch, name, kw, per):
    opt = outer.make_outer(name, **kw)
    assert outer.elementwise(opt)
    theta, sums, prev, gains = _fragment(1)
    state = _state(opt, theta, 2)
    got = close.close(opt, per, sums, gains, theta, state, prev)
    # within rounding: XLA:CPU may contract a multiply-add into one FMA in one kernel and not in
    # another (a piece's against one long loop), and the norms add float32 partial sums
    _same(got, _whole(monkeypatch, opt, per, sums, gains, theta, state, prev), rtol=1e-6)
    assert got.finite
    want = math.sqrt(sum(float(np.sum(np.square(x.astype(np.float64)))) for x in got.theta.values()))
    assert got.theta_norm == pytest.approx(want, rel=1e-6)


def test_the_result_does_not_depend_on_the_thread_count(monkeypatch):
    opt = outer.make_outer("delayed_nesterov", lr=0.7, momentum=0.9, N=1)
    theta, sums, prev, gains = _fragment(3)
    state = _state(opt, theta, 4)
    runs = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv(hostpool.ENV, threads)
        runs.append(close.close(opt, "tensor", sums, gains, theta, state, prev))
    _same(runs[0], runs[1])
    _same(runs[0], runs[2])
    assert int(runs[0].outer_state.count) == int(state.count) + 1  # the scalar is stepped once


def test_the_merged_delta_is_gain_times_sum_or_gain_times_unit_sum():
    """With outer SGD at lr 1 and Theta = ref = 0, the broadcast delta is minus the merged delta."""
    opt = outer.make_outer("sgd", lr=1.0, momentum=0.0)
    _, sums, _, gains = _fragment(5)
    theta = {p: np.zeros_like(s) for p, s in sums.items()}
    for per in (None, "tensor", "fragment"):
        got = close.close(opt, per, sums, gains, theta, opt.init(theta), theta)
        norm = math.sqrt(sum(float(np.sum(np.square(s.astype(np.float64)))) for s in sums.values()))
        for p, s in sums.items():
            group = norm if per == "fragment" else float(np.sqrt(np.sum(np.square(s.astype(np.float64)))))
            want = gains[p] * (s if per is None else s / group)
            np.testing.assert_allclose(-got.diff[p], want, rtol=2e-6, atol=1e-30)


def test_sums_past_float32_squares_still_give_a_finite_unit_direction():
    opt = outer.make_outer("sgd", lr=1.0, momentum=0.0)
    _, sums, _, gains = _fragment(6, scale=1e37)  # squares overflow float32; the norm does not
    theta = {p: np.zeros_like(s) for p, s in sums.items()}
    got = close.close(opt, "tensor", sums, gains, theta, opt.init(theta), theta)
    assert got.finite
    for p, s in sums.items():
        unit = s.astype(np.float64) / np.sqrt(np.sum(np.square(s.astype(np.float64))))
        np.testing.assert_allclose(-got.diff[p], gains[p] * unit, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("per", [None, "tensor"])
def test_a_sum_that_overflowed_is_not_finite(per):
    opt = outer.make_outer("nesterov", lr=0.7, momentum=0.9)
    theta, sums, prev, gains = _fragment(7)
    sums[("a",)][1, C + 1] = np.inf
    assert not close.close(opt, per, sums, gains, theta, opt.init(theta), prev).finite


def test_a_zero_sum_merges_to_zero_under_a_unit_rule():
    opt = outer.make_outer("sgd", lr=1.0, momentum=0.0)
    theta, sums, _, gains = _fragment(8)
    sums[("b",)][:] = 0.0
    got = close.close(opt, "tensor", sums, gains, theta, opt.init(theta), theta)
    assert got.finite and not np.any(got.diff[("b",)])


def test_an_optimizer_that_couples_values_is_closed_in_one_pass():
    """Global-norm clipping couples every value: cut into pieces, each would clip on its own norm."""
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    assert not outer.elementwise(opt)
    theta, sums, prev, gains = _fragment(9)
    got = close.close(opt, None, sums, gains, theta, opt.init(theta), prev)
    delta = {p: gains[p] * sums[p] for p in theta}
    want = optax.apply_updates(theta, opt.update(delta, opt.init(theta), theta)[0])
    for p in theta:
        np.testing.assert_allclose(got.theta[p], want[p], rtol=1e-6, atol=1e-7)
    total = math.sqrt(sum(float(np.sum(np.square((got.theta[p] - theta[p]).astype(np.float64)))) for p in theta))
    assert total == pytest.approx(1.0, rel=1e-5)  # one clip over the fragment


def test_a_state_with_leaves_of_other_shapes_is_not_split():
    factored = optax.adafactor(1.0, min_dim_size_to_factor=4)  # row and column statistics
    assert not close._plan(factored, 3).split
    assert close._plan(outer.make_outer("delayed_nesterov", N=2), 3).split


def test_unit_scale_brings_every_norm_into_one_to_two():
    assert unit_scale(0.0) == (1.0, 0.0)
    assert np.isnan(unit_scale(math.inf)[1]) and np.isnan(unit_scale(math.nan)[1])
    for norm in (1.4e-45, 1e-30, 1.17e-38, 0.3, 1.0, 1.5, 7e20, 3.4e38, 1.6e43):
        f, safe = unit_scale(norm)
        assert math.frexp(float(f))[0] == 0.5 and np.isfinite(f) and f >= 2.0 ** -126  # a normal power of two
        assert np.isfinite(safe) and safe >= 2.0 ** -126  # a normal float32
        assert 1.0 <= safe < 2.0 or f in (np.float32(2.0 ** -126), np.float32(2.0 ** 126))  # unless f is clamped
        assert float(safe) == pytest.approx(norm * float(f), rel=1e-7)
