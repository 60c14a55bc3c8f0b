"""Downstream tasks scored during a run (run.eval_tasks, diloco/evaluation/during_run.py): the
data-parallel trainer and the sim and threads runtimes write the base model's scores at step 0 and
the global model's every run.eval_tasks_every steps and at the end into their eval records, the
last of which are the exported model's own scores and the summary's (whole runs: slow, 10 s of
CPU each here); the scorer's schedule and scores on the tiny model (fast); TensorBoard gets them as
eval/<task>/<metric>; bad options and task files fail before a run directory is made."""

import json
from pathlib import Path

import jax
import pytest
from conftest import tiny_cfg
from test_eval_tasks import GEN_ROWS, write_lm_eval

from diloco import report
from diloco.config import ConfigError, DataConfig
from diloco.data import load_corpus
from diloco.evaluation import during_run, harness
from diloco.evaluation.tasks import TaskError, load_task
from diloco.hf import Pretrained, load
from diloco.model import build
from diloco.run import run, run_tokenizer
from diloco.watch import RunWatch

TEXT = "Q: 2+2?\nA: 4\n\nQ: sky?\nA: blue\n\nQ: cat?\nA: meow\n\n" * 60


def text_cfg(root: Path, kind: str = "sim", algo: str = "diloco", generative: bool = False, **run_options):
    """The tests' tiny run on a byte-level text file, with a 3-question multiple-choice task (and a
    2-question generative one) scored on the first 2 questions of each."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "notes.txt").write_text(TEXT)
    (root / "mc").mkdir()
    tasks = [str(write_lm_eval(root / "mc", task="toy_mc"))]
    if generative:
        (root / "gen").mkdir()
        tasks.append(str(write_lm_eval(root / "gen", GEN_ROWS, generative=True, task="toy_gen")))
    data = DataConfig(source="files", paths=(str(root / "notes.txt"),), seq_len=32, batch_size=8,
                      data_dir=str(root / "data"))
    return tiny_cfg(root, kind, algo, data=data, inner=dict(warmup_steps=1),
                    run={**dict(steps=6, eval_every=2, eval_tasks=tuple(tasks), eval_limit=2, tensorboard=False),
                         **run_options})


def scores_of(cfg, model, params, tokenizer) -> dict:
    """What harness.score_task gives `model` with `params` on cfg's tasks: an eval record's fields."""
    pre = Pretrained(model._replace(params=params), cfg.model, 256, tokenizer, "x")
    out = {}
    for path in cfg.run.eval_tasks:
        result = harness.score_task(pre, load_task(path), limit=cfg.run.eval_limit, batch_size=8)
        assert result["n"] == 2  # eval_limit: the first 2 of each task's documents
        out.update({f"eval/{result['task']}/{k}": m["value"] for k, m in result["metrics"].items()})
    return out


def check_run(cfg, summary, task_steps: list[int]):
    """Eval records at task_steps carry the task scores (and no others do); step 0's are the base
    model's, the last are the exported model's, and the summary carries them."""
    records = [r for r in report.read_metrics(Path(cfg.run.out_dir) / "metrics.jsonl") if r["kind"] == "eval"]
    scored = [r for r in records if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in scored] == task_steps
    assert scored[0]["tokens"] == 0 and scored[0]["eval_loss"] > 0
    exported = load(summary["model_dir"])
    tokenizer = exported.tokenizer
    base = scores_of(cfg, exported.model, build(cfg.model, 256, cfg.run.seed).params, tokenizer)
    final = scores_of(cfg, exported.model, exported.model.params, tokenizer)
    assert set(base) == {k for k in scored[0] if k.startswith("eval/")}
    assert {k: scored[0][k] for k in base} == pytest.approx(base)
    assert {k: scored[-1][k] for k in final} == pytest.approx(final)
    assert {k: summary[k] for k in final} == pytest.approx(final)
    return scored


@pytest.mark.slow
def test_data_parallel_run_scores_tasks_at_step_0_every_n_steps_and_the_end(tmp_path):
    cfg = text_cfg(tmp_path, algo="dp", generative=True, eval_tasks_every=4)
    summary = run(cfg)
    scored = check_run(cfg, summary, [0, 4, 6])  # evals at 2, 4, 6; tasks every 4 and at the last
    assert set(scored[1]) >= {"eval/toy_mc/acc", "eval/toy_mc/acc_norm", "eval/toy_gen/exact_match"}
    assert "toy_mc/acc" in report.render_summary(summary, "run")


@pytest.mark.slow
def test_sim_run_scores_the_global_model(tmp_path):
    cfg = text_cfg(tmp_path, "sim")
    summary = run(cfg)
    # every eval (2, 4 of learner 0), and the last step once: the final model, after the last
    # merges (the eval before them at step 6 has its loss only)
    check_run(cfg, summary, [0, 2, 4, 6])


@pytest.mark.slow
def test_threads_run_scores_the_global_model(tmp_path):
    cfg = text_cfg(tmp_path, "threads", generative=True, eval_tasks_every=4)
    summary = run(cfg)
    check_run(cfg, summary, [0, 4, 6])


def test_the_scorer_scores_at_step_0_every_n_steps_and_the_last_the_full_models_params(tmp_path):
    cfg = text_cfg(tmp_path, eval_tasks_every=4)
    tokenizer = run_tokenizer(load_corpus(cfg.data))
    model = build(cfg.model, 256, 0)
    other = model._replace(params=jax.tree.map(lambda x: -x, model.params))
    # `full` maps what trains to the full model's params (LoRA merges its adapters): scored are those
    tasks = during_run.run_tasks(cfg, model, tokenizer, full=lambda params: other.params)
    got = {step: tasks(model.params, step) for step in range(cfg.run.steps + 1)}
    assert [s for s, f in got.items() if f] == [0, 4, 6]  # the base model, every 4 steps, the last
    assert got[4] == pytest.approx(scores_of(cfg, model, other.params, tokenizer))
    assert set(got[0]) == {"eval/toy_mc/acc", "eval/toy_mc/acc_norm"}
    evaluator = during_run.Evaluator(lambda theta: 1.5, lambda theta, step, final: tasks(model.params, step, final))
    assert evaluator({}) == 1.5 and during_run.fields(evaluator, {}, 4) == got[4]
    assert during_run.fields(lambda theta: 1.5, {}, 4) == {} and not during_run.scores_tasks(lambda theta: 1.5)
    # a DiLoCo runtime scores the last step once: in its eval after the final merges
    assert tasks(model.params, 6, final=False) == {} and tasks(model.params, 6, final=True) == got[6]
    assert tasks(model.params, 5, final=True) == got[4] and tasks(model.params, 4, final=False) == got[4]
    every_eval = during_run.run_tasks(text_cfg(tmp_path / "b"), model, tokenizer, full=lambda p: p)
    assert [s for s in range(7) if every_eval.due(s)] == [0, 2, 4, 6]  # eval_tasks_every=0: at every eval


def test_task_scores_reach_tensorboard_as_eval_task_metric():
    class Sink:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

    sink = Sink()
    watch = RunWatch(steps=10, learners=1, progress=False, wandb=sink)
    watch({"kind": "eval", "step": 0, "tokens": 0, "eval_loss": 2.0, "eval/toy_mc/acc": 0.5, "merges": 0})
    assert ("eval/toy_mc/acc", 0.5, 0) in sink.scalars and ("eval/loss", 2.0, 0) in sink.scalars


def test_bad_options_and_task_files_fail_before_a_run_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"run.eval_tasks_every=3 must be a multiple of run.eval_every=2"):
        text_cfg(tmp_path / "a", eval_tasks_every=3)
    with pytest.raises(ConfigError, match=r"run.eval_limit=-1 must be >= 0"):
        text_cfg(tmp_path / "b", eval_limit=-1)
    cfg = text_cfg(tmp_path / "c", eval_tasks=(str(tmp_path / "gone.yaml"),))
    with pytest.raises(ConfigError, match="run.eval_tasks: .*gone.yaml not found"):
        run(cfg)
    cfg = tiny_cfg(tmp_path / "d", run=dict(eval_tasks=text_cfg(tmp_path / "e").run.eval_tasks))  # synthetic data
    with pytest.raises(ConfigError, match="data.source=synthetic has no tokenizer"):
        run(cfg)
    twice = text_cfg(tmp_path / "f")
    (tmp_path / "f" / "again").mkdir()
    other = write_lm_eval(tmp_path / "f" / "again", task="toy_mc")
    cfg = text_cfg(tmp_path / "g", eval_tasks=(twice.run.eval_tasks[0], str(other)))
    with pytest.raises(TaskError, match=r"mc/task.yaml and .*again/task.yaml are both task 'toy_mc'"):
        run(cfg)
    (tmp_path / "h").mkdir()
    broken = write_lm_eval(tmp_path / "h", process_docs="x")
    with pytest.raises(TaskError, match="process_docs not supported"):
        run(text_cfg(tmp_path / "i", eval_tasks=(str(broken),)))
    assert not any((tmp_path / d / "run").exists() for d in "cdgi")


def test_run_tokenizer_encodes_as_the_exported_model(tmp_path):
    cfg = text_cfg(tmp_path)
    corpus = load_corpus(cfg.data)
    assert run_tokenizer(corpus).encode("Q: 2+2?", add_special_tokens=False) == list(b"Q: 2+2?")
    assert run_tokenizer(load_corpus(tiny_cfg(tmp_path / "s").data)) is None
