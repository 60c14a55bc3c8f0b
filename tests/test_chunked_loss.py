"""model.loss_chunk: the loss computed a chunk of positions at a time equals the whole-logits loss
and its gradients (windows, masked SFT rows, LoRA adapters, an untied head, bfloat16), and its
compiled step holds no B x L x V float32 logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_model

from diloco.config import DataConfig, InnerConfig, LoraConfig, MeshConfig, RunConfig, TrainConfig
from diloco.config.checks import model_errors
from diloco.model import build, lora
from diloco.train.mesh import make_mesh
from diloco.train.step import cross_entropy, make_loss, masked_next_token_loss
from diloco.train.trainer import compile_steps

VOCAB = 211
TINY = tiny_model(d_ff=64)
TOL = dict(rtol=2e-5, atol=1e-6)


def _windows(seed: int, B=3, L=20) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (B, L + 1), 0, VOCAB)


def _sft_batch() -> dict:
    tokens = _windows(1, B=2, L=20)
    segments = jnp.array([[1] * 8 + [2] * 10 + [0] * 3, [1] * 21])
    positions = jnp.array([list(range(8)) + list(range(10)) + [0] * 3, list(range(21))])
    targets = jnp.zeros((2, 20), bool).at[0, 3:7].set(True).at[0, 11:17].set(True).at[1, 5:19].set(True)
    return {"tokens": tokens, "segments": segments, "positions": positions, "targets": targets}


def _value_and_grad(loss, params, batch):
    return jax.jit(jax.value_and_grad(lambda p: loss(p, batch)[0]))(params)


def _assert_trees_close(got, want, scaled_atol: float = 0.0, **tol):
    """Leaf by leaf; `scaled_atol` adds an absolute tolerance of that share of the leaf's largest value."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        atol = max(tol.get("atol", 0.0), scaled_atol * float(np.abs(w).max()))
        np.testing.assert_allclose(g, w, **{**tol, "atol": atol})


def test_cross_entropy_in_chunks_equals_optax_on_whole_logits_for_any_chunk():
    h_BxLxD = jax.random.normal(jax.random.key(0), (2, 13, 8))
    table = jax.random.normal(jax.random.key(1), (8, 50))
    head = lambda h: jnp.dot(h, table, preferred_element_type=jnp.float32)  # noqa: E731
    targets = jax.random.randint(jax.random.key(2), (2, 13), 0, 50)
    want = optax.softmax_cross_entropy_with_integer_labels(head(h_BxLxD), targets)
    for chunk in (0, 1, 4, 5, 13, 100):  # whole, one position, padded last chunk, exact, past L
        np.testing.assert_allclose(cross_entropy(head, h_BxLxD, targets, chunk), want, **TOL)


def test_window_loss_and_gradients_in_chunks_equal_the_whole():
    model = build(TINY, VOCAB, seed=0)
    batch = _windows(3)
    want_v, want_g = _value_and_grad(make_loss(model), model.params, batch)
    for chunk in (1, 7):  # one position at a time; chunks of 7 over 20 positions, the last padded
        got_v, got_g = _value_and_grad(make_loss(model, chunk=chunk), model.params, batch)
        np.testing.assert_allclose(got_v, want_v, **TOL)
        _assert_trees_close(got_g, want_g, **TOL)
    # And the whole loss is today's: optax over the logits apply returns.
    logits = model.apply(model.params, batch[:, :-1])
    np.testing.assert_allclose(want_v, optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean(),
                               **TOL)


@pytest.mark.slow  # 6 s; the tied float32 head's chunks run by default
def test_untied_head_and_bfloat16_in_chunks_equal_the_whole():
    # bfloat16: the logits are float32 either way, but the head's gradients are summed in bf16 over
    # the whole batch or over each chunk, so they agree to bf16 rounding (2^-8) of the largest entry.
    for cfg, tol, scaled in ((dataclasses.replace(TINY, tie_embeddings=False), TOL, 0.0),
                             (dataclasses.replace(TINY, dtype="bfloat16"), dict(rtol=1e-2), 1e-2)):
        model = build(cfg, VOCAB, seed=1)
        batch = _windows(4)
        want_v, want_g = _value_and_grad(make_loss(model), model.params, batch)
        got_v, got_g = _value_and_grad(make_loss(model, chunk=8), model.params, batch)
        np.testing.assert_allclose(got_v, want_v, rtol=1e-5)
        _assert_trees_close(got_g, want_g, scaled, **tol)


def test_masked_sft_loss_count_and_gradients_in_chunks_equal_the_whole():
    model = build(TINY, VOCAB, seed=2)
    batch = _sft_batch()
    whole = masked_next_token_loss(model, model.params, batch)
    chunked = masked_next_token_loss(model, model.params, batch, chunk=6)
    assert float(whole[1]) == float(chunked[1]) == 24.0
    np.testing.assert_allclose(chunked[0], whole[0], **TOL)
    want_v, want_g = _value_and_grad(make_loss(model, sft=True), model.params, batch)
    got_v, got_g = _value_and_grad(make_loss(model, sft=True, chunk=6), model.params, batch)
    np.testing.assert_allclose(got_v, want_v, **TOL)
    _assert_trees_close(got_g, want_g, **TOL)
    # The trained targets alone count: the mean of their -log p from packed's logits.
    logp = jax.nn.log_softmax(model.packed(model.params, batch["tokens"][:, :-1], batch["segments"][:, :-1],
                                           batch["positions"][:, :-1]))
    picked = jnp.take_along_axis(logp, batch["tokens"][:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(whole[0], -picked[batch["targets"]].mean(), **TOL)


@pytest.mark.slow  # 6 s; the full model's chunked gradients run by default
def test_lora_adapter_gradients_in_chunks_equal_the_whole():
    base = build(TINY, VOCAB, seed=3)
    adapted = lora.adapt(LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "down")), base)
    # Non-zero Bs, so the gradients flow through A B into every adapted projection.
    adapters = jax.tree.map(lambda b: 0.05 * jax.random.normal(jax.random.key(b.size), b.shape), adapted.params)
    for sft, batch in ((False, _windows(5)), (True, _sft_batch())):
        want_v, want_g = _value_and_grad(make_loss(adapted, sft), adapters, batch)
        got_v, got_g = _value_and_grad(make_loss(adapted, sft, chunk=5), adapters, batch)
        np.testing.assert_allclose(got_v, want_v, **TOL)
        _assert_trees_close(got_g, want_g, **TOL)
        assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(got_g)) > 0


