"""Run outputs: metrics JSONL, a progress bar, the final summary table and a loss-curve PNG."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

from tqdm import tqdm


def due(step: int, every: int, total: int) -> bool:
    """Whether periodic work runs after `step` (1-based): every `every` steps and at the last one."""
    return step == total or (every > 0 and step % every == 0)


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl; flushed per record so a crash loses nothing.
    `rates` (train/flops.py Rates) adds each train record's throughput first; `watch` (diloco/watch.py RunWatch)
    sees every record too: the status line and TensorBoard."""

    def __init__(self, path: Path, watch: Callable[[dict], None] | None = None,
                 rates: Callable[[dict], dict] | None = None):
        self.path = Path(path)
        self._file = self.path.open("a", encoding="utf-8")
        self.watch, self.rates = watch, rates

    def write(self, record: dict[str, Any]) -> dict:
        """Write `record`; returns it as written (with its throughput)."""
        record = _plain(record)
        if self.rates is not None:
            record = self.rates(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.watch is not None:
            self.watch(record)
        return record

    def summary(self, summary: dict) -> None:
        """The run's final numbers, for the watch (TensorBoard) only: summary.json holds them."""
        if self.watch is not None and hasattr(self.watch, "summary"):
            self.watch.summary(summary)

    def close(self) -> None:
        self._file.close()
        if self.watch is not None and hasattr(self.watch, "close"):
            self.watch.close()


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if hasattr(x, "item"):  # numpy / jax scalars
        return x.item()
    return x


def read_metrics(path: Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def progress(total: int, initial: int, enabled: bool) -> tqdm:
    return tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True,
                unit="step", file=sys.stderr, smoothing=0.1)


def format_table(rows: Iterable[tuple[str, Any]], title: str = "summary") -> str:
    """Two-column text table; floats get 4 significant digits."""
    rows = [(k, _fmt(v)) for k, v in rows]
    width = max([len(k) for k, _ in rows] + [len(title)])
    vwidth = max([len(v) for _, v in rows] + [1])
    rule = "-" * (width + vwidth + 3)
    lines = [rule, title, rule] + [f"{k:<{width}}   {v:>{vwidth}}" for k, v in rows] + [rule]
    return "\n".join(lines)


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def render_summary(summary: dict[str, Any], title: str) -> str:
    """The summary for a person: grouped lines with units (the same numbers, under their
    documented keys, are in summary.json; docs/design.md#the-summary). Lines whose keys a run
    lacks are left out; a final loss above the unigram baseline gets a warning."""
    g = summary.get
    head = [str(g(k)) for k in ("algo", "corpus") if g(k) is not None]
    if g("learners"):
        head.append(f"{g('learners')} learners")
    if g("params"):
        head.append(f"{g('params'):,} parameters")
    if g("adapter_params"):  # LoRA: what trains and travels
        head.append(f"LoRA: {g('adapter_params'):,} trained ({_pct(g('adapter_share'))})")
    lines: list[tuple[str, str]] = []
    if g("eval_loss") is not None:
        text = f"{g('eval_loss'):.4f} nats/token"
        if g("eval_bits_per_byte") is not None:
            text += f"  {g('eval_bits_per_byte'):.4f} bits/byte"
        if g("unigram_loss") is not None:
            text += f"  (unigram baseline {g('unigram_loss'):.4f}"
            text += f", entropy floor {g('entropy_floor'):.4f})" if g("entropy_floor") is not None else ")"
        lines.append(("eval loss", text))
    if g("train_loss") is not None and not math.isnan(g("train_loss")):
        lines.append(("train loss", f"{g('train_loss'):.4f} nats/token (last logged)"))
    scores = [f"{k[len('eval/'):]} {v:.4f}" for k, v in summary.items() if k.startswith("eval/")]
    if scores:  # run.eval_tasks, the last scores (docs/evaluation.md#during-a-run)
        lines.append(("tasks", ", ".join(scores)))
    times = []
    if g("clock") == "virtual" and g("clock_s") is not None:
        times.append(f"{g('clock_s'):,.1f} s virtual")
    if g("wall_s") is not None:
        times.append(f"{g('wall_s'):,.1f} s wall")
    if g("compile_s"):
        times.append(f"{g('compile_s'):,.1f} s compiling")
    if g("tokens_per_s"):
        times.append(f"{g('tokens_per_s'):,.0f} tokens/s")
    if times:
        lines.append(("time", ", ".join(times)))
    throughput = _throughput_line(summary)
    if throughput:
        lines.append(("throughput", throughput))
    tokens = g("tokens_processed", g("tokens"))
    if tokens is not None:
        text = f"{tokens:,}"
        if g("assistant_tokens") is not None:  # fine-tuning: the positions the loss counts
            text += f" ({g('assistant_tokens'):,} assistant tokens, trained on)"
        text += f", {_pct(g('tokens_merged_share'))} merged" if g("tokens_merged_share") is not None else ""
        lines.append(("tokens", text))
    if g("merges") is not None:
        text = f"{g('merges'):,}"
        if g("quorum_mean") is not None:
            text += f", quorum mean {g('quorum_mean'):.2f} (min {g('quorum_min')})"
        if g("grace_mean_s") is not None:
            text += f", grace mean {g('grace_mean_s'):.2f} s (max {g('grace_max_s'):.2f} s)"
        lines.append(("merges", text))
    outer = []  # the outer statistics, where measured (docs/algorithm.md#outer-statistics-and-automatic-momentum)
    if g("update_cos_mean") is not None:
        outer.append(f"update cosine {g('update_cos_mean'):.3f} ({g('update_cos_rounds')} rounds)")
    if g("outer_momentum_mean") is not None:
        outer.append(f"momentum mean {g('outer_momentum_mean'):.3f} (outer.momentum=auto)")
    if outer:
        lines.append(("outer", ", ".join(outer)))
    if g("drift_l2_max") is not None:  # the drift monitor (docs/finetuning.md#drift-monitor)
        text = (f"largest fragment {g('drift_rel_max'):.4f} of the base's norm" if g("drift_rel_max") is not None
                else f"largest fragment {g('drift_l2_max'):.4g} (L2)")
        if g("pseudograd_cos_mean") is not None:
            text += f"; pseudo-gradient cosine {g('pseudograd_cos_mean'):.3f} ({g('pseudograd_cos_rounds')} rounds)"
        lines.append(("drift", text))
    if g("bytes_up") is not None:
        text = f"up {_bytes(g('bytes_up'))}, down {_bytes(g('bytes_down', 0))}"
        if g("peak_rate_up"):
            text += f", peak up {_bytes(g('peak_rate_up'))}/s"
        if g("dp_bytes_over_diloco"):
            text += f"; {g('dp_bytes_over_diloco'):.1f}x fewer bytes than data parallel"
        lines.append(("traffic", text))
    syncer = _syncer_line(summary)
    if syncer:
        lines.append(("syncer", syncer))
    if g("goodput") is not None:
        lines.append(("goodput, uptime", f"{_pct(g('goodput'))}, {_pct(g('uptime', 0.0))}"))
    failures = [f"{g(k):,} {label}" for k, label in (("learner_deaths", "learner deaths"), ("rejoins", "rejoins"),
                                                     ("stalls", "stalls"), ("quarantined", "quarantined frames"))
                if g(k) is not None]
    if g("events_lost"):  # gaps in learners' event streams (docs/design.md#damage-in-the-store)
        failures.append(f"{g('events_lost'):,} learner events lost ({g('tokens_lost_in_gaps'):,} tokens booked lost)")
    if g("store_objects_ignored"):  # unauthenticated or malformed objects in the store, each logged
        failures.append(f"{g('store_objects_ignored'):,} store objects ignored ({g('ignored_events'):,} events, "
                        f"{g('ignored_controls'):,} control objects: unauthenticated or malformed)")
    if g("slice_failures") is not None:  # a chaos tape: what it injected, then what that caused
        failures.insert(0, f"{g('slice_failures'):,} slice failures injected ({g('learner_outages'):,} took a "
                           "learner's last slice)")
    if failures:
        imbalance = g("token_ledger_imbalance")
        lines.append(("failures", ", ".join(failures) + ("" if imbalance is None else
                      ", token ledger balanced" if imbalance == 0 else f", token ledger off by {imbalance:,}")))
    if g("model_dir"):
        lines.append(("model", str(g("model_dir"))))
    width = max([len(k) for k, _ in lines] + [1])
    rule = "-" * 72
    out = [rule, title + (": " + ", ".join(head) if head else ""), rule] + [f"{k:<{width}}   {v}" for k, v in lines] + [rule]
    if g("eval_loss") is not None and g("unigram_loss") is not None and g("eval_loss") > g("unigram_loss"):
        out.append(f"warning: the final eval loss {g('eval_loss'):.4f} is above the unigram baseline "
                   f"{g('unigram_loss'):.4f}: the model predicts worse than token frequencies alone "
                   "(too few steps, or a learning rate too high?)")
    return "\n".join(out)


def _throughput_line(summary: dict[str, Any]) -> str:
    """Tokens/s per device and MFU (docs/design.md#model-flops-and-mfu); where the device's peak
    is unknown, says so rather than print an MFU."""
    g = summary.get
    if not g("tokens_per_s_per_device") or g("flops_per_token") is None:
        return ""
    text = f"{g('tokens_per_s_per_device'):,.0f} tokens/s per device ({g('run_devices')} x {g('device_kind')})"
    if g("mfu") is not None:
        text += f", MFU {100 * g('mfu'):.3g}% of {g('peak_tflops'):,.1f} TFLOP/s"
    else:
        text += f", no MFU: no known peak for {g('device_kind')!r} (set run.peak_tflops)"
    return text + f"; {g('flops_per_token') / 1e6:,.2f} MFLOP/token"


def _syncer_line(summary: dict[str, Any]) -> str:
    """The syncer's busy time (a share of the wall on a wall clock) and the start-up check's
    predicted share (docs/design.md#does-the-syncer-keep-up)."""
    g = summary.get
    parts = []
    if g("syncer_busy_s") is not None:
        text = f"busy {g('syncer_busy_s'):,.2f} s"
        parts.append(text + (f" ({_pct(g('syncer_busy_share'))} of the wall)" if g("syncer_busy_share") is not None
                             else " real (merges take no virtual time)"))
    if g("syncer_pace_share") is not None:
        step = "the modelled step" if g("clock") == "virtual" else "the learners' step"
        parts.append(f"predicted {_pct(g('syncer_pace_share'))} at {step} "
                     f"(largest round {1e3 * g('syncer_round_s'):,.1f} ms)")
    return ", ".join(parts)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:,.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


class GlobalTokens:
    """The run's total tokens as its records arrive in order. A DiLoCo learner's train record counts
    its own tokens and an eval or merge record the total, so the total is the sum of every
    learner's latest count (at least the last eval's or merge's): the x-axis every curve shares
    (loss.png, TensorBoard, W&B)."""

    def __init__(self):
        self.latest: dict[int, int] = {}
        self.evaluated = 0

    def see(self, record: dict) -> int:
        tokens = record.get("tokens")
        if isinstance(tokens, (int, float)) and not isinstance(tokens, bool):
            if record.get("kind") == "train":
                self.latest[int(record.get("learner", 0))] = int(tokens)
            elif record.get("kind") in ("eval", "merge"):
                self.evaluated = int(tokens)
        return self.total

    @property
    def total(self) -> int:
        return max(sum(self.latest.values()), self.evaluated)


def plot_losses(records: list[dict], path: Path, baselines: dict[str, float] | None = None) -> Path:
    """Train loss per learner (one line each) and the global eval loss against the run's total
    tokens (GlobalTokens), with horizontal baselines."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; imported lazily because it is slow to load
    import matplotlib.pyplot as plt

    clock = GlobalTokens()
    train: dict[Any, list] = {}
    evals = []
    for r in records:
        at = clock.see(r)
        if r.get("kind") == "train" and "loss" in r:
            train.setdefault(r.get("learner"), []).append((at, r["loss"]))
        elif r.get("kind") == "eval" and "eval_loss" in r:
            evals.append((at, r["eval_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for learner, points in sorted(train.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        label = "train loss" if learner is None else f"learner {learner} train loss"
        ax.plot(*zip(*points), lw=1, alpha=0.7, label=label)
    if evals:
        ax.plot(*zip(*evals), "o-", lw=1.5, color="black", label="global eval loss")
    for name, value in (baselines or {}).items():
        ax.axhline(value, ls="--", lw=1, color="gray")
        ax.annotate(f"{name} {value:.3f}", (0.99, value), xycoords=("axes fraction", "data"),
                    ha="right", va="bottom", fontsize=8, color="gray")
    ax.set_xlabel("tokens (all learners)")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
