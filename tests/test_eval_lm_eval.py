"""The lm-eval bridge (diloco/evaluation/lm_eval_bridge.py, the `[eval]` extra): lm-eval running
our model on local task files gives the scores our own harness gives, document by document, on a
multiple-choice and a generative task; its rolling loglikelihood is the one computed by hand; its
command line runs through the bridge. Skipped where lm-eval is not installed (the default suite's
environment: `pip install -e .[eval]` adds it)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # task data is local; nothing may reach the hub
lm_eval = pytest.importorskip("lm_eval")

from test_eval_tasks import GEN_ROWS, MC_ROWS, CharTokenizer, bigram, write_lm_eval  # noqa: E402
from test_generate_cli import FIXTURES, TINY  # noqa: E402

from diloco.evaluation import harness  # noqa: E402
from diloco.evaluation.lm_eval_bridge import DilocoLM  # noqa: E402
from diloco.evaluation.tasks import load_task  # noqa: E402
from diloco.hf import load, save  # noqa: E402
from diloco.hf.tokenizer import load_tokenizer  # noqa: E402
from diloco.model import build  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def local_task(folder: Path, name: str, rows, generative: bool) -> Path:
    """A task both harnesses read: lm-eval resolves data_files against the working directory and
    ours against the YAML file, so the paths are absolute."""
    folder.mkdir(parents=True)
    files = {"test": str(folder / "test.jsonl"), "train": str(folder / "train.json")}
    return write_lm_eval(folder, rows, generative, task=name, num_fewshot=1, dataset_kwargs={"data_files": files})


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tests' tiny model as an HF folder, and a multiple-choice and a generative task whose
    second answer is what the model generates for it (so exact match is 1 of 2, not 0 of 2)."""
    root = tmp_path_factory.mktemp("bridge")
    tok = load_tokenizer(FIXTURES / "tokenizer")
    save(root / "tiny", TINY, build(TINY, tok.vocab_size, seed=0).params, tok)
    pre = load(root / "tiny")
    mc = local_task(root / "tasks" / "mc", "toy_mc", MC_ROWS, generative=False)
    draft = local_task(root / "draft", "draft", GEN_ROWS, generative=True)
    outputs = [d["output"] for d in harness.score_task(pre, load_task(draft))["docs"]]
    rows = [GEN_ROWS[0], {**GEN_ROWS[1], "answer": outputs[1]}]
    assert outputs[0] != rows[0]["answer"]
    gen = local_task(root / "tasks" / "gen", "toy_gen", rows, generative=True)
    return root, pre, {"toy_mc": mc, "toy_gen": gen}


@pytest.mark.slow
def test_lm_eval_and_our_harness_score_alike(world):
    root, pre, tasks = world
    from lm_eval.tasks import TaskManager
    theirs = lm_eval.simple_evaluate(model=DilocoLM(pretrained=pre), tasks=list(tasks), log_samples=True,
                                     task_manager=TaskManager(include_path=str(root / "tasks")))
    for name, path in tasks.items():
        ours = harness.score_task(pre, load_task(path))
        samples = sorted(theirs["samples"][name], key=lambda s: s["doc_id"])
        assert len(samples) == ours["n"]
        for metric, m in ours["metrics"].items():
            assert theirs["results"][name][f"{metric},none"] == pytest.approx(m["value"], abs=1e-6)
        for sample, doc in zip(samples, ours["docs"]):
            if "loglikelihoods" in doc:  # the same prompts scored the same, answer by answer
                np.testing.assert_allclose([r[0][0] for r in sample["resps"]], doc["loglikelihoods"], rtol=1e-5)
            else:  # the same greedy text
                assert sample["resps"][0][0] == doc["output"]
    assert theirs["results"]["toy_gen"]["exact_match,none"] == 0.5


def test_rolling_loglikelihood_is_the_sum_over_every_token_by_hand():
    """A bigram model's log p of each character given the one before, summed over a text longer
    than the model's window (so it is scored in several), the first given the prefix token."""
    V = len(CharTokenizer.ALPHABET)
    table = np.random.default_rng(3).normal(0, 2, (V, V)).astype(np.float32)
    text = "q: abc 12+3!\n" * 25  # 325 characters against max_seq_len 128
    got = DilocoLM(pretrained=bigram(table), batch_size="4").loglikelihood_rolling([SimpleNamespace(args=(text,))])
    ids = [0] + CharTokenizer().encode(text)  # no BOS or EOS: the prefix is token 0
    logp = table - np.log(np.exp(table).sum(-1, keepdims=True))
    assert got[0] == pytest.approx(sum(logp[a, b] for a, b in zip(ids, ids[1:])), rel=1e-5)


def test_sampling_is_refused_by_name(world):
    _, pre, _ = world
    request = SimpleNamespace(args=("Q:", {"until": ["\n"], "do_sample": True, "temperature": 0.7}))
    with pytest.raises(ValueError, match="greedily only"):
        DilocoLM(pretrained=pre).generate_until([request])


@pytest.mark.slow
def test_lm_eval_command_line_runs_the_diloco_model(world, tmp_path):
    """`python -m diloco.evaluation.lm_eval_bridge` is lm-eval's command line with our model
    registered: its results file holds our harness's score."""
    root, pre, tasks = world
    env = {**os.environ, "XLA_FLAGS": "", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "diloco.evaluation.lm_eval_bridge", "--model", "diloco",
                           "--model_args", f"checkpoint={root / 'tiny'}", "--tasks", "toy_mc",
                           "--include_path", str(root / "tasks"), "--output_path", str(tmp_path / "out")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results*.json")).read_text())["results"]["toy_mc"]
    ours = harness.score_task(pre, load_task(tasks["toy_mc"]))["metrics"]
    assert results["acc,none"] == pytest.approx(ours["acc"]["value"])
    assert results["acc_norm,none"] == pytest.approx(ours["acc_norm"]["value"])
