"""Streaming DiLoCo Table 4 (Gbit/s needed for X% compute utilisation), reproduced by the simulator.

Reference: Streaming DiLoCo (Douillard et al., arXiv 2501.18512), section 3.1 and Table 4.

Assumptions, taken from the papers' settings where they state them and never tuned per cell (the
variants tried, tau = 2, 2 or 4 layers per fragment, 16/40 or 32/64 layers, do worse: up to 1.75x):
* M = 2 sites (Streaming DiLoCo's experiments use 2 replicas): ring factor 2 (M-1)/M = 1, i.e. a
  link carries N * b bits per full sync. This is the one choice the table pins down: M = 4 or 8
  would multiply every cell by 1.5 or 1.75, and fp32 gradients would double the two blocking rows;
* data parallel all-reduces bf16 gradients, vanilla DiLoCo bf16 outer gradients, streaming 4-bit
  values with no scale overhead (FP4 E3M0);
* H = 100 for both DiLoCo rows; streaming: fragments of 3 strided layers (P = L / 3) and tau = 1
  (Streaming DiLoCo's main setting);
* forward = 1/3 of the step, backward 2/3, split evenly over layers; every layer's sync starts when
  its backward ends (the per-layer overlap of section 3.1);
* depth: 24 layers at 1B, 48 at 10B, 96 at 100B (not public; typical depths). Only the DP 99%
  cells and the streaming row depend on it, through the size of one layer's message;
* latency 0: the 1B data-parallel 99% cell leaves 1 ms of exposed communication per step, so the
  paper's simulation cannot have charged a millisecond-scale latency per all-reduce.
The paper's values sit on a sweep grid 10^(-1 + 4k/49) Gbit/s (ratio 1.21 between neighbours: 86.8,
104.8, ...), so each paper cell is itself uncertain by up to about 20%. The 100B rows are
predictions only: the table is given here for 1B and 10B.
"""

from __future__ import annotations

import math
from typing import Iterable

from diloco.bandwidth.utilisation import (Method, Workload, data_parallel, required_bandwidth,
                                          streaming_diloco, vanilla_diloco)

TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
# name -> (N, step time from FLOPs at 60% MFU as the paper states, assumed depth)
MODELS = {"1B": (1e9, 0.1, 24), "10B": (1e10, 0.8, 48), "100B": (1e11, 4.9, 96)}
METHODS = ("data parallel", "vanilla DiLoCo", "streaming + overlapped FP4")
# (model, method) -> Gbit/s at TARGETS, as printed in Streaming DiLoCo Table 4 (docs/experiments.md#streaming-diloco-table-4).
PAPER = {
    ("1B", "data parallel"): (86.8, 152.6, 184.2, 222.3, 569.0),
    ("1B", "vanilla DiLoCo"): (1.4, 6.2, 13.3, 23.3, 86.8),
    ("1B", "streaming + overlapped FP4"): (0.4, 0.9, 1.7, 2.0, 3.0),
    ("10B", "data parallel"): (104.8, 222.3, 222.3, 268.3, 471.5),
    ("10B", "vanilla DiLoCo"): (1.7, 7.5, 16.0, 33.9, 104.8),
    ("10B", "streaming + overlapped FP4"): (0.4, 0.9, 1.4, 1.4, 1.7),
}
DATACENTERS = 2
LATENCY = 0.0


def workload(model: str) -> Workload:
    if model not in MODELS:
        raise ValueError(f"unknown Table 4 model {model!r}; known: {list(MODELS)}")
    params, step_time, layers = MODELS[model]
    return Workload(params, step_time, layers, datacenters=DATACENTERS, latency=LATENCY)


def methods(model: str) -> dict[str, Method]:
    """The three rows of Table 4 for `model`, keyed by the names in METHODS."""
    w = workload(model)
    rows = (data_parallel(bits=16), vanilla_diloco(H=100, bits=16), streaming_diloco(w.layers, H=100))
    return dict(zip(METHODS, rows))


def rows(models: Iterable[str] = tuple(MODELS), targets: Iterable[float] = TARGETS) -> list[dict]:
    """One row per (model, method, target): the simulator's Gbit/s, the paper's (None where not
    given) and model / paper."""
    targets = tuple(targets)
    out = []
    for model in models:
        w = workload(model)
        for name, method in methods(model).items():
            paper = dict(zip(TARGETS, PAPER.get((model, name), ())))
            for target in targets:
                gbps = required_bandwidth(w, method, target)
                ref = paper.get(target)
                out.append({"model": model, "method": name, "target": target, "model_gbps": gbps,
                            "paper_gbps": ref,
                            "ratio": gbps / ref if ref is not None and math.isfinite(gbps) else None})
    return out


def worst_ratio(table: list[dict]) -> float:
    """max over compared cells of max(r, 1/r): the factor by which the worst cell is off."""
    ratios = [r["ratio"] for r in table if r["ratio"] is not None]
    return max((max(r, 1 / r) for r in ratios), default=math.nan)
