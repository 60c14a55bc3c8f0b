"""The goodput study of docs/experiments.md#goodput-at-millions-of-chips: calibrate on the data-parallel rows, predict
Decoupled DiLoCo for every M untuned, and collect everything the report needs as plain data."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, replace

import numpy as np

from diloco.chaos.calibrate import PAPER, PAPER_CHIPS, calibrate, fit_reconfig
from diloco.chaos.failures import REPAIRS, SECONDS_PER_YEAR, steady_fraction_down
from diloco.chaos.goodput import OVERLAPS, Constants, average, simulate
from diloco.config import ConfigError, from_dict

DAY = 86_400.0
# acceptance, in goodput points per cell (docs/experiments.md#goodput-at-millions-of-chips and the project brief)
TOLERANCE = {("dp", 1): 4.0, ("elastic_dp", 1): 2.0, ("diloco", 8): 5.0}


@dataclass(frozen=True)
class GoodputConfig:
    """configs/goodput.yaml: what to simulate, for how long, and the fixed assumptions."""

    chips: tuple[int, ...] = PAPER_CHIPS
    learners: tuple[int, ...] = (2, 4, 8, 16)  # M of the Decoupled DiLoCo rows
    days: float = 30.0  # simulated wall time of every reported cell
    seeds: int = 2  # reported cells average this many seeds
    fit_days: float = 30.0  # simulated time of each evaluation during the fit
    fit_seeds: int = 1
    fit_restarts: int = 6  # Nelder-Mead restarts of the elastic fit (calibrate.fit_elastic)
    chips_per_slice: int = 256  # fixed assumption (only chips_per_slice x repair_s is identified)
    mtbi_s: float = SECONDS_PER_YEAR  # per chip
    repair: str = "fixed"
    repair_sigma: float = 1.0
    overlap: str = "share"  # rule of the main fit; the others are fitted too when overlap_study
    start_reconfig_s: float = 30.0  # where the elastic fit starts ("tens of seconds")
    start_repair_s: float = 3600.0
    overlap_study: bool = True
    # repair times (s) at which the elastic row is refitted with reconfig_s alone: shows how loosely
    # the row pins the share of slices down, which sets the small-N Decoupled DiLoCo cells
    profile_repairs: tuple[float, ...] = (2000.0, 4000.0, 6000.0, 8000.0, 10000.0)
    quick: bool = False  # 2 simulated days (1 for the fit), one seed, no overlap study: seconds
    out_dir: str = "results"


def load(raw: dict) -> GoodputConfig:
    """Plain dict -> validated GoodputConfig; `quick` shortens everything."""
    cfg = from_dict(GoodputConfig, raw)
    e = []
    if not cfg.chips or min(cfg.chips) < 1:
        e.append(f"chips={list(cfg.chips)} must be a non-empty list of positive counts")
    if not cfg.learners or min(cfg.learners) < 1:
        e.append(f"learners={list(cfg.learners)} must be a non-empty list of M >= 1")
    for name in ("days", "fit_days", "mtbi_s", "start_reconfig_s", "start_repair_s"):
        if getattr(cfg, name) <= 0:
            e.append(f"{name}={getattr(cfg, name)} must be > 0")
    for name in ("seeds", "fit_seeds", "fit_restarts", "chips_per_slice"):
        if getattr(cfg, name) < 1:
            e.append(f"{name}={getattr(cfg, name)} must be >= 1")
    if any(r <= 0 for r in cfg.profile_repairs):
        e.append(f"profile_repairs={list(cfg.profile_repairs)} must all be > 0")
    if cfg.repair not in REPAIRS:
        e.append(f"repair={cfg.repair!r} not in {'|'.join(REPAIRS)}")
    if cfg.overlap not in OVERLAPS:
        e.append(f"overlap={cfg.overlap!r} not in {'|'.join(OVERLAPS)}")
    if e:
        raise ConfigError("invalid goodput config:\n  " + "\n  ".join(e))
    if cfg.quick:
        cfg = replace(cfg, days=min(cfg.days, 2.0), fit_days=min(cfg.fit_days, 1.0), seeds=1,
                      fit_seeds=1, fit_restarts=1, overlap_study=False, profile_repairs=())
    return cfg


def _base(cfg: GoodputConfig, overlap: str) -> Constants:
    return Constants(reconfig_s=cfg.start_reconfig_s, repair_s=cfg.start_repair_s,
                     chips_per_slice=cfg.chips_per_slice, mtbi_s=cfg.mtbi_s, repair=cfg.repair,
                     repair_sigma=cfg.repair_sigma, overlap=overlap)


def _rows(cfg: GoodputConfig) -> list[tuple[str, int]]:
    return [("dp", 1), ("elastic_dp", 1)] + [("diloco", m) for m in cfg.learners]


def _cells(c: Constants, cfg: GoodputConfig, horizon_s: float, seeds: int) -> list[dict]:
    out = []
    for mode, m in _rows(cfg):
        paper = PAPER.get((mode, m))
        for n in cfg.chips:
            cell = dataclasses.asdict(average(mode, n, c, horizon_s, seeds, m))
            target = paper[PAPER_CHIPS.index(n)] if paper and n in PAPER_CHIPS else None
            cell["requested_chips"] = n
            cell["paper"] = target
            cell["error_points"] = None if target is None else 100.0 * (cell["goodput"] - target)
            out.append(cell)
    return out


def _max_errors(cells: list[dict]) -> dict[str, float]:
    worst: dict[str, float] = {}
    for x in cells:
        if x["error_points"] is not None:
            key = f"{x['mode']}/{x['learners']}"
            worst[key] = max(worst.get(key, 0.0), abs(x["error_points"]))
    return worst


def timing(c: Constants, learners: tuple[int, ...], chips: int, horizon_s: float) -> float:
    """Seconds to simulate every mode once at `chips` chips over `horizon_s` (one seed)."""
    t0 = time.perf_counter()
    for mode, m in [("dp", 1), ("elastic_dp", 1)] + [("diloco", m) for m in learners]:
        simulate(mode, chips, c, horizon_s, 0, m)
    return time.perf_counter() - t0


def _checked(c: Constants, cfg: GoodputConfig) -> list[dict]:
    """dp, elastic and M = 8 cells at the fit's horizon: how a set of constants fares."""
    return _cells(c, replace(cfg, learners=(8,)), cfg.fit_days * DAY, cfg.fit_seeds)


