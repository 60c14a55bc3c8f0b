"""Scoring downstream tasks on a model: few-shot prompts, the batched requests of each task, the
per-task metric with its 95% interval, and the table scripts/evaluate.py prints
(docs/evaluation.md).
"""

from __future__ import annotations

import json
import random
import re
import sys
from collections.abc import Sequence

from diloco.evaluation import scoring
from diloco.evaluation.tasks import GENERATE, Doc, Task, TaskError, load_task

FEWSHOT_SEED = 1234  # lm-eval's default few-shot seed


def answer(task: Task, doc: Doc) -> str:
    return doc.choices[doc.gold] if task.output_type != GENERATE else doc.targets[0]


def prompts(task: Task, num_fewshot: int, seed: int = FEWSHOT_SEED) -> list[str]:
    """Each test document's full context: the description, num_fewshot solved examples drawn with a
    fixed seed from the few-shot pool (never the document itself), then its question."""
    rng = random.Random(seed)
    out = []
    for i, doc in enumerate(task.test):
        pool = [j for j in range(len(task.fewshot)) if not (task.fewshot_is_test and j == i)]
        if num_fewshot > len(pool):
            raise TaskError(f"{task.path}: num_fewshot={num_fewshot} but only {len(pool)} few-shot examples")
        shots = [task.fewshot[j] for j in rng.sample(pool, num_fewshot)]
        parts = [s.context + task.target_delimiter + answer(task, s) for s in shots] + [doc.context]
        out.append(task.description + task.fewshot_delimiter.join(parts))
    return out


def _split(context: str, continuation: str) -> tuple[str, str]:
    """lm-eval's rule: trailing spaces of the context belong to the continuation, so `A: ` + `yes`
    and `A:` + ` yes` tokenize alike."""
    stripped = context.rstrip(" ")
    return stripped, context[len(stripped):] + continuation


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Tokens of the context and of the continuation, encoded together and split where the context
    ends (a word cut at a boundary tokenizes as the model saw it); an empty context is the BOS (or
    EOS) token, so the first token has something to be predicted from."""
    context, continuation = _split(context, continuation)
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    n = len(tokenizer.encode(context, add_special_tokens=False))
    ctx, cont = whole[:n], whole[n:]
    if not ctx:
        ctx = [t for t in (tokenizer.bos_id, tokenizer.eos_id) if t is not None][:1] or [0]
    return ctx, cont


def encode_prompt(tokenizer, context: str) -> list[int]:
    """A generation prompt's tokens; an empty one is the BOS (or EOS) token, as an empty context is."""
    return tokenizer.encode(context, add_special_tokens=False) or encode_pair(tokenizer, "", "")[0]


def score_task(pre, task: Task, num_fewshot: int = -1, limit: int = 0, batch_size: int = 8) -> dict:
    """{metric: {value, low, high}} of `task` on pre (a diloco.hf.Pretrained), plus n and the
    per-document records under "docs"."""
    shots = task.num_fewshot if num_fewshot < 0 else num_fewshot
    contexts = prompts(task, shots)
    docs = task.test[:limit] if limit else task.test
    contexts = contexts[:len(docs)]
    if task.output_type == GENERATE:
        encoded = [encode_prompt(pre.tokenizer, c) for c in contexts]
        outputs = scoring.generate_until(pre.model, pre.config, pre.tokenizer, encoded, task.until,
                                         task.max_gen_toks, batch_size)
        if task.output_regex:
            outputs = [next(iter(re.findall(task.output_regex, o)), "") for o in outputs]
        records = [{"output": o, "exact_match": scoring.exact_match(o, d.targets), "f1": scoring.f1(o, d.targets)}
                   for o, d in zip(outputs, docs)]
    else:
        pairs = [encode_pair(pre.tokenizer, c, task.target_delimiter + choice)
                 for c, d in zip(contexts, docs) for choice in d.choices]
        lls = [ll for ll, _ in scoring.loglikelihoods(pre.model, pre.config.max_seq_len, pairs, batch_size)]
        records, at = [], 0
        for d in docs:
            doc_lls, at = lls[at:at + len(d.choices)], at + len(d.choices)
            acc, acc_norm = scoring.choice_correct(doc_lls, d.choices, d.gold)
            records.append({"loglikelihoods": doc_lls, "acc": acc, "acc_norm": acc_norm})
    result = {"task": task.name, "path": task.path, "num_fewshot": shots, "n": len(docs), "metrics": {}}
    for name in task.metrics:
        values = [float(r[name]) for r in records]
        value = sum(values) / max(len(values), 1)
        low, high = (scoring.bootstrap(values) if name == "f1" else scoring.wilson(round(sum(values)), len(values)))
        result["metrics"][name] = {"value": value, "low": low, "high": high}
    result["docs"] = records
    return result


def table(results: Sequence[dict], out=sys.stdout) -> None:
    rows = [(r["task"], str(r["num_fewshot"]), str(r["n"]), name, f"{m['value']:.4f}",
             f"[{m['low']:.4f}, {m['high']:.4f}]") for r in results for name, m in r["metrics"].items()]
    head = ("task", "shots", "n", "metric", "value", "95% interval")
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    for row in [head, tuple("-" * w for w in widths), *rows]:
        print("  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip(), file=out)


def write_json(results: Sequence[dict], path: str) -> None:
    with open(path, "w") as f:
        json.dump({"tasks": list(results)}, f, indent=1)


def run_tasks(cfg, out=sys.stdout) -> dict:
    """scripts/evaluate.py tasks=[...]: every task file read first (a bad one fails before the model
    loads), then scored on cfg.checkpoint; prints the table and returns {"checkpoint", "tasks"}."""
    from diloco.hf import CheckpointError, load, resolve
    tasks = [load_task(p) for p in cfg.tasks]
    pre = load(resolve(cfg.checkpoint), dtype=cfg.dtype)
    if pre.tokenizer is None:
        raise CheckpointError(f"{pre.path} has no tokenizer.json, so task prompts cannot be encoded")
    results = [score_task(pre, t, cfg.num_fewshot, cfg.limit, cfg.batch_size) for t in tasks]
    table(results, out)
    if cfg.output:
        write_json(results, cfg.output)
    return {"checkpoint": cfg.checkpoint, "tasks": results}
