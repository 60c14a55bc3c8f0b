"""An estimate of one device's memory in a run, from its config alone: parameters, gradients,
optimizer state, a learner's extra copies, activations and logits (docs/models.md#presets).

Reference: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(arXiv 2205.05198), section 4, for what a block keeps for its backward pass.

An estimate, not a measurement: it counts the arrays a step must hold at once, not XLA's buffer
assignment or an allocator's fragmentation. tests/test_footprint.py holds it to XLA's own memory
analysis of the compiled step on the CPU.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from diloco.algo import outer_auto
from diloco.algo.outer import AUTO
from diloco.config import ConfigError, ModelConfig, TrainConfig
from diloco.config.learner_batch import learner_batches
from diloco.model.attention import cudnn_fits

GIB = 1 << 30


class Footprint(NamedTuple):
    params: int  # parameters of the model (all of them, trained or frozen)
    trained: int  # of those, what the optimizer steps (the adapters under LoRA)
    devices: int  # devices of one trainer or one learner
    batch: int  # sequences per device per step
    parts: dict[str, float]  # bytes per device, by what holds them

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def lines(self) -> list[str]:
        who = "learner" if "learner copies" in self.parts else "trainer"
        out = [f"{self.params / 1e6:,.1f}M parameters ({self.trained / 1e6:,.1f}M trained), one {who} on "
               f"{self.devices} device(s), {self.batch} sequence(s) per device per step:"]
        out += [f"  {name:16s} {size / GIB:9.2f} GiB" for name, size in self.parts.items()]
        out.append(f"  {'total':16s} {self.total / GIB:9.2f} GiB per device (an estimate; XLA's buffers differ)")
        return out


def fused_attention(m: ModelConfig, platform: str) -> bool:
    """Whether model.attention runs a fused kernel (no scores in memory) on `platform` (gpu | tpu |
    cpu), as diloco/model/attention.py chooses it for a training step."""
    E = m.head_dim or m.d_model // m.n_heads
    return m.attention == "cudnn" or (m.attention == "auto" and platform == "gpu" and cudnn_fits(m.dtype, E))


def activation_bytes(m: ModelConfig, batch: int, seq: int, vocab: int, platform: str) -> dict[str, float]:
    """Per device, what the forward pass keeps for the backward one: the blocks' activations under
    m.remat, and the loss's logits under m.loss_chunk (floats of m.dtype; logits in float32)."""
    width = 2 if m.dtype == "bfloat16" else 4
    E = m.head_dim or m.d_model // m.n_heads
    D, F, L, tokens = m.d_model, m.d_ff, m.n_layers, batch * seq
    q, kv = m.n_heads * E, m.n_kv_heads * E
    mlp_in = 2 * F if m.mlp == "swiglu" else F
    # One block without remat: the residual input and two norm outputs; q, k, v and the attention
    # output; the MLP's pre-activations (gate and up), its product and the down input.
    whole = (3 * D + 2 * q + 2 * kv + mlp_in + F + D) * tokens * width
    # The scores: B x H x L x S float32 and their softmax, unless a fused kernel keeps them on chip
    scores = 0 if fused_attention(m, platform) else 2 * batch * m.n_heads * seq * seq * 4
    # dots: the outputs of the matmuls (q, k, v, o, the MLP's up/gate and down)
    dots = (q + 2 * kv + D + mlp_in + D) * tokens * width
    kept = {"none": L * (whole + scores), "full": L * D * tokens * width + whole + scores,
            "dots": L * dots + whole + scores}[m.remat]
    chunk = m.loss_chunk or seq
    # The logits of a chunk, their softmax and its gradient, in float32
    logits = 3 * batch * min(chunk, seq) * vocab * 4
    return {"activations": float(kept), "logits": float(logits)}


def vocab_of(cfg: TrainConfig) -> int:
    """The vocabulary a run of cfg trains on, from its data config alone (a checkpoint's own,
    under model.init_from, is not read here)."""
    d = cfg.data
    if d.source == "synthetic":
        return d.synthetic_vocab
    return d.bpe_vocab_size if d.tokenizer == "bpe" else 256  # bytes


def describe(cfg: TrainConfig, platform: str = "gpu") -> list[str]:
    """The lines `scripts/train.py --describe <overrides>` prints for cfg: the estimate, per device."""
    from diloco.model import abstract_params, count_params  # builds the model's shapes (jax)

    vocab = vocab_of(cfg)
    params = abstract_params(cfg.model, vocab)
    trained = None
    if cfg.finetune.lora.rank > 0:
        from diloco.model import lora

        trained = count_params(lora.init_adapters(cfg.finetune.lora, params))  # the Bs (rank x d_out each)
    f = estimate(cfg, count_params(params), vocab, trained, platform)
    head = [f"Memory estimate for {platform.upper()} (model={cfg.model.name}, vocabulary {vocab:,}, "
            f"batch {cfg.data.batch_size} x {cfg.data.seq_len}, remat {cfg.model.remat}, "
            f"loss_chunk {cfg.model.loss_chunk}, mesh fsdp {cfg.mesh.fsdp}):"]
    if cfg.model.init_from:
        head.append(f"  (model.init_from={cfg.model.init_from!r}: its shape and vocabulary replace these at start-up)")
    return head + f.lines()


