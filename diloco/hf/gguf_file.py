"""A llama.cpp GGUF file read as if it were a Hugging Face checkpoint: config.json, HF tensor names
and (PyTorch) layout, and a `tokenizers.Tokenizer` rebuilt from the metadata.

Reference: the GGUF specification (gguf.md in the ggml repository); llama.cpp's convert_hf_to_gguf.py (whose changes to
the tensors are undone here) and src/llama-vocab.cpp (whose tokenizer settings are rebuilt here).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable, NamedTuple

import gguf
import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from diloco.hf.source import CheckpointError, TensorSource

# general.architecture -> (HF model_type, HF architectures[0]). Mistral and SmolLM2 are "llama".
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
                 "qwen3": ("qwen3", "Qwen3ForCausalLM"), "gpt2": ("gpt2", "GPT2LMHeadModel")}

# GGUF tensor base name -> HF module path; "{i}" is the layer index (blk.{i}. in GGUF).
_DECODER_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    **{f"blk.{{i}}.{g}": f"model.layers.{{i}}.{h}" for g, h in (
        ("attn_norm", "input_layernorm"), ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
        ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
        ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
        ("ffn_norm", "post_attention_layernorm"), ("ffn_gate", "mlp.gate_proj"),
        ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"))}}
_GPT2_NAMES = {
    "token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f",
    "output": "lm_head",
    **{f"blk.{{i}}.{g}": f"transformer.h.{{i}}.{h}" for g, h in (
        ("attn_norm", "ln_1"), ("attn_qkv", "attn.c_attn"), ("attn_output", "attn.c_proj"),
        ("ffn_norm", "ln_2"), ("ffn_up", "mlp.c_fc"), ("ffn_down", "mlp.c_proj"))}}
# HF GPT-2 uses Conv1D ([in, out]); llama.cpp's converter stores these transposed, as Linear does.
_GPT2_CONV1D = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp, llm_tokenizer_bpe), applied in order, each
# keeping matches and the text between them as separate pieces, before the GPT-2 byte mapping.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
              r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
             r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "falcon3")  # llama.cpp: ignore_merges, add_bos
PRE_TOKENIZERS = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", "[0-9][0-9][0-9]"),
    **{name: (_GPT2_RE,) for name in ("gpt-2", "phi-2", "mpt", "olmo")},
    **{name: (r"\p{N}", _GPT2_RE) for name in ("smollm", "starcoder", "refact", "command-r", "codeshell")},
    **{name: (_QWEN2_RE,) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")},
    **{name: (_LLAMA3_RE,) for name in (*_LLAMA3_PRES, "dbrx", "smaug-bpe")},
}
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4  # gguf.TokenType


class GGUFCheckpoint(NamedTuple):
    config: dict  # what the model's config.json would hold
    tensors: TensorSource  # HF keys, HF layout, dequantized to float32 on read(key)
    tokenizer: tokenizers.Tokenizer
    tokenizer_config: dict  # bos/eos/pad/unk_token, chat_template, add_bos_token, add_eos_token
    generation_config: dict  # bos_token_id, eos_token_id (int or list), pad_token_id


class _Entry(NamedTuple):
    tensor: gguf.ReaderTensor
    shape: tuple[int, ...]  # HF layout
    fix: Callable[[np.ndarray], np.ndarray]  # file layout (numpy order of ggml dims) -> HF layout


class GGUFTensors:
    """TensorSource over one GGUF file; the file stays memory-mapped, one tensor is decoded per read."""

    def __init__(self, path: Path, entries: dict[str, _Entry]):
        self._path, self._entries = path, entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def _entry(self, key: str) -> _Entry:
        if key not in self._entries:
            raise CheckpointError(f"{self._path}: no tensor {key!r} ({len(self._entries)} tensors in the file)")
        return self._entries[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entry(key).shape

    def dtype(self, key: str) -> str:
        return self._entry(key).tensor.tensor_type.name

    def where(self, key: str) -> str:
        return str(self._path)

    def read(self, key: str) -> np.ndarray:
        entry = self._entry(key)
        t = entry.tensor  # its type was checked when the file was opened
        flat = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        # F32 comes back as a view of the mapped file: copy, so callers own their array.
        out = entry.fix(np.array(flat, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape))))
        return np.ascontiguousarray(out, dtype=np.float32)


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    path = Path(path)
    reader = _open(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}

    def need(key: str):
        if key not in meta:
            raise CheckpointError(f"{path}: required metadata key {key!r} is missing")
        return meta[key]

    arch = need("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: unsupported general.architecture {arch!r}; "
                              f"supported: {', '.join(ARCHITECTURES)}")
    by_name = {t.name: t for t in reader.tensors}
    tokenizer, tok_cfg, ids = _tokenizer(path, meta, need)
    config = _config(path, arch, meta, need, by_name, ids)
    entries = _entries(path, arch, config, by_name)
    if config["tie_word_embeddings"]:
        entries.pop("lm_head.weight", None)  # a byte-for-byte copy of the embedding
    eos = [i for i in dict.fromkeys((ids["eos"], ids["eot"], ids["eom"])) if i is not None]
    generation = {"bos_token_id": ids["bos"], "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
                  "pad_token_id": ids["padding"]}
    return GGUFCheckpoint(config, GGUFTensors(path, entries), tokenizer, tok_cfg, generation)


def _open(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF'; {size} bytes)")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError) as e:
        # gguf's reader reports a cut-off file as a failed reshape or an index error.
        raise CheckpointError(f"{path}: cannot parse this GGUF file ({size} bytes; truncated or corrupt?): "
                              f"{type(e).__name__}: {e}") from e
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise CheckpointError(f"{path}: truncated: tensor {t.name!r} needs bytes up to "
                                  f"{t.data_offset + t.n_bytes}, the file has {size}")
    return reader


def _uniform(path: Path, key: str, value) -> int:
    """Per-layer arrays (some GGUFs store head counts per layer) must agree: HF has one number."""
    values = set(value) if isinstance(value, list) else {value}
    if len(values) != 1:
        raise CheckpointError(f"{path}: {key} differs across layers ({sorted(values)}); not supported")
    return int(values.pop())


def _f32(x: float) -> float:
    # GGUF keeps float32; its shortest decimal is the number the HF config held (1e-05, not 9.99e-06).
    return float(str(np.float32(x)))


def _config(path, arch, meta, need, by_name, ids) -> dict:
    model_type, hf_arch = ARCHITECTURES[arch]
    if "token_embd.weight" not in by_name:
        raise CheckpointError(f"{path}: no token_embd.weight tensor")
    out, emb = by_name.get("output.weight"), by_name["token_embd.weight"]
    # Tied when there is no output.weight, or it is a byte-for-byte copy (llama.cpp's GPT-2 converter
    # writes one). Comparing the first row first keeps untied files from being read through.
    tied = out is None or (out.tensor_type == emb.tensor_type and out.data.shape == emb.data.shape
                           and np.array_equal(out.data[:1], emb.data[:1]) and np.array_equal(out.data, emb.data))
    if int(emb.shape[1]) < len(meta["tokenizer.ggml.tokens"]):
        raise CheckpointError(f"{path}: token_embd.weight has {int(emb.shape[1])} rows for "
                              f"{len(meta['tokenizer.ggml.tokens'])} tokens")
    common = {"vocab_size": int(emb.shape[1]), "tie_word_embeddings": tied, "bos_token_id": ids["bos"],
              "eos_token_id": ids["eos"], "torch_dtype": "float32", "model_type": model_type,
              "architectures": [hf_arch]}
    if "general.name" in meta:
        common["_name_or_path"] = meta["general.name"]
    hidden = int(need(f"{arch}.embedding_length"))
    heads = _uniform(path, f"{arch}.attention.head_count", need(f"{arch}.attention.head_count"))
    if arch == "gpt2":
        return {"n_embd": hidden, "n_layer": int(need("gpt2.block_count")), "n_head": heads,
                "n_positions": int(need("gpt2.context_length")), "n_ctx": int(need("gpt2.context_length")),
                "n_inner": int(need("gpt2.feed_forward_length")), "activation_function": "gelu_new",
                "layer_norm_epsilon": _f32(need("gpt2.attention.layer_norm_epsilon")), **common}
    kv = _uniform(path, f"{arch}.attention.head_count_kv", meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise CheckpointError(f"{path}: partial rotary embedding (rope.dimension_count={rope_dim} < "
                              f"head_dim={head_dim}) has no HF {model_type} equivalent")
    theta = _f32(meta.get(f"{arch}.rope.freq_base", 10000.0))
    config = {"hidden_size": hidden, "intermediate_size": _uniform(
                  path, f"{arch}.feed_forward_length", need(f"{arch}.feed_forward_length")),
              "num_hidden_layers": int(need(f"{arch}.block_count")), "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": head_dim,
              "max_position_embeddings": int(need(f"{arch}.context_length")),
              "rms_norm_eps": _f32(need(f"{arch}.attention.layer_norm_rms_epsilon")), "rope_theta": theta,
              "rope_scaling": _rope_scaling(path, arch, meta, by_name.get("rope_freqs.weight"), theta, head_dim),
              "hidden_act": "silu", **common}
    if arch in ("llama", "qwen3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in by_name
    return config


def _rope_scaling(path, arch, meta, rope_freqs, theta: float, head_dim: int) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if rope_freqs is not None:
        # Llama 3 scaling: the converter writes only per-frequency factors (generate_extra_tensors),
        # not its parameters. Accept the parameters every Llama 3.x uses only if they reproduce them.
        got = gguf.quants.dequantize(np.asarray(rope_freqs.data), rope_freqs.tensor_type).reshape(-1)
        factor = _f32(factor if factor is not None else got.max())
        orig = int(meta.get(f"{arch}.rope.scaling.original_context_length", 8192))
        want = llama3_rope_factors(theta, head_dim, factor, 1.0, 4.0, orig)
        if kind not in ("none", "llama3") or got.shape != want.shape or not np.allclose(got, want, rtol=1e-4):
            diff = float(np.abs(got - want).max()) if got.shape == want.shape else f"shape {got.shape}"
            raise CheckpointError(
                f"{path}: llama3 RoPE scaling from GGUF is not supported unless rope_freqs.weight matches "
                f"factor={factor}, low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings="
                f"{orig} (max difference {diff}; rope.scaling.type={kind!r})")
        return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": orig}
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": _f32(factor), "original_max_position_embeddings":
                int(meta[f"{arch}.rope.scaling.original_context_length"])}
    raise CheckpointError(f"{path}: RoPE scaling type {kind!r} is not supported (linear, yarn, llama3 are)")


def llama3_rope_factors(theta: float, dim: int, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """Per-frequency divisors of HF's llama3 rope_type, as llama.cpp stores them in rope_freqs.weight."""
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid)).astype(np.float32)


