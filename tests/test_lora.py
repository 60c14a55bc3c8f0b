"""LoRA fine-tuning (docs/design.md#lora): a LoRA model's params are the trained Bs only, with the
checkpoint and the frozen As closed over. B = 0 is the checkpoint exactly; the adapter forward is
the merged-weights forward; with A shared, merging the Bs merges the products (averaging exactly,
RDA as a non-negative combination); a Decoupled DiLoCo run ships adapters only; the export is the
merged full model; bad settings are one ConfigError naming the value."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco import hf
from diloco.algo.merge import pseudo_gradient, rda, weighted_average
from diloco.runtime import build as build_setup
from diloco.config import ConfigError, FinetuneConfig, LoraConfig, ModelConfig, TrainConfig, from_dict, validate
from diloco.data import train_batch
from diloco.inputs import full_params, load_inputs
from diloco.model import build, count_params, lora, with_params
from diloco.run import export_model, run
from diloco.train.step import make_eval_step, make_loss
from test_finetune import TINY, make_cfg, write_files

LORA = LoraConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny random checkpoint and 30 conversations of tests/test_finetune.py."""
    return write_files(tmp_path_factory.mktemp("lora"))


def lora_cfg(root, name, lo=LORA, **groups) -> TrainConfig:
    return dataclasses.replace(make_cfg(root, name, **groups), finetune=FinetuneConfig(lo))