def overlap_study(cfg: GoodputConfig, fitted: Constants) -> list[dict]:
    """Each overlap rule with its own best fit, and its worst cell errors."""
    out = []
    for overlap in OVERLAPS:
        c = fitted if overlap == cfg.overlap else calibrate(
            _base(cfg, overlap), cfg.fit_days * DAY, cfg.fit_seeds, cfg.fit_restarts)
        errs = _max_errors(_checked(c, cfg))
        out.append({"overlap": overlap, "restart_s": c.restart_s, "reconfig_s": c.reconfig_s,
                    "repair_s": c.repair_s, **{f"max_error_{k}": v for k, v in errs.items()}})
    return out


def repair_profile(cfg: GoodputConfig, fitted: Constants) -> list[dict]:
    """The elastic fit with repair_s held at each of cfg.profile_repairs (reconfig_s refitted)."""
    out = []
    for r in cfg.profile_repairs:
        c = fit_reconfig(replace(fitted, repair_s=r), cfg.fit_days * DAY, cfg.fit_seeds)
        cells = _checked(c, cfg)
        out.append({"repair_s": r, "down_fraction": steady_fraction_down(c.failures()),
                    "reconfig_s": c.reconfig_s,
                    **{f"max_error_{k}": v for k, v in _max_errors(cells).items()},
                    "errors_diloco/8": [x["error_points"] for x in cells
                                        if x["mode"] == "diloco" and x["error_points"] is not None]})
    return out


def run(cfg: GoodputConfig) -> dict:
    """Fit, predict, and return the results as plain data (what results/goodput.json holds)."""
    t0 = time.perf_counter()
    fitted = calibrate(_base(cfg, cfg.overlap), cfg.fit_days * DAY, cfg.fit_seeds, cfg.fit_restarts)
    fit_s = time.perf_counter() - t0
    cells = _cells(fitted, cfg, cfg.days * DAY, cfg.seeds)
    biggest = max(cfg.chips)
    return {
        "config": dataclasses.asdict(cfg),
        "constants": dataclasses.asdict(fitted),
        "down_fraction_steady": steady_fraction_down(fitted.failures()),
        "cells": cells,
        "max_error_points": _max_errors(cells),
        "tolerance_points": {f"{k[0]}/{k[1]}": v for k, v in TOLERANCE.items()},
        "overlap_study": overlap_study(cfg, fitted) if cfg.overlap_study else [],
        "repair_profile": repair_profile(cfg, fitted),
        "fit_seconds": fit_s,
        "timing": {"chips": biggest, "days": cfg.days,
                   "seconds_all_modes": timing(fitted, cfg.learners, biggest, cfg.days * DAY)},
    }


def passed(result: dict) -> dict[str, bool]:
    """Acceptance per checked row: every cell within its tolerance."""
    worst = result["max_error_points"]
    return {k: worst.get(k, np.inf) <= tol for k, tol in result["tolerance_points"].items()
            if k in worst}
