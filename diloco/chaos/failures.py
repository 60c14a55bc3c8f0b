"""Failure model shared by the chaos tapes and the goodput simulator (docs/experiments.md#goodput-at-millions-of-chips).

Every chip fails as a Poisson process with mean time between interruptions `mtbi_s`, so a slice of
c chips fails at rate c / mtbi_s. A failed slice is out until it is repaired, and a slice that is
out cannot fail again: each slice alternates up ~ Exp(mtbi_s / c) and down ~ the repair
distribution (an alternating renewal process), sampled for all slices at once with numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SECONDS_PER_YEAR = 365 * 86_400.0
REPAIRS = ("fixed", "exponential", "lognormal")


@dataclass(frozen=True)
class FailureModel:
    """How often a slice fails and how long it stays out."""

    chips_per_slice: int = 256
    mtbi_s: float = SECONDS_PER_YEAR  # per chip
    repair: str = "fixed"  # fixed | exponential | lognormal
    repair_mean_s: float = 3600.0
    repair_sigma: float = 1.0  # lognormal only: std of log(repair time)

    @property
    def slice_rate(self) -> float:
        """Failures per second of one slice while it is up."""
        return self.chips_per_slice / self.mtbi_s


@dataclass(frozen=True)
class Outages:
    """Every outage that starts in [0, horizon_s): which slice, when it failed, when it is back.

    Arrays are parallel and sorted by slice then time; `up_s` may lie past the horizon.
    """

    slice_id: np.ndarray
    down_s: np.ndarray
    up_s: np.ndarray
    n_slices: int
    horizon_s: float


def unit_repairs(repair: str, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray | None:
    """The random part of `shape` repair durations (None for fixed repairs, which draw nothing)."""
    if repair == "fixed":
        return None
    if repair == "exponential":
        return rng.standard_exponential(shape)
    if repair == "lognormal":
        return rng.standard_normal(shape)
    raise ValueError(f"repair={repair!r} not in {'|'.join(REPAIRS)}")


def scale_repairs(model: FailureModel, unit: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    """Repair durations with mean `model.repair_mean_s` from unit_repairs' variates."""
    mean = model.repair_mean_s
    if model.repair == "fixed":
        return np.full(shape, mean)
    if model.repair == "exponential":
        return mean * unit
    s = model.repair_sigma
    return np.exp(math.log(mean) - 0.5 * s * s + s * unit)


