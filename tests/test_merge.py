"""Pseudo-gradient sign, token weights, weighted averaging and RDA (docs/algorithm.md#merge)."""

import jax.numpy as jnp
import numpy as np
import pytest

from diloco.algo import merge as mg


def test_pseudo_gradient_is_global_minus_local():
    theta = {"w": np.array([1.0, 2.0]), "b": {"c": np.array(3.0)}}
    local = {"w": jnp.array([0.5, 2.5]), "b": {"c": jnp.array(1.0)}}
    delta = mg.pseudo_gradient(theta, local)
    np.testing.assert_array_equal(delta["w"], [0.5, -0.5])
    np.testing.assert_array_equal(delta["b"]["c"], 2.0)
    assert delta["w"].dtype == jnp.float32
    # a descent step Theta - delta lands on the local params: delta points uphill, like a gradient
    np.testing.assert_array_equal(np.asarray(theta["w"]) - delta["w"], local["w"])


def test_token_weight():
    assert mg.token_weight(1000, 10) == 1000**2 / 10
    assert mg.token_weight(0, 0) == 0.0 and mg.token_weight(500, 0) == 0.0
    # same tokens over more steps (smaller batch per step, e.g. lost devices) weighs less
    assert mg.token_weight(1000, 20) < mg.token_weight(1000, 10)
    with pytest.raises(ValueError, match="c_tokens=-1"):
        mg.token_weight(-1, 3)


def test_weighted_average_by_hand():
    a = {"x": np.array([1.0, 0.0]), "y": np.array([[2.0]])}
    b = {"x": jnp.array([0.0, 4.0]), "y": jnp.array([[-2.0]])}
    out = mg.weighted_average([a, b], [1.0, 3.0])
    np.testing.assert_allclose(out["x"], [0.25, 3.0])
    np.testing.assert_allclose(out["y"], [[-1.0]])
    assert out["x"].dtype == jnp.float32
    # huge raw token weights are normalised before the float32 cast
    big = mg.weighted_average([a, b], [1e30, 1e30])
    np.testing.assert_allclose(big["x"], [0.5, 2.0])


def test_zero_or_empty_weight_raises():
    d = {"x": np.ones(2)}
    for method in mg.MERGES:
        with pytest.raises(ValueError, match="total weight is 0"):
            mg.merge([d, d], [0.0, 0.0], method)
        with pytest.raises(ValueError, match="no contributions"):
            mg.merge([], [], method)
    with pytest.raises(ValueError, match="unknown merge method 'mean'"):
        mg.merge([d], [1.0], "mean")
    with pytest.raises(ValueError, match="2 deltas but 1 weights"):
        mg.merge([d, d], [1.0], "average")


def test_rda_keeps_the_norm_of_orthogonal_deltas():
    M, R = 4, 3.0
    deltas = [{"w": R * np.eye(M)[m]} for m in range(M)]
    weights = [1.0] * M
    avg = mg.merge(deltas, weights, "average")
    rda = mg.merge(deltas, weights, "rda")
    np.testing.assert_allclose(mg.global_norm(avg), R / np.sqrt(M), rtol=1e-6)
    np.testing.assert_allclose(mg.global_norm(rda), R, rtol=1e-6)
    np.testing.assert_allclose(rda["w"], np.full(M, R / np.sqrt(M)), rtol=1e-6)
    # direction is that of the (equal-weight) average
    np.testing.assert_allclose(rda["w"] / R, avg["w"] / mg.global_norm(avg), rtol=1e-6)


def test_rda_of_identical_deltas_is_the_delta():
    v = {"a": np.array([3.0, -4.0, 1.0]), "b": np.array([[0.5, 0.25]])}
    for per in ("tensor", "fragment"):
        out = mg.rda([v, v, v], [1.0, 2.0, 5.0], per=per)
        for k in v:
            np.testing.assert_allclose(out[k], v[k], rtol=1e-6)


