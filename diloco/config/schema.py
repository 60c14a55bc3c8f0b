"""The run configuration's schema: one frozen dataclass per section, each field with its default
and, where the papers are silent, the knob's reading (docs/algorithm.md#choices-where-the-papers-are-silent).
Every option of a run with its comment, which `--describe` prints; the runtime section and its
subsections are in diloco/config/schema_runtime.py (re-exported here), the checks in
diloco/config/checks.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.config.schema_runtime import (  # noqa: F401  (re-exported: every section is imported from here)
    AuthConfig, RayConfig, RuntimeConfig, StoreConfig, WorldConfig)


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or inconsistent with another one."""


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer shape; the vocabulary size comes from the tokenizer."""

    name: str = "small"  # the shape's name (its configs/model/ preset), shown in the memory estimate
    d_model: int = 128  # width of the residual stream
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # query heads per attention layer
    n_kv_heads: int = 2  # grouped-query attention: n_heads query heads share n_kv_heads K/V heads
    d_ff: int = 384  # SwiGLU hidden width
    max_seq_len: int = 256  # longest sequence the model takes; data.seq_len must fit in it
    tie_embeddings: bool = True  # the output head reuses the input embedding matrix
    rope_theta: float = 10000.0  # RoPE base frequency
    norm_eps: float = 1e-6  # epsilon of every RMSNorm / LayerNorm
    dtype: str = "float32"  # activation dtype; parameters are always float32
    # A Hugging Face folder or .gguf file to start from (docs/design.md#fine-tuning): its shape
    # (every other field of this section but dtype), weights and tokenizer replace the preset's;
    # "" = random init from run.seed
    init_from: str = ""
    # Architecture variants of the one decoder, for imported checkpoints (docs/models.md). The
    # defaults are our own Llama-style model; each family sets what it needs.
    family: str = ""  # the Hugging Face family a checkpoint came from (llama, mistral, qwen2, qwen3, gpt2); "" = ours
    head_dim: int = 0  # 0: d_model // n_heads (Qwen3 sets it independently)
    norm: str = "rms"  # rms: RMSNorm | layer: LayerNorm with bias (GPT-2)
    mlp: str = "swiglu"  # swiglu: silu(gate) * up | gelu: tanh-approximate GELU of one up projection (GPT-2)
    positions: str = "rope"  # rope: rotary | learned: an absolute position table added to the embedding (GPT-2)
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2, GPT-2)
    o_bias: bool = False  # bias on the attention output projection (GPT-2)
    mlp_bias: bool = False  # biases on the MLP projections (GPT-2)
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3)
    rope_scaling: str = "none"  # none | llama3 (Llama 3.1+ frequency-dependent context extension)
    rope_factor: float = 8.0  # llama3 scaling: long wavelengths are divided by this
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths over original_max_len / this are divided by rope_factor
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths under original_max_len / this are kept; between, blended
    rope_original_max_len: int = 8192  # the context length the frequencies were trained for
    # How the inner step computes, not what (docs/models.md#attention-remat-and-the-chunked-loss); a
    # checkpoint from model.init_from keeps the run's choices.
    # auto: cuDNN's fused kernel on a GPU where the dtype and head dim allow, XLA's on other
    # accelerators, the reference on a CPU (same numbers as before) | xla (jax.nn.dot_product_attention) |
    # cudnn (needs a GPU and bfloat16) | reference (the explicit B x H x L x S float32 scores)
    attention: str = "auto"
    remat: str = "none"  # none | full | dots: what each block keeps for the backward pass
    # Sequence positions per chunk of the loss: the head's logits are computed B x loss_chunk x V
    # at a time, each chunk recomputed in the backward pass; 0 = all B x L x V at once
    loss_chunk: int = 0


@dataclass(frozen=True)
class DataConfig:
    """Where text comes from, how it is tokenized and how batches are cut."""

    # shakespeare | files | synthetic | sft (chat JSONL rendered with the chat template of
    # model.init_from, trained on the assistant's tokens only: docs/design.md#fine-tuning-data)
    # | grain (Parquet, ArrayRecord, JSONL or text files read, tokenised and packed on the fly: docs/data.md)
    source: str = "shakespeare"
    paths: tuple[str, ...] = ()  # files/globs for source=files (.txt or .jsonl) or source=sft (.jsonl)
    text_field: str = "text"  # JSONL field holding the text
    tokenizer: str = "byte"  # byte | bpe
    bpe_vocab_size: int = 1024  # vocabulary of the BPE tokenizer trained on the corpus (tokenizer=bpe)
    seq_len: int = 128  # tokens per training sequence
    batch_size: int = 32  # sequences per step of one trainer (or one learner)
    val_fraction: float = 0.05  # held out for eval: the stream's tail, or (sft) a fixed random share of the examples
    # sft: files/globs of validation conversations (chat JSONL) evaluated instead; () = hold out
    # val_fraction of data.paths
    eval_paths: tuple[str, ...] = ()
    # sft, grain: an example longer than seq_len + 1 tokens is cut to it (truncate), left out
    # (drop) or (grain) cut into row-long pieces (split)
    too_long: str = "truncate"
    # sft: a malformed line is an error naming its file and line (error) or skipped and counted (skip)
    on_bad: str = "error"
    shard_block: int = 0  # 0: each learner a contiguous shard; N: blocks of N tokens dealt round-robin
    data_dir: str = "data"  # downloads, extracted text and tokenized stores are cached here
    synthetic_vocab: int = 16  # states of the synthetic Markov chain: its vocabulary
    synthetic_tokens: int = 200_000  # length of the synthetic token stream
    synthetic_branching: int = 4  # successors per state: sets the entropy floor of the source
    synthetic_seed: int = 1234  # seed of the synthetic chain and of its sample
    format: str = "auto"  # grain: auto (by suffix) | parquet | arrayrecord | jsonl | text (a record a line)
    record: str = "tokens"  # grain: an ArrayRecord record holds tokens (int32 ids) | text (UTF-8) | json
    chat_field: str = ""  # grain: a field of chat messages, rendered with model.init_from's template
    vocab_size: int = 0  # grain, record=tokens: ids are below it (0: the tokenizer's vocabulary)
    workers: int = 0  # grain: Grain worker processes per learner (0: in the learner's process)


@dataclass(frozen=True)
class InnerConfig:
    """The inner optimizer a trainer (or each learner) runs every step."""

    optimizer: str = "adamw"  # adamw | sgd | muon (Muon on hidden matrices, AdamW on the rest)
    lr: float = 3e-3  # peak learning rate, reached after warmup
    warmup_steps: int = 50  # steps of linear warmup from 0 to lr
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    schedule: str = "cosine"  # cosine | constant
    b1: float = 0.9  # AdamW's first-moment decay
    b2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's epsilon
    weight_decay: float = 0.1  # AdamW's decoupled weight decay, on matrices only (not norms or biases)
    clip_norm: float = 1.0  # global-norm clipping; 0 disables it
    muon_beta: float = 0.95  # Muon's momentum decay (inner.optimizer=muon)
    muon_ns_steps: int = 5  # Newton-Schulz iterations that orthogonalise Muon's momentum
    muon_rms: float = 0.2  # RMS of a Muon matrix update before the lr (AdamW's typical RMS; inner=muon sets 0.5, T10)


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh of one trainer: batch over (data, fsdp); parameters over fsdp."""

    data: int = -1  # -1: all devices not used by fsdp
    fsdp: int = 1  # devices each parameter is sharded over; the batch spans data x fsdp
    devices: int = 0  # how many devices to use; 0 = all visible


