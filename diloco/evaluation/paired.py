"""Two models scored on the same test documents, compared document by document: the exact McNemar
test of their disagreements (docs/evaluation.md#comparing-two-models). Two scores' intervals
overlap long before the models stop differing: on the same documents the question is only which
documents one gets right and the other wrong.

Reads what the harness writes: scripts/evaluate.py's output= file ({"tasks": [...]} with each
document's record) and the fine-tuning study's task_score.json ({"metric", "correct"}).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from math import comb
from pathlib import Path

from diloco.config import ConfigError

METRICS = ("exact_match", "acc")  # the per-document right/wrong metrics, in the order preferred


def mcnemar(a: Sequence[bool], b: Sequence[bool]) -> dict:
    """{n, a_only, b_only, diff, p}: the documents only a / only b got right, b's score less a's,
    and the exact two-sided McNemar p-value (a binomial test of the disagreements at 1/2; 1.0 when
    they never disagree)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} and {len(b)} documents: not the same test set")
    a_only = sum(1 for x, y in zip(a, b) if x and not y)
    b_only = sum(1 for x, y in zip(a, b) if y and not x)
    n = a_only + b_only
    tail = sum(comb(n, i) for i in range(min(a_only, b_only) + 1))
    p = 1.0 if n == 0 else min(1.0, 2 * tail / 2 ** n)  # exact integers: no overflow at large n
    return {"n": len(a), "a_only": a_only, "b_only": b_only, "diff": (b_only - a_only) / max(len(a), 1), "p": p}


def as_bits(correct: Sequence[bool]) -> str:
    """A compact record of each document's right (1) or wrong (0)."""
    return "".join("1" if c else "0" for c in correct)


def read(path: str | Path) -> dict[str, tuple[str, list[bool]]]:
    """{task: (metric, each document right or wrong)} of a score file."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"compare: {path} is not a readable JSON score file ({err})") from None
    if isinstance(raw, dict) and isinstance(raw.get("correct"), str):  # the study's task_score.json
        return {str(raw.get("task") or "task"): (raw.get("metric", "?"), [c == "1" for c in raw["correct"]])}
    out = {}
    tasks = raw.get("tasks") if isinstance(raw, dict) else None
    # another file's "tasks" (a config's list of task files, say) is no score: skipped, not a traceback
    for t in tasks if isinstance(tasks, list) else []:
        docs = t.get("docs") if isinstance(t, dict) else None
        if not (docs and isinstance(docs, list) and all(isinstance(d, dict) for d in docs)
                and isinstance(t.get("task"), str)):
            continue
        metric = next((m for m in METRICS if all(m in d for d in docs)), None)
        if metric is not None:
            out[t["task"]] = (metric, [bool(d[metric]) for d in docs])
    if not out:
        raise ConfigError(f"compare: {path} has no per-document results (write them with scripts/evaluate.py "
                          "tasks=[...] output=FILE, or a study's task_score.json that has 'correct')")
    return out


def compare(paths: Sequence[str], out=sys.stdout) -> list[dict]:
    """Each file after the first against the first, task by task (tasks they share; a lone file's
    single task is matched to the other's single task whatever their names); prints a table."""
    if len(paths) < 2:
        raise ConfigError(f"compare={list(paths)} needs two or more score files: the reference first")
    ref = read(paths[0])
    rows = []
    for path in paths[1:]:
        other = read(path)
        pairs = [(t, t) for t in ref if t in other] or (
            [(next(iter(ref)), next(iter(other)))] if len(ref) == len(other) == 1 else [])
        if not pairs:
            raise ConfigError(f"compare: {paths[0]} ({', '.join(ref)}) and {path} ({', '.join(other)}) share no task")
        for t_ref, t_other in pairs:
            (metric, a), (metric_b, b) = ref[t_ref], other[t_other]
            if metric != metric_b:
                raise ConfigError(f"compare: {paths[0]} scored {t_ref} by {metric} and {path} by {metric_b}")
            if len(a) != len(b):
                raise ConfigError(f"compare: {paths[0]} scored {len(a)} documents of {t_ref} and {path} {len(b)}: "
                                  "not the same test set")
            rows.append({"task": t_ref, "metric": metric, "reference": str(paths[0]), "other": str(path),
                         "reference_value": sum(a) / max(len(a), 1), "other_value": sum(b) / max(len(b), 1),
                         **mcnemar(a, b)})
    table(rows, out)
    return rows


def table(rows: Sequence[dict], out=sys.stdout) -> None:
    head = ("task", "metric", "n", "reference", "other", "right only in ref", "only in other", "diff", "McNemar p")
    lines = [(r["task"], r["metric"], str(r["n"]), f"{r['reference_value']:.4f}", f"{r['other_value']:.4f}",
              str(r["a_only"]), str(r["b_only"]), f"{r['diff']:+.4f}", f"{r['p']:.3g}") for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    for line in [head, tuple("-" * w for w in widths), *lines]:
        print("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip(), file=out)
    for p in dict.fromkeys(x for r in rows for x in (r["reference"], r["other"])):
        print(f"  {p}", file=out)
