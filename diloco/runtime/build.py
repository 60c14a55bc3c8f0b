"""Config -> the objects every runtime needs: fragments, schedule, codecs, syncer policy, learner units.

Kept apart from the runtimes so that sim, threads and procs (and ray, which runs procs' processes) build
exactly the same algorithm.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from diloco.algo import outer_auto, quorum
from diloco.algo.auth import MIN_SECRET_BYTES, Secret
from diloco.algo import syncer as sync
from diloco.algo.codecs import Codec, make_codec
from diloco.algo.eager import momentum_of, stand_in_scale
from diloco.algo.fragments import Fragment, extract, make_fragments, make_schedule
from diloco.algo.codec_specs import codec_spec
from diloco.algo.outer import AUTO, make_outer
from diloco.config import ConfigError, MeshConfig, TrainConfig
from diloco.config.learner_batch import learner_batches
from diloco.data import Corpus
from diloco.data.stream import GrainTrain
from diloco.model import Model, is_embedding
from diloco.runtime import placement, world
from diloco.runtime.unit import LearnerUnit, UnitSpec
from diloco.train import flops
from diloco.train.mesh import make_mesh
from diloco.train.trainer import Compiled, compile_steps


class Setup(NamedTuple):
    fragments: tuple[Fragment, ...]
    policy: sync.Policy
    spec: UnitSpec
    compiled: tuple[Compiled, ...]  # one per learner sub-mesh (one for all learners in sim)
    # per fragment, host FP32: the global model every learner starts from (ShapeDtypeStructs in a
    # setup built around abstract params, until the values are read: procs/theta0.py)
    theta0: tuple[dict, ...]
    flops_per_token: int = 0  # model FLOPs of one trained token (train/flops.py): the records' MFU


def outer_optimizer(cfg: TrainConfig):
    o = cfg.outer
    return make_outer(o.name, lr=o.lr, momentum=o.momentum, N=o.delay)


# Where frames cross a process boundary (an object store another process can write to) learners
# are authenticated unless the config says otherwise; in one process there is no one to forge them.
AUTH_BY_DEFAULT = ("procs", "ray")


def auth_secret(cfg: TrainConfig) -> Secret | None:
    """The run secret when runtime.auth.mode is on (docs/algorithm.md#authenticated-learners): from
    runtime.auth.secret_file, else the environment variable runtime.auth.secret_env, else a new
    random one, put into that variable so this process's children (procs) share it. Errors name the
    file or variable, never their contents."""
    r, a = cfg.runtime, cfg.runtime.auth
    if a.mode == "off" or (a.mode == "auto" and r.kind not in AUTH_BY_DEFAULT):
        return None
    if a.secret_file:
        try:
            raw = Path(a.secret_file).expanduser().read_bytes().rstrip(b"\r\n")
        except OSError as e:
            raise ConfigError(f"runtime.auth.secret_file={a.secret_file!r} cannot be read: "
                              f"{e.strerror or e}") from None
        where = f"runtime.auth.secret_file={a.secret_file!r}"
    elif os.environ.get(a.secret_env):
        raw, where = os.environ[a.secret_env].encode("utf-8"), f"${a.secret_env}"
    elif r.launch == "external":  # processes started apart cannot inherit a secret made here
        raise ConfigError(f"runtime.auth is on and the learners are started apart (runtime.launch=external): "
                          f"every process needs the same run secret, in ${a.secret_env} or "
                          "runtime.auth.secret_file (e.g. `openssl rand -hex 32`), or set runtime.auth.mode=off")
    else:
        os.environ[a.secret_env] = secrets.token_hex(32)
        raw, where = os.environ[a.secret_env].encode("utf-8"), "a random secret"
    if len(raw) < MIN_SECRET_BYTES:
        raise ConfigError(f"the authentication secret in {where} has {len(raw)} bytes; it needs at "
                          f"least {MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)")
    return Secret(raw)


class Codecs(NamedTuple):
    """The run's codecs and the specs its frames name them by, built once from cfg.codec."""

    up: Codec
    up_spec: str
    down: Codec | None  # None: broadcasts carry full FP32 values
    down_spec: str


def run_codecs(cfg: TrainConfig) -> Codecs:
    """cfg.codec's up and down codecs with their specs, the one place they are made."""
    c = cfg.codec
    return Codecs(
        make_codec(c.up, error_feedback=c.error_feedback, zstd_level=c.zstd_level, block=c.block,
                   topk_fraction=c.topk_fraction, chunk=c.chunk, chunk_k=c.chunk_k, ef_decay=c.ef_decay),
        codec_spec(c.up, c.error_feedback, c.zstd_level, block=c.block, topk_fraction=c.topk_fraction,
                   chunk=c.chunk, chunk_k=c.chunk_k),
        None if c.down == "fp32" else make_codec(c.down, block=c.block, topk_fraction=c.topk_fraction,
                                                 chunk=c.chunk, chunk_k=c.chunk_k),
        codec_spec(c.down, block=c.block, topk_fraction=c.topk_fraction, chunk=c.chunk, chunk_k=c.chunk_k))


def policy(cfg: TrainConfig, wire: Codecs | None = None) -> sync.Policy:
    """The syncer's rules, with the bounds a contribution's claims are checked against: the run's own
    up codec only, at most run.steps steps and one full batch of tokens per step. `wire`: the run's
    codecs when the caller has built them (build), else built here."""
    s = cfg.syncer
    wire = run_codecs(cfg) if wire is None else wire
    grace = quorum.GraceConfig(K=s.quorum, gamma=s.gamma, cap_steps=s.grace_cap_steps, tau=cfg.fragments.tau)
    return sync.Policy(grace, outer_optimizer(cfg), s.merge, s.embedding_merge,
                       None if s.max_staleness < 0 else s.max_staleness, s.history, wire.down, wire.down_spec,
                       grace_budget=s.grace_budget, anchor=s.anchor, scale=s.scale, norm_bound=s.norm_bound,
                       norm_window=s.norm_window, up_spec=wire.up_spec, max_steps=cfg.run.steps,
                       step_tokens=max(learner_batches(cfg)) * cfg.data.seq_len, theta_norm_bound=s.theta_norm_bound,
                       auth=auth_secret(cfg), clip=s.clip, claim_slack=None if s.claim_slack < 0 else s.claim_slack,
                       clip_span=cfg.fragments.H + cfg.fragments.tau + max(s.claim_slack, 0),
                       auto=outer_auto.Rule() if cfg.outer.momentum == AUTO else None,
                       outer_stats=s.outer_stats == "on",  # `auto` follows from `auto` above (measures())
                       eager=cfg.fragments.eager)


# Runtimes whose every learner is a process of its own: such a process may see only its own
# devices (a host, a Ray actor given only its accelerators), docs/pathways.md#which-devices-a-learner-gets.
ONE_LEARNER_PER_PROCESS = ("procs", "ray")


def learner_device_lists(cfg: TrainConfig, devices) -> list[tuple]:
    """Each sub-mesh's devices out of `devices` (placement.learner_devices): one per learner, or
    the one every learner shares in sim. ConfigError unless they fit; the messages for too few
    devices are the ones this check has always given, with the CPU flag that fixes them."""
    r = cfg.runtime
    count = 1 if cfg.runtime.shares_mesh else r.learners
    one_per_process = r.kind in ONE_LEARNER_PER_PROCESS
    need, have = count * r.devices_per_learner, len(devices)
    own = one_per_process and have == r.devices_per_learner
    if need > have and not own and cfg.runtime.shares_mesh:
        raise ConfigError(f"runtime.devices_per_learner={r.devices_per_learner}, but only {have} devices "
                          f"are visible (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={need}, "
                          f"or lower runtime.devices_per_learner)")
    if need > have and not own:
        raise ConfigError(f"runtime.learners={r.learners} x runtime.devices_per_learner="
                          f"{r.devices_per_learner} = {need} devices, but only {have} are visible "
                          f"(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={need}, or lower "
                          f"runtime.learners or runtime.devices_per_learner)")
    return placement.learner_devices(devices, count, r.devices_per_learner, one_per_process=one_per_process)


def check_devices(cfg: TrainConfig) -> None:
    """ConfigError unless the learners' sub-meshes fit on the visible devices."""
    learner_device_lists(cfg, jax.devices())


def learner_meshes(cfg: TrainConfig) -> list:
    """M disjoint sub-meshes of devices_per_learner devices each, data-parallel inside; in sim
    the first one only, which every learner shares (RuntimeConfig.shares_mesh). In a process that sees only one
    learner's devices (procs, ray) all M are that one sub-mesh: the process runs one of them; so
    in a process of a learner's world (docs/multihost.md), over the devices of every process."""
    r = cfg.runtime
    if jax.process_count() > 1:  # a learner world: this process runs one learner over every process's devices
        mesh = world.learner_mesh_global(r.devices_per_learner, cfg.data.batch_size)
        return [mesh] * (1 if cfg.runtime.shares_mesh else r.learners)
    mesh_cfg = MeshConfig(data=r.devices_per_learner, fsdp=1, devices=r.devices_per_learner)
    return [make_mesh(mesh_cfg, cfg.data.batch_size, list(devs)) for devs in learner_device_lists(cfg, jax.devices())]


def is_abstract(params) -> bool:
    """Whether params are shapes only (jax.ShapeDtypeStruct leaves), no values."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(params))


def per_learner(train, rows: tuple[int, ...]):
    """The corpus's train stream for learners of these batch rows: data=grain batches in its
    pipeline, so unequal rows need a stream that builds each learner's at its own size; every
    other source cuts any rows from the same pure function."""
    if isinstance(train, GrainTrain) and any(b != train.recipe.batch_size for b in rows):
        return GrainTrain(train.recipe, rows)
    return train


def build(cfg: TrainConfig, corpus: Corpus, model: Model) -> Setup:
    f = cfg.fragments
    # One fragment holds everything: there is nothing to separate embeddings from.
    flag = is_embedding if f.count > 1 else None
    try:
        fragments = make_fragments(model.params, f.count, f.strategy, flag)
    except ValueError as e:  # the count suits the model only once it is built (a LoRA's adapters)
        raise ConfigError(f"fragments.count={f.count} does not fit this model: {e}") from None
    stand_in = stand_in_scale(outer_optimizer(cfg), f.eager_share) if f.eager else 0.0
    o = cfg.outer
    momentum = momentum_of(o.name, o.lr, o.momentum, f.eager_share) if f.eager else None
    schedule = make_schedule(f.count, f.H, f.tau, f.alpha, f.keep_overlap, f.others, f.eager, stand_in)
    wire = run_codecs(cfg)
    rows = learner_batches(cfg)
    spec = UnitSpec(per_learner(corpus.train, rows), cfg.run.seed, cfg.runtime.learners, cfg.data.batch_size,
                    cfg.data.seq_len, fragments, schedule, wire.up, wire.up_spec, cfg.data.shard_block,
                    down_spec=wire.down_spec, learner_batch=rows, eager_momentum=momentum)
    compiled = tuple(compile_steps(model, cfg, mesh) for mesh in learner_meshes(cfg))
    if is_abstract(model.params):  # a procs child: Theta_0 comes from the store (procs/theta0.py)
        theta0 = tuple({p: jax.ShapeDtypeStruct(v.shape, np.float32) for p, v in extract(model.params, frag).items()}
                       for frag in fragments)
    else:
        host = jax.device_get(model.params)
        theta0 = tuple({p: np.asarray(v, np.float32) for p, v in extract(host, frag).items()} for frag in fragments)
    return Setup(fragments, policy(cfg, wire), spec, compiled, theta0, flops.of_run(cfg, model.apply, model.params))


def new_unit(setup: Setup, learner: int, incarnation: int, syncer_state: sync.SyncerState,
             step: int = 0) -> LearnerUnit:
    """A learner starting from the syncer's current references: never from its own random init.
    Learners beyond the sub-meshes built (every learner in sim) share them round-robin."""
    anchors = {p: (fs.refs[-1][0], fs.refs[-1][1]) for p, fs in enumerate(syncer_state.fragments)}
    compiled = setup.compiled[learner % len(setup.compiled)]
    secret = setup.policy.auth
    key = None if secret is None else secret.learner_key(learner)
    return LearnerUnit(setup.spec, learner, incarnation, compiled, anchors, step, key)
