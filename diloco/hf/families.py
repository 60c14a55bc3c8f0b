"""One declarative table per model family: Hugging Face checkpoint keys <-> our parameter paths.

Each row names an HF key, the params path(s) it fills and a small invertible transform, so import
and export read the same table in opposite directions (docs/models.md). Config translation
(config.json <-> ModelConfig) lives beside the table of the same family.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from diloco.config import ModelConfig
from diloco.hf.source import CheckpointError

Shape = tuple[int, ...]


class Transform(NamedTuple):
    """HF tensor -> our arrays, its inverse, and the HF shape our shapes imply (for checking)."""

    to_ours: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    to_hf: Callable[[tuple[np.ndarray, ...]], np.ndarray]
    hf_shape: Callable[[tuple[Shape, ...]], Shape]


COPY = Transform(lambda a: (a,), lambda xs: xs[0], lambda shapes: shapes[0])
# PyTorch's nn.Linear stores [out, in]; nnx.Linear's kernel is [in, out].
TRANSPOSE = Transform(lambda a: (np.ascontiguousarray(a.T),), lambda xs: np.ascontiguousarray(xs[0].T),
                      lambda shapes: shapes[0][::-1])
# GPT-2's fused c_attn (Conv1D, already [in, out]) holds q, k, v side by side on the last axis.
SPLIT_QKV = Transform(lambda a: tuple(np.ascontiguousarray(p) for p in np.split(a, 3, axis=-1)),
                      lambda xs: np.concatenate(xs, axis=-1),
                      lambda shapes: (*shapes[0][:-1], 3 * shapes[0][-1]))


class Rule(NamedTuple):
    hf: str  # may contain {i}, the layer index
    ours: tuple[str, ...]  # dotted params paths, same {i}
    transform: Transform = COPY
    when: Callable[[ModelConfig], bool] = lambda cfg: True


class Family(NamedTuple):
    name: str
    architecture: str  # config.json "architectures"[0] written on export
    rules: tuple[Rule, ...]
    from_hf: Callable[[dict], tuple[ModelConfig, int]]  # config.json -> (ModelConfig, vocab size)
    to_hf: Callable[[ModelConfig, int], dict]  # inverse, without token ids
    ignored: tuple[str, ...] = ()  # key suffixes that are buffers, not weights (old GPT-2 files)


def _untied(cfg: ModelConfig) -> bool:
    return not cfg.tie_embeddings


_L = "model.layers.{i}."
_B = "blocks.{i}."
_LLAMA_RULES = (
    Rule("model.embed_tokens.weight", ("embed.embedding",)),
    Rule(_L + "input_layernorm.weight", (_B + "attn_norm.scale",)),
    *(Rule(_L + f"self_attn.{p}_proj.weight", (_B + f"attn.w{p}.kernel",), TRANSPOSE) for p in "qkvo"),
    *(Rule(_L + f"self_attn.{p}_proj.bias", (_B + f"attn.w{p}.bias",), when=lambda c: c.qkv_bias)
      for p in "qkv"),
    Rule(_L + "self_attn.o_proj.bias", (_B + "attn.wo.bias",), when=lambda c: c.o_bias),
    Rule(_L + "self_attn.q_norm.weight", (_B + "attn.q_norm.scale",), when=lambda c: c.qk_norm),
    Rule(_L + "self_attn.k_norm.weight", (_B + "attn.k_norm.scale",), when=lambda c: c.qk_norm),
    Rule(_L + "post_attention_layernorm.weight", (_B + "mlp_norm.scale",)),
    *(Rule(_L + f"mlp.{hf}_proj.weight", (_B + f"mlp.w_{ours}.kernel",), TRANSPOSE)
      for hf, ours in (("gate", "gate"), ("up", "up"), ("down", "down"))),
    *(Rule(_L + f"mlp.{hf}_proj.bias", (_B + f"mlp.w_{ours}.bias",), when=lambda c: c.mlp_bias)
      for hf, ours in (("gate", "gate"), ("up", "up"), ("down", "down"))),
    Rule("model.norm.weight", ("final_norm.scale",)),
    Rule("lm_head.weight", ("lm_head.kernel",), TRANSPOSE, when=_untied),
)

_H = "transformer.h.{i}."
_GPT2_RULES = (
    Rule("transformer.wte.weight", ("embed.embedding",)),
    Rule("transformer.wpe.weight", ("pos_embed.embedding",)),
    Rule(_H + "ln_1.weight", (_B + "attn_norm.scale",)),
    Rule(_H + "ln_1.bias", (_B + "attn_norm.bias",)),
    Rule(_H + "attn.c_attn.weight", tuple(_B + f"attn.w{p}.kernel" for p in "qkv"), SPLIT_QKV),
    Rule(_H + "attn.c_attn.bias", tuple(_B + f"attn.w{p}.bias" for p in "qkv"), SPLIT_QKV),
    Rule(_H + "attn.c_proj.weight", (_B + "attn.wo.kernel",)),
    Rule(_H + "attn.c_proj.bias", (_B + "attn.wo.bias",)),
    Rule(_H + "ln_2.weight", (_B + "mlp_norm.scale",)),
    Rule(_H + "ln_2.bias", (_B + "mlp_norm.bias",)),
    Rule(_H + "mlp.c_fc.weight", (_B + "mlp.w_up.kernel",)),
    Rule(_H + "mlp.c_fc.bias", (_B + "mlp.w_up.bias",)),
    Rule(_H + "mlp.c_proj.weight", (_B + "mlp.w_down.kernel",)),
    Rule(_H + "mlp.c_proj.bias", (_B + "mlp.w_down.bias",)),
    Rule("transformer.ln_f.weight", ("final_norm.scale",)),
    Rule("transformer.ln_f.bias", ("final_norm.bias",)),
    Rule("lm_head.weight", ("lm_head.kernel",), TRANSPOSE, when=_untied),
)


def _get(hf: dict, key: str, default=None, *, required: bool = True):
    if key in hf and hf[key] is not None:
        return hf[key]
    if required and default is None:
        raise CheckpointError(f"config.json has no {key!r}")
    return default


def _rope(hf: dict) -> dict:
    """RoPE settings from either layout: transformers v5's `rope_parameters`, or v4's top-level
    `rope_theta` with an optional `rope_scaling` dict."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
    out = {"rope_theta": float(theta)}
    if kind == "llama3":
        out.update(rope_scaling="llama3", rope_factor=float(merged["factor"]),
                   rope_low_freq_factor=float(merged["low_freq_factor"]),
                   rope_high_freq_factor=float(merged["high_freq_factor"]),
                   rope_original_max_len=int(merged["original_max_position_embeddings"]))
    elif kind != "default":
        raise CheckpointError(f"config.json: RoPE type {kind!r} is not supported (default, llama3 are)")
    return out


