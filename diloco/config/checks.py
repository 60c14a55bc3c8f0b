"""Cross-field checks of each config section: every function returns the problems it finds, each
naming the offending values, and `diloco.config.validate` reports them all together.

Kept apart from the dataclasses so that the types read as a table of what can be set, and these
as the rules that hold between the settings. The runtime's subsections (store, auth, world, ray)
are checked in checks_runtime.py, which diloco_errors calls.
"""

from __future__ import annotations

import math
from pathlib import Path

from diloco.algo.codecs import BLOCK_FORMATS, CODECS
from diloco.algo.fragments import FRAGMENTERS
from diloco.algo.merge import MERGES
from diloco.algo.outer import AUTO, AUTO_STATIC, OUTER
from diloco.config.checks_runtime import auth_errors, check, ray_errors, store_errors, world_errors
from diloco.config.learner_batch import learner_batch_errors
from diloco.config.schema import (ChaosConfig, DataConfig, FinetuneConfig, InnerConfig, MeshConfig, ModelConfig,
                                  RunConfig, TrainConfig)

# finetune.lora.targets: each name and the projection of every block it adapts (the params path
# below blocks/<i>/ of diloco/model/transformer.py).
LORA_TARGETS = {"q": ("attn", "wq"), "k": ("attn", "wk"), "v": ("attn", "wv"), "o": ("attn", "wo"),
                "gate": ("mlp", "w_gate"), "up": ("mlp", "w_up"), "down": ("mlp", "w_down")}
# model.attention: the kernels diloco/model/attention.py runs; model.remat: the policies of
# diloco/model/transformer.py's REMAT_POLICIES (a test holds the two lists equal).
ATTENTION_KERNELS = ("auto", "xla", "cudnn", "reference")
REMAT_NAMES = ("none", "full", "dots")


def model_errors(m: ModelConfig) -> list[str]:
    e: list[str] = []
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
        check(e, getattr(m, name) > 0, f"model.{name}={getattr(m, name)} must be > 0")
    check(e, m.head_dim >= 0, f"model.head_dim={m.head_dim} must be >= 0 (0: d_model / n_heads)")
    if m.n_heads > 0 and m.n_kv_heads > 0:
        if m.head_dim == 0:
            check(e, m.d_model % m.n_heads == 0,
                   f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}")
        check(e, m.n_heads % m.n_kv_heads == 0,
               f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}")
        head_dim = m.head_dim or m.d_model // m.n_heads
        if m.positions == "rope" and (m.head_dim or m.d_model % m.n_heads == 0):
            where = f"model.head_dim={head_dim}" if m.head_dim else f"head dim model.d_model/model.n_heads={head_dim}"
            check(e, head_dim % 2 == 0, f"{where} must be even for RoPE")
    check(e, m.dtype in ("float32", "bfloat16"), f"model.dtype={m.dtype!r} not in float32|bfloat16")
    check(e, m.family in ("", "llama", "mistral", "qwen2", "qwen3", "gpt2"),
           f"model.family={m.family!r} not in ''|llama|mistral|qwen2|qwen3|gpt2")
    check(e, m.norm in ("rms", "layer"), f"model.norm={m.norm!r} not in rms|layer")
    check(e, m.mlp in ("swiglu", "gelu"), f"model.mlp={m.mlp!r} not in swiglu|gelu")
    check(e, m.positions in ("rope", "learned"), f"model.positions={m.positions!r} not in rope|learned")
    check(e, m.rope_scaling in ("none", "llama3"), f"model.rope_scaling={m.rope_scaling!r} not in none|llama3")
    check(e, m.norm_eps > 0, f"model.norm_eps={m.norm_eps} must be > 0")
    check(e, m.attention in ATTENTION_KERNELS, f"model.attention={m.attention!r} not in {'|'.join(ATTENTION_KERNELS)}")
    check(e, m.remat in REMAT_NAMES, f"model.remat={m.remat!r} not in {'|'.join(REMAT_NAMES)}")
    check(e, m.loss_chunk >= 0, f"model.loss_chunk={m.loss_chunk} must be >= 0 (0: the whole sequence at once)")
    if m.attention == "cudnn":
        # cuDNN's fused attention takes half-precision inputs only, head dims up to 256 in steps of 8.
        check(e, m.dtype == "bfloat16", f"model.attention=cudnn needs model.dtype=bfloat16, got {m.dtype!r}")
        if m.n_heads > 0 and (m.head_dim or m.d_model % m.n_heads == 0):
            hd = m.head_dim or m.d_model // m.n_heads
            check(e, hd % 8 == 0 and hd <= 256,
                  f"model.attention=cudnn needs a head dim that is a multiple of 8 and <= 256, got {hd}")
    if m.rope_scaling == "llama3":
        check(e, m.rope_factor >= 1, f"model.rope_factor={m.rope_factor} must be >= 1")
        check(e, m.rope_high_freq_factor > m.rope_low_freq_factor > 0,
               f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed "
               f"model.rope_low_freq_factor={m.rope_low_freq_factor} > 0")
        check(e, m.rope_original_max_len > 0, f"model.rope_original_max_len={m.rope_original_max_len} must be > 0")
    return e


