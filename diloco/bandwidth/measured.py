"""A training run's byte ledger against the analytic bytes per step and against data parallel.

Reference: docs/experiments.md#measured-bytes; diloco/run.py writes the run directory.

Measured bytes count whole frames (JSON header + payload, zstd where the up codec uses it); the
analytic figure is the codec payload alone, so measured / analytic = 1 + headers - zstd savings.
It follows the run's own schedule: sends are counted step by step from the fragment offsets plus
the final flush, and down bytes from the syncer's merge count, since every merge is published to
every live learner (with quorum K = 1 and no grace each arrival is its own merge, up to M merges
per fragment round). The `schedule_*` figures are the steady state with one merge per round.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from diloco.bandwidth.analytic import diloco_bytes_per_step, dp_bytes_per_step, payload_bytes

_SUMMARY_KEYS = ("params", "learners", "bytes_up", "bytes_down", "merges")
_CONFIG_KEYS = {"run": ("steps",), "fragments": ("H", "count", "tau"),
                "codec": ("up", "down", "block", "topk_fraction")}


def _read(run_dir: Path) -> tuple[dict, dict]:
    summary_path, config_path = run_dir / "summary.json", run_dir / "config.yaml"
    for path in (summary_path, config_path):
        if not path.is_file():
            raise ValueError(f"{path} not found: measured_vs_analytic needs a Decoupled DiLoCo run directory")
    summary = json.loads(summary_path.read_text())
    config = yaml.safe_load(config_path.read_text()) or {}
    missing = [k for k in _SUMMARY_KEYS if k not in summary]
    missing += [f"{g}.{k}" for g, keys in _CONFIG_KEYS.items() for k in keys if k not in (config.get(g) or {})]
    if summary.get("algo", "diloco") != "diloco" or missing:
        raise ValueError(f"{run_dir}: not a Decoupled DiLoCo run with a byte ledger "
                         f"(algo={summary.get('algo')!r}, missing {missing})")
    return summary, config


def sends_per_learner(steps: int, H: int, P: int, tau: int, final_sync: bool = True) -> int:
    """Fragment sends of one learner that ran `steps` steps without failing.

    Fragment p leaves after step s when s mod H == p * H // P (diloco.algo.fragments). The final
    flush sends every fragment with unsent progress (diloco.algo.learner.flush): all but those sent
    at steps >= steps - tau, which are still in flight or were applied just as training ended.
    """
    offsets = [p * H // P for p in range(P)]
    sent = sum(1 for s in range(1, steps + 1) for o in offsets if s % H == o)
    recent = {p for p, o in enumerate(offsets) for s in range(max(1, steps - tau), steps + 1) if s % H == o}
    return sent + (P - len(recent) if final_sync else 0)


def measured_vs_analytic(run_dir: str | Path) -> dict:
    """Per learner and inner step: measured bytes up and down, the analytic payload and data parallel.

    Ratios: `up_ratio` / `down_ratio` = measured / analytic for the run's sends and merges (1 plus
    headers, less zstd); `dp_over_up` / `dp_over_down` = what one data-parallel site sends per step
    (bf16 ring all-reduce) over what a learner sent or received; `dp_over_total` matches the run
    summary's dp_bytes_over_diloco. Raises ValueError when the directory lacks a byte ledger.
    """
    run_dir = Path(run_dir)
    summary, cfg = _read(run_dir)
    N, M = int(summary["params"]), int(summary["learners"])
    steps, frag, codec = int(cfg["run"]["steps"]), cfg["fragments"], cfg["codec"]
    H, P, tau = int(frag["H"]), int(frag["count"]), int(frag["tau"])
    block, fraction = int(codec["block"]), float(codec["topk_fraction"])
    chunk, chunk_k = int(codec.get("chunk", 4096)), int(codec.get("chunk_k", 32))  # runs before sparseloco lack them
    sends = sends_per_learner(steps, H, P, tau, bool(frag.get("final_sync", True)))
    fragment = -(-N // P)
    up_payload = payload_bytes(codec["up"], fragment, block, fraction, chunk, chunk_k)
    down_payload = payload_bytes(codec["down"], fragment, block, fraction, chunk, chunk_k)
    measured_up = summary["bytes_up"] / (M * steps)
    measured_down = summary["bytes_down"] / (M * steps)
    analytic_up = sends * up_payload / steps
    analytic_down = summary["merges"] * down_payload / steps  # every merge reaches every learner
    schedule = diloco_bytes_per_step(N, H, P, codec["up"], codec["down"], block, fraction, chunk=chunk, chunk_k=chunk_k)
    dp = dp_bytes_per_step(N, M)
    return {
        "run_dir": str(run_dir), "params": N, "learners": M, "steps": steps, "H": H, "P": P, "tau": tau,
        "codec_up": codec["up"], "codec_down": codec["down"], "zstd_level": codec.get("zstd_level", 0),
        "sends_per_learner": sends, "merges": int(summary["merges"]),
        "merges_per_round": summary["merges"] / max(sends, 1),
        "measured_up": measured_up, "measured_down": measured_down,
        "analytic_up": analytic_up, "analytic_down": analytic_down,
        "schedule_up": schedule.up, "schedule_down": schedule.down,
        "dp": dp,
        "up_ratio": measured_up / analytic_up if analytic_up else None,
        "down_ratio": measured_down / analytic_down if analytic_down else None,
        "dp_over_up": dp / measured_up if measured_up else None,
        "dp_over_down": dp / measured_down if measured_down else None,
        "dp_over_total": 2 * dp / (measured_up + measured_down) if measured_up + measured_down else None,
    }