def _unpermute(n_head: int) -> Callable[[np.ndarray], np.ndarray]:
    # Inverse of LlamaModel.permute in convert_hf_to_gguf.py, which interleaves each head's rotary
    # halves for llama.cpp's GPT-J-style RoPE: [head, 2, d/2] -> [head, d/2, 2]. We swap back.
    def fix(w: np.ndarray) -> np.ndarray:
        return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return fix


def _entries(path: Path, arch: str, config: dict, by_name: dict) -> dict[str, _Entry]:
    names = _GPT2_NAMES if arch == "gpt2" else _DECODER_NAMES
    entries, unknown = {}, []
    for name, t in by_name.items():
        m = re.fullmatch(r"(blk\.(\d+)\.)?(\w+)\.(weight|bias)", name)
        base = m and (f"blk.{{i}}.{m[3]}" if m[1] else m[3])
        if name == "rope_freqs.weight" and arch == "llama":
            continue  # folded into config["rope_scaling"]
        if not m or base not in names:
            unknown.append(name)
            continue
        hf = names[base].replace("{i}", m[2] or "") + "." + m[4]
        shape = tuple(int(d) for d in reversed(t.shape))
        fix: Callable[[np.ndarray], np.ndarray] = lambda w: w
        if arch == "llama" and m[3] in ("attn_q", "attn_k"):
            n_head = config["num_attention_heads" if m[3] == "attn_q" else "num_key_value_heads"]
            if shape[0] % (2 * n_head):
                raise CheckpointError(f"{path}: {name} has {shape[0]} rows, not a multiple of 2 x {n_head} heads")
            fix = _unpermute(n_head)
        elif arch == "gpt2" and m[3] in _GPT2_CONV1D and len(shape) == 2:
            fix, shape = (lambda w: w.T), shape[::-1]
        entries[hf] = _Entry(t, shape, fix)
    if unknown:
        raise CheckpointError(f"{path}: {len(unknown)} tensors have no Hugging Face {arch} name: "
                              f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}")
    for t in by_name.values():
        if not _dequantizable(t.tensor_type):
            raise CheckpointError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which this gguf "
                                  "package cannot dequantize to float32 (F32, F16, BF16, Q4_0..Q8_0, "
                                  "Q2_K..Q6_K and the IQ types it can)")
    return entries