def data_errors(d: DataConfig) -> list[str]:
    e: list[str] = []
    check(e, d.source in ("shakespeare", "files", "synthetic", "sft", "grain"),
           f"data.source={d.source!r} not in shakespeare|files|synthetic|sft|grain")
    check(e, d.too_long in ("truncate", "drop", "split"), f"data.too_long={d.too_long!r} not in truncate|drop|split")
    check(e, d.too_long != "split" or d.source == "grain",
          f"data.too_long=split is for data.source=grain; data.source={d.source!r} takes truncate|drop")
    if d.source == "grain":
        check(e, d.format in ("auto", "parquet", "arrayrecord", "jsonl", "text"),
              f"data.format={d.format!r} not in auto|parquet|arrayrecord|jsonl|text")
        check(e, d.record in ("tokens", "text", "json"), f"data.record={d.record!r} not in tokens|text|json")
        check(e, d.workers >= 0, f"data.workers={d.workers} must be >= 0 (0: read in the learner's process)")
        check(e, d.vocab_size >= 0, f"data.vocab_size={d.vocab_size} must be >= 0 (0: the tokenizer's)")
    check(e, d.on_bad in ("error", "skip"), f"data.on_bad={d.on_bad!r} not in error|skip")
    check(e, d.source != "files" or len(d.paths) > 0, "data.source=files needs data.paths")
    check(e, not d.eval_paths or d.source == "sft",
          f"data.eval_paths={list(d.eval_paths)} is for data.source=sft (a validation chat JSONL); "
          f"data.source={d.source!r} holds out the last data.val_fraction")
    check(e, d.tokenizer in ("byte", "bpe"), f"data.tokenizer={d.tokenizer!r} not in byte|bpe")
    check(e, d.tokenizer != "bpe" or d.bpe_vocab_size >= 260,
           f"data.bpe_vocab_size={d.bpe_vocab_size} must be >= 260 (256 bytes + specials)")
    check(e, d.seq_len > 0, f"data.seq_len={d.seq_len} must be > 0")
    check(e, d.batch_size > 0, f"data.batch_size={d.batch_size} must be > 0")
    check(e, 0.0 < d.val_fraction < 0.5, f"data.val_fraction={d.val_fraction} must be in (0, 0.5)")
    check(e, d.shard_block == 0 or d.shard_block > d.seq_len,
           f"data.shard_block={d.shard_block} must be 0 (contiguous shards) or > data.seq_len={d.seq_len}")
    check(e, d.data_dir != "", "data.data_dir must not be empty (use '.' for the working directory)")
    check(e, d.text_field != "", "data.text_field must not be empty")
    if d.source == "synthetic":
        check(e, d.synthetic_vocab >= 2, f"data.synthetic_vocab={d.synthetic_vocab} must be >= 2")
        check(e, d.synthetic_tokens > 0, f"data.synthetic_tokens={d.synthetic_tokens} must be > 0")
        # numpy seeds its generators from non-negative integers only
        check(e, d.synthetic_seed >= 0, f"data.synthetic_seed={d.synthetic_seed} must be >= 0")
        check(e, 1 <= d.synthetic_branching <= d.synthetic_vocab,
               f"data.synthetic_branching={d.synthetic_branching} must be in "
               f"[1, data.synthetic_vocab={d.synthetic_vocab}]")
    return e