@dataclass(frozen=True)
class RunConfig:
    """Length of the run and what happens periodically."""

    steps: int = 300  # training steps (each learner's inner steps in DiLoCo)
    seed: int = 0  # random init of the model and the order of the batches
    log_every: int = 10  # steps between train records (metrics.jsonl, TensorBoard, the status line)
    eval_every: int = 50  # steps between evals of the (global) model on the validation split
    eval_batches: int = 8  # validation batches per eval
    # downstream task files (lm-eval .yaml, BIG-bench .json, as scripts/evaluate.py tasks=[...]) scored
    # on the global model beside the eval loss, and on the base model at step 0 (docs/evaluation.md#during-a-run)
    eval_tasks: tuple[str, ...] = ()
    eval_tasks_every: int = 0  # steps between task scores, a multiple of run.eval_every; 0 = at every eval
    eval_limit: int = 100  # test documents scored per task each time (the first ones); 0 = all
    # trainer: steps between checkpoints; sim: inner steps per learner between snapshots; procs:
    # merges between syncer checkpoints (0 = none, and then a killed syncer fails the run)
    checkpoint_every: int = 100
    # checkpoints (trainer), snapshots (sim), syncer and learner checkpoints kept: the newest n, so a
    # torn or damaged newest one falls back to the one before (1 saves disk and loses that); a sim
    # snapshot holds syncer.history broadcast references and every learner's optimizer state
    keep_checkpoints: int = 2
    # seconds of failed checkpoint commits (each logged, retried at the next) before a run fails; 0 = never
    checkpoint_fail_s: float = 600.0  # (docs/design.md#checkpoint-integrity)
    log_refusals: bool = False  # every refused frame's record in metrics.jsonl (docs/design.md#damage-in-the-store)
    out_dir: str = "runs/default"  # the run directory (configs/train.yaml: runs/<timestamp>)
    resume: bool = False  # continue the run in out_dir from what it saved (docs/design.md#resuming-a-run)
    progress: bool = True  # a live status line on stderr (off under CI=1)
    tensorboard: bool = True  # TensorBoard event files in <run>/tensorboard (`tensorboard --logdir runs/`)
    # the same scalars to Weights & Biases, files in <run>/wandb; offline unless WANDB_MODE says
    # otherwise (needs the wandb extra: pip install -e .[wandb]; docs/design.md#metrics-series)
    wandb: bool = False
    wandb_project: str = "diloco"  # the W&B project the run is logged under (run.wandb=true)
    plot: bool = True  # loss.png at the end of the run
    # bf16 dense peak TFLOP/s of one device, which MFU is measured against; 0 = the known peak of
    # the device kind (H100/H200 989.4, A100 312, TPU v5e 197, v5p 459, v6e 918: diloco/train/flops.py),
    # none on a CPU, so no MFU there (docs/design.md#model-flops-and-mfu)
    peak_tflops: float = 0.0
    # [start_step, stop_step]: a jax.profiler trace of the steps after start_step up to stop_step
    # (the data-parallel trainer's, or learner 0's) in <run>/profile; [] or null = none
    # (docs/design.md#profiling-a-run)
    profile: tuple[int, ...] | None = ()
    # refuse at start a run whose memory estimate exceeds 90% of the machine's available memory
    # (docs/design.md#memory-before-a-run); false starts it anyway
    memory_check: bool = True