def _dequantizable(qtype: gguf.GGMLQuantizationType) -> bool:
    # Ask gguf itself (one zero block), so whatever its version decodes is accepted.
    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _tokenizer(path: Path, meta: dict, need) -> tuple[tokenizers.Tokenizer, dict, dict]:
    kind = need("tokenizer.ggml.model")
    tokens: list[str] = need("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if len(set(tokens)) != len(tokens) or len(types) != len(tokens):
        raise CheckpointError(f"{path}: {len(tokens)} tokens, {len(set(tokens))} distinct, {len(types)} "
                              "token types: the vocabulary must be distinct tokens with one type each")
    if kind == "gpt2":
        if pre not in PRE_TOKENIZERS:
            raise CheckpointError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported; "
                                  f"supported: {', '.join(PRE_TOKENIZERS)}")
        merges = [tuple(m.split(" ", 1)) for m in need("tokenizer.ggml.merges")]
        tok = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                                              ignore_merges=pre in _LLAMA3_PRES))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), "isolated") for r in PRE_TOKENIZERS[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        defaults = {"bos": None, "eos": None, "unknown": None, "add_bos": pre in _LLAMA3_PRES}
    elif kind == "llama":
        tok = _sentencepiece(tokens, need("tokenizer.ggml.scores"), types,
                             meta.get("tokenizer.ggml.unknown_token_id", 0),
                             meta.get("tokenizer.ggml.add_space_prefix", True))
        defaults = {"bos": 1, "eos": 2, "unknown": 0, "add_bos": True}  # llama.cpp's SPM defaults
    else:
        raise CheckpointError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (gpt2, llama are)")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in (_CONTROL, _UNKNOWN)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    ids = {}
    for name in ("bos", "eos", "eot", "eom", "unknown", "padding"):
        i = meta.get(f"tokenizer.ggml.{name}_token_id", defaults.get(name))
        if i is not None and not 0 <= i < len(tokens):
            raise CheckpointError(f"{path}: tokenizer.ggml.{name}_token_id = {i} is outside the "
                                  f"vocabulary of {len(tokens)} tokens")
        ids[name] = i
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", defaults["add_bos"]))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    text = {k: tokens[i] if i is not None else None for k, i in ids.items()}
    for flag, key in ((add_bos, "bos"), (add_eos, "eos")):
        if flag and ids[key] is None:
            raise CheckpointError(f"{path}: tokenizer.ggml.add_{key}_token is set but there is no {key} token")
    if add_bos or add_eos:
        # What llama.cpp does on tokenize(add_special=True); HF puts it in the post-processor too.
        ends = [(text[k], ids[k]) for k, on in (("bos", add_bos), ("eos", add_eos)) if on]
        bos, eos = [text["bos"]] * add_bos, [text["eos"]] * add_eos
        tok.post_processor = processors.TemplateProcessing(
            single=[*bos, "$A", *eos], pair=[*bos, "$A", *eos, *bos, "$B:1", *eos],
            special_tokens=list(dict(ends).items()))
    tok_cfg = {"bos_token": text["bos"], "eos_token": text["eos"], "pad_token": text["padding"],
               "unk_token": text["unknown"], "chat_template": meta.get("tokenizer.chat_template"),
               "add_bos_token": add_bos, "add_eos_token": add_eos}
    return tok, tok_cfg, ids


def _sentencepiece(tokens, scores, types, unk_id: int, add_prefix: bool) -> tokenizers.Tokenizer:
    """Llama 2 / Mistral SentencePiece BPE the way HF's converter (SentencePieceExtractor) builds it:
    every split of a piece into two pieces is a merge, ranked by the merged piece's score."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for i in sorted(range(len(tokens)), key=lambda i: -scores[i]):  # stable: ties keep id order
        piece = tokens[i]
        merges += sorted(((piece[:k], piece[k:]) for k in range(1, len(piece))
                          if piece[:k] in vocab and piece[k:] in vocab), key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token=tokens[unk_id], fuse_unk=True,
                                          byte_fallback=True))
    spaces = [normalizers.Replace(" ", "▁")]
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if add_prefix else []) + spaces)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
    return tok
