"""Model FLOPs per token against a hand count and XLA's own count; the peak table; tokens/s per
device and MFU in the records, the summary, the status line and TensorBoard (docs/design.md#model-flops-and-mfu)."""

import json
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
import yaml
from conftest import tiny_cfg

from diloco import report
from diloco.config import LoraConfig, ModelConfig, TrainConfig
from diloco.model import build, lora
from diloco.runtime.summary import replayable
from diloco.train import flops, optim
from diloco.watch import RunWatch

ROOT = Path(__file__).resolve().parents[1]


def tiny_preset() -> ModelConfig:
    return ModelConfig(**yaml.safe_load((ROOT / "configs" / "model" / "tiny.yaml").read_text()))


def test_the_tiny_preset_counted_by_hand():
    """d_model 64, 2 layers, 4 heads of 16, 2 K/V heads, SwiGLU d_ff 192, tied, byte vocabulary,
    128 positions. Per block: q 64x64 = 4,096, k and v 64x32 = 2,048 each, o 4,096, gate, up and
    down 64x192 = 12,288 each: 49,152. Two blocks 98,304 and the head 64 x 256 = 16,384: N =
    114,688 (the preset's 115,008 parameters less the 320 norm weights). 6N = 688,128; attention
    12 x 2 layers x 4 heads x 16 x 128 = 196,608. Total 884,736 FLOPs per token."""
    m = tiny_preset()
    assert flops.matmul_weights(m, 256) == 114_688
    assert flops.attention_flops(m, 128) == 196_608
    assert flops.flops_per_token(m, 256, 128) == 884_736
    # Tied or not, the head is one D x V matmul; the embedding lookup is no matmul.
    assert flops.flops_per_token(replace(m, tie_embeddings=False), 256, 128) == 884_736
    # GELU drops the gate (2 x 12,288 x 6 per token less); head_dim 32 doubles q, k, v, o and the
    # attention term; one K/V head halves k and v.
    assert flops.flops_per_token(replace(m, mlp="gelu"), 256, 128) == 884_736 - 6 * 2 * 12_288
    wide = flops.matmul_weights(replace(m, head_dim=32), 256) - flops.matmul_weights(m, 256)
    assert wide == 2 * (4_096 + 2_048 + 2_048 + 4_096)
    assert flops.attention_flops(replace(m, head_dim=32), 128) == 2 * 196_608
    assert flops.matmul_weights(replace(m, n_kv_heads=1), 256) == 114_688 - 2 * (1_024 + 1_024)
    # LoRA on q and v: the adapted 2 x (4,096 + 2,048) = 12,288 weights cost 6, the other 102,400 cost 4.
    lo = LoraConfig(rank=8, targets=("q", "v"))
    assert flops.flops_per_token(m, 256, 128, lo) == 6 * 12_288 + 4 * 102_400 + 196_608
    assert flops.flops_per_token(m, 256, 128, LoraConfig(rank=0)) == 884_736


