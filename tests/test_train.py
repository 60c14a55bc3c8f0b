"""Inner training: schedule, golden loss, mesh invariance, learning to the entropy floor, resume."""

import json
import os
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import tiny_cfg, tiny_model

from diloco.config import InnerConfig, MeshConfig, TrainConfig
from diloco.data import batch_at, load_corpus
from diloco.model import build
from diloco.train.mesh import make_mesh
from diloco.train.optim import lr_schedule, make_optimizer
from diloco.train.trainer import compile_steps, train_dp

GOLDEN = Path(__file__).parent / "golden" / "tiny_loss.json"


def make_cfg(tmp_path, steps=20, mesh=MeshConfig(), **run) -> TrainConfig:
    """The tests' tiny run (tests/conftest.py), data-parallel, checkpointed every 10 steps."""
    return tiny_cfg(tmp_path, algo="dp", mesh=mesh, run={"checkpoint_every": 10, **run, "steps": steps})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return load_corpus(make_cfg(tmp_path_factory.mktemp("c")).data)


def losses(cfg, corpus, devices, steps):
    mesh = make_mesh(cfg.mesh, cfg.data.batch_size, devices)
    model = build(cfg.model, corpus.vocab_size, seed=cfg.run.seed)
    compiled = compile_steps(model, cfg, mesh)
    state, out = compiled.init(model.params), []
    for step in range(steps):
        batch = batch_at(corpus.train, seed=0, learner=0, num_learners=1, step=step,
                         batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len)
        state, metrics = compiled.train_step(state, jax.device_put(batch, compiled.batch_sharding))
        out.append(float(metrics["loss"]))
    return np.array(out), state


def test_schedule_warms_up_then_decays_to_floor():
    cfg = InnerConfig(lr=1e-2, warmup_steps=10, min_lr_ratio=0.1)
    s = lr_schedule(cfg, 100)
    assert float(s(0)) == 0.0
    assert float(s(10)) == pytest.approx(1e-2)
    assert float(s(100)) == pytest.approx(1e-3)
    assert float(s(5)) == pytest.approx(5e-3)
    const = lr_schedule(InnerConfig(lr=0.1, warmup_steps=0, schedule="constant"), 100)
    assert float(const(0)) == float(const(99)) == pytest.approx(0.1)


def test_weight_decay_skips_vectors():
    """AdamW with zero gradients only decays: matrices shrink, norm scales do not."""
    opt = make_optimizer(InnerConfig(lr=0.1, warmup_steps=0, schedule="constant", weight_decay=0.5,
                                     clip_norm=0.0), 10)
    params = {"w": np.ones((2, 2), np.float32), "scale": np.ones((2,), np.float32)}
    zeros = jax.tree.map(np.zeros_like, params)
    updates, _ = opt.update(zeros, opt.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.05)
    np.testing.assert_allclose(updates["scale"], 0.0)


def test_golden_tiny_loss(tmp_path, corpus):
    """Loss trajectory of the tiny model on the synthetic source, pinned.

    After an intended change (model init, optimizer, data order), regenerate with
        UPDATE_GOLDEN=1 pytest tests/test_train.py -k golden
    and say why in the commit message.
    """
    got, _ = losses(make_cfg(tmp_path), corpus, jax.devices()[:1], 20)
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps({"losses": got.tolist()}, indent=1))
    want = np.array(json.loads(GOLDEN.read_text())["losses"])
    np.testing.assert_allclose(got, want, rtol=1e-4, err_msg="golden loss changed; see docstring")
    assert got[-1] < got[0] - 0.3  # and it is learning


@pytest.mark.parametrize("mesh", [MeshConfig(), MeshConfig(fsdp=2), MeshConfig(data=1, fsdp=8)],
                         ids=["data8", "data4xfsdp2", "fsdp8"])
def test_sharded_steps_match_one_device(tmp_path, corpus, mesh):
    """The same 6 steps on 8 simulated devices give the 1-device losses within 1e-5 relative.

    Only the reduction order of the sharded batch mean differs, so float32 rounding is all that
    separates them.
    """
    cfg = make_cfg(tmp_path)
    one, _ = losses(cfg, corpus, jax.devices()[:1], 6)
    many, state = losses(replace(cfg, mesh=mesh), corpus, jax.devices(), 6)
    np.testing.assert_allclose(many, one, rtol=1e-5)
    if mesh.fsdp > 1:  # parameters really are split over the fsdp axis
        shard_shapes = {tuple(s.data.shape) for s in jax.tree.leaves(state.params)[0].addressable_shards}
        assert any(np.prod(s) < jax.tree.leaves(state.params)[0].size for s in shard_shapes) or \
            jax.tree.leaves(state.params)[0].size % mesh.fsdp != 0


def test_learns_toward_entropy_floor(tmp_path, corpus):
    """On a Markov source the loss goes from ~log(V) to within 0.25 nats of the known floor."""
    cfg = make_cfg(tmp_path, steps=150)
    cfg = replace(cfg, inner=InnerConfig(lr=1e-2, warmup_steps=10))
    model = build(cfg.model, corpus.vocab_size, seed=0)
    _, summary = train_dp(cfg, corpus, model, make_mesh(cfg.mesh, 16), Path(cfg.run.out_dir))
    assert corpus.entropy_floor < np.log(16) - 0.3
    assert summary["eval_loss"] < corpus.entropy_floor + 0.25, (summary["eval_loss"], corpus.entropy_floor)
    records = [json.loads(x) for x in (Path(cfg.run.out_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "eval"] == list(range(10, 151, 10))


def test_resume_is_bit_identical(tmp_path, corpus):
    """10 steps, checkpoint, restart the process state, 10 more == 20 uninterrupted steps, exactly."""
    mesh = make_mesh(MeshConfig(), 16)
    model = build(tiny_model(), corpus.vocab_size, seed=0)
    straight = make_cfg(tmp_path / "a", steps=20)
    full, _ = train_dp(straight, corpus, model, mesh, Path(straight.run.out_dir))

    half = make_cfg(tmp_path / "b", steps=20)
    first, _ = train_dp(half, corpus, model, mesh, Path(half.run.out_dir), stop=lambda step: step == 10)
    resumed, summary = train_dp(replace(half, run=replace(half.run, resume=True)), corpus, model, mesh,
                                Path(half.run.out_dir))
    assert int(first.step) == 10 and int(resumed.step) == 20
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoint_every_zero_saves_no_checkpoint(tmp_path, corpus):
    """run.checkpoint_every=0 is none, the last step's included (a full fine-tune's would be GBs)."""
    cfg = make_cfg(tmp_path, steps=6, checkpoint_every=0)
    cfg = replace(cfg, inner=InnerConfig(lr=1e-2, warmup_steps=1))
    model = build(cfg.model, corpus.vocab_size, seed=0)
    train_dp(cfg, corpus, model, make_mesh(cfg.mesh, 16), Path(cfg.run.out_dir))
    saved = Path(cfg.run.out_dir) / "checkpoints"
    assert not saved.exists() or not any(saved.iterdir()), list(saved.iterdir())