@dataclass(frozen=True)
class FragmentsConfig:
    """How parameters are split and when each fragment travels (Streaming DiLoCo)."""

    count: int = 4  # P
    H: int = 24  # each fragment is sent once per H inner steps
    tau: int = 2  # overlap: the merged fragment is applied tau steps after sending
    alpha: float = 0.0  # learner mix on apply: alpha * local + (1 - alpha) * global [unsure]
    strategy: str = "balanced"  # balanced | layer_strided | layer_sequential | tensor
    final_sync: bool = True  # at the end each learner sends every fragment with unsent progress
    # On applying the merge that answers a send, add the local progress made since that send
    # (Theta + local - local at send) instead of overwriting it; alpha is then unused [unsure].
    keep_overlap: bool = False
    # A merge another learner triggered: now (apply before the next step) | defer (hold it until
    # this learner's own send of the fragment is answered) [unsure].
    others: str = "now"
    # Eager outer steps (arXiv 2502.12996): a send moves the learner at once by the outer step on its
    # own pseudo-gradient, the merge later by the correction; allows tau >= H (needs syncer.anchor=base).
    eager: bool = False
    # How much of the merged pseudo-gradient a learner's own stands in for until the merge comes: all
    # of it at 1, its own part at 1/M, the paper's rule (docs/algorithm.md#eager-outer-steps).
    eager_share: float = 1.0


@dataclass(frozen=True)
class OuterConfig:
    """The syncer's outer optimizer, one state per fragment."""

    name: str = "nesterov"  # nesterov | sgd | average | delayed_nesterov
    lr: float = 0.7  # outer learning rate, on each fragment's merged pseudo-gradient
    # Nesterov momentum of the outer step (nesterov, delayed_nesterov); auto = each fragment's own, set
    # from its merged pseudo-gradients' measured autocorrelation
    # (docs/algorithm.md#outer-statistics-and-automatic-momentum)
    momentum: float | str = 0.9
    delay: int = 4  # N of delayed_nesterov


@dataclass(frozen=True)
class CodecConfig:
    """Wire precision of contributions (up) and broadcasts (down)."""

    up: str = "int4"  # fp32 | bf16 | int8 | int4 | fp4 | 2bit | topk | sparseloco
    down: str = "int8"  # broadcast deltas; learners that missed a version get fp32
    error_feedback: bool = False  # on the up direction
    zstd_level: int = 1  # 0 disables the zstd stage
    block: int = 64  # values per float32 scale in the block formats (int8, int4, fp4, 2bit)
    topk_fraction: float = 0.01  # topk: the share of each tensor's values sent, largest magnitudes first
    chunk: int = 4096  # sparseloco: values per chunk (a power of two), each with its own top-k and scale
    chunk_k: int = 32  # sparseloco: values kept per chunk
    ef_decay: float = 1.0  # error feedback: the residual is multiplied by this before it is added (SparseLoCo: 0.95)


