"""Config -> objects -> training -> summary: the one function behind every entry point."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import time
from pathlib import Path
from typing import Callable

import jax
import yaml

from diloco import report
from diloco.algo import drift, hostpool
from diloco.algo import syncer as sync
from diloco.algo.fragments import get_path
from diloco.bandwidth.analytic import dp_bytes_per_step
from diloco.config import ConfigError, TrainConfig, legacy, to_dict
from diloco.config.convert import options_by_path
from diloco.config.learner_batch import learner_batches
from diloco.data import Corpus, assistant_tokens, held_out
from diloco.data.corpus import val_bytes_per_token
from diloco.evaluation import bits_per_byte, during_run
from diloco.inputs import full_params, load_inputs
from diloco.model import Model, count_params
from diloco.runtime import build as build_setup
from diloco.runtime import procs, sim, threads
from diloco.train import flops, footprint
from diloco.train.mesh import make_mesh
from diloco.train.trainer import evaluate, train_dp

# A resumed run may change how it is watched, never what it computes.
_RESUMABLE_CHANGES = {("run", "resume"), ("run", "progress"), ("run", "plot"), ("run", "tensorboard"),
                      ("run", "peak_tflops"), ("run", "profile"),
                      ("run", "memory_check"), ("run", "wandb"), ("run", "wandb_project"),
                      ("run", "eval_tasks"), ("run", "eval_tasks_every"), ("run", "eval_limit")}
# Options naming files or directories: the same on resume if they resolve to the same path, so
# `runs/a` and `/home/me/runs/a` (what a stopped run's resume line may print) are one directory.
_PATHS = {("run", "out_dir"), ("data", "paths"), ("data", "eval_paths"), ("data", "data_dir"),
          ("model", "init_from"), ("runtime", "store", "url"), ("runtime", "auth", "secret_file"),
          ("chaos", "tape_file")}
# What a run leaves in its directory (docs/design.md#outputs-of-a-run); any of them means "used".
RUN_OUTPUTS = ("config.yaml", "metrics.jsonl", "summary.json", "loss.png", "model", "checkpoints",
               "decisions.jsonl", "syncer_inputs.bin", "chaos_tape.json", "learners", "sim", "store",
               "syncer", "syncer_journal.jsonl", "tensorboard", "auth_secret", "profile", "wandb")


def used_by_a_run(run_dir: Path) -> list[str]:
    """The outputs of an earlier run in `run_dir` (none for a new or empty directory, or one that
    holds only other files, such as Hydra's log)."""
    return [name for name in RUN_OUTPUTS if (run_dir / name).exists()]


def check_run_dir(cfg: TrainConfig) -> None:
    """Refuse a new run into a directory an earlier run used (docs/design.md#run-directory-reuse):
    its learner checkpoints, metrics and snapshots would mix into the new run's; and a resume of
    a directory that holds no run (a mistyped path would otherwise train a new run there)."""
    run_dir = Path(cfg.run.out_dir)
    # A syncer host started apart (runtime.launch=external) resumes whatever its learners, started
    # by hand, already wrote there before its own first config.yaml (docs/cluster.md)
    if cfg.run.resume and cfg.runtime.launch != "external" and not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"run.resume=true but run.out_dir={run_dir} holds no run to resume (no "
                          f"{run_dir / 'config.yaml'}); check the path, or drop run.resume=true to start one there")
    found = used_by_a_run(run_dir)
    if cfg.run.resume or not found:
        return
    raise ConfigError(f"run.out_dir={run_dir} already holds a run ({', '.join(found)}); pass "
                      "run.resume=true to continue it, or choose another run.out_dir")


def finished_steps(run_dir: Path) -> int | None:
    """The run.steps of the run in `run_dir` if it finished, else None: the one test of "finished"
    for every runtime (docs/design.md#resuming-a-finished-run). summary.json is written when a run
    ends, never by a stop, and removed when a resume with more run.steps continues the run."""
    if not (run_dir / "summary.json").is_file() or not (run_dir / "config.yaml").is_file():
        return None
    return int(yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["steps"])


def _resolved(value):
    """A path option's value with every path made absolute ('' stays: it means none)."""
    if isinstance(value, (list, tuple)):
        return [_resolved(v) for v in value]
    return os.path.abspath(os.path.expanduser(value)) if isinstance(value, str) and value else value


def same_setting(key: tuple[str, ...], saved, new) -> bool:
    """Whether option `key` is unchanged on resume: equal, or for a path option (_PATHS) equal
    after resolving against the working directory (docs/design.md#resuming-a-run)."""
    if isinstance(saved, (list, tuple)) and isinstance(new, (list, tuple)):
        saved, new = list(saved), list(new)  # yaml gives lists where the config has tuples
    return saved == new or (key in _PATHS and _resolved(saved) == _resolved(new))


