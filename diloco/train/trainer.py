"""The plain data-parallel trainer: the baseline every DiLoCo result is compared with.

It is also the inner loop's toolbox: `compile_steps` builds the jitted, sharded steps that a
Decoupled DiLoCo learner runs on its own sub-mesh.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from diloco import checkpoint, report
from diloco import watch as run_watch
from diloco.config import TrainConfig
from diloco.data import Corpus, assistant_tokens, held_out, target_tokens, train_batch, trained_tokens
from diloco.data.stream import restore_position, saved_position
from diloco.model import Model
from diloco.train import flops, profile
from diloco.train.mesh import batch_sharding, replicated, tree_shardings
from diloco.train.optim import lr_schedule, make_optimizer
from diloco.train.step import TrainState, init_state, make_eval_step, make_loss, make_train_step


class Compiled(NamedTuple):
    """Jitted steps over one mesh, with the shardings they expect."""

    init: Callable[[dict], TrainState]  # params -> sharded TrainState
    train_step: Callable  # (state, batch) -> (state, metrics); donates state
    eval_step: Callable  # (params, batch) -> (loss, trained tokens)
    state_sharding: object
    batch_sharding: object  # a sharding, or for packed fine-tuning rows a dict of them like the batch
    abstract_state: TrainState
    # n -> (n states, n batches) -> (n states, n metrics): n learners' steps as one vmapped step
    # (sim's learners share one mesh, docs/design.md#sim); donates the states
    train_many: Callable[[int], Callable] | None = None


def compile_steps(model: Model, cfg: TrainConfig, mesh: Mesh) -> Compiled:
    optimizer = make_optimizer(cfg.inner, cfg.run.steps)
    schedule = lr_schedule(cfg.inner, cfg.run.steps)
    abstract = jax.eval_shape(lambda p: init_state(p, optimizer), model.params)
    state_sh = tree_shardings(mesh, abstract)
    sft = cfg.data.source in ("sft", "grain")  # packed rows, with segments (diloco/data/stream.py too)
    # Every array of a fine-tuning batch (diloco/data/sft.py) is [B, ...], split over B like windows.
    batch_sh = batch_sharding(mesh)
    if sft:
        batch_sh = {k: batch_sh for k in ("tokens", "segments", "positions", "targets")}
    rep = replicated(mesh)
    frozen = _Frozen(model, mesh)

    def train(m: Model) -> Callable:
        return make_train_step(make_loss(m, sft, cfg.model.loss_chunk), optimizer, schedule)

    def evaluation(m: Model) -> Callable:
        return make_eval_step(make_loss(m, sft, cfg.model.loss_chunk))

    init = jax.jit(lambda p: init_state(p, optimizer), out_shardings=state_sh)
    train_step = frozen.jit(train, (state_sh, batch_sh), (state_sh, rep), donate_argnums=0)
    eval_step = frozen.jit(evaluation, (state_sh.params, batch_sh), rep)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, state_sh)
    return Compiled(init, train_step, eval_step, state_sh, batch_sh, abstract,
                    _stepper(frozen, train, state_sh, batch_sh, rep))


class _Frozen:
    """The frozen weights of a model (LoRA's checkpoint; none for a full model) placed once on a
    mesh, and jit for a step built from the model: with frozen weights the step takes them as a
    last argument, bound to that one copy, so the train, eval and vmapped steps share it instead
    of each embedding them as constants (docs/design.md#lora)."""

    def __init__(self, model: Model, mesh: Mesh):
        self.model = model
        if model.frozen is not None:
            self.sharding = jax.tree.map(lambda _: replicated(mesh), model.frozen)
            self.placed = jax.device_put(model.frozen, self.sharding)

    def jit(self, build: Callable[[Model], Callable], in_shardings, out_shardings, **kw):
        """build(model) -> step; jitted with the given shardings (and the frozen tree's)."""
        if self.model.frozen is None:
            return jax.jit(build(self.model), in_shardings=in_shardings, out_shardings=out_shardings, **kw)
        jitted = jax.jit(lambda *args: build(self.model.thaw(args[-1]))(*args[:-1]),
                         in_shardings=(*in_shardings, self.sharding), out_shardings=out_shardings, **kw)
        return _Bound(jitted, self.placed)


class _Bound:
    """A jitted function with its last argument bound (called and lowered alike)."""

    def __init__(self, jitted, last):
        self.jitted, self.last = jitted, last

    def __call__(self, *args):
        return self.jitted(*args, self.last)

    def lower(self, *args):
        return self.jitted.lower(*args, self.last)

    def _cache_size(self) -> int:
        return self.jitted._cache_size()


def _stepper(frozen: _Frozen, train: Callable[[Model], Callable], state_sh, batch_sh, rep) -> Callable[[int], Callable]:
    """n -> one jitted step of n learners: their states and batches stacked on a leading axis,
    the step vmapped over it (the frozen weights, if any, shared), the results taken apart
    again; compiled once per n."""

    @functools.lru_cache(maxsize=None)
    def train_many(n: int) -> Callable:
        def build(m: Model) -> Callable:
            step = train(m)

            def many(states, batches):
                stacked = jax.vmap(step)(*(jax.tree.map(lambda *xs: jnp.stack(xs), *t) for t in (states, batches)))
                return tuple(zip(*(tuple(jax.tree.map(lambda x: x[i], tree) for i in range(n)) for tree in stacked)))
            return many

        return frozen.jit(build, ((state_sh,) * n, (batch_sh,) * n),
                          tuple((state_sh, rep) for _ in range(n)), donate_argnums=0)

    return train_many


def evaluate(compiled: Compiled, params: dict, batches: list) -> float:
    """Mean loss per trained token over the batches (packed rows train on unequal counts)."""
    got = jax.device_get([compiled.eval_step(params, jax.device_put(b, compiled.batch_sharding)) for b in batches])
    losses, counts = (np.asarray([g[i] for g in got], np.float64) for i in (0, 1))
    return float((losses * counts).sum() / max(counts.sum(), 1.0))


def train_dp(cfg: TrainConfig, corpus: Corpus, model: Model, mesh: Mesh, run_dir: Path,
             stop: Callable[[int], bool] = lambda step: False,
             tasks: Callable[[dict, int], dict] | None = None) -> tuple[TrainState, dict]:
    """Train with data parallelism over `mesh`; returns the final state and a summary dict.
    `tasks(params, step)`: run.eval_tasks' scores due at a step (diloco/evaluation/during_run.py),
    written into the eval records, the base model's at step 0.

    `stop(step)` is asked after every step; when it says yes (preemption, a signal, a test that
    simulates a crash) the state is checkpointed and the run ends early, to be resumed later.
    """
    run, data = cfg.run, cfg.data
    compiled = compile_steps(model, cfg, mesh)
    val = held_out(corpus.val, batch_size=data.batch_size, seq_len=data.seq_len, n=run.eval_batches)
    manager = checkpoint.open_manager(run_dir / "checkpoints", run.keep_checkpoints)
    saves = checkpoint.Saves(manager, "checkpoint", run.checkpoint_fail_s)  # a failed one is logged, retried
    # tokens/s per device and MFU over the trainer's mesh (docs/design.md#model-flops-and-mfu)
    rates = flops.Rates(flops.of_run(cfg, model.apply, model.params),
                         flops.hardware(mesh.devices.size, cfg.run.peak_tflops))
    writer = report.MetricsWriter(run_dir / "metrics.jsonl", run_watch.for_run(cfg, run_dir, "wall", progress=False),
                                  rates)
    trace = profile.for_run(cfg, run_dir)
    try:
        # Placed first: an imported checkpoint's params are committed to the device they were read onto.
        params = jax.device_put(model.params, compiled.state_sharding.params)
        state, start, tokens = compiled.init(params), 0, 0
        if run.resume:
            found = checkpoint.restore_latest(manager, compiled.abstract_state)
            if found is None and manager.all_steps():
                raise RuntimeError(f"run.resume=true but none of the checkpoints {manager.all_steps()} in "
                                   f"{run_dir / 'checkpoints'} could be read; see the warnings above")
            if found is not None:
                start, state, meta = found
                tokens = int(meta.get("tokens", start * data.batch_size * data.seq_len))
                restore_position(corpus.train, 0, 1, start, meta)  # data=grain: its stream's position
        state, summary = _loop(cfg, corpus, compiled, state, start, tokens, val, saves, writer, stop, trace, tasks)
        saves.settle(fatal=False)
        writer.summary(summary)
        return state, summary
    finally:
        trace.close()
        writer.close()
        saves.close()


def _loop(cfg, corpus, compiled, state, start, tokens, val, saves, writer, stop, trace, tasks=None):
    """`tokens`: trained tokens (positions) before `start`, counted on from there into the
    records, checkpoints and the summary; fine-tuning adds its assistant tokens beside them
    (docs/design.md#fine-tuning). `trace` (train/profile.py) is told the steps done before each
    step and after the last."""
    run, data = cfg.run, cfg.data
    sft = data.source == "sft"
    assistant = assistant_tokens(corpus.train, seed=run.seed, steps=[start], batch_size=data.batch_size) if sft else 0
    bar = report.progress(run.steps, start, run.progress)
    t0 = t_log = time.perf_counter()
    compile_s, last, eval_loss, since_log, after_compile = None, {}, float("nan"), 0, 0
    if tasks is not None and start == 0:
        writer.write({"kind": "eval", "step": 0, "tokens": 0, "eval_loss": evaluate(compiled, state.params, val),
                      **tasks(state.params, 0)})
    for step in range(start + 1, run.steps + 1):
        batch = train_batch(corpus.train, seed=run.seed, learner=0, num_learners=1, step=step - 1,
                            batch_size=data.batch_size, seq_len=data.seq_len)
        n = trained_tokens(batch)
        tokens += n
        assistant += target_tokens(batch) if sft else 0
        trace.at(step - 1, state)
        state, metrics = compiled.train_step(state, jax.device_put(batch, compiled.batch_sharding))
        since_log += n
        after_compile += n
        if compile_s is None:  # the first step includes compilation; keep it out of tokens/s
            jax.block_until_ready(metrics)
            compile_s, t_log, since_log, after_compile = time.perf_counter() - t0, time.perf_counter(), 0, 0
        bar.update(1)
        if report.due(step, run.log_every, run.steps):
            last = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            tok_s = since_log / max(now - t_log, 1e-9)
            t_log, since_log = now, 0
            record = writer.write({"kind": "train", "step": step, "tokens": tokens, **last, "tokens_per_s": tok_s,
                                   **({"assistant_tokens": assistant} if sft else {})})
            bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{tok_s:,.0f}", **_device_rate(record))
        if report.due(step, run.eval_every, run.steps):
            eval_loss = evaluate(compiled, state.params, val)
            writer.write({"kind": "eval", "step": step, "tokens": tokens, "eval_loss": eval_loss,
                          **(tasks(state.params, step) if tasks is not None else {})})
        stopping = stop(step)
        # checkpoint_every=0 saves none, not even the last step's (a stop still saves, to resume from)
        if stopping or (run.checkpoint_every > 0 and report.due(step, run.checkpoint_every, run.steps)):
            saves.save(step, state, {"tokens": tokens, **saved_position(corpus.train, 0, 1, step)})
        if stopping:
            break
    trace.at(int(state.step), state)
    bar.close()
    wall = time.perf_counter() - t0
    done = int(state.step) - start
    return state, {
        "steps": int(state.step),
        "tokens": tokens,
        **({"assistant_tokens": assistant} if sft else {}),
        "train_loss": last.get("loss", float("nan")),
        "eval_loss": eval_loss,
        "wall_s": wall,
        "compile_s": compile_s or 0.0,
        "tokens_per_s": after_compile / max(wall - (compile_s or 0.0), 1e-9) if done > 1 else 0.0,
    }


def _device_rate(record: dict) -> dict:
    """The status line's tokens/s per device and MFU (none where the device's peak is unknown)."""
    out = {"tok_s_device": f"{record['tokens_per_s_per_device']:,.0f}"}
    if "mfu" in record:
        out["mfu"] = f"{100 * record['mfu']:.1f}%"
    return out