def finetune_errors(f: FinetuneConfig) -> list[str]:
    e: list[str] = []
    lo = f.lora
    check(e, lo.rank >= 0, f"finetune.lora.rank={lo.rank} must be >= 0 (0: full fine-tune)")
    check(e, lo.alpha > 0, f"finetune.lora.alpha={lo.alpha} must be > 0")
    check(e, lo.seed >= 0, f"finetune.lora.seed={lo.seed} must be >= 0")
    unknown = [t for t in lo.targets if t not in LORA_TARGETS]
    check(e, not unknown,
          f"finetune.lora.targets={list(lo.targets)}: unknown {unknown}; known: {'|'.join(LORA_TARGETS)}")
    check(e, len(set(lo.targets)) == len(lo.targets), f"finetune.lora.targets={list(lo.targets)} names one twice")
    check(e, lo.rank == 0 or len(lo.targets) > 0, f"finetune.lora.rank={lo.rank} needs finetune.lora.targets")
    return e


def run_errors(r: RunConfig) -> list[str]:
    """run.peak_tflops and run.profile (docs/design.md#model-flops-and-mfu, #profiling-a-run)."""
    e: list[str] = []
    check(e, r.peak_tflops >= 0, f"run.peak_tflops={r.peak_tflops} must be >= 0 (0: the device's known peak)")
    check(e, math.isfinite(r.checkpoint_fail_s) and r.checkpoint_fail_s >= 0,
          f"run.checkpoint_fail_s={r.checkpoint_fail_s} must be a finite number of seconds >= 0 (0: never fail)")
    if r.profile:
        window = list(r.profile)
        check(e, len(window) == 2 and 0 <= window[0] < window[1] <= r.steps,
              f"run.profile={window} must be [start_step, stop_step] with 0 <= start_step < stop_step <= "
              f"run.steps={r.steps} ([] or null: no trace)")
    check(e, r.eval_limit >= 0, f"run.eval_limit={r.eval_limit} must be >= 0 (0: every test document)")
    # Tasks are scored where the eval loss is (docs/evaluation.md#during-a-run).
    check(e, r.eval_tasks_every == 0 or (r.eval_every > 0 and r.eval_tasks_every > 0
                                         and r.eval_tasks_every % r.eval_every == 0),
          f"run.eval_tasks_every={r.eval_tasks_every} must be a multiple of run.eval_every={r.eval_every}: "
          "tasks are scored at evals (0: at every eval)")
    return e