def prepare_run_dir(cfg: TrainConfig, continuing: bool = False) -> Path:
    """Create the run directory and write the resolved config; on resume, refuse a changed config.
    `run` has already refused a directory an earlier run used (check_run_dir), before the data.
    `continuing`: a finished run resumed with more run.steps, the one change that continues it."""
    run_dir = Path(cfg.run.out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    resolved = to_dict(cfg)
    if cfg.run.resume and path.exists():
        saved = legacy.upgraded(yaml.safe_load(path.read_text()))  # a run saved with the old flat keys
        # A section added since that run was made (finetune) held its library defaults then.
        saved = {**{g: v for g, v in to_dict(TrainConfig()).items() if g not in saved}, **saved}
        allowed = _RESUMABLE_CHANGES | ({("run", "steps")} if continuing else set())
        before = options_by_path(saved, TrainConfig)
        changed = [f"{'.'.join(key)}: {before.get(key)!r} -> {v!r}"
                   for key, v in options_by_path(resolved, TrainConfig).items()
                   if not same_setting(key, before.get(key), v) and key not in allowed]
        if changed:
            raise ConfigError(f"run.resume=true but the config in {path} differs:\n  " + "\n  ".join(changed))
    path.write_text(yaml.safe_dump(resolved, sort_keys=False))
    return run_dir


def global_evaluator(cfg: TrainConfig, corpus: Corpus, model: Model, setup,
                     tasks: during_run.RunTasks | None = None) -> during_run.Evaluator:
    """Eval loss of a global model given as {path: array}, on learner 0's sub-mesh and the run's
    fixed validation batches; with `tasks` (run.eval_tasks), its task scores at the steps due."""
    val = held_out(corpus.val, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len,
                   n=cfg.run.eval_batches)
    compiled = setup.compiled[0]

    def evaluate_global(theta_by_path: dict) -> float:
        params = params_of(model, theta_by_path)
        return evaluate(compiled, jax.device_put(params, compiled.state_sharding.params), val)

    if tasks is None:
        return during_run.Evaluator(evaluate_global)
    return during_run.Evaluator(evaluate_global, lambda theta, step, final=None: tasks(params_of(model, theta), step, final))


def params_of(model: Model, theta_by_path: dict) -> dict:
    """A global model given as {path tuple: array} in the params tree of `model`."""
    return jax.tree_util.tree_map_with_path(lambda path, _: theta_by_path[tuple(k.key for k in path)],
                                            model.params)


def export_model(run_dir: Path, cfg: TrainConfig, corpus: Corpus, params: dict) -> Path:
    """The trained global model as a Hugging Face folder `run_dir/model`, with the run's
    tokenizer, so scripts/generate.py, diloco.hf.load and transformers read it (docs/models.md).
    A model fine-tuned from model.init_from carries that checkpoint's tokenizer, special tokens and
    chat template, so it chats as the original did."""
    from diloco import hf
    return hf.save(run_dir / "model", cfg.model, params, run_tokenizer(corpus))


def run_tokenizer(corpus: Corpus):
    """The run's text as a Hugging Face tokenizer (what its exported model carries and its task
    prompts are encoded with): the checkpoint's, else the run's byte or BPE one; None for synthetic."""
    from diloco.hf.tokenizer import from_parts

    if corpus.hf_tokenizer is not None:
        return corpus.hf_tokenizer
    source = corpus.tokenizer.hf if corpus.tokenizer is not None else None
    return None if source is None else from_parts(source, {})


def _final_theta(rt) -> dict:
    # procs keeps the syncer process's final report; sim and threads hold the syncer in-process.
    return rt.theta if getattr(rt, "theta", None) is not None else sync.theta(rt.host.state)


def dp_bytes_same_steps(cfg: TrainConfig, params: int) -> float:
    """Bytes data parallel moves through the M learners' links in cfg's steps, both directions:
    each link sends and receives dp_bytes_per_step of `params` every step."""
    M = cfg.runtime.learners
    return 2 * M * cfg.run.steps * dp_bytes_per_step(params, M)


def run_diloco(cfg: TrainConfig, corpus: Corpus, model: Model, run_dir: Path,
               full: Callable[[dict], dict] = lambda params: params, tasks: during_run.RunTasks | None = None) -> dict:
    """`full`: the full model's params of the trained ones (inputs.full_params: LoRA merges its
    adapters into the checkpoint), which the export writes; `tasks`: run.eval_tasks' scorer."""
    setup = build_setup.build(cfg, corpus, model)
    # ray: procs' supervisor with Ray's launcher (procs.launcher_for imports Ray only then)
    runtime = {"sim": sim.run, "threads": threads.run, "procs": procs.run, "ray": procs.run}[cfg.runtime.kind]
    rt, summary = runtime(cfg, setup, run_dir, global_evaluator(cfg, corpus, model, setup, tasks))
    theta = _final_theta(rt)
    summary["model_dir"] = str(export_model(run_dir, cfg, corpus, full(params_of(model, theta))))
    # The drift monitor: Theta's distance from Theta_0 (the model's params before the run) per fragment
    summary.update(drift.summary(theta, {p: get_path(model.params, p) for p in theta}, setup.fragments))
    # Under LoRA data parallel too would all-reduce the adapters only.
    dp = dp_bytes_same_steps(cfg, count_params(model.params))
    summary["dp_bytes_same_steps"] = int(dp)
    sent = summary["bytes_up"] + summary["bytes_down"]
    summary["dp_bytes_over_diloco"] = dp / sent if sent else float("inf")
    return summary


def _from_records(run_dir: Path) -> dict:
    """Summary numbers only the metrics records hold: the last logged train loss (the mean over
    learners of each one's last) and the rejoins."""
    records = report.read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    last = {r.get("learner", 0): r["loss"] for r in records if r.get("kind") == "train" and "loss" in r}
    out = {"rejoins": sum(r.get("kind") == "rejoin" for r in records), **during_run.last_scores(records)}
    if last:
        out["train_loss"] = sum(last.values()) / len(last)
    return out


def _assistant_tokens(cfg: TrainConfig, corpus: Corpus, run_dir: Path) -> int:
    """A DiLoCo fine-tune's assistant tokens (docs/design.md#fine-tuning): those of each learner's
    batches up to its last logged step (every step of a finished run; a redone step once)."""
    steps = [0] * cfg.runtime.learners
    for r in report.read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []:
        if r.get("kind") == "train" and isinstance(r.get("learner"), int) and r["learner"] < len(steps):
            steps[r["learner"]] = max(steps[r["learner"]], int(r.get("step", 0)))
    rows = learner_batches(cfg)
    return assistant_tokens(build_setup.per_learner(corpus.train, rows), seed=cfg.run.seed, steps=steps,
                            batch_size=rows)


def check_memory(cfg: TrainConfig, corpus: Corpus, model: Model, pre) -> None:
    """Print the run's memory estimate against the machine's; refuse one that cannot fit
    (diloco/train/footprint.py, docs/design.md#memory-before-a-run)."""
    lora = cfg.finetune.lora.rank > 0  # the adapters train; the checkpoint's weights are all there is
    params = count_params(pre.model.params if lora else model.params)
    trained = count_params(model.params) if lora else None
    # what an earlier run in this process freed (glibc keeps it in its heap), so MemAvailable counts it
    gc.collect()
    hostpool.release_freed(force=True)
    for line in footprint.preflight(cfg, params, corpus.vocab_size, trained, jax.default_backend(),
                                    footprint.mem_available()):
        print(line)


def run(cfg: TrainConfig) -> dict:
    """Train as `cfg` says, write outputs into cfg.run.out_dir, print and return the summary.
    What can fail on the user's input (the run directory, the checkpoint to start from, the data,
    the devices) is checked before the run directory is written. Started apart
    (runtime.launch=external, docs/cluster.md): a learner runs (scripts/learner.py) and exits with
    its status; the syncer host (scripts/syncer.py) started again on its run directory resumes it,
    as a scheduler restarts it with the same command line."""
    if cfg.runtime.launch == "external":
        from diloco.runtime.procs.standalone import finished, run_learner
        if cfg.runtime.learner_index >= 0:
            code = run_learner(cfg)
            if code:
                raise SystemExit(code)
            return {"learner": cfg.runtime.learner_index, "exitcode": 0}
        if finished(cfg):
            print(f"the run in {cfg.run.out_dir} has finished: its summary is {Path(cfg.run.out_dir) / 'summary.json'}")
            return {}
        if used_by_a_run(Path(cfg.run.out_dir)):
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=True))
    check_run_dir(cfg)
    done = finished_steps(Path(cfg.run.out_dir)) if cfg.run.resume else None
    if done is not None and cfg.run.steps <= done:  # never retrained, never overwritten
        summary_path = Path(cfg.run.out_dir) / "summary.json"
        print(f"the run in {cfg.run.out_dir} has finished its {done} steps; nothing to do (raise run.steps "
              f"above {done} to train on). Its summary: {summary_path}")
        return json.loads(summary_path.read_text())
    continuing = done is not None
    if continuing and cfg.algo == "diloco" and cfg.runtime.kind != "sim":
        raise ConfigError(f"run.steps={cfg.run.steps} would continue the finished {cfg.runtime.kind} run in "
                          f"{cfg.run.out_dir} past its {done} steps, but a {cfg.runtime.kind} run resumes only "
                          "from a stop's checkpoints; algo=dp and runtime=sim runs can train on")
    if continuing and cfg.algo == "diloco" and cfg.run.checkpoint_every == 0:
        raise ConfigError(f"run.steps={cfg.run.steps} would continue the finished sim run in {cfg.run.out_dir}, "
                          "but with run.checkpoint_every=0 it saved no snapshot to continue from")
    inputs = load_inputs(cfg)
    cfg, corpus, model, pre = inputs  # cfg.model: model.init_from's shape, if set
    if cfg.algo == "diloco":
        build_setup.check_devices(cfg)
    check_memory(cfg, corpus, model, pre)
    full = lambda params: full_params(inputs, params)  # noqa: E731
    # Task files are read before the run directory is written; LoRA's scores run on the merged weights.
    tasks = during_run.run_tasks(cfg, pre.model if cfg.finetune.lora.rank > 0 else model, run_tokenizer(corpus), full)
    run_dir = prepare_run_dir(cfg, continuing)
    if continuing:  # no longer finished: the summary is written again when the new steps are done
        (run_dir / "summary.json").unlink()
    head = {"corpus": corpus.name, "algo": cfg.algo, "params": count_params(model.params)}
    if cfg.finetune.lora.rank > 0:  # the adapters train and travel; the model is the checkpoint's
        head.update(params=count_params(pre.model.params), adapter_params=count_params(model.params))
        head["adapter_share"] = head["adapter_params"] / head["params"]
    if cfg.model.init_from:
        head["init_from"] = cfg.model.init_from
    if corpus.sft is not None:
        head["sft"] = corpus.sft
    t0 = time.perf_counter()
    if cfg.algo == "diloco":
        summary = {**head, "learners": cfg.runtime.learners, "runtime": cfg.runtime.kind,
                   **run_diloco(cfg, corpus, model, run_dir, full, tasks)}
    else:
        mesh = make_mesh(cfg.mesh, cfg.data.batch_size)
        state, result = train_dp(cfg, corpus, model, mesh, run_dir, tasks=tasks)
        summary = {**head, "devices": f"{mesh.devices.size} x {jax.devices()[0].platform}", **result,
                   "model_dir": str(export_model(run_dir, cfg, corpus, full(state.params)))}
    summary.setdefault("wall_s", time.perf_counter() - t0)
    if cfg.algo == "diloco":
        if summary["wall_s"] > 0:  # a resumed run's own tokens over its own wall time
            trained = summary["tokens_processed"] - summary.get("tokens_at_start", 0)
            summary["tokens_per_s"] = trained / summary["wall_s"]
        # sim's learners take turns on one mesh; the wall-clock runtimes' each step on their own
        devices = cfg.runtime.devices_per_learner * (1 if cfg.runtime.shares_mesh else cfg.runtime.learners)
    else:
        devices = mesh.devices.size
    summary.update(flops.run_figures(summary.get("tokens_per_s", 0.0), flops.of_run(cfg, model.apply, model.params),
                                     flops.hardware(devices, cfg.run.peak_tflops)))
    summary.update(_from_records(run_dir))
    if corpus.sft is not None and cfg.algo == "diloco":  # the trainer counts its own
        summary["assistant_tokens"] = _assistant_tokens(cfg, corpus, run_dir)
    per_token = val_bytes_per_token(corpus)
    if per_token is not None and summary.get("eval_loss") is not None:
        summary["eval_bits_per_byte"] = bits_per_byte(summary["eval_loss"], per_token)
    summary["unigram_loss"] = corpus.unigram_loss
    if corpus.entropy_floor is not None:
        summary["entropy_floor"] = corpus.entropy_floor
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if cfg.run.plot:
        baselines = {"unigram": corpus.unigram_loss}
        if corpus.entropy_floor is not None:
            baselines["entropy floor"] = corpus.entropy_floor
        report.plot_losses(report.read_metrics(run_dir / "metrics.jsonl"), run_dir / "loss.png", baselines)
    print(report.render_summary(summary, f"run {run_dir}"))
    print(f"all numbers: {run_dir / 'summary.json'}; TensorBoard: tensorboard --logdir {run_dir.parent}"
          if cfg.run.tensorboard else f"all numbers: {run_dir / 'summary.json'}")
    return summary