def random_b(adapters, seed, std=0.5):
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [std * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def row_inputs(corpus):
    batch = train_batch(corpus.train, seed=0, learner=0, num_learners=1, step=0, batch_size=2, seq_len=96)
    return [batch[k][:, :-1] for k in ("tokens", "segments", "positions")]


def test_the_params_are_the_adapters_and_b_zero_is_the_checkpoint_exactly(files):
    cfg, corpus, model, pre = load_inputs(lora_cfg(files, "zero"))
    paths = [tuple(k.key for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(model.params)[0]]
    assert len(paths) == 7 * cfg.model.n_layers and all(p[-1] == "lora_b" for p in paths)
    assert model.params["blocks"]["0"]["attn"]["wk"]["lora_b"].shape == (4, cfg.model.n_kv_heads * 16)
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(model.params))
    tokens = row_inputs(corpus)[0]
    np.testing.assert_array_equal(np.asarray(model.apply(model.params, tokens)),
                                  np.asarray(pre.model.apply(pre.model.params, tokens)))
    np.testing.assert_array_equal(np.asarray(model.packed(model.params, *row_inputs(corpus))),
                                  np.asarray(pre.model.packed(pre.model.params, *row_inputs(corpus))))
    # A is a pure function of (finetune.lora, shapes): every learner and process draws the same
    a1, a2 = lora.frozen_a(LORA, pre.model.params), lora.frozen_a(LORA, pre.model.params)
    assert all(np.array_equal(a1[p], a2[p]) for p in a1) and len(a1) == 7


def test_the_adapter_forward_is_the_merged_weights_forward(files):
    cfg, corpus, model, pre = load_inputs(lora_cfg(files, "fwd"))
    b = random_b(model.params, 1)
    merged = with_params(cfg.model, pre.vocab_size, lora.merge(LORA, pre.model.params, b))
    inputs = row_inputs(corpus)
    adapter = jax.jit(model.packed)(b, *inputs)  # compiled, the frozen weights as constants
    plain = merged.packed(merged.params, *inputs)
    assert float(jnp.max(jnp.abs(adapter - pre.model.packed(pre.model.params, *inputs)))) > 1e-2  # B moved it
    # the same arithmetic, fused differently under jit: float32 rounding only
    np.testing.assert_allclose(np.asarray(adapter), np.asarray(plain), rtol=1e-5, atol=1e-5)
    # exactly W + (alpha / rank) A B on the targets, the checkpoint elsewhere
    a = lora.frozen_a(LORA, pre.model.params)
    full = lora.merge(LORA, pre.model.params, b)
    path = ("blocks", "0", "mlp", "w_up")
    want = (np.asarray(pre.model.params["blocks"]["0"]["mlp"]["w_up"]["kernel"], np.float64)
            + 2.0 * np.asarray(a[path], np.float64) @ np.asarray(b["blocks"]["0"]["mlp"]["w_up"]["lora_b"], np.float64))
    np.testing.assert_allclose(np.asarray(full["blocks"]["0"]["mlp"]["w_up"]["kernel"]), want, rtol=1e-6, atol=1e-6)
    assert full["embed"]["embedding"] is pre.model.params["embed"]["embedding"]


def test_the_compiled_steps_take_the_frozen_weights_as_one_placed_argument(files):
    """A LoRA model's train, eval and vmapped steps share one copy of the frozen checkpoint on
    their mesh, passed as an argument: their programs hold no constant the checkpoint's size (a
    closure would embed every frozen weight in each one), and they compute what the closure did."""
    from diloco.train.mesh import make_mesh
    from diloco.train.trainer import compile_steps

    cfg, corpus, model, pre = load_inputs(lora_cfg(files, "frozen"))
    assert model.frozen is pre.model.params and model.thaw(model.frozen).params.keys() == model.params.keys()
    compiled = compile_steps(model, cfg, make_mesh(cfg.mesh, cfg.data.batch_size))
    frozen_bytes = sum(x.nbytes for x in jax.tree.leaves(model.frozen))
    batch = jax.device_put(train_batch(corpus.train, seed=0, learner=0, num_learners=1, step=0,
                                       batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len),
                           compiled.batch_sharding)
    state = compiled.init(jax.device_put(random_b(model.params, 2), compiled.state_sharding.params))
    texts = [compiled.train_step.lower(state, batch).as_text(),
             compiled.eval_step.lower(state.params, batch).as_text(),
             compiled.train_many(2).lower((state, state), (batch, batch)).as_text()]
    def constant_bytes(text):  # the bytes of the program's hex-encoded dense constants
        return sum(len(h) // 2 for h in re.findall(r'dense<"0x([0-9A-F]+)">', text))

    embedded = [constant_bytes(text) for text in texts]
    assert max(embedded) < frozen_bytes / 4, (embedded, frozen_bytes)  # the As, small, remain constants
    closure = jax.jit(make_eval_step(make_loss(model, True))).lower(state.params, batch).as_text()
    assert constant_bytes(closure) >= frozen_bytes
    placed = compiled.train_step.last
    assert compiled.eval_step.last is placed and compiled.train_many(2).last is placed
    loss, tokens = compiled.eval_step(state.params, batch)
    closure = jax.jit(make_eval_step(make_loss(model, True)))(state.params, batch)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(closure[0]), rtol=1e-6)
    assert float(tokens) == float(closure[1])


def test_with_a_shared_a_merging_the_bs_merges_the_products(files):
    """FFA-LoRA's reason: sum_m w_m A B_m = A sum_m w_m B_m, so averaging the learners' Bs is
    averaging their weight updates. RDA of the Bs is sum_m c_m dB_m with c_m >= 0: still one
    rank-r product with the same A, a non-negative combination of the learners' updates."""
    _, _, model, pre = load_inputs(lora_cfg(files, "merge"))
    a = lora.frozen_a(LORA, pre.model.params)
    path = ("blocks", "0", "attn", "wq")
    A = np.asarray(a[path], np.float64)
    global_b = random_b(model.params, 10)
    local = [random_b(model.params, 20 + m) for m in range(3)]
    deltas = [pseudo_gradient(global_b, b) for b in local]
    weights = [3.0, 1.0, 2.0]
    w = np.asarray(weights) / sum(weights)
    dB = [np.asarray(d["blocks"]["0"]["attn"]["wq"]["lora_b"], np.float64) for d in deltas]

    avg = np.asarray(weighted_average(deltas, weights)["blocks"]["0"]["attn"]["wq"]["lora_b"], np.float64)
    np.testing.assert_allclose(A @ avg, sum(w[m] * (A @ dB[m]) for m in range(3)), rtol=1e-5, atol=1e-6)
    # and the merged full weights are the token-weighted mean of the learners' full weights
    mean_b = jax.tree.map(lambda *bs: sum(w[m] * bs[m] for m in range(3)), *local)
    def kernel(b):
        return np.asarray(lora.merge(LORA, pre.model.params, b)["blocks"]["0"]["attn"]["wq"]["kernel"])

    np.testing.assert_allclose(kernel(mean_b), sum(w[m] * kernel(local[m]) for m in range(3)), rtol=1e-5, atol=1e-6)

    merged = np.asarray(rda(deltas, weights)["blocks"]["0"]["attn"]["wq"]["lora_b"], np.float64)
    norms = [np.linalg.norm(d) for d in dB]
    direction = sum(w[m] * dB[m] / norms[m] for m in range(3))
    c = [w[m] * np.dot(w, norms) / (norms[m] * np.linalg.norm(direction)) for m in range(3)]
    np.testing.assert_allclose(A @ merged, sum(c[m] * (A @ dB[m]) for m in range(3)), rtol=1e-5, atol=1e-6)
    # A is near an isometry, so RDA's norms of the Bs are near the norms of the products
    assert all(abs(np.linalg.norm(A @ d) / np.linalg.norm(d) - 1) < 0.5 for d in dB)

    # the rule plain LoRA would need fails: with A trained too, mean(B) mean(A) != mean(B A)
    As = [np.random.default_rng(m).normal(size=A.shape) for m in range(3)]
    assert not np.allclose(sum(w[m] * As[m] for m in range(3)) @ avg, sum(w[m] * As[m] @ dB[m] for m in range(3)))


def test_a_sim_run_ships_only_adapters_and_exports_the_merged_model(files):
    full_cfg = make_cfg(files, "sim-full", algo="diloco", runtime=dict(kind="sim"))
    cfg = lora_cfg(files, "sim-lora", algo="diloco", runtime=dict(kind="sim"))
    inputs = load_inputs(cfg)
    full, adapted = run(full_cfg), run(cfg)
    assert adapted["token_ledger_imbalance"] == 0 and adapted["merges"] == 2
    assert adapted["tokens_processed"] == full["tokens_processed"] and adapted["tokens_merged_share"] == 1.0
    share = count_params(inputs.model.params) / count_params(inputs.pretrained.model.params)
    assert adapted["params"] == full["params"] == count_params(inputs.pretrained.model.params)
    assert adapted["adapter_params"] == count_params(inputs.model.params) and adapted["adapter_share"] == share
    # fp32 both ways, no zstd: the bytes on the wire are the params that travel, plus frame headers
    ratio = adapted["bytes_up"] / full["bytes_up"]
    assert share < ratio < 1.5 * share < 0.15, (ratio, share)  # measured: 0.065 against 0.054
    assert adapted["bytes_down"] / full["bytes_down"] < 1.5 * share
    # the export is the full model, merged, and it moved off the checkpoint
    back = hf.load(adapted["model_dir"])
    assert count_params(back.model.params) == adapted["params"]
    assert not np.allclose(back.model.params["blocks"]["0"]["attn"]["wq"]["kernel"],
                           inputs.pretrained.model.params["blocks"]["0"]["attn"]["wq"]["kernel"])
    np.testing.assert_array_equal(back.model.params["embed"]["embedding"],
                                  inputs.pretrained.model.params["embed"]["embedding"])
    # the adapters learned: the global model's eval loss fell from the checkpoint's
    evals = [json.loads(x) for x in (files / "sim-lora" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in evals if r["kind"] == "eval"]
    assert adapted["eval_loss"] == evals[-1] < evals[0]


def test_the_export_reloads_with_the_merged_models_logits(files, tmp_path):
    inputs = load_inputs(lora_cfg(files, "export"))
    cfg, corpus, model, pre = inputs
    b = random_b(model.params, 3, std=0.2)
    back = hf.load(export_model(tmp_path, cfg, corpus, full_params(inputs, b)))
    assert back.config.d_model == cfg.model.d_model and back.tokenizer.chat_template is not None
    inputs_ = row_inputs(corpus)
    np.testing.assert_allclose(np.asarray(back.model.packed(back.model.params, *inputs_)),
                               np.asarray(model.packed(b, *inputs_)), rtol=1e-5, atol=1e-5)


def test_bad_lora_settings_are_config_errors_naming_the_value(files):
    def error(**over):
        with pytest.raises(ConfigError) as e:
            validate(TrainConfig(finetune=FinetuneConfig(dataclasses.replace(LORA, **over))))
        return str(e.value)

    assert "finetune.lora.targets=['q', 'query']: unknown ['query']; known: q|k|v|o|gate|up|down" in error(
        targets=("q", "query"))
    assert "finetune.lora.rank=-2 must be >= 0" in error(rank=-2)
    assert "finetune.lora.alpha=0.0 must be > 0" in error(alpha=0.0)
    # a random init has nothing to adapt
    with pytest.raises(ConfigError, match=r"finetune.lora.rank=4 needs model.init_from"):
        load_inputs(dataclasses.replace(lora_cfg(files, "none"), model=ModelConfig(),
                                        data=dataclasses.replace(make_cfg(files, "x").data, source="shakespeare")))
    # a target the model lacks: GPT-2's MLP has no gate
    gelu = build(dataclasses.replace(TINY, mlp="gelu"), 300, seed=0)
    with pytest.raises(ConfigError, match=r"this model has no \['gate'\] projection \(it has q\|k\|v\|o\|up\|down\)"):
        lora.adapt(LORA, gelu)
    # more fragments than adapter tensors: known only once the adapters are built
    many = lora_cfg(files, "many", algo="diloco", runtime=dict(kind="sim"))
    many = dataclasses.replace(many, fragments=dataclasses.replace(many.fragments, count=999))
    inputs = load_inputs(many)
    with pytest.raises(ConfigError, match=r"fragments.count=999 does not fit this model: the model has \d+ tensors"):
        build_setup.build(inputs.cfg, inputs.corpus, inputs.model)
    # the nested section reads from plain data (Hydra's output) like any other
    assert from_dict(TrainConfig, {"finetune": {"lora": {"rank": 2, "targets": ["q", "up"]}}}).finetune.lora == \
        LoraConfig(rank=2, targets=("q", "up"))


def test_finetune_lora_composes_from_the_configs():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from test_config import CONFIGS

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        raw = compose(config_name="train", overrides=["finetune=lora", "finetune.lora.rank=2", "run.out_dir=runs/t"])
    cfg = validate(from_dict(TrainConfig, OmegaConf.to_container(raw, resolve=True)))
    assert cfg.finetune.lora.rank == 2 and "gate" in cfg.finetune.lora.targets


def test_a_data_parallel_lora_run_exports_from_its_sharded_adapters(files):
    """The trained Bs are sharded over the trainer's 2 devices, the checkpoint's arrays are not:
    the export merges on the host."""
    from diloco.report import render_summary

    summary = run(lora_cfg(files, "dp"))
    back = hf.load(summary["model_dir"])
    assert count_params(back.model.params) == summary["params"] and np.isfinite(summary["eval_loss"])
    assert "18,912 parameters, LoRA: 1,024 trained (5.4%)" in render_summary(summary, "dp")


@pytest.mark.slow
def test_procs_children_build_the_same_lora_model(files):
    """Every procs child reads the frozen checkpoint, rebuilds the As from the config, takes the
    adapters' Theta_0 from the store, and ships the Bs only."""
    summary = run(lora_cfg(files, "procs", algo="diloco", runtime=dict(kind="procs")))
    assert summary["token_ledger_imbalance"] == 0 and summary["merges"] == 2
    assert summary["bytes_up"] < 0.1 * 307_488  # a full fine-tune of this config sends 307,488 bytes up in sim


def test_a_run_made_before_the_finetune_section_still_resumes_and_a_changed_lora_is_refused(tmp_path):
    import yaml

    from diloco.config import RunConfig, to_dict
    from diloco.run import prepare_run_dir

    cfg = TrainConfig(run=RunConfig(out_dir=str(tmp_path), resume=True))
    old = {g: v for g, v in to_dict(cfg).items() if g != "finetune"}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    prepare_run_dir(cfg)  # the missing section held its defaults
    with pytest.raises(ConfigError, match=r"finetune.lora.rank: 0 -> 4"):
        prepare_run_dir(dataclasses.replace(cfg, finetune=FinetuneConfig(LoraConfig(rank=4))))