def repair_times(model: FailureModel, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Repair durations with mean `model.repair_mean_s`.

    Drawn as unit variates scaled by the mean, so changing the mean under the same seed changes
    the durations smoothly (common random numbers keep the calibration's objective smooth).
    """
    return scale_repairs(model, unit_repairs(model.repair, rng, shape), shape)


@dataclass(frozen=True)
class Candidates:
    """sample_outages' draws before any repair time is applied, sorted by (slice, time).

    Only the slice rate and the repair distribution's kind shape them, so outages for another
    repair mean or sigma are made from the same candidates (outages_from) without redrawing or
    resorting them."""

    slice_id: np.ndarray
    time: np.ndarray
    unit: np.ndarray | None  # unit_repairs' variates, in the same order
    key: np.ndarray  # slice_id * 2 horizon + time: sorted
    counts: np.ndarray  # candidates per slice
    n_slices: int
    horizon_s: float


def draw_candidates(model: FailureModel, n_slices: int, horizon_s: float,
                    rng: np.random.Generator) -> Candidates:
    """Every slice's Poisson stream of candidate failures at the slice rate over [0, horizon_s)."""
    counts = rng.poisson(model.slice_rate * horizon_s, n_slices)
    slice_id = np.repeat(np.arange(n_slices), counts)
    time = rng.uniform(0.0, horizon_s, slice_id.size)
    unit = unit_repairs(model.repair, rng, (slice_id.size,))
    key = slice_id * (2.0 * horizon_s) + time  # sorts by (slice, time); slices 2h apart
    order = stable_order(key)
    return Candidates(slice_id=slice_id[order], time=time[order], unit=None if unit is None else unit[order],
                      key=key[order], counts=counts, n_slices=n_slices, horizon_s=horizon_s)


def outages_from(cand: Candidates, model: FailureModel) -> Outages:
    """The outages of `cand` under `model`'s repair times: a candidate is a failure when its slice
    is up and is dropped while it is down."""
    counts = cand.counts
    repair = scale_repairs(model, cand.unit, (cand.slice_id.size,))
    # next candidate after the repair of candidate i: the first at or after its return, never
    # past the first candidate of the next slice (which starts up)
    ends = np.cumsum(counts)
    slice_end = np.repeat(ends, counts)
    nxt = np.minimum(np.searchsorted(cand.key, cand.key + repair, side="left"), slice_end)
    has = counts > 0
    idx = follow(ends[has] - counts[has], ends[has], nxt)
    return Outages(slice_id=cand.slice_id[idx], down_s=cand.time[idx], up_s=cand.time[idx] + repair[idx],
                   n_slices=cand.n_slices, horizon_s=cand.horizon_s)


def sample_outages(model: FailureModel, n_slices: int, horizon_s: float,
                   rng: np.random.Generator) -> Outages:
    """All outages of `n_slices` slices, all up at t = 0, over [0, horizon_s).

    Every slice gets a Poisson stream of candidate failures at the slice rate; a candidate is a
    failure when the slice is up and is dropped while it is down. By memorylessness this is the
    alternating renewal process above, and its failure times do not move when the repair time
    changes (only which candidates fall inside a repair), so fits across repair times compare the
    same random failures (common random numbers) and the objective stays smooth.
    """
    return outages_from(draw_candidates(model, n_slices, horizon_s, rng), model)


def stable_order(key: np.ndarray) -> np.ndarray:
    """np.argsort(key, kind="stable"), in a fifth of the time: numpy's default sort is vectorised
    but not stable, and when no two keys are equal every sort is the stable one. Equal keys
    (hand-placed events) take the stable sort."""
    order = np.argsort(key)
    ranked = key[order]
    return np.argsort(key, kind="stable") if np.any(ranked[1:] == ranked[:-1]) else order


def follow(first: np.ndarray, stop: np.ndarray, nxt: np.ndarray) -> np.ndarray:
    """Sorted indices visited by following `nxt` from each first[k] while below stop[k].

    A greedy walk ("the next event after this one's repair / pause") is sequential within a block
    but blocks are independent, so all blocks advance together: one numpy step per visit of the
    longest block, not a Python step per event.
    """
    visited = []
    ptr, lim = np.asarray(first, np.int64), np.asarray(stop, np.int64)
    while ptr.size:
        keep = ptr < lim
        ptr, lim = ptr[keep], lim[keep]
        visited.append(ptr)
        ptr = nxt[ptr]
    return np.sort(np.concatenate(visited)) if visited else np.empty(0, np.int64)


def poisson_times(rate: float, horizon_s: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted event times of a Poisson process of `rate` per second over [0, horizon_s)."""
    n = rng.poisson(rate * horizon_s)
    return np.sort(rng.uniform(0.0, horizon_s, n))


def fraction_down(out: Outages) -> float:
    """Average share of slices out over [0, horizon_s)."""
    if out.n_slices == 0 or out.horizon_s <= 0:
        return 0.0
    lost = np.minimum(out.up_s, out.horizon_s) - out.down_s
    return float(lost.sum() / (out.n_slices * out.horizon_s))


def steady_fraction_down(model: FailureModel) -> float:
    """Long-run share of slices out: mean repair / (mean up + mean repair)."""
    return model.repair_mean_s / (1.0 / model.slice_rate + model.repair_mean_s)


def events_by_time(out: Outages, horizon_s: float | None = None):
    """Down (-1) and up (+1) events inside the horizon, sorted by time: (slice, time, delta).

    The stable sort keeps failures (listed first) before returns at equal times, and each kind in
    (slice, time) order. One sort per set of outages, shared by every grouping (slice_events)."""
    h = out.horizon_s if horizon_s is None else horizon_s
    back = out.up_s < h
    time = np.concatenate([out.down_s, out.up_s[back]])
    delta = np.concatenate([-np.ones(out.down_s.size, np.int64), np.ones(int(back.sum()), np.int64)])
    slice_id = np.concatenate([out.slice_id, out.slice_id[back]])
    order = stable_order(time)
    return slice_id[order], time[order], delta[order]


def slice_events(out: Outages, group_of_slice: np.ndarray, horizon_s: float | None = None, by_time=None):
    """Down (-1) and up (+1) events inside the horizon, sorted by (group, time).

    Returns (group, time, delta) arrays; `group_of_slice[s]` says which job slice s belongs to;
    `by_time` is events_by_time(out, horizon_s) when the caller already has it.
    """
    slice_id, time, delta = events_by_time(out, horizon_s) if by_time is None else by_time
    group = group_of_slice[slice_id]
    # A stable sort by group of the time-sorted events: (group, time) order. On 16-bit keys numpy's
    # stable sort is a radix sort, linear in the events, where a (group, time) sort is not.
    key = group.astype(np.min_scalar_type(max(int(group.max(initial=0)), 0)), copy=False)
    order = np.argsort(key, kind="stable")
    return group[order], time[order], delta[order]