def start_errors(cfg: TrainConfig) -> list[str]:
    """What fine-tuning needs, checked when a run starts rather than by `validate`: the data=sft
    preset composes and validates before the command line names the files and the checkpoint."""
    e: list[str] = []
    m, d = cfg.model, cfg.data
    if m.init_from:
        from diloco.pretrained import CheckpointError, resolve  # the one name rule (generate, evaluate, convert)

        try:
            check(e, resolve(m.init_from).exists(),
                  f"model.init_from={m.init_from!r}: no such file or folder (working directory {Path.cwd()})")
        except CheckpointError as err:
            e.append(f"model.init_from={m.init_from!r}: {err}")
    if d.source == "sft":
        # The conversations are rendered with a checkpoint's chat template; a random model has none.
        check(e, m.init_from != "", "data.source=sft needs model.init_from=<hf folder | .gguf file | smollm2>: "
              "its chat template renders the conversations and its tokenizer encodes them")
        check(e, len(d.paths) > 0, "data.source=sft needs data.paths (JSONL files of conversations)")
    # A checkpoint's tokenizer encodes text; synthetic tokens are no text.
    # LoRA adapts a checkpoint's weights; a random init has nothing worth keeping frozen.
    check(e, cfg.finetune.lora.rank == 0 or m.init_from != "",
          f"finetune.lora.rank={cfg.finetune.lora.rank} needs model.init_from=<hf folder | .gguf file | smollm2>: "
          "LoRA trains adapters on a pretrained model's frozen weights")
    if cfg.run.wandb:  # an optional extra: refused before any output rather than at the first scalar
        import importlib.util

        check(e, importlib.util.find_spec("wandb") is not None,
              "run.wandb=true needs the wandb package: pip install -e .[wandb] (or run.wandb=false)")
    gone = [p for p in cfg.run.eval_tasks if not Path(p).is_file()]
    check(e, not gone, f"run.eval_tasks: {', '.join(gone)} not found (working directory {Path.cwd()})")
    check(e, not (cfg.run.eval_tasks and d.source == "synthetic"),
          "run.eval_tasks needs text: data.source=synthetic has no tokenizer to encode task prompts with")
    check(e, not (m.init_from and d.source == "synthetic"),
          f"model.init_from={m.init_from!r} with data.source=synthetic: the chain's states are not "
          "the checkpoint's tokens; use data.source=sft, files or shakespeare")
    return e


def inner_errors(i: InnerConfig, steps: int) -> list[str]:
    e: list[str] = []
    check(e, i.optimizer in ("adamw", "sgd", "muon"), f"inner.optimizer={i.optimizer!r} not in adamw|sgd|muon")
    check(e, i.schedule in ("cosine", "constant"), f"inner.schedule={i.schedule!r} not in cosine|constant")
    check(e, i.lr > 0, f"inner.lr={i.lr} must be > 0")
    check(e, 0 <= i.warmup_steps <= steps,
           f"inner.warmup_steps={i.warmup_steps} must be in [0, run.steps={steps}]"
           + (f": for a run this short set inner.warmup_steps={max(steps // 10, 0)}" if i.warmup_steps > steps else ""))
    check(e, 0.0 <= i.min_lr_ratio <= 1.0, f"inner.min_lr_ratio={i.min_lr_ratio} must be in [0, 1]")
    check(e, i.clip_norm >= 0, f"inner.clip_norm={i.clip_norm} must be >= 0")
    check(e, i.weight_decay >= 0, f"inner.weight_decay={i.weight_decay} must be >= 0")
    check(e, 0.0 <= i.muon_beta < 1.0, f"inner.muon_beta={i.muon_beta} must be in [0, 1)")
    check(e, i.muon_ns_steps >= 1, f"inner.muon_ns_steps={i.muon_ns_steps} must be >= 1")
    check(e, i.muon_rms > 0, f"inner.muon_rms={i.muon_rms} must be > 0")
    return e


def mesh_errors(mesh: MeshConfig, batch_size: int, n_visible: int) -> list[str]:
    """Mesh checks need the number of visible devices, so they run where devices are known."""
    e: list[str] = []
    n = mesh.devices or n_visible
    check(e, 0 < n <= n_visible, f"mesh.devices={mesh.devices} but only {n_visible} devices are visible")
    check(e, mesh.fsdp >= 1, f"mesh.fsdp={mesh.fsdp} must be >= 1")
    if e:
        return e
    data = mesh.data if mesh.data > 0 else n // mesh.fsdp
    check(e, data * mesh.fsdp == n,
           f"mesh.data={data} x mesh.fsdp={mesh.fsdp} != {n} devices (mesh.devices={mesh.devices})")
    check(e, batch_size % (data * mesh.fsdp) == 0,
           f"data.batch_size={batch_size} is not divisible by mesh.data*mesh.fsdp={data * mesh.fsdp}")
    return e


