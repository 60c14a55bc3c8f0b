"""Goodput of data parallel, elastic data parallel and Decoupled DiLoCo under chip failures at
millions of chips (docs/experiments.md#goodput-at-millions-of-chips, the paper's Table 1).

Event-driven and vectorised: the work is proportional to the number of failures, never to chips
or seconds. Definitions:

* goodput = productive chip-seconds / (chips x wall seconds): a job counts its live chips while it
  runs and nothing while it is paused (restarting, reconfiguring) or has no live slice;
* uptime = share of wall time the global model advances: the job runs (dp, elastic_dp) or at
  least one learner runs (diloco, K = 1: the syncer merges whatever arrives).

Modes:

* `dp`: no elasticity. Any chip failure stops every chip for `restart_s`; the job comes back on
  all N chips (a failed slice is swapped for a spare, so slice repairs never shrink it). Failures
  are a Poisson process of rate N / MTBI.
* `elastic_dp`: one job over all slices. A slice failure pauses the whole job for `reconfig_s`;
  it then runs on the live slices; the slice's return (after the repair time) pauses it again.
* `diloco`: M learners, each an elastic job over its own N / M chips; a pause stops only that
  learner. `diloco` with M = 1 is `elastic_dp` (same code, same failures).

Overlapping pauses (an event while a pause is under way) follow one named rule (OVERLAPS):

* `share`: the event joins the pause under way, which ends when it would have (the
  reconfiguration takes in every change known when it finishes);
* `extend`: the pause restarts: it ends `pause` seconds after the last event;
* `queue`: every event gets its own pause, served one after the other.

The calibration uses `share`: with `extend` or `queue`, goodput falls exponentially or to zero once
failures arrive faster than a pause lasts (2.4M chips: one failure every 13 s), which neither
data-parallel row of the paper shows (see `results/goodput.md` for each rule's best fit).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from diloco.chaos.failures import (SECONDS_PER_YEAR, Candidates, FailureModel, Outages, draw_candidates,
                                   events_by_time, follow, fraction_down, outages_from, poisson_times, slice_events)

MODES = ("dp", "elastic_dp", "diloco")
OVERLAPS = ("share", "extend", "queue")


@dataclass(frozen=True)
class Constants:
    """The time constants of the simulator and the fixed assumptions they are fitted under."""

    # defaults: the fit of `python scripts/goodput.py` (results/goodput.md)
    restart_s: float = 77.5  # dp: from a failure to the job running again on N chips
    reconfig_s: float = 9.4  # elastic: pause of a whole job per failure and per return
    repair_s: float = 7640.0  # elastic: mean time a failed slice stays out of its job
    chips_per_slice: int = 256  # fixed assumption: only chips_per_slice x repair_s is identified
    mtbi_s: float = SECONDS_PER_YEAR  # per chip
    repair: str = "fixed"  # fixed | exponential | lognormal
    repair_sigma: float = 1.0
    overlap: str = "share"  # share | extend | queue

    def failures(self) -> FailureModel:
        return FailureModel(chips_per_slice=self.chips_per_slice, mtbi_s=self.mtbi_s,
                            repair=self.repair, repair_mean_s=self.repair_s,
                            repair_sigma=self.repair_sigma)


@dataclass(frozen=True)
class Cell:
    """One simulated (mode, M, chips) point."""

    mode: str
    learners: int
    chips: int  # simulated chips: whole slices, the nearest multiple of chips_per_slice
    goodput: float
    uptime: float
    down_fraction: float  # average share of the job's slices out (dp: 0, spares take their place)
    failures: int


def pauses(times: np.ndarray, pause_s: float, overlap: str) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint pause intervals (starts, ends) caused by sorted event `times` under `overlap`."""
    first, ends = _pause_starts(times, pause_s, overlap)
    return times[first], ends


