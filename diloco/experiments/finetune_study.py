"""The fine-tuning comparison of docs/finetuning.md: a pretrained checkpoint taught the record
task (diloco/experiments/records.py) by data parallel, by Decoupled DiLoCo and by Decoupled
DiLoCo with LoRA at equal trained tokens, each scored on held-out sentences by the answers it
generates, against the checkpoint before training.

Every run is an ordinary training run (configs/train.yaml plus the study's overrides) in
<out_dir>/finetune/<variant>/seed<k>/, reused when it already finished with the same config, as the experiment
runner does; the scores of a model are cached beside it in downstream.json.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from diloco.config import ConfigError, from_dict
from diloco.experiments import records, runner
from diloco.experiments.spec import ExperimentSpec, Job, Settings, Variant, dp_reference, hydra_configs, train_config

NAME = "finetune"


@dataclass(frozen=True)
class StudyConfig:
    """configs/finetune_study.yaml."""

    checkpoint: str = "smollm2"  # smollm2, a Hugging Face folder or a .gguf file
    seed: int = 0  # of the data, and every run's run.seed
    train_examples: int = 2000
    test_examples: int = 128
    max_new_tokens: int = 32
    generate_batch: int = 64
    eval_sequences: int = 32  # held-out rows of the masked-loss eval, the same for every variant
    base: tuple[str, ...] = ()  # train overrides shared by every variant
    variants: tuple[Variant, ...] = ()  # the first is the data-parallel reference of the bytes
    overrides: tuple[str, ...] = ()  # appended to every run (command line)
    out_dir: str = "results"  # runs in <out_dir>/finetune/<variant>/seed<k>, the table in <out_dir>/finetune.md
    fresh: bool = False
    compilation_cache: str = "~/.cache/diloco/xla"


def parse(raw: dict) -> StudyConfig:
    cfg = from_dict(StudyConfig, raw)
    e = []
    if cfg.train_examples < 1 or cfg.test_examples < 1:
        e.append(f"train_examples={cfg.train_examples} and test_examples={cfg.test_examples} must be >= 1")
    if cfg.max_new_tokens < 1 or cfg.generate_batch < 1:
        e.append(f"max_new_tokens={cfg.max_new_tokens} and generate_batch={cfg.generate_batch} must be >= 1")
    if not cfg.variants:
        e.append("no variants")
    if e:
        raise ConfigError("invalid finetune study:\n  " + "\n  ".join(e))
    return cfg


def data_files(cfg: StudyConfig) -> tuple[Path, list[dict]]:
    """Write the training JSONL under out_dir/data; return it and the held-out pairs."""
    train, test = records.splits(cfg.seed, cfg.train_examples, cfg.test_examples)
    root = Path(cfg.out_dir) / NAME / "data"
    path = records.write_jsonl(root / "train.jsonl", train)
    records.write_jsonl(root / "test.jsonl", test)
    return path, test


def jobs(cfg: StudyConfig, checkpoint: Path, train_file: Path) -> tuple[Settings, list[Job]]:
    spec = ExperimentSpec(name=NAME, base=(*cfg.base, "data=sft", f"data.paths=[{train_file}]",
                                           f"model.init_from={checkpoint}"),
                          variants=cfg.variants, seeds=(cfg.seed,), eval_sequences=cfg.eval_sequences)
    settings = Settings(experiment=spec, overrides=cfg.overrides, out_dir=cfg.out_dir,
                        fresh=cfg.fresh, compilation_cache=cfg.compilation_cache)
    with hydra_configs():
        planned = [Job(NAME, v.label, cfg.seed, train_config(spec, v, cfg.seed, settings)) for v in cfg.variants]
    return settings, planned


def _test_key(cfg: StudyConfig, test: list[dict]) -> str:
    h = hashlib.sha256(json.dumps([test, cfg.max_new_tokens]).encode()).hexdigest()
    return h[:16]


def downstream(model_path: Path, test: list[dict], cfg: StudyConfig, cache: Path) -> dict:
    """Greedy answers of the model to the held-out prompts, scored (records.score); cached in
    `cache` for this test set and length."""
    key = _test_key(cfg, test)
    if cache.exists() and not cfg.fresh:
        saved = json.loads(cache.read_text())
        if saved.get("key") == key:
            return saved
    from diloco.hf import load
    from diloco.model.generate import Sampling, generate

    pre = load(model_path)
    tok = pre.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": e["prompt"]}], add_generation_prompt=True)
               for e in test]
    replies, start = [], time.perf_counter()
    for lo in range(0, len(prompts), cfg.generate_batch):
        out = generate(pre.model, pre.config, prompts[lo:lo + cfg.generate_batch], cfg.max_new_tokens,
                       Sampling(0.0, 0, 1.0), stop_ids=tok.stop_ids, seed=0)
        replies += [tok.decode(t) for t in out.tokens]
    result = {"key": key, **records.score(replies, [e["response"] for e in test]),
              "generate_s": time.perf_counter() - start,
              "examples": [{"prompt": e["prompt"], "answer": e["response"], "reply": r}
                           for e, r in zip(test[:8], replies[:8])]}
    cache.write_text(json.dumps(result, indent=2))
    return result


def masked_loss(job: Job) -> float:
    """The held-out masked loss of the run's starting checkpoint, on the windows every run is
    evaluated on (the study's eval_sequences): the 'before' of the loss column."""
    from diloco.data import held_out
    from diloco.evaluation import mean_loss
    from diloco.inputs import load_inputs

    cfg, corpus, _, pre = load_inputs(job.cfg)
    return mean_loss(pre, held_out(corpus.val, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len,
                                   n=cfg.run.eval_batches))


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion p of n trials."""
    if n == 0:
        return (math.nan, math.nan)
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def row(job: Job, summary: dict, score: dict, dp_bytes: float) -> dict:
    cfg = job.cfg
    if cfg.algo == "dp":
        sent = dp_bytes
    else:
        sent = summary["bytes_up"] + summary["bytes_down"]
    # The tokens the loss counts: every variant's rows are the same, their assistant tokens what is learned from
    tokens = summary["assistant_tokens"]
    return {"variant": job.variant, "algo": cfg.algo, "lora_rank": cfg.finetune.lora.rank,
            "learners": cfg.runtime.learners if cfg.algo == "diloco" else 1, "steps": cfg.run.steps,
            "assistant_tokens": tokens, "eval_loss": summary["eval_loss"],
            "exact": score["exact"], "exact_ci": wilson(score["exact"], score["n"]),
            "format": score["format"], "fields": score["fields"], "n": score["n"],
            "bytes": sent, "bytes_over_dp": sent / dp_bytes if dp_bytes else math.nan,
            "wall_s": summary["wall_s"], "tokens_per_s": tokens / summary["wall_s"],
            "trained_params": summary.get("adapter_params", summary["params"]), "params": summary["params"],
            "run_dir": cfg.run.out_dir}


def table(base: dict, rows: list[dict]) -> str:
    lo, hi = wilson(base["exact"], base["n"])
    lines = ["| model | trained / all params | exact match [95% CI] | format ok | fields right | "
             "held-out masked loss | bytes sent | / data parallel | wall s | assistant tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|",
             f"| checkpoint, before | - | {base['exact']:.3f} [{lo:.3f}, {hi:.3f}] | {base['format']:.3f} | "
             f"{base['fields']:.3f} | {base.get('eval_loss', math.nan):.4f} | - | - | - | - |"]
    for r in rows:
        lo, hi = r["exact_ci"]
        lines.append(f"| {r['variant']} | {r['trained_params']:,} / {r['params']:,} | {r['exact']:.3f} "
                     f"[{lo:.3f}, {hi:.3f}] | {r['format']:.3f} | {r['fields']:.3f} | {r['eval_loss']:.4f} | "
                     f"{r['bytes'] / 1e9:.2f} GB | {r['bytes_over_dp']:.4f} | {r['wall_s']:.0f} | "
                     f"{r['tokens_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def run(cfg: StudyConfig) -> list[Path]:
    """Train and score every variant; write <out_dir>/finetune.{md,json}."""
    from diloco.hf import resolve
    from diloco.run import dp_bytes_same_steps

    checkpoint = resolve(cfg.checkpoint)
    train_file, test = data_files(cfg)
    settings, planned = jobs(cfg, checkpoint, train_file)
    runner.ensure_devices(runner.devices_needed(planned))
    runner.enable_compilation_cache(cfg.compilation_cache)
    out = Path(cfg.out_dir)
    cache = out / NAME / "before_downstream.json"
    base = downstream(checkpoint, test, cfg, cache)
    if "eval_loss" not in base:
        base["eval_loss"] = masked_loss(planned[0])
        cache.write_text(json.dumps(base, indent=2))
    print(f"[{NAME}] checkpoint before training: exact {base['exact']:.3f}, format {base['format']:.3f}", flush=True)
    rows, dp_bytes, refused = [], None, []
    ref = dp_reference(settings.experiment, cfg.seed, settings)  # its slices, whether or not it runs
    for job, summary in runner.trained_each(planned, settings, refused):
        if dp_bytes is None:  # the data-parallel reference: the full model, every step
            dp_bytes = dp_bytes_same_steps(ref, summary["params"])
        score = downstream(Path(job.cfg.run.out_dir) / "model", test, cfg,
                           Path(job.cfg.run.out_dir) / "downstream.json")
        rows.append(row(job, summary, score, dp_bytes))
        print(f"[{NAME}] {job.variant}: exact {score['exact']:.3f}, eval loss {summary['eval_loss']:.4f}, "
              f"{summary['wall_s']:.0f} s", flush=True)
    md = out / f"{NAME}.md"
    md.write_text(f"# Fine-tuning {cfg.checkpoint} on the record task\n\n"
                  f"{cfg.train_examples} training conversations, {len(test)} held-out sentences, seed {cfg.seed}; "
                  f"greedy answers of at most {cfg.max_new_tokens} tokens.\n\n" + table(base, rows))
    js = out / f"{NAME}.json"
    js.write_text(json.dumps({"before": base, "rows": rows}, indent=2))
    return runner.complete(refused, [md, js])