def diloco_errors(cfg: TrainConfig) -> list[str]:
    e: list[str] = []
    f, o, c, s, r = cfg.fragments, cfg.outer, cfg.codec, cfg.syncer, cfg.runtime
    check(e, cfg.algo in ("dp", "diloco"), f"algo={cfg.algo!r} not in dp|diloco")
    check(e, 1 <= f.count <= f.H, f"fragments.count={f.count} must be in [1, fragments.H={f.H}]")
    check(e, 0 <= f.tau and (f.tau < f.H or f.eager),
          f"fragments.tau={f.tau} must be in [0, fragments.H={f.H}) (tau >= H needs fragments.eager=true)")
    check(e, not f.eager or (not f.keep_overlap and f.alpha == 0.0),
          f"fragments.eager=true keeps the progress since a send by its own rule:"
          f" fragments.keep_overlap={f.keep_overlap} and fragments.alpha={f.alpha} must be false and 0")
    # An eager contribution is a pseudo-gradient against the learner's own anchor, which the syncer
    # must take as sent; against `current` it would undo the merges the learner has not applied yet.
    check(e, not f.eager or s.anchor == "base",
          f"fragments.eager=true needs syncer.anchor=base (got syncer.anchor={s.anchor})")
    check(e, 0.0 < f.eager_share <= 1.0, f"fragments.eager_share={f.eager_share} must be in (0, 1]")
    check(e, 0.0 <= f.alpha <= 1.0, f"fragments.alpha={f.alpha} must be in [0, 1]")
    # Choices are checked against the registries themselves, so a new entry needs no second list.
    check(e, f.strategy in FRAGMENTERS, f"fragments.strategy={f.strategy!r} not in {'|'.join(FRAGMENTERS)}")
    check(e, o.name in OUTER, f"outer.name={o.name!r} not in {'|'.join(OUTER)}")
    check(e, o.lr > 0, f"outer.lr={o.lr} must be > 0")
    if isinstance(o.momentum, str):
        check(e, o.momentum == AUTO, f"outer.momentum={o.momentum!r} must be a number in [0, 1) or {AUTO}")
        check(e, o.momentum != AUTO or o.name in AUTO_STATIC,
              f"outer.momentum={AUTO} needs outer.name in {'|'.join(AUTO_STATIC)}, not {o.name!r} (it has no momentum)")
    else:
        check(e, 0 <= o.momentum < 1, f"outer.momentum={o.momentum} must be in [0, 1) or {AUTO}")
    check(e, s.outer_stats in ("auto", "on", "off"), f"syncer.outer_stats={s.outer_stats!r} not in auto|on|off")
    check(e, not (s.outer_stats == "off" and o.momentum == AUTO),
          f"outer.momentum={AUTO} sets momenta from the outer statistics: syncer.outer_stats=off turns them off "
          "(use auto or on)")
    check(e, c.up in CODECS, f"codec.up={c.up!r} not in {'|'.join(CODECS)}")
    check(e, c.down in CODECS, f"codec.down={c.down!r} not in {'|'.join(CODECS)}")
    check(e, 0 <= c.zstd_level <= 22, f"codec.zstd_level={c.zstd_level} must be in [0, 22]")
    check(e, 0.0 < c.ef_decay <= 1.0, f"codec.ef_decay={c.ef_decay} must be in (0, 1]")
    # The block formats' residuals live on the learner's devices (device_codecs.py), undecayed.
    check(e, c.ef_decay == 1.0 or (c.error_feedback and c.up not in BLOCK_FORMATS),
          f"codec.ef_decay={c.ef_decay} needs codec.error_feedback=true and a host-encoded up codec "
          f"(sparseloco or topk), not codec.up={c.up!r} with error_feedback={c.error_feedback}")
    if "sparseloco" in (c.up, c.down):
        check(e, 2 <= c.chunk <= 1 << 16 and c.chunk & (c.chunk - 1) == 0,
              f"codec.chunk={c.chunk} must be a power of two in [2, 65536]")
        check(e, 1 <= c.chunk_k <= c.chunk, f"codec.chunk_k={c.chunk_k} must be in [1, codec.chunk={c.chunk}]")
    check(e, 1 <= s.quorum <= r.learners, f"syncer.quorum={s.quorum} must be in [1, runtime.learners={r.learners}]")
    check(e, 0 <= s.gamma <= 1, f"syncer.gamma={s.gamma} must be in [0, 1]")
    for name in ("merge", "embedding_merge"):
        check(e, getattr(s, name) in MERGES, f"syncer.{name}={getattr(s, name)!r} not in {'|'.join(MERGES)}")
    check(e, s.history >= 1, f"syncer.history={s.history} must be >= 1")
    check(e, s.theta_norm_bound >= 0, f"syncer.theta_norm_bound={s.theta_norm_bound} must be >= 0 (0: no bound)")
    check(e, s.clip == 0 or s.clip >= 1, f"syncer.clip={s.clip} must be 0 (off) or >= 1 (x the median norm)")
    check(e, s.claim_slack >= -1, f"syncer.claim_slack={s.claim_slack} must be -1 (off) or >= 0 steps")
    check(e, s.grace_budget in ("waiting", "slowest"), f"syncer.grace_budget={s.grace_budget!r} not in waiting|slowest")
    check(e, s.anchor in ("current", "base"), f"syncer.anchor={s.anchor!r} not in current|base")
    check(e, s.scale in ("admitted", "live"), f"syncer.scale={s.scale!r} not in admitted|live")
    check(e, cfg.fragments.others in ("now", "defer"), f"fragments.others={cfg.fragments.others!r} not in now|defer")
    check(e, r.kind in ("sim", "threads", "procs", "ray"), f"runtime.kind={r.kind!r} not in sim|threads|procs|ray")
    check(e, r.launch in ("local", "external"), f"runtime.launch={r.launch!r} not in local|external")
    check(e, r.launch == "local" or r.kind == "procs",
          f"runtime.launch={r.launch!r} needs runtime.kind=procs (got {r.kind!r})")
    check(e, -1 <= r.learner_index < r.learners,
          f"runtime.learner_index={r.learner_index} must be in 0..{r.learners - 1} (runtime.learners={r.learners}), "
          "or -1 where no single learner is meant")
    e += ray_errors(r)
    check(e, not (cfg.chaos.enabled and cfg.chaos.scavenge and r.kind != "sim"),
           f"chaos.scavenge={list(cfg.chaos.scavenge)} needs runtime.kind=sim (got {r.kind!r})")
    check(e, cfg.chaos.wall_scale > 0, f"chaos.wall_scale={cfg.chaos.wall_scale} must be > 0")
    check(e, not cfg.chaos.tape_file or Path(cfg.chaos.tape_file).is_file(),
           f"chaos.tape_file={cfg.chaos.tape_file!r} is not a file")
    check(e, s.norm_bound == 0 or s.norm_bound > 1, f"syncer.norm_bound={s.norm_bound} must be 0 (off) or > 1")
    check(e, s.norm_window >= 4, f"syncer.norm_window={s.norm_window} must be >= 4")
    check(e, r.queue_size >= 1, f"runtime.queue_size={r.queue_size} must be >= 1")
    check(e, r.max_rejoin_staleness >= 0, f"runtime.max_rejoin_staleness={r.max_rejoin_staleness} must be >= 0")
    check(e, r.restart_s >= 0, f"runtime.restart_s={r.restart_s} must be >= 0")
    check(e, r.step_period_s >= 0, f"runtime.step_period_s={r.step_period_s} must be >= 0")
    check(e, r.step_period_s == 0 or r.kind != "sim",
          f"runtime.step_period_s={r.step_period_s} paces the wall-clock runtimes (threads, procs); "
          f"sim steps take runtime.step_time={r.step_time} virtual seconds")
    check(e, r.rejoin_at in ("own", "schedule"), f"runtime.rejoin_at={r.rejoin_at!r} must be own or schedule")
    check(e, r.batch_learners in ("auto", "on", "off"),
          f"runtime.batch_learners={r.batch_learners!r} must be auto, on or off")
    e += auth_errors(r.auth) + store_errors(r.store)
    check(e, r.rejoin_at != "schedule" or r.step_period_s > 0,
          f"runtime.rejoin_at=schedule needs runtime.step_period_s > 0 (got {r.step_period_s}): "
          "without a paced schedule there is no step the other learners are at")
    check(e, r.learner_checkpoint_every >= 0,
           f"runtime.learner_checkpoint_every={r.learner_checkpoint_every} must be >= 0")
    check(e, r.learners >= 1, f"runtime.learners={r.learners} must be >= 1")
    check(e, r.devices_per_learner >= 1, f"runtime.devices_per_learner={r.devices_per_learner} must be >= 1")
    e += world_errors(r)
    check(e, len(r.speeds) in (0, r.learners),
           f"runtime.speeds has {len(r.speeds)} entries for runtime.learners={r.learners}")
    check(e, all(x > 0 for x in r.speeds), f"runtime.speeds={list(r.speeds)} must all be > 0")
    check(e, r.step_time > 0 and r.bandwidth > 0 and r.latency >= 0 and r.jitter >= 0,
           f"runtime.step_time={r.step_time}, bandwidth={r.bandwidth} must be > 0; latency={r.latency}, "
           f"jitter={r.jitter} >= 0")
    if cfg.algo == "diloco":
        # sim resumes from its snapshots; threads and procs from the syncer checkpoint a stop saves
        # (procs: and its journal, kept only with run.checkpoint_every > 0), docs/design.md#stopping-a-run
        check(e, not cfg.run.resume or r.kind not in ("procs", "ray") or cfg.run.checkpoint_every > 0,
               f"run.resume=true with runtime.kind={r.kind} needs run.checkpoint_every > 0 (got "
               f"{cfg.run.checkpoint_every}): the syncer's checkpoints and journal are what it resumes from")
        check(e, cfg.data.batch_size % r.devices_per_learner == 0,
               f"data.batch_size={cfg.data.batch_size} is not divisible by "
               f"runtime.devices_per_learner={r.devices_per_learner}")
        e += learner_batch_errors(cfg)
    return e


