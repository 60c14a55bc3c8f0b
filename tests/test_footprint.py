"""The presets' shapes and the memory estimate per device (diloco/train/footprint.py): the published
parameter counts, each part's analytic size, what remat, the loss chunk and FSDP change, and the
estimate against XLA's own memory analysis of a compiled step."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import yaml

from diloco.config import (DataConfig, FinetuneConfig, InnerConfig, LoraConfig, MeshConfig, ModelConfig,
                           RuntimeConfig, TrainConfig, from_dict)
from diloco.model import abstract_params, count_params, with_params
from diloco.train import footprint
from diloco.train.mesh import make_mesh
from diloco.train.trainer import compile_steps

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def _model(name: str) -> ModelConfig:
    return from_dict(ModelConfig, yaml.safe_load((ROOT / "configs" / "model" / f"{name}.yaml").read_text()))


@pytest.mark.parametrize("name,vocab,params", [
    ("135m", 49152, 134_515_008),  # SmolLM2-135M
    ("360m", 49152, 361_821_120),  # SmolLM2-360M
    ("llama3_1b", 128256, 1_235_814_400),  # Llama-3.2-1B
    ("llama3_8b", 128256, 8_030_261_248),  # Llama-3.1-8B
])
def test_presets_have_the_published_parameter_counts(name, vocab, params):
    assert count_params(abstract_params(_model(name), vocab)) == params


def _cfg(**kw) -> TrainConfig:
    base = dict(model=ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=512, max_seq_len=256,
                                  dtype="bfloat16"),
                data=DataConfig(batch_size=8, seq_len=128), mesh=MeshConfig(devices=1), algo="dp")
    return TrainConfig(**{**base, **kw})


def test_state_parts_are_four_bytes_per_value_sharded_over_fsdp():
    n = 1_000_000
    f = footprint.estimate(_cfg(), n, 1000)
    assert (f.parts["parameters"], f.parts["gradients"], f.parts["optimizer"]) == (4e6, 4e6, 8e6)
    assert "learner copies" not in f.parts
    sgd = footprint.estimate(_cfg(inner=InnerConfig(optimizer="sgd")), n, 1000)
    assert sgd.parts["optimizer"] == 0
    learner = footprint.estimate(_cfg(algo="diloco", mesh=MeshConfig(fsdp=4),
                                      runtime=RuntimeConfig(devices_per_learner=4)), n, 1000, trained=n // 10)
    assert learner.devices == 4 and learner.batch == 2  # 8 sequences over 4 devices
    assert learner.parts["parameters"] == 1e5 and learner.parts["optimizer"] == 2 * 1e5
    assert learner.parts["frozen weights"] == 9e5  # the 90% that never train (a LoRA's checkpoint)
    assert learner.parts["learner copies"] > 0


def test_remat_and_the_loss_chunk_shrink_what_a_step_keeps():
    kept = {r: footprint.activation_bytes(dataclasses.replace(_cfg().model, remat=r), 8, 128, 1000, "cpu")
            for r in ("none", "dots", "full")}
    assert kept["none"]["activations"] > kept["dots"]["activations"] > kept["full"]["activations"]
    whole = footprint.activation_bytes(dataclasses.replace(_cfg().model, loss_chunk=0), 8, 128, 50_000, "cpu")
    chunked = footprint.activation_bytes(dataclasses.replace(_cfg().model, loss_chunk=32), 8, 128, 50_000, "cpu")
    assert whole["logits"] == 3 * 8 * 128 * 50_000 * 4 and chunked["logits"] * 4 == whole["logits"]


def test_a_fused_attention_kernel_keeps_no_scores():
    m = _cfg().model  # bfloat16, head dim 64: cuDNN's kernel fits on a GPU
    gpu, cpu = (footprint.activation_bytes(m, 8, 128, 1000, p)["activations"] for p in ("gpu", "cpu"))
    assert cpu - gpu == m.n_layers * 2 * 8 * m.n_heads * 128 * 128 * 4
    fp32 = dataclasses.replace(m, dtype="float32")  # cuDNN takes half precision only
    assert not footprint.fused_attention(fp32, "gpu") and footprint.fused_attention(m, "gpu")


def test_lora_trains_the_adapters_only():
    cfg = _cfg(finetune=FinetuneConfig(lora=LoraConfig(rank=8, targets=("q", "v"))))
    lines = "\n".join(footprint.describe(cfg))
    m = cfg.model
    adapters = m.n_layers * 8 * (m.n_heads * (m.d_model // m.n_heads) + m.n_kv_heads * (m.d_model // m.n_heads))
    assert f"({adapters / 1e6:,.1f}M trained)" in lines


def test_the_estimate_is_near_xla_own_analysis_of_the_compiled_step():
    """On the CPU (the reference attention's scores kept, no remat): within [0.5, 1.5] of the
    arguments and temporaries XLA assigns. Not a tight bound: XLA's buffer assignment reuses and
    pads; a unit error (bytes for values, a missing layer factor) lands far outside it."""
    cfg = _cfg(model=dataclasses.replace(_cfg().model, dtype="float32", attention="reference"))
    vocab = 4096
    model = with_params(cfg.model, vocab, abstract_params(cfg.model, vocab))
    compiled = compile_steps(model, cfg, make_mesh(cfg.mesh, cfg.data.batch_size))
    batch = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len + 1), jnp.int32)
    mem = compiled.train_step.lower(compiled.abstract_state, batch).compile().memory_analysis()
    xla = mem.argument_size_in_bytes + mem.temp_size_in_bytes
    est = footprint.estimate(cfg, count_params(model.params), vocab, platform="cpu").total
    assert 0.5 < est / xla < 1.5, (est / GIB, xla / GIB)


def test_describe_sizes_a_preset_and_refuses_a_bad_override():
    run = lambda *a: subprocess.run([sys.executable, "scripts/train.py", "--describe", *a], cwd=ROOT,
                                    capture_output=True, text=True, timeout=600)
    done = run("preset=llama3_8b")
    assert done.returncode == 0, done.stderr
    out = done.stdout[done.stdout.index("Memory estimate"):]
    assert "8,030.3M parameters" in out and "one learner on 8 device(s), 1 sequence(s) per device" in out
    total = float(out.split("total")[1].split()[0])
    assert 10 < total < 40  # GiB: the 8B learner's state over 8 devices, fully rematerialised
    bad = run("preset=llama3_8b", "model.remat=sometimes")
    assert bad.returncode == 2 and "error:" in bad.stderr and "Traceback" not in bad.stderr