def _pause_starts(times: np.ndarray, pause_s: float, overlap: str) -> tuple[np.ndarray, np.ndarray]:
    """pauses(), with each pause's start as the index of the event that starts it."""
    n = times.size
    if n == 0 or pause_s <= 0:
        return np.empty(0, np.int64), np.empty(0)
    if overlap == "share":
        # Greedy: the next pause starts at the first event at or after the current pause's end.
        # An event at least one pause after the previous event always starts a pause, so the
        # walks between such events are independent and run side by side (failures.follow).
        nxt = np.searchsorted(times, times + pause_s, side="left")
        first = np.flatnonzero(np.diff(times, prepend=-np.inf) >= pause_s)
        idx = follow(first, np.append(first[1:], n), nxt)
        return idx, times[idx] + pause_s
    if overlap == "extend":
        new = np.ones(n, bool)
        new[1:] = np.diff(times) > pause_s
        first = np.flatnonzero(new)
        last = np.append(first[1:] - 1, n - 1)
        return first, times[last] + pause_s
    if overlap == "queue":
        # Lindley recursion end_i = max(t_i, end_{i-1}) + p, closed form with a running maximum
        k = np.arange(n)
        ends = np.maximum.accumulate(times - k * pause_s) + (k + 1) * pause_s
        new = np.ones(n, bool)
        new[1:] = times[1:] >= ends[:-1]
        first = np.flatnonzero(new)
        last = np.append(first[1:] - 1, n - 1)
        return first, ends[last]
    raise ValueError(f"overlap={overlap!r} not in {'|'.join(OVERLAPS)}")


