"""Outer optimizers: optax transformations fed the merged pseudo-gradient as gradient (docs/algorithm.md#outer-optimizers).

Reference: DiLoCo (Douillard et al., arXiv 2311.08105) for outer Nesterov SGD; Async Local-SGD
(Liu et al., arXiv 2401.09135, Algorithm 3) for Delayed Nesterov.

`momentum="auto"` builds the same optimizer with its momentum a value of its state, which the syncer
sets per fragment before each step from the run's measured statistics (diloco/algo/outer_auto.py),
and its learning rate lr (1 - mu): momentum then averages the merged deltas over about 1 / (1 - mu)
rounds without making the step along a steady direction 1 / (1 - mu) times larger.

The syncer keeps one optimizer state per fragment (`opt.init(Theta_p)`) and calls `outer_step` once
per merged round. All state is float32.
"""

from __future__ import annotations

import functools
import inspect

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

Tree = Any


def nesterov(lr: float = 0.7, momentum: float = 0.9) -> optax.GradientTransformation:
    """DiLoCo's outer optimizer: b <- mu b + delta; Theta <- Theta - lr (delta + mu b)."""
    return optax.sgd(lr, momentum=momentum, nesterov=True)


def sgd_momentum(lr: float = 1.0, momentum: float = 0.0) -> optax.GradientTransformation:
    """Heavy-ball SGD: b <- mu b + delta; Theta <- Theta - lr b (plain SGD when momentum is 0)."""
    return optax.sgd(lr, momentum=momentum or None)


def averaging() -> optax.GradientTransformation:
    """Theta <- Theta - delta: with delta = mean(Theta - theta_m) this is parameter averaging."""
    return optax.sgd(1.0)


class DelayedNesterovState(NamedTuple):
    count: jax.Array  # arrivals so far (int32)
    buffer: Tree  # sum of the deltas since the last momentum update
    momentum: Tree  # m, updated once every N arrivals


def delayed_nesterov(lr: float = 0.7, momentum: float = 0.9, N: int = 4,
                     activation: float = 0.0) -> optax.GradientTransformation:
    """Delayed Nesterov (Async Local-SGD, arXiv 2401.09135, Algorithm 3).

    For the t-th delta g_t (t from 1), with Delta the sum of the buffered deltas:
        t mod N == 0:  m <- beta m + Delta / N;  Theta <- Theta - lr (g_t / N + beta m);  Delta <- 0
        otherwise:     Theta <- Theta - lr (g_t / N + c m)   (c = `activation`, default 0)
    Each arrival takes a plain gradient step of 1/N, and momentum moves once per N arrivals with
    their average. So N arrivals of the same g add up to one Nesterov step on g, and N = 1 is
    exactly `nesterov(lr, momentum)`; applying every arrival through ordinary Nesterov would
    compound momentum over stale deltas (section 4, Async Local-SGD eq. 5).
    """
    if not isinstance(N, int) or N < 1:
        raise ValueError(f"delayed Nesterov buffer size N={N!r} must be a positive integer")
    if activation < 0.0:
        raise ValueError(f"momentum activation c={activation} must be non-negative (the paper uses 0)")

    def init_fn(params: Tree) -> DelayedNesterovState:
        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        return DelayedNesterovState(jnp.zeros((), jnp.int32), zeros, zeros)

    def update_fn(updates: Tree, state: DelayedNesterovState, params: Tree = None):
        del params
        count = state.count + 1
        fire = count % N == 0
        buffer = jax.tree.map(lambda b, g: b + g, state.buffer, updates)
        m = jax.tree.map(lambda m, b: jnp.where(fire, momentum * m + b / N, m), state.momentum, buffer)
        coef = jnp.where(fire, momentum, activation)
        step = jax.tree.map(lambda g, m: -lr * (g / N + coef * m), updates, m)
        buffer = jax.tree.map(lambda b: jnp.where(fire, jnp.zeros_like(b), b), buffer)
        return step, DelayedNesterovState(count, buffer, m)

    return optax.GradientTransformation(init_fn, update_fn)


OUTER: dict[str, Callable[..., optax.GradientTransformation]] = {
    "nesterov": nesterov,
    "sgd": sgd_momentum,
    "average": averaging,
    "delayed_nesterov": delayed_nesterov,
}
# Those of OUTER whose every output value (of Theta' and of the state) depends only on the same value
# of Theta, the delta and the state, and on scalars: the syncer closes a round of these in pieces on
# every core (docs/design.md#closing-a-round). An entry that couples values (a norm, a matrix
# orthogonalisation) stays out and gets one pass over the whole fragment.
ELEMENTWISE = frozenset({"nesterov", "sgd", "average", "delayed_nesterov"})
_MADE_ELEMENTWISE: set = set()  # what make_outer built from ELEMENTWISE entries (cached, so kept alive)


