"""Downstream tasks scored during a training run (run.eval_tasks): the global model's scores beside
its eval loss every run.eval_tasks_every steps and the base model's at step 0, as
`eval/<task>/<metric>` fields of the run's eval records (docs/evaluation.md#during-a-run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from diloco import report
from diloco.evaluation.harness import score_task
from diloco.evaluation.tasks import Task, TaskError, load_task

PREFIX = "eval/"  # a task score's field in an eval record and its TensorBoard tag: eval/<task>/<metric>
BATCH = 8  # requests per forward pass or generation call (split over the devices when they divide it)


def load_tasks(paths) -> tuple[Task, ...]:
    """run.eval_tasks read and checked before a run starts; two tasks of one name would write the
    same fields, so that is refused, naming both files."""
    tasks = tuple(load_task(p) for p in paths)
    seen: dict[str, str] = {}
    for t in tasks:
        if t.name in seen:
            raise TaskError(f"run.eval_tasks: {seen[t.name]} and {t.path} are both task {t.name!r}; "
                            "their scores would share the fields eval/<task>/<metric> (rename one's task:)")
        seen[t.name] = t.path
    return tasks


class RunTasks(NamedTuple):
    """Scores `tasks` on a run's trained params at the steps due: step 0 (the base model),
    every `every` steps (0: only the last) and the last, `limit` test documents each (0: all)."""
    tasks: tuple[Task, ...]
    model: Any  # the full model (diloco.model.Model) whose apply and decode the scores run through
    config: Any  # its ModelConfig
    tokenizer: Any  # diloco.hf.tokenizer.HFTokenizer of the run's text
    full: Callable[[Any], Any]  # trained params -> the full model's (LoRA: the adapters merged in)
    every: int
    steps: int
    limit: int

    def due(self, step: int, final: bool | None = None) -> bool:
        """Whether scores are due at `step`. `final`: None from a trainer with one eval a step;
        from a DiLoCo runtime, True for its eval after the final merges and False for the ones
        before, so the last step is scored once, on the model that is exported."""
        if final is False and step >= self.steps:
            return False
        return step == 0 or final is True or report.due(step, self.every, self.steps)

    def __call__(self, params, step: int, final: bool | None = None) -> dict[str, float]:
        """{eval/<task>/<metric>: value} of `params` at `step`; {} when none are due."""
        if not self.due(step, final):
            return {}
        from diloco.hf import Pretrained
        pre = Pretrained(self.model._replace(params=self.full(params)), self.config, 0, self.tokenizer, "run")
        return {f"{PREFIX}{result['task']}/{name}": m["value"]
                for result in (score_task(pre, t, -1, self.limit, BATCH) for t in self.tasks)
                for name, m in result["metrics"].items()}


def run_tasks(cfg, model, tokenizer, full: Callable[[Any], Any]) -> RunTasks | None:
    """The RunTasks of a TrainConfig (None without run.eval_tasks); run.eval_tasks_every 0 scores
    them at every eval. Task files are read here, so a bad one fails before the run starts."""
    r = cfg.run
    if not r.eval_tasks:
        return None
    return RunTasks(load_tasks(r.eval_tasks), model, cfg.model, tokenizer, full,
                    r.eval_tasks_every or r.eval_every, r.steps, r.eval_limit)


class Evaluator(NamedTuple):
    """What a runtime calls with the global model ({path: array}): its eval loss, as a plain
    evaluator; `tasks(theta, step)` adds the downstream scores due at that step (fields)."""
    loss: Callable[[dict], float]
    tasks: Callable[..., dict] | None = None  # (theta, step, final) -> fields, RunTasks.__call__

    def __call__(self, theta: dict) -> float:
        return self.loss(theta)


def fields(evaluate, theta, step: int, final: bool | None = None) -> dict[str, float]:
    """The task scores an eval record at `step` carries: {} from an evaluator without tasks (a
    plain loss function) or when none are due (`final`: RunTasks.due)."""
    tasks = getattr(evaluate, "tasks", None)
    return {} if tasks is None else tasks(theta, step, final)


def scores_tasks(evaluate) -> bool:
    """Whether `evaluate` scores tasks, so a new run's step-0 record is written."""
    return getattr(evaluate, "tasks", None) is not None


def last_scores(records) -> dict[str, float]:
    """The summary's task scores: each field's last value in the run's eval records."""
    out: dict[str, float] = {}
    for r in records:
        if r.get("kind") == "eval":
            out.update({k: v for k, v in r.items() if k.startswith(PREFIX)})
    return out