def _merge(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals as disjoint sorted intervals."""
    if starts.size == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.maximum.accumulate(ends[order])
    new = np.ones(s.size, bool)
    new[1:] = s[1:] > e[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, s.size - 1)
    return s[first], e[last]


def elastic_job(times: np.ndarray, delta_chips: np.ndarray, chips0: int, pause_s: float,
                 overlap: str, horizon_s: float):
    """One elastic job from its sorted events (times, change in live chips) and its chips at t = 0:
    (productive chip-seconds, starts and ends of the time it makes no progress)."""
    live = chips0 + np.cumsum(delta_chips)  # live chips after each event
    first, pe = _pause_starts(times, pause_s, overlap)
    ps, pe = times[first], np.minimum(pe, horizon_s)
    # F(x) = integral of live chips over [0, x]: piecewise linear between events
    t = np.concatenate([[0.0], times])
    level = np.concatenate([[chips0], live]).astype(float)
    area = np.concatenate([[0.0], np.cumsum(level[:-1] * np.diff(t))])

    def F(x: np.ndarray) -> np.ndarray:
        k = np.searchsorted(t, x, side="right") - 1
        return area[k] + level[k] * (x - t[k])

    # A pause starts at its event, t[first + 1], where F is area[first + 1] (exactly: equal times
    # after it add level * 0), so only the pause ends need a search.
    productive = F(np.array([horizon_s]))[0] - float((F(pe) - area[first + 1]).sum())
    dead = np.flatnonzero(level == 0)  # no live slice: the learner cannot run, paused or not
    dead_end = np.append(t[1:], horizon_s)[dead]
    stop_s, stop_e = _merge(np.concatenate([ps, t[dead]]), np.concatenate([pe, dead_end]))
    return productive, stop_s, stop_e


def _intersect(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]):
    """The intervals of positive length in both of two sorted lists of disjoint intervals."""
    (a_s, a_e), (b_s, b_e) = a, b
    lo = np.searchsorted(b_e, a_s, side="right")  # the first b ending after a starts
    hi = np.searchsorted(b_s, a_e, side="left")  # past the last b starting before a ends
    counts = np.maximum(hi - lo, 0)
    i = np.repeat(np.arange(a_s.size), counts)
    j = np.arange(i.size) - np.repeat(np.cumsum(counts) - counts - lo, counts)
    s, e = np.maximum(a_s[i], b_s[j]), np.minimum(a_e[i], b_e[j])
    keep = e > s
    return s[keep], e[keep]


def _all_stopped(stops: list[tuple[np.ndarray, np.ndarray]], horizon_s: float) -> float:
    """Seconds during which every job is stopped (each job's intervals sorted and disjoint).

    The jobs' stopped intervals are intersected one job at a time; the intersection is short
    after the first two, so this is far cheaper than sweeping all the jobs' interval ends together.
    Each interval's length is the last start to the first end, as a sweep would take it."""
    both = stops[0][0], np.minimum(stops[0][1], horizon_s)
    for s, e in stops[1:]:
        both = _intersect(both, (s, np.minimum(e, horizon_s)))
    gaps = both[1] - both[0]
    return float(gaps[gaps > 0].sum())


def dp_job(times: np.ndarray, n_chips: int, c: Constants, horizon_s: float) -> Cell:
    """No elasticity: every failure in `times` stops all n_chips for restart_s."""
    ps, pe = pauses(times, c.restart_s, c.overlap)
    up = 1.0 - float((np.minimum(pe, horizon_s) - ps).sum()) / horizon_s
    return Cell("dp", 1, n_chips, up, up, 0.0, int(times.size))


def elastic_jobs(out: Outages, learners: int, c: Constants, by_time=None) -> Cell:
    """`learners` elastic jobs over contiguous, near-equal shares of the slices of `out`
    (`by_time`: failures.events_by_time(out), when the caller shares it between calls)."""
    m, h, n_slices = learners, out.horizon_s, out.n_slices
    owner = np.arange(n_slices) * m // n_slices
    group, times, delta = slice_events(out, owner, by_time=by_time)
    bounds = np.searchsorted(group, np.arange(m + 1))
    productive, stops = 0.0, []
    for j in range(m):
        lo, hi = bounds[j], bounds[j + 1]
        chips0 = int((owner == j).sum()) * c.chips_per_slice
        p, s, e = elastic_job(times[lo:hi], delta[lo:hi] * c.chips_per_slice, chips0,
                              c.reconfig_s, c.overlap, h)
        productive += p
        stops.append((s, e))
    n_chips = n_slices * c.chips_per_slice
    return Cell("diloco" if m > 1 else "elastic_dp", m, n_chips, productive / (n_chips * h),
                1.0 - _all_stopped(stops, h) / h, fraction_down(out), int(out.down_s.size))


def _frozen(*arrays: np.ndarray | None) -> None:
    for a in arrays:
        if a is not None:
            a.flags.writeable = False  # shared by every mode and call that draws the same


# The draws behind a cell depend only on (seed, size, horizon) and the failure rate, not on the
# mode, M or the time constants, so they are made once and shared: every mode and M at a size
# sees the same failures (as before: one stream per (seed, size)), the fit's evaluations reuse
# them across constants, and the repair time only re-runs the cheap walk of outages_from.
@functools.lru_cache(maxsize=32)
def _candidates(chips_per_slice: int, mtbi_s: float, repair: str, n_slices: int, horizon_s: float,
                seed: int) -> Candidates:
    model = FailureModel(chips_per_slice=chips_per_slice, mtbi_s=mtbi_s, repair=repair)
    cand = draw_candidates(model, n_slices, horizon_s, np.random.default_rng([seed, n_slices]))
    _frozen(cand.slice_id, cand.time, cand.unit, cand.key, cand.counts)
    return cand


@functools.lru_cache(maxsize=32)
def outages(model: FailureModel, n_slices: int, horizon_s: float, seed: int) -> Outages:
    """The outages every elastic mode sees on `n_slices` slices under `seed` (shared, read-only)."""
    cand = _candidates(model.chips_per_slice, model.mtbi_s, model.repair, n_slices, horizon_s, seed)
    out = outages_from(cand, model)
    _frozen(out.slice_id, out.down_s, out.up_s)
    return out


@functools.lru_cache(maxsize=32)
def _by_time(model: FailureModel, n_slices: int, horizon_s: float, seed: int):
    events = events_by_time(outages(model, n_slices, horizon_s, seed))
    _frozen(*events)
    return events


@functools.lru_cache(maxsize=32)
def dp_failures(n_chips: int, mtbi_s: float, n_slices: int, horizon_s: float, seed: int) -> np.ndarray:
    """Sorted chip-failure times of the dp mode (shared, read-only)."""
    times = poisson_times(n_chips / mtbi_s, horizon_s, np.random.default_rng([seed, n_slices]))
    _frozen(times)
    return times


def simulate(mode: str, chips: int, c: Constants, horizon_s: float, seed: int = 0,
             learners: int = 1) -> Cell:
    """Goodput, uptime and slice-down fraction of one mode on `chips` chips over `horizon_s`."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} not in {'|'.join(MODES)}")
    m = learners if mode == "diloco" else 1
    n_slices = max(m, round(chips / c.chips_per_slice))
    n_chips = n_slices * c.chips_per_slice
    if mode == "dp":
        return dp_job(dp_failures(n_chips, c.mtbi_s, n_slices, horizon_s, seed), n_chips, c, horizon_s)
    model = c.failures()
    cell = elastic_jobs(outages(model, n_slices, horizon_s, seed), m, c,
                        _by_time(model, n_slices, horizon_s, seed))
    return replace(cell, mode=mode)


def average(mode: str, chips: int, c: Constants, horizon_s: float, seeds: int,
            learners: int = 1) -> Cell:
    """`simulate` averaged over seeds 0 .. seeds - 1."""
    cells = [simulate(mode, chips, c, horizon_s, s, learners) for s in range(seeds)]

    def mean(name: str) -> float:
        return float(np.mean([getattr(x, name) for x in cells]))

    return replace(cells[0], goodput=mean("goodput"), uptime=mean("uptime"),
                   down_fraction=mean("down_fraction"), failures=int(sum(x.failures for x in cells)))