def chaos_errors(c: ChaosConfig) -> list[str]:
    e: list[str] = []
    check(e, c.slices_per_learner >= 1, f"chaos.slices_per_learner={c.slices_per_learner} must be >= 1")
    check(e, c.chips_per_slice >= 1, f"chaos.chips_per_slice={c.chips_per_slice} must be >= 1")
    check(e, c.mtbi_s > 0, f"chaos.mtbi_s={c.mtbi_s} must be > 0")
    check(e, c.repair in ("fixed", "exponential", "lognormal"),
           f"chaos.repair={c.repair!r} not in fixed|exponential|lognormal")
    check(e, c.repair_mean_s > 0, f"chaos.repair_mean_s={c.repair_mean_s} must be > 0")
    check(e, c.repair_sigma >= 0, f"chaos.repair_sigma={c.repair_sigma} must be >= 0")
    check(e, all(x > 0 for x in c.speeds), f"chaos.speeds={list(c.speeds)} must all be > 0")
    check(e, c.jitter >= 0, f"chaos.jitter={c.jitter} must be >= 0")
    for i, w in enumerate(c.scavenge):
        check(e, len(w) == 2 and 0 <= w[0] < w[1],
               f"chaos.scavenge[{i}]={list(w)} must be [start_s, stop_s] with 0 <= start_s < stop_s")
    check(e, c.seed >= 0, f"chaos.seed={c.seed} must be >= 0")  # numpy seeds are non-negative
    return e