def xla_flops_per_token(model, B: int, L: int) -> float:
    """What XLA counts for the gradient of the next-token loss at batch B x L, per token."""
    def loss(params, batch):
        logits = model.apply(params, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    compiled = jax.jit(jax.grad(loss)).lower(model.params, jnp.zeros((B, L + 1), jnp.int32)).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["flops"] / (B * L)


SHAPE = ModelConfig(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=768, max_seq_len=128)


@pytest.mark.parametrize("variant", [{}, {"mlp": "gelu", "head_dim": 48, "tie_embeddings": False, "n_kv_heads": 1}])
def test_within_two_percent_of_xlas_count(variant):
    """The matmuls are all but the norms, softmaxes and loss, which XLA counts too: at d_model 256
    they add under 2%."""
    m = replace(SHAPE, **variant)
    got = xla_flops_per_token(build(m, 512, 0), 4, 128)
    want = flops.flops_per_token(m, 512, 128)
    assert want <= got <= 1.02 * want, (got, want)


def test_lora_is_an_upper_estimate_within_five_percent_of_xlas_count():
    """Under LoRA the lowest block's input gradients feed nothing (the embedding is frozen), so
    XLA leaves them out; the count keeps them (docs/design.md#model-flops-and-mfu)."""
    lo = LoraConfig(rank=8, targets=("q", "v"))
    got = xla_flops_per_token(lora.adapt(lo, build(SHAPE, 512, 0)), 4, 128)
    want = flops.flops_per_token(SHAPE, 512, 128, lo)
    assert 0.95 * want <= got <= want, (got, want)


def test_vocab_is_read_from_the_model():
    m = tiny_preset()
    model = build(m, 300, 0)
    assert flops.vocab_of(model.apply, model.params) == 300
    adapted = lora.adapt(LoraConfig(rank=4), model)  # params are the adapters only
    assert flops.vocab_of(adapted.apply, adapted.params) == 300


@pytest.mark.parametrize("kind, peak", [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H100 NVL", 835.5), ("NVIDIA H200", 989.4),
                                        ("NVIDIA A100-SXM4-80GB", 312.0), ("TPU v4", 275.0),
                                        ("TPU v5 lite", 197.0), ("TPU v5", 459.0), ("TPU v5p", 459.0),
                                        ("TPU v6 lite", 918.0), ("cpu", None), ("NVIDIA GeForce RTX 4090", None)])
def test_peak_of_each_device_kind(kind, peak):
    assert flops.peak_tflops(kind) == peak
    assert flops.peak_tflops(kind, 123.0) == 123.0  # run.peak_tflops wins


def test_throughput_analytic():
    hw = flops.Hardware(devices=4, peak_tflops=100.0, device_kind="x")
    got = flops.throughput(8_000.0, 1e9, hw)
    assert got["tokens_per_s_per_device"] == 2_000.0
    assert got["mfu"] == pytest.approx(1e9 * 8_000 / (4 * 100e12))  # 2%
    assert flops.throughput(8_000.0, 1e9, hw._replace(peak_tflops=None)) == {"tokens_per_s_per_device": 2_000.0}
    figures = flops.run_figures(0.0, 1e9, hw._replace(peak_tflops=None))
    assert figures["mfu"] is None and figures["peak_tflops"] is None and figures["run_devices"] == 4


def test_rates_of_each_learner_between_its_records():
    hw = flops.Hardware(devices=2, peak_tflops=1.0, device_kind="x")
    rates = flops.Rates(1e6, hw)
    records = [{"kind": "train", "learner": 0, "step": 2, "time": 1.0, "tokens": 100},
               {"kind": "train", "learner": 1, "step": 2, "time": 2.0, "tokens": 100},
               {"kind": "eval", "step": 2, "time": 2.0, "tokens": 200},
               {"kind": "train", "learner": 0, "step": 4, "time": 3.0, "tokens": 300},
               {"kind": "train", "learner": 1, "step": 1, "time": 4.0, "tokens": 50},  # rejoined: starts again
               {"kind": "train", "learner": 1, "step": 3, "time": 5.0, "tokens": 150}]
    out = [rates(r) for r in records]
    assert [("tokens_per_s" in r) for r in out] == [False, False, False, True, False, True]
    assert out[3]["tokens_per_s"] == 100.0 and out[5]["tokens_per_s"] == 100.0
    assert out[3]["tokens_per_s_per_device"] == 50.0
    assert out[3]["mfu"] == pytest.approx(1e6 * 100 / (2 * 1e12))
    # The data-parallel trainer's own tokens/s (compilation left out) is kept.
    dp = rates({"kind": "train", "step": 5, "tokens": 10, "tokens_per_s": 40.0})
    assert dp["tokens_per_s"] == 40.0 and dp["tokens_per_s_per_device"] == 20.0
    # A clock read on arrival (sim: the record times are virtual).
    ticks = iter([10.0, 12.0])
    sim = flops.Rates(1e6, hw._replace(peak_tflops=None), clock=lambda: next(ticks))
    sim({"kind": "train", "learner": 0, "step": 1, "time": 1.0, "tokens": 10})
    got = sim({"kind": "train", "learner": 0, "step": 2, "time": 2.0, "tokens": 30})
    assert got["tokens_per_s"] == 10.0 and "mfu" not in got


def test_the_status_line_and_tensorboard_show_each_learners_throughput(tmp_path, monkeypatch, capsys):
    from test_watch import read_scalars

    monkeypatch.delenv("CI", raising=False)
    records = [{"kind": "train", "learner": m, "step": 10, "time": 10.0, "tokens": 1280, "loss": 3.0,
                "tokens_per_s": 100.0 * (m + 1), "tokens_per_s_per_device": 50.0 * (m + 1), "mfu": 0.1 * (m + 1)}
               for m in range(2)]
    watch = RunWatch(steps=20, learners=2, progress=True, tensorboard_dir=tmp_path / "tb", share=0.5)
    for r in records:
        watch(r)
    watch.close()
    err = capsys.readouterr().err
    assert "75 tok/s/device" in err and "MFU 15.0%" in err  # the run's: the mean where each has its own devices
    scalars = read_scalars(tmp_path / "tb")
    assert scalars["train/mfu/learner1"] == [(2560, pytest.approx(0.2))]
    assert scalars["train/tokens_per_s_per_device/learner0"] == [(1280, pytest.approx(50.0))]
    # No peak: tokens/s per device, no MFU.
    watch = RunWatch(steps=20, learners=1, progress=True, clock="virtual")
    watch({"kind": "train", "step": 10, "time": 10.0, "tokens": 1280, "tokens_per_s_per_device": 64.0})
    watch.close()
    err = capsys.readouterr().err
    assert "64 tok/s/device (wall)" in err and "MFU" not in err


def test_the_summary_says_mfu_or_why_there_is_none():
    summary = {"tokens_per_s": 800.0, **flops.run_figures(800.0, 2e6, flops.Hardware(8, 989.4, "NVIDIA H200"))}
    text = report.render_summary(summary, "run r")
    assert "100 tokens/s per device (8 x NVIDIA H200), MFU 2.02e-05% of 989.4 TFLOP/s; 2.00 MFLOP/token" in text
    none = {"tokens_per_s": 800.0, **flops.run_figures(800.0, 2e6, flops.Hardware(8, None, "cpu"))}
    text = report.render_summary(none, "run r")
    assert "100 tokens/s per device (8 x cpu), no MFU: no known peak for 'cpu' (set run.peak_tflops)" in text
    assert "MFU 0" not in text
    assert replayable(summary).keys() == replayable(none).keys()
    assert not {"tokens_per_s", "tokens_per_s_per_device", "mfu"} & set(replayable(summary))


def tiny_run(tmp_path, algo: str, **run) -> TrainConfig:
    """tests/test_conformance.py's one-layer tiny run, 8 steps, learners of 2 devices."""
    return tiny_cfg(tmp_path, algo=algo, model=dict(n_layers=1, d_ff=64), inner=dict(warmup_steps=2),
                    data=dict(seq_len=16, batch_size=8, synthetic_tokens=20_000),
                    run=dict(steps=8, log_every=2, eval_every=8, eval_batches=1, out_dir=str(tmp_path / algo),
                             tensorboard=False, checkpoint_every=0, **run),
                    runtime=dict(devices_per_learner=2, learner_checkpoint_every=0))


def check_consistent(figures: dict, devices: int, per_token: float, peak: float | None) -> None:
    assert figures["tokens_per_s_per_device"] == pytest.approx(figures["tokens_per_s"] / devices, rel=1e-12)
    if peak is None:
        assert figures.get("mfu") is None
    else:
        want = per_token * figures["tokens_per_s"] / (devices * peak * 1e12)
        assert figures["mfu"] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("algo, peak", [("dp", 2.5), ("dp", None), ("diloco", 2.5)])
def test_a_tiny_run_reports_consistent_throughput(tmp_path, algo, peak):
    """Data parallel over every visible device, and the sim runtime (learners take turns on one
    mesh of devices_per_learner): the records, summary.json and the printed summary agree."""
    from diloco.run import run

    cfg = tiny_run(tmp_path, algo, peak_tflops=peak or 0.0)
    summary = run(cfg)
    per_token = flops.flops_per_token(cfg.model, 16, 16)
    devices = len(jax.devices()) if algo == "dp" else cfg.runtime.devices_per_learner
    assert summary["flops_per_token"] == per_token and summary["run_devices"] == devices
    assert summary["peak_tflops"] == peak and summary["tokens_per_s"] > 0
    check_consistent(summary, devices, per_token, peak)
    assert json.loads((Path(cfg.run.out_dir) / "summary.json").read_text())["mfu"] == summary["mfu"]
    train = [r for r in report.read_metrics(Path(cfg.run.out_dir) / "metrics.jsonl") if r["kind"] == "train"]
    # DP: every record; DiLoCo: a learner's records after its first (which only starts its interval).
    rated = [r for r in train if "tokens_per_s" in r]
    assert len(rated) == (4 if algo == "dp" else 2 * 3)
    for r in rated:
        check_consistent(r, cfg.runtime.devices_per_learner if algo == "diloco" else devices, per_token, peak)
        assert ("mfu" in r) == (peak is not None)
    # every train record's lr is the schedule's at its step: DP's from its jitted step, DiLoCo's
    # added by the writer (flops.Rates), the same rule (docs/design.md#metrics-series)
    step_lr = optim.step_lr(cfg.inner, cfg.run.steps)
    assert train and all(r["lr"] == pytest.approx(step_lr(r["step"]), rel=1e-6) for r in train)