def test_rda_weight_zero_has_no_effect():
    a = {"w": np.array([1.0, 2.0, 0.0])}
    b = {"w": np.array([0.0, -1.0, 5.0])}
    junk = {"w": np.array([100.0, -300.0, 7.0])}
    for per in ("tensor", "fragment"):
        with_junk = mg.rda([a, junk, b], [2.0, 0.0, 1.0], per=per)
        without = mg.rda([a, b], [2.0, 1.0], per=per)
        np.testing.assert_allclose(with_junk["w"], without["w"], rtol=1e-6)
    # radius and direction by hand: norms sqrt(5) and sqrt(26), weights 2/3 and 1/3
    na, nb = np.sqrt(5.0), np.sqrt(26.0)
    direction = (2 * a["w"] / na + b["w"] / nb) / 3
    expected = (2 * na + nb) / 3 * direction / np.linalg.norm(direction)
    np.testing.assert_allclose(without["w"], expected, rtol=1e-6)


def test_rda_of_zero_deltas_is_zero_not_nan():
    z = {"w": np.zeros(3), "b": np.zeros(())}
    v = {"w": np.array([0.0, 2.0, 0.0]), "b": np.zeros(())}
    for per in ("tensor", "fragment"):
        out = mg.rda([z, z], [1.0, 1.0], per=per)
        assert np.all(np.asarray(out["w"]) == 0) and np.asarray(out["b"]) == 0
        # one zero delta (unit(0) = 0) still counts in the radius average, not in the direction
        mixed = mg.rda([z, v], [1.0, 1.0], per=per)
        np.testing.assert_allclose(mixed["w"], [0.0, 1.0, 0.0], rtol=1e-6)
        assert np.isfinite(np.asarray(mixed["b"])) and np.asarray(mixed["b"]) == 0
    # opposite deltas cancel in direction: the result is 0, not NaN
    out = mg.rda([v, {"w": -v["w"], "b": v["b"]}], [1.0, 1.0])
    assert np.all(np.asarray(out["w"]) == 0)


def test_rda_per_fragment_differs_from_per_tensor():
    # learner 1 moved only tensor x, learner 2 only tensor y
    d1 = {"x": np.array([4.0, 0.0]), "y": np.array([0.0, 0.0])}
    d2 = {"x": np.array([0.0, 0.0]), "y": np.array([0.0, 2.0])}
    per_tensor = mg.rda([d1, d2], [1.0, 1.0], per="tensor")
    per_fragment = mg.rda([d1, d2], [1.0, 1.0], per="fragment")
    # per tensor: each tensor has one non-zero delta; radius = its norm / 2, direction = its own
    np.testing.assert_allclose(per_tensor["x"], [2.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(per_tensor["y"], [0.0, 1.0], rtol=1e-6)
    # per fragment: the two deltas are orthogonal; radius (4 + 2) / 2 = 3 along (1, 1) / sqrt 2
    s = 3.0 / np.sqrt(2.0)
    np.testing.assert_allclose(per_fragment["x"], [s, 0.0], rtol=1e-6)
    np.testing.assert_allclose(per_fragment["y"], [0.0, s], rtol=1e-6)
    np.testing.assert_allclose(mg.global_norm(per_fragment), 3.0, rtol=1e-6)
    np.testing.assert_allclose(mg.merge([d1, d2], [1.0, 1.0], "rda_fragment")["x"], per_fragment["x"])
    with pytest.raises(ValueError, match="per='layer'"):
        mg.rda([d1], [1.0], per="layer")


def test_merge_accepts_fragment_dicts_keyed_by_path():
    d1 = {("blocks", "0", "w"): np.ones((2, 2)), ("final_norm", "scale"): np.ones(2)}
    d2 = {("blocks", "0", "w"): -np.ones((2, 2)), ("final_norm", "scale"): 3 * np.ones(2)}
    out = mg.merge([d1, d2], [1.0, 1.0], "average")
    np.testing.assert_allclose(out[("final_norm", "scale")], [2.0, 2.0])
    np.testing.assert_allclose(out[("blocks", "0", "w")], np.zeros((2, 2)))