# The entries outer.momentum="auto" serves, and the arguments of each that stay out of its state
# (a buffer size, and a coefficient its factory checks with a Python comparison).
AUTO_STATIC: dict[str, tuple[str, ...]] = {"nesterov": (), "sgd": (), "delayed_nesterov": ("N", "activation")}
AUTO = "auto"


def _sgd(lr: float, momentum: float, nesterov: bool = False) -> optax.GradientTransformation:
    """optax.sgd at lr (1 - momentum), with a momentum buffer whatever the momentum (sgd_momentum
    drops it at 0, which a momentum set at run time cannot do). Along a steady delta the buffer
    grows to delta / (1 - mu), so the step stays lr x delta, heavy ball and Nesterov alike."""
    return optax.sgd(lr * (1.0 - momentum), momentum=momentum, nesterov=nesterov)


def _delayed(lr: float, momentum: float, N: int = 4, activation: float = 0.0) -> optax.GradientTransformation:
    """delayed_nesterov at lr (1 - momentum), as _sgd."""
    return delayed_nesterov(lr * (1.0 - momentum), momentum, N, activation)


_AUTO_FACTORIES = {"nesterov": functools.partial(_sgd, nesterov=True), "sgd": _sgd, "delayed_nesterov": _delayed}


def make_outer(name: str, **options: Any) -> optax.GradientTransformation:
    """The outer optimizer `name` from OUTER, given those of `options` its factory takes (as
    make_codec does), so one config section (lr, momentum, N) serves every entry. With
    momentum="auto" the momentum is a value of the optimizer's state (optax.inject_hyperparams),
    starting at 0, that `with_momentum` sets between steps, and the step is lr (1 - momentum).

    Equal arguments give the same object: the syncer's jitted close takes the optimizer as a
    static argument, hashed by identity, so an equal optimizer built again would compile again."""
    if name not in OUTER:
        raise ValueError(f"unknown outer optimizer {name!r}; choose from {sorted(OUTER)}")
    if options.get("momentum") == AUTO and name not in AUTO_STATIC:
        raise ValueError(f"outer momentum {AUTO!r} needs an optimizer with momentum: one of "
                         f"{sorted(AUTO_STATIC)}, not {name!r}")
    params = inspect.signature(OUTER[name]).parameters
    return _make(name, tuple(sorted((k, v) for k, v in options.items() if k in params)))


@functools.lru_cache(maxsize=256)
def _make(name: str, options: tuple) -> optax.GradientTransformation:
    kwargs = dict(options)
    if kwargs.get("momentum") == AUTO:
        # every argument not static is a state value: a scalar leaf the close passes through
        opt = optax.inject_hyperparams(_AUTO_FACTORIES[name], static_args=AUTO_STATIC[name])(
            **{**kwargs, "momentum": 0.0})
    else:
        opt = OUTER[name](**kwargs)
    if name in ELEMENTWISE:
        _MADE_ELEMENTWISE.add(opt)
    return opt


def with_momentum(opt_state: Any, momentum: float) -> Any:
    """The state of a momentum="auto" optimizer with the momentum its next step uses set."""
    hyper = {**opt_state.hyperparams, "momentum": np.asarray(momentum, np.float32)}
    return opt_state._replace(hyperparams=hyper)


def momentum_of(opt_state: Any) -> float | None:
    """The momentum a momentum="auto" state holds; None for any other optimizer's state."""
    hyper = getattr(opt_state, "hyperparams", None)
    return None if hyper is None or "momentum" not in hyper else float(hyper["momentum"])


def elementwise(opt: optax.GradientTransformation) -> bool:
    """Whether opt came from make_outer for an ELEMENTWISE entry (anything else is not assumed to be)."""
    return opt in _MADE_ELEMENTWISE


def outer_step(opt: optax.GradientTransformation, theta: Tree, opt_state: Any,
               delta: Tree) -> tuple[Tree, Any]:
    """One outer step on one fragment: delta is the gradient, Theta moves against it.

    Pure; jit it with the optimizer closed over: `jax.jit(functools.partial(outer_step, opt))`.
    """
    theta = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), theta)
    delta = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), delta)
    updates, opt_state = opt.update(delta, opt_state, theta)
    return optax.apply_updates(theta, updates), opt_state