def estimate(cfg: TrainConfig, params: int, vocab: int, trained: int | None = None,
             platform: str = "gpu", rows: int | None = None) -> Footprint:
    """One device's memory for cfg's trainer (algo=dp, over cfg.mesh.devices or 1) or one of its
    learners (runtime.devices_per_learner) on `platform`, with `params` parameters of which
    `trained` are stepped (all by default), parameters in float32 sharded over mesh.fsdp. A
    learner's batch is `rows`, by default the largest of runtime.learner_batch (the device peak)."""
    m = cfg.model
    learner = cfg.algo == "diloco"
    devices = max(cfg.runtime.devices_per_learner if learner else cfg.mesh.devices, 1)
    fsdp = max(min(cfg.mesh.fsdp, devices), 1)
    data = max(devices // fsdp, 1)
    rows = rows or (max(learner_batches(cfg)) if learner else cfg.data.batch_size)
    batch = max(math.ceil(rows / devices), 1) if data > 1 or fsdp > 1 else rows
    trained = params if trained is None else trained
    # Adam's two moments; plain SGD keeps none; Muon one momentum on matrices (an upper bound of
    # 2 here: the embeddings and vectors it leaves to AdamW keep two).
    slots = {"adamw": 2, "muon": 2, "sgd": 0}[cfg.inner.optimizer]
    parts = {
        "parameters": 4.0 * trained / fsdp,
        "gradients": 4.0 * trained / fsdp,
        "optimizer": 4.0 * slots * trained / fsdp,
    }
    if params > trained:  # LoRA's checkpoint: one copy on a mesh, whatever steps run there (train/trainer.py)
        parts["frozen weights"] = 4.0 * (params - trained) / fsdp
    if learner:  # the anchor Theta of the last merge, and the fragment being encoded on the devices
        parts["learner copies"] = 4.0 * trained / fsdp + 4.0 * trained / max(cfg.fragments.count, 1) / fsdp
    parts.update(activation_bytes(m, batch, cfg.data.seq_len, vocab, platform))
    return Footprint(params, trained, devices, batch, parts)


# What a process holds before any model (Python, JAX, XLA's compiled steps): 0.86 GiB measured at
# the first step of a 3.2M-parameter sim run on the CPU (docs/design.md#memory-before-a-run).
RUNTIME_BYTES = 0.8 * GIB
# procs and ray run the supervisor, the syncer and each learner as processes of their own. Beyond
# its runtime and the state counted for it, each learner held about 9 float32 copies of what trains
# at its peak, the learners at the same moment, and the syncer 3.5 then (its own peak comes at the
# end, as the supervisor's, when the learners are gone): full fine-tunes of 135m-shaped models of
# 4, 12 and 30 layers, M = 2, one device each, on the CPU (docs/design.md#memory-before-a-run).
# They are the Theta_0 a process reads from the store and the frame it came in, the frames it
# encodes or decodes, and XLA's buffers for its own programs.
PROCESS_COPIES = {"learner": 9.0, "syncer": 3.5}
# What a refusal leaves unclaimed: an estimate is no measurement, and the kernel kills at the edge.
MARGIN = 0.9


def outer_slots(name: str) -> int:
    """Float32 copies of a fragment the outer optimizer keeps (Nesterov's momentum; none to average)."""
    return 0 if name == "average" else 1


def host_estimate(cfg: TrainConfig, params: int, vocab: int, trained: int | None = None,
                  platform: str = "cpu") -> Footprint:
    """The resident memory of the process (or, for procs, the machine) that runs cfg, with the
    host's own terms beside the devices' (docs/design.md#memory-before-a-run): on the CPU the
    devices are this memory, every learner's state on each of its devices (a data-parallel mesh
    replicates it; fsdp shards it), and the activations of one learner at a time (sim steps them in
    turn) or of all (threads, procs). The syncer holds Theta, the outer state, a round's sums and
    the broadcast references of the versions learners may still be based on (counted as M + 1 per
    fragment; 2 measured with M = 4, docs/design.md#syncer-memory),
    and the setup a host copy of Theta_0 and of the loaded model. Under procs and ray (started
    together) every learner and the syncer is a process with a runtime of its own, and on the CPU
    each holds PROCESS_COPIES more than its state; LoRA learners read the frozen checkpoint each."""
    per = estimate(cfg, params, vocab, trained, platform)
    diloco = cfg.algo == "diloco"
    learners = cfg.runtime.learners if diloco else 1
    # sim's learners share one mesh: one step at a time, one copy of the frozen weights
    meshes = 1 if diloco and cfg.runtime.shares_mesh else learners
    parts: dict[str, float] = {"runtime": RUNTIME_BYTES}
    if platform == "cpu":
        step = ("gradients", "activations", "logits")  # held while a step runs, freed after it
        state = sum(v for k, v in per.parts.items() if k not in step and k != "frozen weights")
        parts["learner states" if diloco else "trainer state"] = learners * per.devices * state
        if "frozen weights" in per.parts:
            parts["frozen weights"] = meshes * per.devices * per.parts["frozen weights"]
        parts["a step"] = meshes * per.devices * sum(per.parts[k] for k in step)
        if diloco and meshes > 1 and len(set(learner_batches(cfg))) > 1:  # at once, each at its own rows
            parts["a step"] = per.devices * sum(
                sum(estimate(cfg, params, vocab, trained, platform, rows=b).parts[k] for k in step)
                for b in learner_batches(cfg))
    parts["model on host"] = 4.0 * params  # the loaded (or initial) parameters, kept for the export
    if diloco:
        trained_ = per.trained
        versions = min(cfg.syncer.history, learners + 1)
        # Theta, the outer state, a round's sums, the references, Theta_0 (the setup's copy) and,
        # where the outer statistics are measured, the last merged pseudo-gradient (diloco/algo/outer_auto.py)
        last = outer_auto.measured(cfg.syncer.outer_stats, cfg.outer.momentum == AUTO)
        parts["syncer"] = 4.0 * trained_ * (1 + outer_slots(cfg.outer.name) + 1 + versions + 1 + last)
        if cfg.runtime.kind in ("procs", "ray") and cfg.runtime.launch != "external":
            parts.update(_process_parts(learners, per, platform))
    return Footprint(params, per.trained, per.devices, per.batch, parts)


def _process_parts(learners: int, per: Footprint, platform: str) -> dict[str, float]:
    """What M learner processes and a syncer process add to the supervisor's runtime and the
    state counted for them (PROCESS_COPIES; measured on the CPU only, so elsewhere the runtimes)."""
    parts = {"runtimes of the M + 1 children": (learners + 1) * RUNTIME_BYTES}
    if platform == "cpu":
        copies = learners * PROCESS_COPIES["learner"] + PROCESS_COPIES["syncer"]
        parts["per-process copies"] = 4.0 * per.trained * copies + learners * 4.0 * (per.params - per.trained)
    return parts


def mem_available() -> int | None:
    """The kernel's estimate of memory a new process can take without swapping (MemAvailable in
    /proc/meminfo), in bytes; None where there is no /proc."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def fits(f: Footprint, available: int | None) -> bool:
    """Whether an estimate fits in MARGIN of the available memory (unknown memory: assumed to)."""
    return available is None or f.total <= MARGIN * available


class MemoryRefused(ConfigError):
    """A run refused at start because it cannot fit in the memory available now. A study skips it
    and trains the rest (diloco/experiments/runner.py: trained_each): what is free depends on
    what else the machine runs, and the same command later trains only what is missing."""


def preflight(cfg: TrainConfig, params: int, vocab: int, trained: int | None, platform: str,
              available: int | None) -> list[str]:
    """The lines a run prints at start: its host memory estimate against the available memory.
    A run that does not fit is refused here, before it is killed for memory hours in, unless
    run.memory_check=false (docs/design.md#memory-before-a-run)."""
    f = host_estimate(cfg, params, vocab, trained, platform)
    have = "unknown" if available is None else f"{available / GIB:.1f} GiB"
    parts = ", ".join(f"{name} {size / GIB:.2f}" for name, size in f.parts.items())
    lines = [f"memory: about {f.total / GIB:.1f} GiB of {have} available ({parts} GiB)"]
    if cfg.run.memory_check and not fits(f, available):
        r, d = cfg.runtime, cfg.data
        knobs = (f"runtime.learners={r.learners}, runtime.devices_per_learner={r.devices_per_learner}, "
                 if cfg.algo == "diloco" else f"mesh.devices={cfg.mesh.devices}, ")
        raise MemoryRefused(
            f"this run needs about {f.total / GIB:.1f} GiB of memory and {have} is available "
            f"(MemAvailable; runs are refused above {MARGIN:.0%} of it): {parts} GiB. Lower {knobs}"
            f"data.batch_size={d.batch_size} or data.seq_len={d.seq_len}, or train finetune=lora or with "
            f"model.remat=full; run.memory_check=false starts it anyway")
    return lines