def _llama_from_hf(hf: dict, family: str) -> tuple[ModelConfig, int]:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"config.json: hidden_act={act!r}; the {family} family needs silu")
    d, heads = int(_get(hf, "hidden_size")), int(_get(hf, "num_attention_heads"))
    head_dim = int(hf.get("head_dim") or d // heads)
    max_len = int(_get(hf, "max_position_embeddings"))
    window = hf.get("sliding_window") if hf.get("use_sliding_window", family == "mistral") else None
    if window:
        # Full causal attention equals sliding-window attention while sequences fit the window.
        max_len = min(max_len, int(window))
    bias = bool(hf.get("attention_bias", False))
    cfg = ModelConfig(
        name=hf.get("_name_or_path") or family, family=family, d_model=d,
        n_layers=int(_get(hf, "num_hidden_layers")), n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads), d_ff=int(_get(hf, "intermediate_size")),
        max_seq_len=max_len, tie_embeddings=bool(hf.get("tie_word_embeddings", family in ("qwen2", "qwen3"))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        head_dim=0 if head_dim * heads == d else head_dim,
        qkv_bias=family == "qwen2" or bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=family == "qwen3", **_rope(hf))
    return cfg, int(_get(hf, "vocab_size"))


def _llama_to_hf(cfg: ModelConfig, vocab: int, family: str) -> dict:
    hd = cfg.head_dim or cfg.d_model // cfg.n_heads
    rope: dict = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
                "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_len}
    out = {"model_type": family, "vocab_size": vocab, "hidden_size": cfg.d_model,
           "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
           "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": hd,
           "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
           "hidden_act": "silu", "tie_word_embeddings": cfg.tie_embeddings,
           # Both layouts: v5 reads rope_parameters, v4 rope_theta and rope_scaling.
           "rope_parameters": rope, "rope_theta": cfg.rope_theta,
           "rope_scaling": rope if cfg.rope_scaling != "none" else None}
    if family in ("llama", "mistral"):
        if cfg.qkv_bias != cfg.o_bias:
            raise CheckpointError(f"{family} has one attention_bias for q, k, v and o; this model has "
                                  f"qkv_bias={cfg.qkv_bias}, o_bias={cfg.o_bias}")
        out.update(attention_bias=cfg.o_bias, mlp_bias=cfg.mlp_bias)
    if family == "mistral":
        out["sliding_window"] = None
    if family in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None)
    if family == "qwen3":
        out["attention_bias"] = cfg.qkv_bias
    return out


