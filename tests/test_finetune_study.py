"""The fine-tuning study behind `make finetune` (docs/finetuning.md): its default config composes
into runs at equal trained tokens, and a miniature of it (a tiny random checkpoint, two steps)
trains, scores generated answers, writes its table, and reuses finished runs and scores."""

import dataclasses
import json

import pytest

from diloco import hf
from diloco.config import ConfigError
from diloco.experiments import finetune_study as fs
from diloco.experiments.spec import Variant, _compose
from diloco.hf.tokenizer import load_tokenizer
from diloco.model import build
from test_finetune import TINY
from test_generate_cli import FIXTURES


def default_study() -> fs.StudyConfig:
    return fs.parse(_compose("finetune_study", []))


def test_default_study_compares_at_equal_trained_rows(tmp_path):
    cfg = default_study()
    assert [v.label for v in cfg.variants] == ["dp", "diloco", "diloco_lora"]
    _, jobs = fs.jobs(cfg, tmp_path / "ckpt.gguf", tmp_path / "train.jsonl")
    dp, diloco, lora = (j.cfg for j in jobs)
    assert dp.algo == "dp" and diloco.algo == lora.algo == "diloco"
    # The same rows every step: data parallel's batch is M learners' batches.
    assert dp.data.batch_size == diloco.runtime.learners * diloco.data.batch_size == 4 * 2
    assert dp.run.steps == diloco.run.steps == lora.run.steps
    assert diloco.syncer.quorum == 1 and diloco.runtime.learners == 4
    assert lora.finetune.lora.rank > 0 and diloco.finetune.lora.rank == 0
    # Every variant evaluates the same held-out rows.
    assert {j.cfg.run.eval_batches * j.cfg.data.batch_size for j in jobs} == {cfg.eval_sequences}
    assert all(j.cfg.model.init_from == str(tmp_path / "ckpt.gguf") for j in jobs)


def test_bad_study_configs_name_the_value():
    with pytest.raises(ConfigError, match="no variants"):
        fs.parse({"variants": []})
    with pytest.raises(ConfigError, match="test_examples=0"):
        fs.parse({"test_examples": 0, "variants": [{"label": "dp"}]})


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A random tiny model with the fixture tokenizer (byte-level, ChatML), long enough a context
    for the record prompts."""
    tok = load_tokenizer(FIXTURES / "tokenizer")
    shape = dataclasses.replace(TINY, max_seq_len=512)
    return hf.save(tmp_path_factory.mktemp("ck") / "ckpt", shape, build(shape, tok.vocab_size, seed=0).params, tok)


@pytest.mark.slow  # 12 s of four fine-tunes and their scoring
def test_miniature_study_trains_scores_and_reuses(tiny_ckpt, tmp_path, monkeypatch):
    fast = ["run.steps=2", "inner.warmup_steps=0", "data.seq_len=384", "run.log_every=1",
            "codec=fp32", "codec.zstd_level=0"]
    cfg = dataclasses.replace(
        default_study(), checkpoint=str(tiny_ckpt), train_examples=24, test_examples=3, max_new_tokens=3,
        generate_batch=2, eval_sequences=4, out_dir=str(tmp_path), compilation_cache="",
        variants=(Variant("dp", ("algo=dp", "data.batch_size=4", "data.val_fraction=0.2")),
                  Variant("diloco", ("data.batch_size=2", "data.val_fraction=0.2", "runtime.learners=2",
                                     "fragments.count=1", "fragments.H=2", "fragments.tau=0",
                                     "syncer.quorum=1"))),
        overrides=tuple(fast))
    paths = fs.run(cfg)
    result = json.loads(paths[1].read_text())
    before, rows = result["before"], result["rows"]
    # A random model cannot know the record format; its masked loss is about log(vocab).
    assert before["exact"] == 0.0 and before["n"] == 3 and before["eval_loss"] > 3.0
    dp, diloco = rows
    assert dp["variant"] == "dp" and dp["bytes_over_dp"] == 1.0 and dp["learners"] == 1
    assert diloco["learners"] == 2 and 0.0 < diloco["bytes"] and diloco["assistant_tokens"] > 0
    assert all(0.0 <= r["exact"] <= r["format"] <= 1.0 and r["n"] == 3 for r in rows)
    assert all((tmp_path / "finetune" / v / "seed0" / "downstream.json").exists() for v in ("dp", "diloco"))
    table = paths[0].read_text()
    assert "| checkpoint, before |" in table and "| dp |" in table and "| diloco |" in table

    # Rerun: every run and score is reused, nothing trains or generates again.
    def refuse(*a, **k):
        raise AssertionError("retrained or regenerated a finished run")

    monkeypatch.setattr("diloco.run.run", refuse)
    monkeypatch.setattr("diloco.model.generate.generate", refuse)
    again = json.loads(fs.run(cfg)[1].read_text())
    assert [r["exact"] for r in again["rows"]] == [r["exact"] for r in rows]
