"""The fine-tuning study on real tasks (issue 33 item 4, docs/finetuning.md#real-tasks): a pretrained
checkpoint fine-tuned on the train split of BIG-bench tasks by data parallel, DP + LoRA, Decoupled
DiLoCo and DiLoCo + LoRA at equal trained tokens over seeds, each scored on the task's test split
(loglikelihood for multiple choice, exact match for generation) with its 95% interval, beside its
held-out masked loss, the bytes it sent and the syncer's drift monitor.

Every run is an ordinary training run in <out_dir>/finetune_tasks/<task>/<variant>/seed<k>/,
reused when it already finished with the same config (experiments/runner.py); a model's scores are
cached beside it in task_score.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from diloco.config import ConfigError, from_dict
from diloco.evaluation import bigbench_data
from diloco.experiments import runner
from diloco.experiments.spec import ExperimentSpec, Job, Settings, Variant, dp_reference, hydra_configs, train_config

NAME = "finetune_tasks"
# Copied from a run's summary into its row: the drift monitor's, and the share of the trained
# tokens the final model holds (a DiLoCo run's progress overwritten by a merge, or never sent, is
# lost: docs/algorithm.md#applying-merged-fragments)
SUMMARY_KEYS = ("drift_rel_max", "drift_l2_max", "pseudograd_cos_mean", "tokens_merged_share")


@dataclass(frozen=True)
class TasksConfig:
    """configs/finetune_tasks.yaml."""

    checkpoint: str = "smollm2"
    tasks: dict = dataclasses.field(default_factory=dict)  # name -> "" (made from the sdist) or a task.json path
    only_tasks: tuple[str, ...] = ()  # a subset of tasks' names to run; () = all
    test_size: int = 200  # test examples of each task; the rest (minus repeats of test inputs) train
    split_seed: int = 0  # the split's shuffle: fixed across the runs' seeds, so every seed scores the same test set
    seeds: tuple[int, ...] = (0, 1, 2)  # each run's run.seed (its data order and init of LoRA)
    max_gen_toks: int = 8  # generated tokens of a generative task's answer
    score_batch: int = 8
    eval_sequences: int = 16
    base: tuple[str, ...] = ()
    variants: tuple[Variant, ...] = ()  # the first is the data-parallel reference of the bytes
    only: tuple[str, ...] = ()  # a subset of variants' labels to run; () = all
    overrides: tuple[str, ...] = ()
    data_dir: str = "data/bigbench"  # the sdist and what is made from it (git-ignored)
    out_dir: str = "results"
    fresh: bool = False
    compilation_cache: str = "~/.cache/diloco/xla"


def parse(raw: dict) -> TasksConfig:
    cfg = from_dict(TasksConfig, raw)
    e = []
    if not cfg.tasks:
        e.append("no tasks")
    if not cfg.variants:
        e.append("no variants")
    if cfg.test_size < 1 or cfg.max_gen_toks < 1 or cfg.score_batch < 1 or not cfg.seeds:
        e.append(f"test_size={cfg.test_size}, max_gen_toks={cfg.max_gen_toks}, score_batch={cfg.score_batch} "
                 f"must be >= 1 and seeds={list(cfg.seeds)} non-empty")
    labels = [v.label for v in cfg.variants]
    if set(cfg.only) - set(labels) or set(cfg.only_tasks) - set(cfg.tasks):
        e.append(f"only={list(cfg.only)} must name variants of {labels} and only_tasks={list(cfg.only_tasks)} "
                 f"tasks of {list(cfg.tasks)}")
    if e:
        raise ConfigError("invalid finetune_tasks study:\n  " + "\n  ".join(e))
    return cfg


def jobs(cfg: TasksConfig, task: str, checkpoint: Path, train_file: Path) -> tuple[Settings, list[Job]]:
    spec = ExperimentSpec(name=f"{NAME}/{task}", base=(*cfg.base, "data=sft", f"data.paths=[{train_file}]",
                                                       f"model.init_from={checkpoint}"),
                          variants=cfg.variants, seeds=cfg.seeds, eval_sequences=cfg.eval_sequences)
    settings = Settings(experiment=spec, overrides=cfg.overrides, out_dir=cfg.out_dir,
                        fresh=cfg.fresh, compilation_cache=cfg.compilation_cache)
    chosen = [v for v in cfg.variants if not cfg.only or v.label in cfg.only]
    with hydra_configs():
        planned = [Job(spec.name, v.label, s, train_config(spec, v, s, settings)) for v in chosen for s in cfg.seeds]
    return settings, planned


def score(model_path: Path, test_file: Path, cfg: TasksConfig, cache: Path) -> dict:
    """The model's metric on the test split with its 95% interval; cached in `cache` for this test
    file and generation length."""
    from diloco.evaluation.harness import score_task
    from diloco.evaluation.tasks import GENERATE, load_task
    from diloco.hf import load

    from diloco.evaluation.paired import as_bits

    key = bigbench_data.sha256(test_file)[:16] + f"/{cfg.max_gen_toks}"
    if cache.exists() and not cfg.fresh:
        saved = json.loads(cache.read_text())
        if saved.get("key") == key and "correct" in saved:  # older files lack the per-question record
            return saved
    task = dataclasses.replace(load_task(test_file), max_gen_toks=cfg.max_gen_toks)
    result = score_task(load(model_path), task, 0, 0, cfg.score_batch)
    metric = "exact_match" if task.output_type == GENERATE else "acc"
    m = result["metrics"][metric]
    out = {"key": key, "task": task.name, "metric": metric, "value": m["value"], "low": m["low"], "high": m["high"], "n": result["n"],
           "acc_norm": result["metrics"].get("acc_norm", {}).get("value"), "examples": result["docs"][:4],
           "correct": as_bits(bool(d[metric]) for d in result["docs"])}  # each question: the paired tests
    cache.write_text(json.dumps(out, indent=1))
    return out


def row(task: str, job: Job, summary: dict, s: dict, dp_bytes: float) -> dict:
    c = job.cfg
    if c.algo == "dp":  # a bf16 ring all-reduce of what trains (LoRA: the adapters) every step
        from diloco.run import dp_bytes_same_steps
        sent = dp_bytes_same_steps(c, summary.get("adapter_params", summary["params"]))
    else:
        sent = summary["bytes_up"] + summary["bytes_down"]
    return {"task": task, "variant": job.variant, "seed": job.seed, "algo": c.algo,
            "learners": c.runtime.learners if c.algo == "diloco" else 1, "lora_rank": c.finetune.lora.rank,
            "steps": c.run.steps, "assistant_tokens": summary.get("assistant_tokens"),
            "metric": s["metric"], "value": s["value"], "low": s["low"], "high": s["high"], "n": s["n"],
            "eval_loss": summary["eval_loss"], "bytes": sent, "bytes_over_dp": sent / dp_bytes if dp_bytes else math.nan,
            "wall_s": summary["wall_s"], "trained_params": summary.get("adapter_params", summary["params"]),
            "params": summary["params"], **{k: summary[k] for k in SUMMARY_KEYS if k in summary},
            "correct": s["correct"], "run_dir": str(c.run.out_dir)}


def _num(x, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _drift(r: dict) -> str:
    """The largest fragment's distance from the base over its norm, or its L2 where the base is
    zero (LoRA's adapters)."""
    if r.get("drift_rel_max") is not None:
        return f"{r['drift_rel_max']:.4f} of the base"
    return "-" if r.get("drift_l2_max") is None else f"L2 {r['drift_l2_max']:.3g}"


def table(before: dict, rows: list[dict]) -> str:
    """One line per task and model (the base, then each run), in the order run."""
    head = ("| task | model | seed | metric [95% CI] | n | held-out masked loss | bytes sent | / data parallel | "
            "drift: largest fragment's | pseudo-grad cos | tokens merged | trained params | wall s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for task, b in before.items():
        lines.append(f"| {task} | base | - | {b['metric']} {b['value']:.3f} [{b['low']:.3f}, {b['high']:.3f}] | "
                     f"{b['n']} | {_num(b.get('eval_loss'), '.4f')} | - | - | - | - | - | - | - |")
        for r in (r for r in rows if r["task"] == task):
            lines.append(f"| {task} | {r['variant']} | {r['seed']} | {r['metric']} {r['value']:.3f} "
                         f"[{r['low']:.3f}, {r['high']:.3f}] | {r['n']} | {r['eval_loss']:.4f} | "
                         f"{r['bytes'] / 1e9:.3f} GB | {_num(r['bytes_over_dp'], '.5f')} | "
                         f"{_drift(r)} | {_num(r.get('pseudograd_cos_mean'), '.3f')} | "
                         f"{_num(r.get('tokens_merged_share'), '.3f')} | "
                         f"{r['trained_params']:,} | {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n" + paired_table(rows)


def reference(r: dict, rows: list[dict]) -> dict | None:
    """The data-parallel run a DiLoCo run is paired with: the same task and seed, trained the same
    way (LoRA against DP + LoRA, every weight against DP)."""
    lora = r["trained_params"] < r["params"]
    return next((d for d in rows if d["algo"] == "dp" and d["task"] == r["task"] and d["seed"] == r["seed"]
                 and (d["trained_params"] < d["params"]) == lora), None)


def paired_table(rows: list[dict]) -> str:
    """Each DiLoCo run against its data-parallel run on the same questions (exact McNemar)."""
    from diloco.evaluation.paired import mcnemar

    lines = []
    for r in rows:
        ref = reference(r, rows) if r["algo"] != "dp" else None
        if ref is None:
            continue
        m = mcnemar([c == "1" for c in ref["correct"]], [c == "1" for c in r["correct"]])
        lines.append(f"| {r['task']} | {r['variant']} | {ref['variant']} | {r['seed']} | {m['diff'] * 100:+.1f} | "
                     f"{m['b_only']} | {m['a_only']} | {m['p']:.3g} |")
    if not lines:
        return ""
    head = "| task | model | against | seed | points | right only here | right only there | McNemar p |"
    return "\n" + "\n".join([head, "|" + "---|" * 8, *lines]) + "\n"


def prepare(cfg: TasksConfig, task: str, tokenizer) -> dict:
    """The task's splits under <out_dir>/finetune_tasks/<task>/data (the test prompt in the
    checkpoint's chat wrapping, as its training conversations are rendered)."""
    source = bigbench_data.fetch(task, cfg.data_dir, cfg.tasks[task] or "")
    out = Path(cfg.out_dir) / NAME / task / "data"
    return bigbench_data.write_splits(source, task, cfg.split_seed, cfg.test_size, out,
                                      bigbench_data.chat_wrapping(tokenizer))


def run(cfg: TasksConfig) -> list[Path]:
    """Train and score every task x variant x seed; write <out_dir>/finetune_tasks.{md,json}."""
    from diloco.experiments.finetune_study import masked_loss
    from diloco.hf import CheckpointError, load, resolve
    from diloco.hf.tokenizer import load_tokenizer

    checkpoint = resolve(cfg.checkpoint)
    tokenizer = load_tokenizer(checkpoint) if Path(checkpoint).is_dir() else load(checkpoint).tokenizer
    if tokenizer is None:
        raise CheckpointError(f"{checkpoint} has no tokenizer, so task prompts cannot be encoded")
    out = Path(cfg.out_dir)
    before, rows, refused = {}, [], []
    for task in (t for t in cfg.tasks if not cfg.only_tasks or t in cfg.only_tasks):
        data = prepare(cfg, task, tokenizer)
        settings, planned = jobs(cfg, task, checkpoint, data["train"])
        runner.ensure_devices(runner.devices_needed(planned))
        runner.enable_compilation_cache(cfg.compilation_cache)
        base = score(checkpoint, data["test"], cfg, out / NAME / task / "base_score.json")
        if "eval_loss" not in base:
            base["eval_loss"] = masked_loss(planned[0])
            (out / NAME / task / "base_score.json").write_text(json.dumps(base, indent=1))
        before[task] = base
        print(f"[{NAME}] {task}: {data['n_train']} train, {data['n_test']} test; base {base['metric']} "
              f"{base['value']:.3f}", flush=True)
        # The bytes' reference: data parallel of the full model every step, among the slices of the
        # first data-parallel variant, run or not (runtime.learners: 4 in the default study)
        ref = dp_reference(settings.experiment, planned[0].seed, settings)
        dp_bytes = None
        for job, summary in runner.trained_each(planned, settings, refused):
            if dp_bytes is None:
                from diloco.run import dp_bytes_same_steps
                dp_bytes = dp_bytes_same_steps(ref, summary["params"])
            run_dir = Path(job.cfg.run.out_dir)
            s = score(run_dir / "model", data["test"], cfg, run_dir / "task_score.json")
            rows.append(row(task, job, summary, s, dp_bytes))
            print(f"[{NAME}] {task} {job.variant} seed {job.seed}: {s['metric']} {s['value']:.3f}, "
                  f"eval loss {summary['eval_loss']:.4f}, {summary['wall_s']:.0f} s", flush=True)
    md, js = out / f"{NAME}.md", out / f"{NAME}.json"
    md.write_text(f"# Fine-tuning {cfg.checkpoint} on BIG-bench tasks\n\nsplit seed {cfg.split_seed}, "
                  f"{cfg.test_size} test examples a task, run seeds {list(cfg.seeds)}.\n\n" + table(before, rows))
    js.write_text(json.dumps({"before": before, "rows": rows}, indent=1))
    return runner.complete(refused, [md, js])
