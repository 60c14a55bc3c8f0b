"""Which runtimes put every learner on one sub-mesh: read by the runtimes' set-up and by the run's
watch (its per-learner throughput), so it imports neither."""

from __future__ import annotations

from diloco.config import TrainConfig


def shares_mesh(cfg: TrainConfig) -> bool:
    """Whether every learner runs on the one sub-mesh with one compiled step: sim steps its
    learners one after another, so disjoint devices buy nothing but a compile per learner
    (docs/design.md#runtimes); the wall-clock runtimes step them at once, on devices of their own."""
    return cfg.runtime.kind == "sim"