def _gpt2_from_hf(hf: dict) -> tuple[ModelConfig, int]:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise CheckpointError(f"config.json: activation_function={act!r}; only the tanh GELU "
                              "(gelu_new) is supported for gpt2")
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("scale_attn_weights") is False:
        raise CheckpointError("config.json: gpt2 attention scaling other than 1/sqrt(head_dim) is not supported")
    d = int(_get(hf, "n_embd"))
    cfg = ModelConfig(
        name=hf.get("_name_or_path") or "gpt2", family="gpt2", d_model=d, n_layers=int(_get(hf, "n_layer")),
        n_heads=int(_get(hf, "n_head")), n_kv_heads=int(_get(hf, "n_head")),
        d_ff=int(hf.get("n_inner") or 4 * d), max_seq_len=int(_get(hf, "n_positions")),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), norm="layer", mlp="gelu", positions="learned",
        qkv_bias=True, o_bias=True, mlp_bias=True)
    return cfg, int(_get(hf, "vocab_size"))


def _gpt2_to_hf(cfg: ModelConfig, vocab: int) -> dict:
    return {"model_type": "gpt2", "vocab_size": vocab, "n_embd": cfg.d_model, "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads, "n_inner": cfg.d_ff, "n_positions": cfg.max_seq_len,
            "n_ctx": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
            "tie_word_embeddings": cfg.tie_embeddings, "scale_attn_weights": True}


def _llama_like(name: str, arch: str) -> Family:
    return Family(name, arch, _LLAMA_RULES, lambda hf: _llama_from_hf(hf, name),
                  lambda cfg, vocab: _llama_to_hf(cfg, vocab, name))


FAMILIES = {
    "llama": _llama_like("llama", "LlamaForCausalLM"),
    "mistral": _llama_like("mistral", "MistralForCausalLM"),
    "qwen2": _llama_like("qwen2", "Qwen2ForCausalLM"),
    "qwen3": _llama_like("qwen3", "Qwen3ForCausalLM"),
    "gpt2": Family("gpt2", "GPT2LMHeadModel", _GPT2_RULES, _gpt2_from_hf, _gpt2_to_hf,
                   ignored=(".attn.bias", ".attn.masked_bias")),
}


def family_of_config(hf: dict, where: str) -> Family:
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        archs = ", ".join(hf.get("architectures") or []) or "none given"
        raise CheckpointError(f"{where}: unsupported architecture model_type={model_type!r} "
                              f"(architectures: {archs}); supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def family_for_export(cfg: ModelConfig) -> Family:
    """The family a config is written as: its own, or for our presets the one its features imply."""
    if cfg.family:
        return FAMILIES[cfg.family]
    if cfg.positions == "learned" or cfg.norm == "layer" or cfg.mlp == "gelu":
        if (cfg.positions, cfg.norm, cfg.mlp) != ("learned", "layer", "gelu"):
            raise CheckpointError("no Hugging Face family has this mix of positions/norm/mlp: "
                                  f"{cfg.positions}/{cfg.norm}/{cfg.mlp}")
        return FAMILIES["gpt2"]
    if cfg.qk_norm:
        return FAMILIES["qwen3"]
    if cfg.qkv_bias and not cfg.o_bias:
        return FAMILIES["qwen2"]
    return FAMILIES["llama"]


def expand(family: Family, cfg: ModelConfig) -> list[tuple[str, tuple[str, ...], Transform]]:
    """The table's rows for this config: one per HF tensor, layer templates filled in."""
    rows = []
    for rule in family.rules:
        if not rule.when(cfg):
            continue
        layers = range(cfg.n_layers) if "{i}" in rule.hf else [None]
        for i in layers:
            fill = (lambda s: s.format(i=i)) if i is not None else (lambda s: s)
            rows.append((fill(rule.hf), tuple(fill(p) for p in rule.ours), rule.transform))
    return rows


def strip_prefix(keys: list[str], family: Family) -> dict[str, str]:
    """Canonical key -> key in the file. GPT-2 files from the original release lack 'transformer.'."""
    if family.name != "gpt2" or any(k.startswith("transformer.") for k in keys):
        return {k: k for k in keys}
    return {(k if k.startswith("lm_head.") else "transformer." + k): k for k in keys}
