"""Config -> objects -> training -> summary: the one function behind every entry point."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import yaml

from diloco import report
from diloco.config import ConfigError, TrainConfig, to_dict
from diloco.data import load_corpus
from diloco.model import build, count_params
from diloco.train.mesh import make_mesh
from diloco.train.trainer import train_dp

# A resumed run may change how it is watched, never what it computes.
_RESUMABLE_CHANGES = {("run", "resume"), ("run", "progress"), ("run", "plot")}


def prepare_run_dir(cfg: TrainConfig) -> Path:
    """Create the run directory and write the resolved config; on resume, refuse a changed config."""
    run_dir = Path(cfg.run.out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    resolved = to_dict(cfg)
    if cfg.run.resume and path.exists():
        saved = yaml.safe_load(path.read_text())
        changed = [f"{g}.{k}: {saved.get(g, {}).get(k)!r} -> {v!r}"
                   for g, section in resolved.items() for k, v in section.items()
                   if saved.get(g, {}).get(k) != v and (g, k) not in _RESUMABLE_CHANGES]
        if changed:
            raise ConfigError(f"run.resume=true but the config in {path} differs:\n  " + "\n  ".join(changed))
    path.write_text(yaml.safe_dump(resolved, sort_keys=False))
    return run_dir


def run(cfg: TrainConfig) -> dict:
    """Train as `cfg` says, write outputs into cfg.run.out_dir, print and return the summary."""
    run_dir = prepare_run_dir(cfg)
    corpus = load_corpus(cfg.data)
    model = build(cfg.model, corpus.vocab_size, cfg.run.seed)
    mesh = make_mesh(cfg.mesh, cfg.data.batch_size)
    _, summary = train_dp(cfg, corpus, model, mesh, run_dir)
    summary = {
        "corpus": corpus.name,
        "params": count_params(model.params),
        "devices": f"{mesh.devices.size} x {jax.devices()[0].platform}",
        **summary,
        "unigram_loss": corpus.unigram_loss,
    }
    if corpus.entropy_floor is not None:
        summary["entropy_floor"] = corpus.entropy_floor
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if cfg.run.plot:
        baselines = {"unigram": corpus.unigram_loss}
        if corpus.entropy_floor is not None:
            baselines["entropy floor"] = corpus.entropy_floor
        report.plot_losses(report.read_metrics(run_dir / "metrics.jsonl"), run_dir / "loss.png", baselines)
    print(report.format_table(summary.items(), title=f"run {run_dir}"))
    return summary
