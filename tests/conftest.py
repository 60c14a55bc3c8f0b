"""Test setup: 8 simulated CPU devices, so sharded code paths run without accelerators; strict rank
promotion; the tests' one tiny configuration (tiny_model, tiny_cfg) and the helpers they share."""

import dataclasses
import os
import threading

from hypothesis import HealthCheck, settings

# Must happen before jax is imported anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Strict broadcasting: an operation between arrays of different ranks raises instead of promoting
# silently (a [B] against a [B, L] is a bug more often than not). The environment carries it to
# the child processes of the procs, ray and command-line tests.
os.environ.setdefault("JAX_NUMPY_RANK_PROMOTION", "raise")

# No per-example time limits: a busy machine makes any example slow (docs/design.md#tests).
settings.register_profile("diloco", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("diloco")

from diloco.config import (DataConfig, FragmentsConfig, InnerConfig, ModelConfig, RunConfig,  # noqa: E402
                           RuntimeConfig, SyncerConfig, TrainConfig, validate)

# Plain SGD at a constant rate, no clipping or decay: the inner optimizer of the hand-computed tests.
SGD = InnerConfig(optimizer="sgd", lr=0.1, schedule="constant", warmup_steps=0, clip_norm=0.0, weight_decay=0.0)


def tiny_model(**overrides) -> ModelConfig:
    """The tests' tiny decoder: 2 layers of width 32, 4 query and 2 K/V heads, a feed-forward of 96,
    64 positions; `overrides` replace fields (a test that needs another shape says which)."""
    base = dict(name="tiny", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64)
    return ModelConfig(**{**base, **overrides})


def _replaced(current, value):
    """`value` over `current`: a dict over a config section replaces the fields it names, in
    sections nested at any depth; anything else replaces `current` whole."""
    if isinstance(value, dict) and dataclasses.is_dataclass(current):
        return dataclasses.replace(current, **{k: _replaced(getattr(current, k), v) for k, v in value.items()})
    return value


def override(cfg: TrainConfig, **groups) -> TrainConfig:
    """`cfg` validated with `groups` applied: a dict replaces fields of its group
    (run=dict(steps=40)), anything else replaces the group or field itself (inner=SGD, algo="dp")."""
    return validate(_replaced(cfg, groups))


def tiny_cfg(root, kind: str = "sim", algo: str = "diloco", **groups) -> TrainConfig:
    """The tests' tiny run under `root`, validated: tiny_model on a synthetic chain of 16 states with 2
    successors each (40,000 tokens in root/data), batches of 16 rows of 32 tokens, AdamW at 1e-2
    after 5 warmup steps, 20 steps logged every 5 and evaluated every 10 on 2 batches into root/run,
    no progress line or plot; Decoupled DiLoCo with M = 2 learners of 1 device under runtime `kind`,
    P = 2 fragments, H = 4, tau = 1, K = 1. `groups` as override's: each test states what it changes."""
    base = TrainConfig(
        model=tiny_model(), algo=algo,
        data=DataConfig(source="synthetic", seq_len=32, batch_size=16, data_dir=str(root / "data"),
                        synthetic_vocab=16, synthetic_tokens=40_000, synthetic_branching=2),
        inner=InnerConfig(lr=1e-2, warmup_steps=5),
        run=RunConfig(steps=20, log_every=5, eval_every=10, eval_batches=2, out_dir=str(root / "run"),
                      progress=False, plot=False),
        fragments=FragmentsConfig(count=2, H=4, tau=1), syncer=SyncerConfig(quorum=1),
        runtime=RuntimeConfig(kind=kind, learners=2, devices_per_learner=1))
    return override(base, **groups)


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


def kill_after_first_checkpoint(run_dir, learner: int, killed: list, pid=lambda record: record["pid"]):
    """A background for `alongside`: once learner's first checkpoint directory exists in a procs
    run at run_dir, SIGKILL its process (`pid` of its record in the run's `procs` control object: a
    world's follower is record["pids"][1]), once, appending the incarnation killed to `killed`."""
    import signal

    from diloco import store as bs

    def killer(stop):
        store, saved = bs.BlobStore(f"file://{run_dir}/store"), run_dir / "learners" / f"learner-{learner}"
        while not stop.is_set() and not killed:
            if saved.is_dir() and any(d.name.isdigit() for d in saved.iterdir()):
                record = bs.read_control(store, "procs")["learners"][str(learner)]
                os.kill(pid(record), signal.SIGKILL)
                killed.append(record["incarnation"])
            stop.wait(0.01)
    return killer


def alongside(background, run):
    """run() while background(stop) runs on a thread of its own (what a test kills, forges or breaks
    during a live run); `stop`, a threading.Event, is set and the thread joined once run() returns
    or raises. Returns what run() returned."""
    stop = threading.Event()
    thread = threading.Thread(target=background, args=(stop,))
    thread.start()
    try:
        return run()
    finally:
        stop.set()
        thread.join()


def load_scaled(bound_s: float, baseline_s: float, ratio: float = 1.0) -> float:
    """A wall-clock bound that holds on a busy machine: `bound_s`, set on a quiet one, or `ratio`
    times a baseline the same test measured just before (its start-up, say), if that is longer.
    Load slows the baseline and the bounded span alike, so the bound keeps its strictness on a
    quiet machine without failing on a loaded one (docs/design.md#tests)."""
    return max(bound_s, ratio * baseline_s)
