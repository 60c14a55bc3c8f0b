"""Test setup: 8 simulated CPU devices, so sharded code paths run without accelerators."""

import os

# Must happen before jax is imported anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


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
