"""Hugging Face checkpoints in and out: logits parity with transformers for every family (stored
fixtures, tests/fixtures/hf/README.md), export round trips, and every bad-input case named."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco.hf import CheckpointError, load, save
from diloco.hf.convert import _flat
from diloco.hf.families import FAMILIES, family_for_export
from diloco.model import build
from test_model import TINY

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
FAMILY_FIXTURES = ["llama2", "llama3", "llama3_sharded", "mistral", "qwen2", "qwen2_bf16", "qwen3", "gpt2"]


def _logits(pre, tokens):
    return np.asarray(jax.jit(pre.model.apply)(pre.model.params, jnp.asarray(tokens)))


@pytest.mark.parametrize("name", FAMILY_FIXTURES)
def test_logits_match_transformers(name):
    pre = load(FIXTURES / name)
    ref = np.load(FIXTURES / name / "reference.npz")
    np.testing.assert_allclose(_logits(pre, ref["tokens"]), ref["logits"], atol=1e-4, rtol=0)
    # The reference is far from uniform, so a wrong or missing weight cannot pass unseen.
    assert ref["logits"].std() > 0.3


def test_each_family_sets_the_features_it_needs():
    cfg = {n: load(FIXTURES / n).config for n in ("llama3", "qwen2", "qwen3", "gpt2", "mistral")}
    assert cfg["llama3"].rope_scaling == "llama3" and not cfg["llama3"].tie_embeddings
    assert cfg["qwen2"].qkv_bias and not cfg["qwen2"].o_bias and cfg["qwen2"].tie_embeddings
    assert cfg["qwen3"].qk_norm and cfg["qwen3"].head_dim * cfg["qwen3"].n_heads != cfg["qwen3"].d_model
    assert (cfg["gpt2"].norm, cfg["gpt2"].mlp, cfg["gpt2"].positions) == ("layer", "gelu", "learned")
    assert cfg["mistral"].family == "mistral"


def test_llama3_rope_scaling_is_exercised():
    """Without the scaling the logits move: the fixture's frequencies straddle its bands."""
    pre = load(FIXTURES / "llama3")
    ref = np.load(FIXTURES / "llama3" / "reference.npz")
    plain = load(FIXTURES / "llama3")._replace()
    from diloco.model import with_params
    cfg = dataclasses.replace(pre.config, rope_scaling="none")
    unscaled = with_params(cfg, pre.vocab_size, plain.model.params)
    got = np.asarray(jax.jit(unscaled.apply)(unscaled.params, jnp.asarray(ref["tokens"])))
    assert np.abs(got - ref["logits"]).max() > 1e-2


def test_bf16_checkpoint_is_upcast_to_float32_master_weights():
    pre = load(FIXTURES / "qwen2_bf16")
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(pre.model.params))


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3", "gpt2", "mistral"])
def test_export_round_trip_gives_identical_tensors_and_config(name, tmp_path):
    pre = load(FIXTURES / name)
    save(tmp_path / "out", pre.config, pre.model.params, pre.tokenizer)
    again = load(tmp_path / "out")
    assert again.config == pre.config and again.vocab_size == pre.vocab_size
    for path, a in _flat(pre.model.params).items():
        np.testing.assert_array_equal(np.asarray(a), np.asarray(_flat(again.model.params)[path]), err_msg=path)
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["architectures"] == [FAMILIES[pre.config.family].architecture]


def test_export_shards_and_dtypes(tmp_path):
    pre = load(FIXTURES / "llama3")
    save(tmp_path / "sharded", pre.config, pre.model.params, max_shard_bytes=20_000)
    files = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) >= 3 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    # every file gets the umask's mode, like the config beside it (safetensors alone writes 0600)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "sharded").iterdir()}
    assert set(modes.values()) == {(tmp_path / "sharded" / "config.json").stat().st_mode & 0o777}, modes
    again = load(tmp_path / "sharded")
    ref = np.load(FIXTURES / "llama3" / "reference.npz")
    np.testing.assert_allclose(_logits(again, ref["tokens"]), ref["logits"], atol=1e-4)
    # Re-exporting into the same folder unsharded leaves no stale shard behind.
    save(tmp_path / "sharded", pre.config, pre.model.params, dtype="bfloat16")
    assert sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors")) == ["model.safetensors"]
    bf16 = load(tmp_path / "sharded")
    np.testing.assert_allclose(_logits(bf16, ref["tokens"]), ref["logits"], atol=0.1)
    with pytest.raises(CheckpointError, match="export dtype 'int8'"):
        save(tmp_path / "x", pre.config, pre.model.params, dtype="int8")


