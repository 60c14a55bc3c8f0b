"""Rows of finished runs -> per-variant means and spreads, and the Markdown, CSV and JSON reports.

Relative loss differences are paired by seed (the same seed gives the same initial model and data
order), as docs/experiments.md#training-experiments-t1-to-t8 reports them: relative loss differences with their spread.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from diloco.experiments.spec import ExperimentSpec, Settings

NAN = float("nan")
SCALARS = ("eval_loss", "time_to_target", "tokens", "clock_s", "goodput", "uptime", "up_per_step",
           "down_per_step", "peak_up_per_step", "peak_up_training", "peak_over_mean", "merges", "quarantined",
           "quorum_mean", "grace_mean_s", "stalls", "tokens_merged_share", "norm_full", "norm_single",
           "norm_ratio", "throughput", "wall_s")
CSV_FIELDS = ("experiment", "variant", "seed", "algo", "learners", "steps", "params", *SCALARS, "run_dir")


def _stats(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation over the finite values (nan when there are none)."""
    x = np.array([v for v in values if v is not None and math.isfinite(v)], float)
    if not x.size:
        return NAN, NAN
    return float(x.mean()), float(x.std(ddof=1)) if x.size > 1 else 0.0


def mean_curve(curves: list[list[list[float]]]) -> dict:
    """Seeds' eval curves (tokens, time, loss) averaged point by point over their common length."""
    n = min((len(c) for c in curves), default=0)
    if n == 0:
        return {"tokens": [], "time": [], "loss": [], "loss_std": []}
    a = np.array([c[:n] for c in curves], float)  # seeds x points x (tokens, time, loss)
    std = a[:, :, 2].std(axis=0, ddof=1) if len(curves) > 1 else np.zeros(n)
    return {"tokens": a[:, :, 0].mean(0).tolist(), "time": a[:, :, 1].mean(0).tolist(),
            "loss": a[:, :, 2].mean(0).tolist(), "loss_std": std.tolist()}


def time_to(curve: dict, target: float) -> float:
    """First time the curve reaches `target`, linearly interpolated between eval points."""
    t, y = curve["time"], curve["loss"]
    for i, (ti, yi) in enumerate(zip(t, y)):
        if yi <= target:
            if i == 0:
                return ti
            t0, y0 = t[i - 1], y[i - 1]
            return t0 + (ti - t0) * (y0 - target) / (y0 - yi)
    return math.inf


def seed_targets(spec: ExperimentSpec, rows: list[dict]) -> dict[int, float]:
    """Per seed, the loss every run of that seed is timed to: spec.target_loss, or else the worst
    variant's final eval loss in that seed, which every variant reaches by its end."""
    finals: dict[int, list[float]] = {}
    for r in rows:
        if math.isfinite(r["eval_loss"]):
            finals.setdefault(r["seed"], []).append(r["eval_loss"])
    return {seed: spec.target_loss or max(losses) for seed, losses in finals.items()}


def _timed(row: dict, targets: dict[int, float]) -> dict:
    """The row with time_to_target on its own eval curve, against its seed's target."""
    curve = {"time": [p[1] for p in row["curve"]], "loss": [p[2] for p in row["curve"]]}
    target = targets.get(row["seed"], NAN)
    return {**row, "time_to_target": time_to(curve, target) if math.isfinite(target) else NAN}


def aggregate(spec: ExperimentSpec, settings: Settings, rows: list[dict]) -> dict:
    """The JSON result of one experiment: per-variant statistics, and every run's row."""
    targets = seed_targets(spec, rows)
    rows = [_timed(r, targets) for r in rows]
    by = {v.label: [r for r in rows if r["variant"] == v.label] for v in spec.variants}
    ref_of = {v.label: v.reference or spec.variants[0].label for v in spec.variants}
    variants = []
    for v in spec.variants:
        mine = by[v.label]
        ref = {r["seed"]: r["eval_loss"] for r in by[ref_of[v.label]]}
        rel = [(r["eval_loss"] - ref[r["seed"]]) / ref[r["seed"]] for r in mine if r["seed"] in ref]
        stats = {k: _stats([r.get(k, NAN) for r in mine]) for k in SCALARS}
        variants.append({"label": v.label, "reference": ref_of[v.label], "overrides": list(v.overrides),
                         "seeds": [r["seed"] for r in mine],
                         "mean": {k: s[0] for k, s in stats.items()}, "std": {k: s[1] for k, s in stats.items()},
                         "rel_loss": list(_stats(rel)), "curve": mean_curve([r["curve"] for r in mine])})
    return {"experiment": dataclasses.asdict(spec), "quick": settings.quick,
            "overrides": list(settings.overrides), "target_loss": _stats(list(targets.values()))[0],
            "seed_targets": {str(k): v for k, v in sorted(targets.items())},
            "variants": variants, "runs": rows}


def _bytes(v: float) -> str:
    if not math.isfinite(v):
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(v) >= size:
            return f"{v / size:.3g} {unit}"
    return f"{v:.0f} B"


