"""Outer optimizers pinned against hand-computed trajectories (docs/algorithm.md#outer-optimizers)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco.algo import outer
from diloco.algo.merge import pseudo_gradient, weighted_average

DELTAS = [np.array([1.0, -2.0]), np.array([0.5, 0.5]), np.array([-1.0, 3.0]), np.array([2.0, 0.0]),
          np.array([0.0, -1.0]), np.array([1.5, 1.0])]


def run(opt, theta, deltas):
    step = jax.jit(functools.partial(outer.outer_step, opt))
    state = opt.init(theta)
    out = []
    for d in deltas:
        theta, state = step(theta, state, {"w": d})
        out.append(np.asarray(theta["w"]))
    return out


def test_nesterov_matches_the_diloco_form_by_hand():
    lr, mu = 0.7, 0.9
    got = run(outer.nesterov(lr, mu), {"w": jnp.array([1.0, 1.0])}, DELTAS)
    x, b = np.array([1.0, 1.0]), np.zeros(2)
    for d, g in zip(DELTAS, got):
        b = mu * b + d
        x = x - lr * (d + mu * b)
        np.testing.assert_allclose(g, x, rtol=1e-6, atol=1e-6)


def test_sgd_momentum_is_heavy_ball_by_hand():
    lr, mu = 0.5, 0.8
    got = run(outer.sgd_momentum(lr, mu), {"w": jnp.zeros(2)}, DELTAS)
    x, b = np.zeros(2), np.zeros(2)
    for d, g in zip(DELTAS, got):
        b = mu * b + d
        x = x - lr * b
        np.testing.assert_allclose(g, x, rtol=1e-6, atol=1e-6)


def test_outer_lr_one_without_momentum_is_parameter_averaging():
    theta = {"w": np.array([1.0, 2.0, 3.0])}
    locals_ = [{"w": np.array([0.0, 2.0, 5.0])}, {"w": np.array([2.0, -2.0, 1.0])},
               {"w": np.array([4.0, 3.0, 0.0])}]
    delta = weighted_average([pseudo_gradient(theta, l) for l in locals_], [1.0] * 3)
    mean = np.mean([l["w"] for l in locals_], axis=0)
    for opt in (outer.averaging(), outer.make_outer("sgd", lr=1.0, momentum=0.0)):
        new, _ = outer.outer_step(opt, theta, opt.init(theta), delta)
        np.testing.assert_allclose(new["w"], mean, rtol=1e-6)
        assert new["w"].dtype == jnp.float32


def test_delayed_nesterov_with_N_1_is_nesterov():
    theta = {"w": jnp.array([0.3, -0.2])}
    a = run(outer.delayed_nesterov(0.7, 0.9, N=1), theta, DELTAS)
    b = run(outer.nesterov(0.7, 0.9), theta, DELTAS)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_delayed_nesterov_by_hand():
    lr, mu, N = 0.5, 0.9, 3
    got = run(outer.delayed_nesterov(lr, mu, N), {"w": jnp.zeros(2)}, DELTAS)
    x, m, buf = np.zeros(2), np.zeros(2), np.zeros(2)
    for t, (d, g) in enumerate(zip(DELTAS, got), 1):
        buf = buf + d
        if t % N == 0:
            m = mu * m + buf / N
            x = x - lr * (d / N + mu * m)
            buf = np.zeros(2)
        else:
            x = x - lr * d / N
        np.testing.assert_allclose(g, x, rtol=1e-6, atol=1e-6)


def test_delayed_nesterov_over_N_arrivals_is_one_nesterov_step_on_their_mean():
    lr, mu, N = 0.7, 0.9, 3
    theta = {"w": jnp.array([1.0, -1.0])}
    delayed = run(outer.delayed_nesterov(lr, mu, N), theta, DELTAS)
    means = [np.mean(DELTAS[i:i + N], axis=0) for i in range(0, len(DELTAS), N)]
    nest = run(outer.nesterov(lr, mu), theta, means)
    np.testing.assert_allclose([delayed[N - 1], delayed[2 * N - 1]], nest, rtol=1e-6, atol=1e-6)


def test_registry_and_errors():
    assert set(outer.OUTER) == {"nesterov", "sgd", "average", "delayed_nesterov"}
    with pytest.raises(ValueError, match="unknown outer optimizer 'adam'"):
        outer.make_outer("adam")
    with pytest.raises(ValueError, match="N=0"):
        outer.delayed_nesterov(N=0)
