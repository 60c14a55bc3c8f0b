"""Model FLOPs per trained token, a device's peak, and model FLOPs utilisation (MFU).

Reference: Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways" (2022),
arXiv:2204.02311, appendix B: a training token costs 6N + 12 L H Q T FLOPs. The conventions this
module keeps are in docs/design.md#model-flops-and-mfu.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from diloco.config import LoraConfig, ModelConfig, TrainConfig

# Projections of one block, by the names finetune.lora.targets uses (diloco/config/checks.py
# LORA_TARGETS): each a [d_in, d_out] matmul every token passes through.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")

# bf16 dense peak TFLOP/s of one device (one GPU, one TPU chip), matched in order against
# jax.Device.device_kind (case-insensitive substrings, the more specific first). From the vendors'
# data sheets, without sparsity: H100 SXM and H200 989.4 (the same tensor cores; GH200's GPU is
# the H200's), H100 NVL 835.5, H100 PCIe 756, A100 312 (SXM and PCIe alike); TPU v4 275, v5e
# 197, v5p 459, v6e (Trillium) 918. jax names v5e "TPU v5 lite", v6e "TPU v6 lite" and v5p
# "TPU v5". A device not listed has no known peak: its MFU is not reported unless
# run.peak_tflops sets one (docs/design.md#model-flops-and-mfu).
PEAK_TFLOPS = (
    ("h100 pcie", 756.0),
    ("h100 nvl", 835.5),
    ("h100", 989.4),
    ("h200", 989.4),
    ("a100", 312.0),
    ("tpu v4", 275.0),
    ("tpu v5 lite", 197.0),
    ("tpu v5e", 197.0),
    ("tpu v5p", 459.0),
    ("tpu v5", 459.0),
    ("tpu v6 lite", 918.0),
    ("tpu v6e", 918.0),
)


def head_dim(m: ModelConfig) -> int:
    return m.head_dim or m.d_model // m.n_heads


def projection_weights(m: ModelConfig) -> dict[str, int]:
    """Weights of each projection of one block: {q, k, v, o, up, down, and gate for SwiGLU}."""
    D, E, F = m.d_model, head_dim(m), m.d_ff
    out = {"q": D * m.n_heads * E, "k": D * m.n_kv_heads * E, "v": D * m.n_kv_heads * E,
           "o": m.n_heads * E * D, "up": D * F, "down": F * D}
    if m.mlp == "swiglu":
        out["gate"] = D * F
    return out


def matmul_weights(m: ModelConfig, vocab: int) -> int:
    """N of 6N: every weight a token is multiplied by. The blocks' projections and the output head
    (D x V, counted whether or not it is tied to the embedding: the logits are a matmul with the
    table either way); not the embedding lookup (a gather), norms, biases or position tables."""
    return m.n_layers * sum(projection_weights(m).values()) + m.d_model * vocab


def attention_flops(m: ModelConfig, seq_len: int) -> int:
    """Training FLOPs of one token's attention scores and weighted sum: 2 x 2 x H x E x T forward
    per layer (q k^T, then p v, over all T = seq_len key positions: the causal mask's zero half is
    counted, as PaLM does), times 3 for forward and backward."""
    return 12 * m.n_layers * m.n_heads * head_dim(m) * seq_len


def flops_per_token(m: ModelConfig, vocab: int, seq_len: int, lora: LoraConfig | None = None) -> int:
    """Model FLOPs of one trained token of a training step: 6 per weight (2 forward, 2 for the
    gradient of the input, 2 for the gradient of the weight) plus attention. With LoRA
    (lora.rank > 0) a frozen weight costs 4, its weight gradient never computed; an adapted
    projection costs 6, since its merged weight W + s A B gets a gradient that is then projected
    onto B (diloco/model/lora.py). Per-step work (the merge, that projection, the optimizer) is
    not per token and left out."""
    full = 6 * matmul_weights(m, vocab) + attention_flops(m, seq_len)
    if lora is None or lora.rank <= 0:
        return full
    per_block = projection_weights(m)
    adapted = m.n_layers * sum(per_block.get(t, 0) for t in lora.targets)
    return full - 2 * (matmul_weights(m, vocab) - adapted)


def vocab_of(apply, params) -> int:
    """The vocabulary a model's logits span (its embedding's rows, a checkpoint's padding
    included): read off the table, or where the params hold none (LoRA's are the adapters) by
    abstract evaluation of `apply`, which computes nothing."""
    if "embed" in params:
        return int(params["embed"]["embedding"].shape[0])
    return int(jax.eval_shape(apply, params, jax.ShapeDtypeStruct((1, 1), jnp.int32)).shape[-1])


def of_run(cfg: TrainConfig, apply, params) -> int:
    """flops_per_token of a run's model (`apply`, `params`: diloco.model.Model's) at data.seq_len."""
    return flops_per_token(cfg.model, vocab_of(apply, params), cfg.data.seq_len, cfg.finetune.lora)


def peak_tflops(device_kind: str, override: float = 0.0) -> float | None:
    """bf16 dense peak TFLOP/s of one device: `override` (run.peak_tflops) when > 0, else the
    PEAK_TFLOPS entry for `device_kind`, else None (a CPU, an unlisted accelerator)."""
    if override > 0:
        return float(override)
    kind = device_kind.lower()
    return next((peak for name, peak in PEAK_TFLOPS if name in kind), None)


class Hardware(NamedTuple):
    """What throughput is measured against: the devices one trainer (or one learner) steps on."""

    devices: int
    peak_tflops: float | None  # per device; None: unknown, so no MFU
    device_kind: str


def hardware(devices: int, override: float = 0.0, device: jax.Device | None = None) -> Hardware:
    """`devices` of the kind of `device` (default: jax.devices()[0]) with their peak."""
    kind = (device or jax.devices()[0]).device_kind
    return Hardware(devices, peak_tflops(kind, override), kind)


def throughput(tokens_per_s: float, per_token: float, hw: Hardware) -> dict:
    """tokens_per_s_per_device and, where the peak is known, mfu = per_token x tokens_per_s /
    (devices x peak): a fraction (0.4 = 40%)."""
    out = {"tokens_per_s_per_device": tokens_per_s / hw.devices}
    if hw.peak_tflops:
        out["mfu"] = per_token * tokens_per_s / (hw.devices * hw.peak_tflops * 1e12)
    return out


class Rates:
    """The learner-side series of each train record (docs/design.md#metrics-series): its inner
    learning rate, `lr(step)`, and its throughput (docs/design.md#model-flops-and-mfu):
    tokens_per_s, tokens_per_s_per_device and mfu (throughput above) of its learner (0
    without one) since that learner's previous train record. A record that brings its own lr or
    tokens_per_s (the data-parallel trainer's, compilation left out) keeps it. `clock`: seconds
    read as each record arrives, for runs whose record times are virtual (sim); None: the record's
    own time (a wall clock run's). A learner's first record, and one after its count went back (a
    rejoin), only start its interval; so do a resumed run's first ones: its rates are its own."""

    def __init__(self, per_token: float, hardware, clock: Callable[[], float] | None = None,
                 lr: Callable[[int], float] | None = None):
        self.per_token, self.hardware, self.clock, self.lr = per_token, hardware, clock, lr
        self.last: dict[int, tuple[float, float]] = {}  # learner -> (time, tokens) of its last record

    def __call__(self, record: dict) -> dict:
        if record.get("kind") != "train":
            return record
        step = record.get("step")
        if self.lr is not None and "lr" not in record and isinstance(step, int) and step > 0:
            record = {**record, "lr": self.lr(step)}
        if "tokens_per_s" not in record:
            now = self.clock() if self.clock is not None else record.get("time")
            tokens, m = record.get("tokens"), int(record.get("learner", 0))
            if not (isinstance(now, (int, float)) and isinstance(tokens, (int, float))):
                return record
            before = self.last.get(m)
            self.last[m] = (now, tokens)
            if before is None or now <= before[0] or tokens <= before[1]:
                return record
            record = {**record, "tokens_per_s": (tokens - before[1]) / (now - before[0])}
        return {**record, **throughput(record["tokens_per_s"], self.per_token, self.hardware)}


def run_figures(tokens_per_s: float, per_token: float, hw: Hardware) -> dict:
    """A run summary's throughput: its tokens/s over `hw` (the run's devices), per device, and
    MFU, None (and peak_tflops None) where the device's peak is unknown."""
    return {"flops_per_token": per_token, "device_kind": hw.device_kind, "run_devices": hw.devices,
            "peak_tflops": hw.peak_tflops, "mfu": None, **throughput(tokens_per_s, per_token, hw)}