def test_our_own_preset_exports_as_llama_and_loads_back_with_the_same_logits(tmp_path):
    cfg = TINY
    model = build(cfg, 256, seed=0)
    assert family_for_export(cfg).name == "llama"
    save(tmp_path / "ours", cfg, model.params)
    again = load(tmp_path / "ours")
    tokens = jnp.arange(32).reshape(2, 16) % 256
    np.testing.assert_allclose(again.model.apply(again.model.params, tokens), model.apply(model.params, tokens),
                               atol=1e-5)


def test_sharded_placement_on_load():
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    if jax.device_count() < 2:
        pytest.skip("needs several (simulated) devices")
    n = jax.device_count()
    base = load(FIXTURES / "llama3")

    def spec(a):
        return jax.NamedSharding(mesh, jax.P("fsdp") if a.ndim == 2 and a.shape[0] % n == 0 else jax.P())

    shardings = jax.tree.map(spec, base.model.params)
    pre = load(FIXTURES / "llama3", shardings=shardings)
    kernel = pre.model.params["blocks"]["0"]["mlp"]["w_up"]["kernel"]
    assert kernel.sharding == shardings["blocks"]["0"]["mlp"]["w_up"]["kernel"]
    assert kernel.addressable_shards[0].data.shape[0] == kernel.shape[0] // n
    ref = np.load(FIXTURES / "llama3" / "reference.npz")
    np.testing.assert_allclose(_logits(pre, ref["tokens"]), ref["logits"], atol=1e-4)


# ---- bad input: each names the file and the key ----

def _copy(name, tmp_path) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def test_unsupported_architecture(tmp_path):
    d = _copy("llama2", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(CheckpointError, match=r"unsupported architecture model_type='mamba'.*MambaForCausalLM"):
        load(d)


def test_missing_unexpected_and_misshapen_tensors_reported_together(tmp_path):
    from safetensors.numpy import load_file, save_file
    d = _copy("llama2", tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.rotary.weight"] = np.zeros(3, np.float32)
    tensors["model.norm.weight"] = np.zeros(31, np.float32)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load(d)
    msg = str(err.value)
    assert "3 problem(s)" in msg
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in msg
    assert "unexpected tensor model.layers.0.self_attn.rotary.weight" in msg
    assert "model.norm.weight has shape [31], the config implies [32]" in msg
    assert str(d / "model.safetensors") in msg


def test_config_that_does_not_match_the_tensors(tmp_path):
    d = _copy("qwen3", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))
    with pytest.raises(CheckpointError, match=r"mlp.up_proj.weight has shape \[64, 32\], the config implies \[48, 32\]"):
        load(d)


def test_truncated_safetensors_file(tmp_path):
    d = _copy("llama2", tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file"):
        load(d)


def test_sharded_index_pointing_at_a_missing_file(tmp_path):
    d = _copy("llama3_sharded", tmp_path)
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003.safetensors: listed in model.safetensors.index.json but missing"):
        load(d)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or folder"):
        load(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match="no config.json"):
        load(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="weights.bin: not a GGUF file"):
        load(tmp_path / "weights.bin")
    d = _copy("gpt2", tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json: unreadable JSON"):
        load(d)


def test_non_finite_weights_are_refused(tmp_path):
    from safetensors.numpy import load_file, save_file
    d = _copy("gpt2", tmp_path)
    tensors = load_file(d / "model.safetensors")
    tensors["transformer.ln_f.bias"][3] = np.nan
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="transformer.ln_f.bias holds non-finite values"):
        load(d)


def test_unsupported_activation_and_rope_type(tmp_path):
    d = _copy("llama2", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    with pytest.raises(CheckpointError, match="hidden_act='gelu'"):
        load(d)
    (d / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}))
    with pytest.raises(CheckpointError, match="RoPE type 'yarn' is not supported"):
        load(d)


def test_tokenizer_larger_than_the_embedding(tmp_path):
    d = _copy("llama3", tmp_path)
    for f in (FIXTURES / "tokenizer").iterdir():
        if f.name != "reference.json":
            shutil.copy(f, d / f.name)
    with pytest.raises(CheckpointError, match="the tokenizer has 300 ids but the model's embedding only 96 rows"):
        load(d)