def _num(digits: int):
    return lambda v: f"{v:.{digits}f}" if math.isfinite(v) else "-"


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%" if math.isfinite(v) else "-"


# column -> (header, formatter, show the spread); the first block is always reported
STANDARD = {"eval_loss": ("eval loss", _num(4), True), "goodput": ("goodput", _pct, False),
            "uptime": ("uptime", _pct, False), "up_per_step": ("up / learner-step", _bytes, False),
            "down_per_step": ("down / learner-step", _bytes, False),
            "peak_up_per_step": ("peak up / step", _bytes, False), "merges": ("merges", _num(0), False),
            "quarantined": ("quarantined", _num(0), False)}
EXTRA = {"time_to_target": ("time to target (s)", _num(1), True), "clock_s": ("clock (s)", _num(1), False),
         "tokens": ("tokens", _num(0), False), "quorum_mean": ("mean quorum", _num(2), False),
         "grace_mean_s": ("mean grace (s)", _num(3), False), "stalls": ("stalls", _num(1), False),
         "norm_full": ("merged-delta norm, all M", _num(4), True),
         "norm_single": ("delta norm, 1 learner", _num(4), True),
         "norm_ratio": ("ratio all M / 1", _num(3), True), "tokens_merged_share": ("merged share", _pct, False),
         "peak_up_training": ("peak up / step while training", _bytes, False),
         "peak_over_mean": ("peak / mean up while training", _num(2), True),
         "throughput": ("throughput vs nominal", _pct, False)}


def _cell(x: dict, key: str, fmt, spread: bool) -> str:
    m, s = x["mean"][key], x["std"][key]
    return f"{fmt(m)} ± {fmt(s)}" if spread and len(x["seeds"]) > 1 and math.isfinite(m) else fmt(m)


def _targets(result: dict) -> str:
    return ", ".join(f"seed {k}: {v:.4f}" for k, v in result["seed_targets"].items())


def command(result: dict) -> str:
    name = result["experiment"]["name"]
    extra = " quick=true" if result["quick"] else ""
    return f"python scripts/experiment.py experiment={name}{extra}"


def markdown(result: dict, figures: list[str]) -> str:
    spec = result["experiment"]
    columns = {**STANDARD, **{k: EXTRA[k] for k in spec["metrics"]}}
    seeds = sorted({s for x in result["variants"] for s in x["seeds"]})
    head = ["variant", "seeds", *(c[0] for c in list(columns.values())[:1]), "Δ loss vs reference",
            *(c[0] for c in list(columns.values())[1:])]
    lines = [f"# {spec['name'].upper()}: {spec['title']}", "",
             f"`{command(result)}`" + (" (quick setting: a smoke test, not a result)" if result["quick"] else ""),
             "", f"* paper: {spec['paper']}", f"* expected at small scale: {spec['expect']}"]
    if spec["notes"]:
        lines.append(f"* notes: {spec['notes']}")
    if result["overrides"]:
        lines.append(f"* extra overrides: `{' '.join(result['overrides'])}`")
    lines += [f"* seeds {seeds}; mean ± sample std over seeds; Δ loss is paired by seed "
              f"against the reference variant; bytes per learner-step are a run's total over M x steps "
              f"(M base learners); peak up is the most bytes all learners send in any window of one "
              f"step time; goodput and uptime are the sim's time ledger (diloco/experiments/measure.py "
              f"for data parallel).",
              f"* time to target: per seed, the first time a run's eval loss reaches that seed's "
              f"target ({_targets(result)}), interpolated between eval points", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for x in result["variants"]:
        cells = [_cell(x, k, fmt, spread) for k, (_, fmt, spread) in columns.items()]
        m, s = x["rel_loss"]
        if x["label"] == x["reference"]:
            rel = "reference"
        else:
            rel = f"{100 * m:+.2f}%" + (f" ± {100 * s:.2f}" if len(x["seeds"]) > 1 else "")
            rel += f" vs {x['reference']}"
        lines.append("| " + " | ".join([f"`{x['label']}`", str(len(x["seeds"])), cells[0], rel, *cells[1:]]) + " |")
    lines += ["", "Variants (train overrides on top of the experiment's base "
              f"`{' '.join(spec['base']) or '(none)'}`):", ""]
    lines += [f"* `{x['label']}`: `{' '.join(x['overrides']) or '(defaults)'}`" for x in result["variants"]]
    lines += ["", *[f"![{f}]({f})" for f in figures], ""]
    return "\n".join(lines)


def write(result: dict, out_dir: Path, figures: list[str]) -> list[Path]:
    """<name>.md, <name>.csv (one row per run) and <name>.json in out_dir."""
    name = result["experiment"]["name"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, csv_path, js = out / f"{name}.md", out / f"{name}.csv", out / f"{name}.json"
    md.write_text(markdown(result, figures))
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["runs"])
    js.write_text(json.dumps(result, indent=1))  # NaN where a number does not apply (DP merges)
    return [md, csv_path, js]
