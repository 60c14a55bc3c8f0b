"""Downstream tasks read from local files into one document form: lm-eval's task YAML (`dataset_path:
json`, Jinja templates) and BIG-bench's JSON task files (docs/evaluation.md#task-files).

A Task carries the documents and the few prompt-building strings both formats need; prompts.py
assembles them and harness.py scores them, whichever file they came from.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import numpy as np
import yaml

from diloco.config import ConfigError

MULTIPLE_CHOICE, GENERATE = "multiple_choice", "generate_until"
METRICS = {MULTIPLE_CHOICE: ("acc", "acc_norm"), GENERATE: ("exact_match", "f1")}
# BIG-bench's prompt defaults, the optional fields of its JSON task format (docs/evaluation.md#task-files)
BB_INPUT, BB_OUTPUT, BB_CHOICE, BB_SEPARATOR = "\nQ: ", "\nA: ", "\n  choice: ", "\n"
BB_REGEX = r"[^\.\?\!\;\n]+"  # BIG-bench's answer extraction when a task gives no stop string or regex


class TaskError(ConfigError):
    """A task file is missing, malformed, or uses a feature this harness does not support."""


@dataclass(frozen=True)
class Doc:
    context: str  # the rendered question, without few-shot examples
    choices: tuple[str, ...] = ()  # multiple choice: each answer, scored after target_delimiter
    gold: int = 0  # multiple choice: index of the right answer
    targets: tuple[str, ...] = ()  # generative: the accepted answers


@dataclass(frozen=True)
class Task:
    name: str
    path: str
    output_type: str  # MULTIPLE_CHOICE | GENERATE
    test: tuple[Doc, ...]
    fewshot: tuple[Doc, ...]  # the pool few-shot examples are drawn from
    fewshot_is_test: bool = False  # BIG-bench: examples come from the test docs, never the item itself
    num_fewshot: int = 0
    description: str = ""  # text before everything (lm-eval description, BIG-bench task_prefix)
    target_delimiter: str = " "
    fewshot_delimiter: str = "\n\n"
    until: tuple[str, ...] = ()
    max_gen_toks: int = 256
    output_regex: str | None = None  # generative: keep the first match of the generation (BIG-bench)
    metrics: tuple[str, ...] = field(default=())


def _fail(path, message: str):
    raise TaskError(f"{path}: {message}")


def load_task(path: str | Path) -> Task:
    path = Path(path)
    if not path.is_file():
        _fail(path, "task file not found")
    if path.suffix in (".yaml", ".yml"):
        return _lm_eval(path)
    if path.suffix == ".json":
        return _bigbench(path)
    _fail(path, "a task file is lm-eval YAML (.yaml) or a BIG-bench task (.json)")


# ---- lm-eval YAML --------------------------------------------------------------------------------

_YAML_KEYS = {"task", "dataset_path", "dataset_kwargs", "dataset_name", "test_split", "validation_split",
              "training_split", "fewshot_split", "doc_to_text", "doc_to_target", "doc_to_choice", "output_type",
              "generation_kwargs", "num_fewshot", "metric_list", "target_delimiter", "fewshot_delimiter",
              "description", "tag", "group", "metadata", "should_decontaminate", "doc_to_decontamination_query",
              "repeats"}
_JINJA = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def _lm_eval(path: Path) -> Task:
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:  # includes lm-eval's !function tags, which run Python from the task
        _fail(path, f"not YAML this harness reads ({str(err).splitlines()[0]}); !function is not supported")
    if not isinstance(raw, dict):
        _fail(path, "a task YAML is a mapping of fields")
    unknown = sorted(set(raw) - _YAML_KEYS)
    if unknown:
        _fail(path, f"field(s) {', '.join(unknown)} not supported (supported: {', '.join(sorted(_YAML_KEYS))})")
    if raw.get("dataset_path") != "json":
        _fail(path, f"dataset_path={raw.get('dataset_path')!r}: only 'json' (local files in dataset_kwargs.data_files)")
    if raw.get("dataset_name") is not None:
        _fail(path, "dataset_name: not supported with dataset_path: json")
    if raw.get("repeats", 1) != 1:
        _fail(path, f"repeats={raw['repeats']}: only 1")
    output_type = raw.get("output_type", GENERATE)
    if output_type not in METRICS:
        _fail(path, f"output_type={output_type!r} not in {MULTIPLE_CHOICE}|{GENERATE}")
    splits = _splits(path, raw)
    test_name = raw.get("test_split") or raw.get("validation_split")
    if test_name is None:
        _fail(path, "test_split (or validation_split) is required")
    shot_name = raw.get("fewshot_split") or raw.get("training_split") or raw.get("validation_split")
    for key in ("test_split", "fewshot_split", "training_split", "validation_split"):
        if raw.get(key) is not None and raw[key] not in splits:
            _fail(path, f"{key}={raw[key]!r} is not a split of data_files (splits: {', '.join(splits)})")
    to_doc = _doc_maker(path, raw, output_type)
    test = tuple(to_doc(d, i, test_name) for i, d in enumerate(splits[test_name]))
    if not test:
        _fail(path, f"test_split={test_name!r} holds no documents")
    pool = () if shot_name is None else tuple(to_doc(d, i, shot_name) for i, d in enumerate(splits[shot_name]))
    gen = raw.get("generation_kwargs") or {}
    unknown = sorted(set(gen) - {"until", "max_gen_toks", "do_sample", "temperature"})
    if unknown or gen.get("do_sample") or gen.get("temperature", 0):
        _fail(path, f"generation_kwargs: only greedy decoding with until and max_gen_toks (got {gen})")
    until = gen.get("until", [raw.get("fewshot_delimiter", "\n\n")])
    until = (until,) if isinstance(until, str) else tuple(until)
    metrics = _metrics(path, raw.get("metric_list"), output_type)
    return Task(name=str(raw.get("task", path.stem)), path=str(path), output_type=output_type, test=test,
                fewshot=pool, fewshot_is_test=shot_name == test_name, num_fewshot=_int(path, raw, "num_fewshot", 0),
                description=str(raw.get("description", "")), target_delimiter=str(raw.get("target_delimiter", " ")),
                fewshot_delimiter=str(raw.get("fewshot_delimiter", "\n\n")), until=until,
                max_gen_toks=_int(path, gen, "max_gen_toks", 256), metrics=metrics)


def _int(path, raw: dict, key: str, default: int) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or value < 0:
        _fail(path, f"{key}={value!r} must be an integer >= 0")
    return value


def _metrics(path, metric_list, output_type: str) -> tuple[str, ...]:
    if metric_list is None:
        return METRICS[output_type][:1] if output_type == GENERATE else METRICS[output_type]
    names = [m.get("metric") if isinstance(m, dict) else m for m in metric_list]
    bad = [n for n in names if n not in METRICS[output_type]]
    if bad:
        _fail(path, f"metric_list: {bad} not supported for {output_type} "
                    f"(supported: {', '.join(METRICS[output_type])})")
    return tuple(names)


def _splits(path: Path, raw: dict) -> dict[str, list[dict]]:
    kwargs = raw.get("dataset_kwargs") or {}
    if not isinstance(kwargs, dict) or set(kwargs) - {"data_files"}:
        _fail(path, f"dataset_kwargs: only data_files is supported (got {kwargs})")
    files = kwargs.get("data_files")
    if files is None:
        _fail(path, "dataset_kwargs.data_files is required (local .json/.jsonl files)")
    if not isinstance(files, dict):  # as Hugging Face datasets does: files without split names are "train"
        files = {"train": files}
    out = {}
    for split, names in files.items():
        docs = []
        for name in [names] if isinstance(names, str) else names:
            file = Path(name) if Path(name).is_absolute() else path.parent / name  # relative to the YAML
            docs += _records(path, file, split)
        out[split] = docs
    return out


def _records(task: Path, file: Path, split: str) -> list[dict]:
    if not file.is_file():
        _fail(task, f"dataset_kwargs.data_files[{split}]: {file} not found")
    text = file.read_text()
    try:
        lines = [json.loads(x) for x in text.splitlines() if x.strip()] if not text.lstrip().startswith("[") else None
        data = json.loads(text) if lines is None else lines
    except json.JSONDecodeError as err:
        _fail(task, f"dataset_kwargs.data_files[{split}]: {file} is not JSON lines or a JSON list ({err})")
    if not all(isinstance(d, dict) for d in data):
        _fail(task, f"dataset_kwargs.data_files[{split}]: {file} holds records that are not objects")
    return data


def _doc_maker(path: Path, raw: dict, output_type: str):
    for key in ("doc_to_text", "doc_to_target") + (("doc_to_choice",) if output_type == MULTIPLE_CHOICE else ()):
        if key not in raw:
            _fail(path, f"{key} is required for output_type {output_type}")

    def render(key: str, doc: dict, where: str):
        spec = raw[key]
        if isinstance(spec, (int, list)):
            return spec
        if not isinstance(spec, str):
            _fail(path, f"{key}: a Jinja template, a field name, an integer or a list (got {type(spec).__name__})")
        if spec in doc:  # lm-eval: a bare field name is that field's value
            return doc[spec]
        try:
            return _JINJA.from_string(spec).render(**doc)
        except jinja2.TemplateError as err:
            _fail(path, f"{key} on {where}: {err}")

    def to_doc(doc: dict, i: int, split: str) -> Doc:
        where = f"{split}[{i}]"
        text, target = str(render("doc_to_text", doc, where)), render("doc_to_target", doc, where)
        if output_type == GENERATE:
            targets = tuple(map(str, target)) if isinstance(target, list) else (str(target),)
            return Doc(text, targets=targets)
        choices = render("doc_to_choice", doc, where)
        if isinstance(choices, str):  # a template renders a list as its Python literal
            try:
                choices = ast.literal_eval(choices)
            except (ValueError, SyntaxError):
                _fail(path, f"doc_to_choice on {where}: {choices!r} is not a list")
        if not isinstance(choices, list) or not choices:
            _fail(path, f"doc_to_choice on {where}: {choices!r} is not a non-empty list")
        choices = tuple(map(str, choices))
        if isinstance(target, str) and target.strip().isdigit():
            target = int(target)
        gold = target if isinstance(target, int) else choices.index(target) if target in choices else None
        if gold is None or not 0 <= gold < len(choices):
            _fail(path, f"doc_to_target on {where}: {target!r} is neither an index nor one of {list(choices)}")
        return Doc(text, choices=choices, gold=gold)

    return to_doc


# ---- BIG-bench JSON ------------------------------------------------------------------------------

_BB_KEYS = {"name", "description", "keywords", "metrics", "preferred_score", "examples", "task_prefix",
            "example_input_prefix", "example_output_prefix", "choice_prefix", "append_choices_to_input",
            "few_shot_example_separator", "stop_string", "output_regex", "canary", "comment",
            "append_choices_to_input", "random_seed"}


def _bigbench(path: Path) -> Task:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        _fail(path, f"not JSON ({err})")
    if not isinstance(raw, dict) or not isinstance(raw.get("examples"), list) or not raw["examples"]:
        _fail(path, "examples: a BIG-bench task holds a non-empty list of examples")
    unknown = sorted(set(raw) - _BB_KEYS)
    if unknown:
        _fail(path, f"field(s) {', '.join(unknown)} not supported")
    mc = not bb_generative(raw)
    if mc and not all("target_scores" in e for e in raw["examples"]):
        _fail(path, "examples: each holds target_scores (multiple choice) or each holds target (generative)")
    output = raw.get("example_output_prefix", BB_OUTPUT)
    # A trailing space of the output prefix is the delimiter before the answer, as lm-eval moves it
    # (so `A: ` + `yes` scores the same tokens as `A:` + ` yes`).
    stripped = output.rstrip(" ")
    docs = tuple(_bb_doc(path, raw, e, i, mc, stripped) for i, e in enumerate(raw["examples"]))
    stop = raw.get("stop_string")
    regex = raw.get("output_regex", None if stop else BB_REGEX)
    return Task(name=str(raw.get("name", path.parent.name if path.stem == "task" else path.stem)), path=str(path),
                output_type=MULTIPLE_CHOICE if mc else GENERATE, test=docs, fewshot=docs, fewshot_is_test=True,
                description=str(raw.get("task_prefix", "")), target_delimiter=output[len(stripped):],
                fewshot_delimiter=str(raw.get("few_shot_example_separator", BB_SEPARATOR)),
                until=(stop,) if stop else ("\n",), max_gen_toks=128, output_regex=regex,
                metrics=METRICS[MULTIPLE_CHOICE] if mc else ("exact_match",))


def bb_generative(raw: dict) -> bool:
    """Whether a BIG-bench task is scored by generation: every example has a target, and the task
    prefers exact_str_match or some example lacks target_scores (arithmetic's examples carry both;
    its preferred score is exact match)."""
    ex = raw["examples"]
    return (all(isinstance(e, dict) and "target" in e for e in ex)
            and (raw.get("preferred_score") == "exact_str_match"
                 or not all(isinstance(e, dict) and "target_scores" in e for e in ex)))


def _bb_doc(path: Path, raw: dict, example, i: int, mc: bool, output: str) -> Doc:
    if not isinstance(example, dict) or not isinstance(example.get("input"), str):
        _fail(path, f"examples[{i}].input: a string is required")
    text = raw.get("example_input_prefix", BB_INPUT) + example["input"]
    if not mc:
        target = example["target"]
        targets = (target,) if isinstance(target, str) else tuple(target) if isinstance(target, list) else ()
        if not targets or not all(isinstance(t, str) for t in targets):
            _fail(path, f"examples[{i}].target: a string or a list of strings")
        return Doc(text + output, targets=targets)
    scores = example["target_scores"]
    if not isinstance(scores, dict) or not scores:
        _fail(path, f"examples[{i}].target_scores: a non-empty mapping of answer to score")
    choices = tuple(scores)
    if raw.get("append_choices_to_input", True):
        # BIG-bench lists the choices sorted, then shuffled with seed 42, afresh for each example
        shown = np.random.RandomState(42).permutation(sorted(choices))
        prefix = raw.get("choice_prefix", BB_CHOICE)
        text += prefix + prefix.join(shown)
    best = max(scores.values())
    return Doc(text + output, choices=choices, gold=[s == best for s in scores.values()].index(True))