def test_the_chunked_step_never_holds_the_whole_float32_logits():
    # A vocabulary large enough that B x L x V float32 logits (2 x 128 x 8192 x 4 = 8 MiB) dwarf
    # everything else the step holds.
    cfg = dataclasses.replace(TINY, max_seq_len=128)
    model = build(cfg, 8192, seed=0)
    batch = jax.ShapeDtypeStruct((2, 129), jnp.int32)
    logits_bytes = 2 * 128 * 8192 * 4

    def temp_bytes(chunk):
        grad = jax.jit(jax.grad(lambda p, b: make_loss(model, chunk=chunk)(p, b)[0]))
        return grad.lower(model.params, batch).compile().memory_analysis().temp_size_in_bytes

    whole, chunked = temp_bytes(0), temp_bytes(16)
    assert whole >= logits_bytes, whole
    # A chunk's logits are 1/8 of the whole: the step needs at least the other 7/8 less.
    assert chunked < whole - 0.75 * logits_bytes, (whole, chunked)


def _trainer_step(chunk: int, remat: str, learners: int = 0):
    """One step of the trainer's compiled step: batch over (data 4, fsdp 2), parameters split over
    fsdp; with `learners`, sim's vmapped step of that many (Compiled.train_many), the last one's."""
    model_cfg = dataclasses.replace(TINY, loss_chunk=chunk, remat=remat)
    cfg = TrainConfig(model=model_cfg, data=DataConfig(batch_size=8, seq_len=20), inner=InnerConfig(),
                      mesh=MeshConfig(data=4, fsdp=2, devices=8), run=RunConfig(steps=10))
    model = build(model_cfg, VOCAB, seed=4)
    compiled = compile_steps(model, cfg, make_mesh(cfg.mesh, 8))
    batch = jax.device_put(np.asarray(_windows(6, B=8, L=20)), compiled.batch_sharding)
    if learners:
        states = tuple(compiled.init(model.params) for _ in range(learners))
        return compiled.train_many(learners)(states, (batch,) * learners)[-1]
    return compiled.train_step(compiled.init(model.params), batch)


def _assert_steps_close(got, want):
    (state, metrics), (want_state, want_metrics) = got, want
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose(metrics[name], want_metrics[name], rtol=2e-5)
    _assert_trees_close(state.params, want_state.params, rtol=1e-5, atol=1e-6)


def test_the_trainers_sharded_step_in_chunks_and_under_remat_equals_the_whole():
    _assert_steps_close(_trainer_step(6, "dots"), _trainer_step(0, "none"))


@pytest.mark.slow
def test_sims_vmapped_step_in_chunks_and_under_remat_equals_the_whole():
    _assert_steps_close(_trainer_step(6, "dots", learners=2), _trainer_step(0, "none", learners=2))


def test_loss_chunk_must_not_be_negative():
    assert "model.loss_chunk=-1 must be >= 0 (0: the whole sequence at once)" in \
        model_errors(dataclasses.replace(TINY, loss_chunk=-1))


def test_a_run_from_a_checkpoint_keeps_its_own_attention_remat_and_loss_chunk(tmp_path):
    from test_finetune import make_cfg, write_files

    from diloco.inputs import load_checkpoint, load_inputs

    root = write_files(tmp_path)
    base = make_cfg(root, "run")
    knobs = dict(attention="xla", remat="full", loss_chunk=16)
    cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, **knobs))
    resolved, pre = load_checkpoint(cfg)
    # The checkpoint decides the shape (d_model 32), the run how the step computes it.
    assert resolved.model.d_model == 32 and resolved.model.init_from == str(root / "ckpt")
    assert {k: getattr(resolved.model, k) for k in knobs} == knobs
    assert {k: getattr(pre.config, k) for k in knobs} == knobs
    # And the model built from it computes under them: the same logits as the checkpoint's defaults.
    plain = load_inputs(base).model
    inputs = load_inputs(cfg)
    tokens = jnp.arange(24)[None] % 50
    np.testing.assert_allclose(inputs.model.apply(inputs.model.params, tokens),
                               plain.apply(plain.params, tokens), rtol=1e-5, atol=1e-5)
    jaxpr = jax.make_jaxpr(lambda p: make_loss(inputs.model)(p, jnp.zeros((2, 9), jnp.int32))[0])(inputs.model.params)
    # remat=full reached the blocks: jax.checkpoint's primitive around each (remat2 in jax 0.10)
    assert sum("remat" in e.primitive.name or "checkpoint" in e.primitive.name for e in jaxpr.jaxpr.eqns) == 1
