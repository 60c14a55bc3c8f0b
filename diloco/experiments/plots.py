"""PNG figures of one experiment's result: eval loss against tokens and against the (virtual)
clock, mean over seeds with a band of one standard deviation; goodput and bytes as bars."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; imported lazily because it is slow to load
    import matplotlib.pyplot as plt

    return plt


def loss_curves(result: dict, path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110, sharey=True)
    for i, x in enumerate(result["variants"]):
        c = x["curve"]
        if not c["loss"]:
            continue
        loss, std = np.array(c["loss"]), np.array(c["loss_std"])
        for ax, key in zip(axes, ("tokens", "time")):
            ax.plot(c[key], loss, "o-", ms=3, lw=1.5, color=f"C{i}", label=x["label"])
            if len(x["seeds"]) > 1:
                ax.fill_between(c[key], loss - std, loss + std, color=f"C{i}", alpha=0.15, lw=0)
    target = result["target_loss"]
    for ax, xlabel in zip(axes, ("tokens processed", "clock (virtual seconds)")):
        if math.isfinite(target) and "time_to_target" in result["experiment"]["metrics"]:
            ax.axhline(target, ls="--", lw=1, color="gray")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("eval loss (nats/token)")
    axes[0].legend(fontsize=8)
    seeds = max((len(x["seeds"]) for x in result["variants"]), default=1)
    fig.suptitle(f"{result['experiment']['name'].upper()}: {result['experiment']['title']} "
                 f"(mean of {seeds} seed(s))", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def bars(result: dict, path: Path) -> Path:
    plt = _pyplot()
    xs = result["variants"]
    labels = [x["label"] for x in xs]
    pos = np.arange(len(xs))

    def col(key: str) -> np.ndarray:
        return np.array([x["mean"][key] for x in xs], float)

    fig, axes = plt.subplots(1, 3, figsize=(13, 4), dpi=110)
    axes[0].bar(pos, 100 * np.nan_to_num(col("goodput")), color="C0")
    axes[0].set_ylabel("goodput (%)")
    axes[0].set_ylim(0, 105)
    w = 0.4
    axes[1].bar(pos - w / 2, np.nan_to_num(col("up_per_step")), w, label="up", color="C1")
    axes[1].bar(pos + w / 2, np.nan_to_num(col("down_per_step")), w, label="down", color="C2")
    axes[1].set_ylabel("bytes per learner-step")
    axes[1].legend(fontsize=8)
    axes[2].bar(pos, np.nan_to_num(col("peak_up_per_step")), color="C3")
    axes[2].set_ylabel("peak bytes up in one step (all learners)")
    for ax, keys in zip(axes[1:], (("up_per_step", "down_per_step"), ("peak_up_per_step",))):
        v = np.concatenate([col(k) for k in keys])
        v = v[np.isfinite(v) & (v > 0)]
        if v.size and v.max() > 20 * v.min():  # data parallel moves orders of magnitude more
            ax.set_yscale("log")
    for ax in axes:
        ax.set_xticks(pos, labels, rotation=30, ha="right", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{result['experiment']['name'].upper()}: goodput and bytes", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def write(result: dict, out_dir: Path) -> list[Path]:
    """<name>_loss.png and <name>_bars.png in out_dir."""
    name = result["experiment"]["name"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [loss_curves(result, out / f"{name}_loss.png"), bars(result, out / f"{name}_bars.png")]
