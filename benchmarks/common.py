"""Shared helpers of the benchmark scripts: machine description and JSON output."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    import jax

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write(name: str, payload: dict, out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path


def first_merge_of(decisions: list[dict], learner: int, incarnation: int) -> float:
    """Clock time of the first merge that took in a contribution of (learner, incarnation), from
    the syncer's decision records."""
    arrivals = [r for r in decisions if r["event"] == "arrival" and r.get("key")
                and r["key"][:2] == [learner, incarnation]]
    merges = [r for r in decisions if r["event"] == "merge" and learner in r["learners"]]
    first_arrival = min(r["at"] for r in arrivals)
    return min(r["at"] for r in merges if r["at"] >= first_arrival)
