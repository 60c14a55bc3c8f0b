"""Write the goodput study (diloco/chaos/study.py) as Markdown, CSV, JSON and a PNG figure."""

from __future__ import annotations

import csv
import json
from pathlib import Path

CSV_FIELDS = ("mode", "learners", "chips", "requested_chips", "goodput", "uptime", "down_fraction",
              "failures", "paper", "error_points")
NAMES = {"dp": "data parallel, no elasticity", "elastic_dp": "data parallel, elastic"}


def row_name(mode: str, learners: int) -> str:
    return NAMES.get(mode, f"Decoupled DiLoCo, M = {learners}")


def _rows(cells: list[dict]) -> dict[tuple[str, int], list[dict]]:
    rows: dict[tuple[str, int], list[dict]] = {}
    for x in cells:
        rows.setdefault((x["mode"], x["learners"]), []).append(x)
    return rows


def _chips(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def _table(cells: list[dict], value: str, fmt, with_paper: bool) -> list[str]:
    rows = _rows(cells)
    chips = [x["requested_chips"] for x in next(iter(rows.values()))]
    lines = ["| | " + " | ".join(_chips(n) for n in chips) + " |", "|---" * (len(chips) + 1) + "|"]
    for (mode, m), xs in rows.items():
        tag = " (fitted)" if mode != "diloco" else (" (predicted: the check)" if m == 8 else " (predicted)")
        out = []
        for x in xs:
            s = fmt(x[value])
            if with_paper and x["paper"] is not None:
                s += f" / {100 * x['paper']:.0f} ({x['error_points']:+.1f})"
            out.append(s)
        lines.append(f"| {row_name(mode, m)}{tag if with_paper else ''} | " + " | ".join(out) + " |")
    return lines


def _acceptance(result: dict) -> list[str]:
    lines = ["| acceptance | worst cell error (points) | tolerance | pass |", "|---|---|---|---|"]
    for key, tol in result["tolerance_points"].items():
        worst = result["max_error_points"].get(key)
        if worst is not None:
            mode, m = key.split("/")
            lines.append(f"| {row_name(mode, int(m))} | {worst:.1f} | {tol:g} | "
                         f"{'yes' if worst <= tol else '**no**'} |")
    return lines


def _studies(result: dict) -> list[str]:
    lines = []
    if result["overlap_study"]:
        keys = [k for k in result["overlap_study"][0] if k.startswith("max_error_")]
        lines += ["## Overlap rule: each rule's own best fit (worst cell error, points)", "",
                  "| rule | restart s | reconfig s | repair s | " + " | ".join(k[10:] for k in keys) + " |",
                  "|---" * (4 + len(keys)) + "|"]
        for s in result["overlap_study"]:
            lines.append(f"| {s['overlap']} | {s['restart_s']:.1f} | {s['reconfig_s']:.2f} | "
                         f"{s['repair_s']:.0f} | "
                         + " | ".join(f"{s.get(k, float('nan')):.1f}" for k in keys) + " |")
        lines.append("")
    if result.get("repair_profile"):
        lines += ["## How well the elastic row pins the slices down", "",
                  "The repair time held at each value and reconfig_s refitted alone; the elastic row "
                  "barely tells these apart, the small-N Decoupled DiLoCo cells do.", "",
                  "| repair s | slices down % | reconfig s | elastic worst | M = 8 worst | M = 8 errors |",
                  "|---|---|---|---|---|---|"]
        for p in result["repair_profile"]:
            errs = " / ".join(f"{e:+.1f}" for e in p["errors_diloco/8"])
            lines.append(f"| {p['repair_s']:.0f} | {100 * p['down_fraction']:.2f} | {p['reconfig_s']:.2f} | "
                         f"{p.get('max_error_elastic_dp/1', float('nan')):.1f} | "
                         f"{p.get('max_error_diloco/8', float('nan')):.1f} | {errs} |")
        lines.append("")
    return lines


def markdown(result: dict) -> str:
    cfg, c, cells = result["config"], result["constants"], result["cells"]

    def pct(v: float) -> str:
        return f"{100 * v:.1f}"

    down = [x for x in cells if x["mode"] == "elastic_dp"]
    t = result["timing"]
    return "\n".join([
        "# Goodput under chip failures (docs/experiments.md#goodput-at-millions-of-chips, paper Table 1)", "",
        f"`python scripts/goodput.py{' quick=true' if cfg['quick'] else ''}`: every cell simulates "
        f"{cfg['days']:g} days ({cfg['seeds']} seed(s)); the fit evaluates {cfg['fit_days']:g} days "
        f"({cfg['fit_seeds']} seed(s)). MTBI {c['mtbi_s'] / 86400 / 365:g} year(s) per chip, "
        f"{c['chips_per_slice']} chips per slice (assumption), repair time `{c['repair']}`, "
        f"overlapping pauses `{c['overlap']}`.", "",
        "Fitted on the two data-parallel rows only (least squares in goodput points): "
        f"restart **{c['restart_s']:.1f} s**, reconfiguration **{c['reconfig_s']:.2f} s**, repair "
        f"**{c['repair_s']:.0f} s** ({c['repair_s'] / 3600:.2f} h), so "
        f"**{100 * result['down_fraction_steady']:.2f}%** "
        "of slices are down on average. Decoupled DiLoCo rows use the same constants, untuned.", "",
        "## Goodput, % (simulated / paper (error in points))", "",
        *_table(cells, "goodput", pct, True), "", *_acceptance(result), "",
        "## Uptime, % (share of wall time the global model advances)", "",
        *_table(cells, "uptime", lambda v: f"{100 * v:.2f}", False), "",
        "Slices down on average (elastic and every M see the same failures; dp swaps in spares): "
        + ", ".join(f"{_chips(x['requested_chips'])} {100 * x['down_fraction']:.2f}%" for x in down) + ".", "",
        *_studies(result),
        f"Every mode once at {_chips(t['chips'])} chips over {t['days']:g} simulated days: "
        f"{t['seconds_all_modes']:.2f} s; the fit took {result['fit_seconds']:.1f} s.", "",
    ])


def figure(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, ((mode, m), xs) in enumerate(_rows(result["cells"]).items()):
        colour = f"C{i}"
        chips = [x["requested_chips"] for x in xs]
        ax.plot(chips, [100 * x["goodput"] for x in xs], "o-", color=colour, label=row_name(mode, m))
        paper = [(x["requested_chips"], 100 * x["paper"]) for x in xs if x["paper"] is not None]
        if paper:
            ax.plot(*zip(*paper), "s", mfc="none", ms=10, color=colour)
    ax.plot([], [], "s", mfc="none", ms=10, color="gray", label="paper (Table 1)")
    ax.set_xscale("log")
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput (%)")
    ax.set_title("Goodput under chip failures, MTBI 1 year per chip")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(result: dict, out_dir: str | Path) -> list[Path]:
    """goodput.md, goodput.csv, goodput.json and goodput.png in out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"goodput.{ext}" for ext in ("md", "csv", "json", "png")]
    paths[0].write_text(markdown(result))
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["cells"])
    paths[2].write_text(json.dumps(result, indent=1))
    figure(result, paths[3])
    return paths
