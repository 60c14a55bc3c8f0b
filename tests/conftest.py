"""Test setup: 8 simulated CPU devices, so sharded code paths run without accelerators."""

import os

from hypothesis import HealthCheck, settings

# Must happen before jax is imported anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# No per-example time limits: a busy machine makes any example slow (docs/design.md#tests).
settings.register_profile("diloco", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("diloco")


def diloco_world(cfg):
    """(corpus, model, setup, evaluate_global, initial loss) of a Decoupled DiLoCo config: what
    the runtime tests share. evaluate_global is the run's own (diloco.run.global_evaluator)."""
    from diloco.data import load_corpus
    from diloco.model import build
    from diloco.run import global_evaluator
    from diloco.runtime import build as build_setup

    corpus = load_corpus(cfg.data)
    model = build(cfg.model, corpus.vocab_size, cfg.run.seed)
    setup = build_setup.build(cfg, corpus, model)
    evaluate_global = global_evaluator(cfg, corpus, model, setup)
    initial = evaluate_global({path: x for frag in setup.theta0 for path, x in frag.items()})
    return corpus, model, setup, evaluate_global, initial


def load_scaled(bound_s: float, baseline_s: float, ratio: float = 1.0) -> float:
    """A wall-clock bound that holds on a busy machine: `bound_s`, set on a quiet one, or `ratio`
    times a baseline the same test measured just before (its start-up, say), if that is longer.
    Load slows the baseline and the bounded span alike, so the bound keeps its strictness on a
    quiet machine without failing on a loaded one (docs/design.md#tests)."""
    return max(bound_s, ratio * baseline_s)