@dataclass(frozen=True)
class SyncerConfig:
    """Quorum, grace window and merge rules (docs/algorithm.md#syncer)."""

    quorum: int = 1  # K
    gamma: float = 0.8  # Eq. 3 safety factor [unsure]
    grace_cap_steps: float = 1.0  # the grace window never exceeds this many step times (Eq. 3)
    merge: str = "rda"  # a rule in diloco.algo.merge.MERGES (rda, rda_fragment, average), non-embedding fragments
    embedding_merge: str = "average"  # the merge rule of embedding fragments (the same choices as merge)
    max_staleness: int = -1  # versions; -1 = no cut-off
    history: int = 16  # versions of broadcast references kept for decoding contributions
    grace_budget: str = "waiting"  # Eq. 3 step time: waiting (fastest learner in the round) | slowest [unsure]
    scale: str = "admitted"  # one merge's delta: the admitted mean | x admitted / live learners [unsure]
    anchor: str = "current"  # delta_m = Theta_p - theta_m against: current (Theta now) | base (the version sent from) [unsure]
    # Quarantine a pseudo-gradient whose norm per step exceeds norm_bound x the median of the fragment's
    # last norm_window admitted ones (once 8 are known; 0 = none): loose, as warmup moves it several-fold.
    norm_bound: float = 100.0
    norm_window: int = 32  # how many admitted norms the median of norm_bound is taken over
    # Armed from a fragment's first contribution, before the median has a window: quarantine a norm
    # per inner step above theta_norm_bound x (||Theta_p|| + sqrt(size of p)); 0 = no bound.
    theta_norm_bound: float = 100.0
    # Robust merge: scale each pseudo-gradient down to at most clip x the fragment's median norm per
    # step (docs/algorithm.md#robust-merges); 0 = off. Bounds what a plausible bad update can do.
    clip: float = 2.0
    claim_slack: int = 2  # c_steps <= steps reported since the last merged contribution + tau + this; -1 = off
    # At start-up, time one fragment round on this host and warn once if the learners would hand
    # the syncer more work than it can do (docs/design.md#does-the-syncer-keep-up).
    check_pace: bool = True
    # The consecutive cosine update_cos of each fragment's merged pseudo-gradients, which keeps the
    # last one (a float32 copy of the model in all): auto = only under outer.momentum=auto, which
    # needs it | on | off (docs/algorithm.md#outer-statistics-and-automatic-momentum: its cost)
    outer_stats: str = "auto"


@dataclass(frozen=True)
class ChaosConfig:
    """Failures, stragglers and scavenged learners replayed from a tape (diloco/chaos/tapes.py).

    Times are seconds: virtual seconds in the sim runtime; wall-clock runtimes scale them.
    """

    enabled: bool = False  # replay a failure tape: generated from this section, or chaos.tape_file
    slices_per_learner: int = 4  # a learner with slices down steps on a smaller batch, with none left it dies
    chips_per_slice: int = 256  # chips of one slice (a slice fails at chips_per_slice / mtbi_s)
    # mean time between interruptions of one chip (1 year); a slice of c chips fails at c / mtbi_s
    mtbi_s: float = 31_536_000.0
    repair: str = "exponential"  # fixed | exponential | lognormal: how long a failed slice stays down
    repair_mean_s: float = 600.0  # mean seconds a failed slice stays down
    repair_sigma: float = 1.0  # lognormal only: std of log(repair time)
    # step-time factor per learner, cycled over learners: [1.0, 1.18] = every second one 1.18x slower
    speeds: tuple[float, ...] = ()
    jitter: float = 0.0  # relative std of each step time
    scavenge: tuple[tuple[float, ...], ...] = ()  # [start_s, stop_s] per extra learner (ids from runtime.learners on)
    seed: int = 0  # seed of the generated tape
    wall_scale: float = 1.0  # threads/procs: wall seconds per tape second (a real step's seconds / step_time)
    tape_file: str = ""  # a tape JSON (e.g. a sim run's chaos_tape.json) to replay instead of generating one


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters with a frozen A (docs/design.md#lora): a target's weight is W + (alpha /
    rank) A B, W and A frozen, only B trained, so learners and the syncer see only the Bs."""

    rank: int = 0  # r of each adapter; 0 = full fine-tune (every parameter trained)
    alpha: float = 16.0  # the adapters' product is scaled by alpha / rank
    # Projections adapted in every block: q k v o (attention), gate up down (MLP). Hu et al. (2021)
    # section 7.1 find q and v the best use of a fixed budget.
    targets: tuple[str, ...] = ("q", "v")
    seed: int = 0  # of the frozen random A matrices: the same on every learner and process


@dataclass(frozen=True)
class FinetuneConfig:
    """What a run starting from model.init_from trains (docs/design.md#fine-tuning)."""

    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    run: RunConfig = field(default_factory=RunConfig)
    algo: str = "dp"  # dp: the data-parallel baseline | diloco: Decoupled DiLoCo
    fragments: FragmentsConfig = field(default_factory=FragmentsConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    syncer: SyncerConfig = field(default_factory=SyncerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
