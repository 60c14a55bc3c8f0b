"""Watching a run as it goes: a live status line and TensorBoard scalars, both fed by the records a
run writes to metrics.jsonl (docs/design.md#watching-a-run).

Every runtime (sim, threads, the procs supervisor) and the data-parallel trainer already write one
record per logged step, eval and rejoin through `report.MetricsWriter`; a `RunWatch` attached to it
sees the same records, so no runtime needs code of its own to show progress, and what the status
line and TensorBoard show is exactly what metrics.jsonl holds.

Global tokens: a DiLoCo learner's train record counts its own tokens; the x-axis of every curve
(TensorBoard and loss.png) is the run's total, the sum of every learner's latest count.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

# tqdm's monitor thread only tunes miniters; a run's thread accounting (threads runtime) needs none left.
tqdm.monitor_interval = 0

from diloco.report import GlobalTokens, read_metrics

_WRITERS = itertools.count()  # event files this process opened


def live_output(enabled: bool) -> bool:
    """Whether to draw a status line: asked for, and not under CI (logs there read like a film strip)."""
    return enabled and not os.environ.get("CI")


# A merge record's series (diloco/runtime/summary.py merge_record), as TensorBoard's syncer/<key>.
MERGE_SERIES = ("merges", "quorum", "grace_s", "bytes_up", "bytes_down", "stalls", "quarantined", "goodput")
# Its outer statistics, per fragment (summary.OUTER_STATS), as syncer/<key>/fragment<p>.
FRAGMENT_SERIES = ("delta_norm", "update_cos", "agreement", "momentum")


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class RunWatch:
    """A status line for a run of `learners` x `steps` learner steps (DiLoCo) or `steps` steps (data
    parallel: learners = 1), with merges, the latest eval loss, tokens per second of the run's clock,
    tokens per second per device and MFU (from the train records' throughput), learners back after
    a failure, and tqdm's ETA; a line per log interval with every learner's loss; TensorBoard event
    files in `tensorboard_dir` (None: none) and the same scalars to `wandb` (diloco/wandb_sink.py,
    None: none). `share`: one learner's devices as a share of the run's,
    1 where every learner steps on the one mesh (sim), 1 / learners where each has its own; the
    run's figures are the learners' latest summed, times it (docs/design.md#model-flops-and-mfu)."""

    def __init__(self, *, steps: int, learners: int, progress: bool, tensorboard_dir: Path | None = None,
                 clock: str = "wall", log_every: int = 10, initial: int = 0, share: float = 1.0, wandb=None):
        self.steps, self.learners, self.clock, self.log_every = steps, learners, clock, log_every
        self.share = share
        self.show = live_output(progress)
        self.bar = tqdm(total=steps * learners, initial=initial, disable=not self.show, dynamic_ncols=True,
                        unit="step", file=sys.stderr, smoothing=0.1, leave=True)
        self.step: dict[int, int] = {}  # learner -> its latest logged step
        self.tokens = GlobalTokens()
        self.loss: dict[int, float] = {}
        self.rate: dict[str, dict[int, float]] = {"tokens_per_s_per_device": {}, "mfu": {}}  # key -> learner -> latest
        self.eval_loss = math.nan
        self.merges: int | None = None
        self.rejoins = 0
        self.time = 0.0
        self.tb = None
        if tensorboard_dir is not None:
            from tensorboardX import SummaryWriter  # imported here: only runs that write event files need it
            # Event files are named by the second they open in: a resume in the same second (a test's,
            # or a quick restart) would write into the stopped run's file without a suffix of its own.
            self.tb = SummaryWriter(str(tensorboard_dir), flush_secs=10,
                                    filename_suffix=f".{os.getpid()}.{next(_WRITERS)}")
        self.wandb = wandb

    def resumed(self, records: list[dict]) -> None:
        """Take up where a stopped run's records end: its global tokens (the x-axis continues past
        the checkpoint, docs/design.md#metrics-series), steps, merges and rejoins; draws nothing."""
        for r in records:
            self.tokens.see(r)
            if r.get("kind") == "train" and _num(r.get("step")):
                self.step[int(r.get("learner", 0))] = int(r["step"])
            elif r.get("kind") == "rejoin":
                self.rejoins += 1
            if _num(r.get("merges")):
                self.merges = int(r["merges"])
        self.bar.update(max(sum(self.step.values()) - self.bar.n, 0))

    @property
    def global_tokens(self) -> int:
        return self.tokens.total

    def __call__(self, record: dict) -> None:
        kind = record.get("kind")
        self.tokens.see(record)
        if _num(record.get("time")):
            self.time = max(self.time, float(record["time"]))
        if _num(record.get("merges")):
            self.merges = int(record["merges"])
        if kind == "train":
            self._train(record)
        elif kind == "eval":
            self._eval(record)
        elif kind == "merge":
            self._merge(record)
        elif kind == "rejoin":
            self.rejoins += 1
            self._scalar("failures/rejoins", self.rejoins)
        self._postfix()

    def _train(self, r: dict) -> None:
        m = int(r.get("learner", 0))
        before = sum(self.step.values())
        if _num(r.get("step")):
            self.step[m] = int(r["step"])
        if _num(r.get("loss")):
            self.loss[m] = float(r["loss"])
            self._scalar(f"train/loss/learner{m}" if "learner" in r else "train/loss", r["loss"])
        for key in ("tokens_per_s", "tokens_per_s_per_device", "mfu", "lr", "grad_norm"):
            if _num(r.get(key)):
                self._scalar(f"train/{key}/learner{m}" if "learner" in r else f"train/{key}", r[key])
                if key in self.rate:
                    self.rate[key][m] = float(r[key])
        self.bar.update(max(sum(self.step.values()) - before, 0))
        if m == 0 and self.learners > 1 and self.step.get(0, 0) % max(self.log_every, 1) == 0:
            self._detail()

    def _eval(self, r: dict) -> None:
        if _num(r.get("eval_loss")):
            self.eval_loss = float(r["eval_loss"])
            self._scalar("eval/loss", self.eval_loss)
        for key, value in r.items():  # run.eval_tasks' scores, eval/<task>/<metric> (diloco/evaluation/during_run.py)
            if key.startswith("eval/") and _num(value):
                self._scalar(key, value)

    def _merge(self, r: dict) -> None:
        """The syncer's series, one point per merge (docs/design.md#metrics-series), and the merged
        fragment's outer statistics as syncer/<key>/fragment<p>."""
        for key in MERGE_SERIES:
            if _num(r.get(key)):
                self._scalar(f"syncer/{key}", r[key])
        for key in FRAGMENT_SERIES:
            if _num(r.get(key)):
                self._scalar(f"syncer/{key}/fragment{r['fragment']}", r[key])

    def _scalar(self, tag: str, value: float) -> None:
        if self.tb is not None:
            self.tb.add_scalar(tag, float(value), self.global_tokens)
        if self.wandb is not None:
            self.wandb.add_scalar(tag, float(value), self.global_tokens)

    def _rate(self) -> float:
        return self.global_tokens / self.time if self.time > 0 else 0.0

    def _postfix(self) -> None:
        if not self.show:
            return
        parts = []
        if self.learners > 1:
            parts.append(f"t={self.time:,.0f}s" + (" (virtual)" if self.clock == "virtual" else ""))
        if self.merges is not None:
            parts.append(f"merges {self.merges:,}")
        if not math.isnan(self.eval_loss):
            parts.append(f"eval {self.eval_loss:.3f}")
        elif self.loss:
            parts.append(f"loss {sum(self.loss.values()) / len(self.loss):.3f}")
        if self._rate():
            parts.append(f"{self._rate():,.0f} tok/s")
        parts += self._device_rate()
        if self.rejoins:
            parts.append(f"rejoins {self.rejoins}")
        self.bar.set_postfix_str("  ".join(parts), refresh=False)

    def _device_rate(self) -> list[str]:
        """The run's tokens/s per device and MFU: on the wall clock, also where the run's clock is
        virtual (sim); no MFU where the device's peak is unknown."""
        per_device, mfu = (sum(self.rate[k].values()) * self.share for k in ("tokens_per_s_per_device", "mfu"))
        if not per_device:
            return []
        wall = " (wall)" if self.clock == "virtual" else ""
        return [f"{per_device:,.0f} tok/s/device{wall}"] + ([f"MFU {100 * mfu:.1f}%"] if self.rate["mfu"] else [])

    def _detail(self) -> None:
        if not self.show:
            return
        losses = "  ".join(f"L{m} {self.loss[m]:.3f}@{self.step.get(m, 0)}" for m in sorted(self.loss))
        self.bar.write(f"step {self.step.get(0, 0)}/{self.steps}  {losses}"
                       + (f"  eval {self.eval_loss:.3f}" if not math.isnan(self.eval_loss) else ""),
                       file=sys.stderr)

    def summary(self, summary: dict) -> None:
        """The run's final numbers into TensorBoard (goodput, bytes, stalls, ...), at the last step."""
        for key, value in summary.items():
            if _num(value):
                self._scalar(f"summary/{key}", value)

    def close(self) -> None:
        self.bar.close()
        for sink in (self.tb, self.wandb):
            if sink is not None:
                sink.close()
        self.tb = self.wandb = None


def for_run(cfg, run_dir: Path | None, clock: str, progress: bool | None = None) -> RunWatch:
    """The watch of a run of config `cfg`: its status line (run.progress, unless `progress` says
    otherwise: the data-parallel trainer draws its own bar) and, with a run directory, event files
    in <run>/tensorboard (run.tensorboard) and W&B's in <run>/wandb (run.wandb). A resumed run's
    watch takes up where the records in <run>/metrics.jsonl end (RunWatch.resumed)."""
    learners = cfg.runtime.learners if cfg.algo == "diloco" else 1
    tb = run_dir / "tensorboard" if run_dir is not None and cfg.run.tensorboard else None
    share = 1.0
    if cfg.algo == "diloco":
        share = 1.0 if cfg.runtime.shares_mesh else 1.0 / learners
    sink = None
    if run_dir is not None and cfg.run.wandb:
        from diloco.wandb_sink import WandbScalars  # an optional extra, imported only when asked for

        sink = WandbScalars(cfg, run_dir)
    watch = RunWatch(steps=cfg.run.steps, learners=learners, tensorboard_dir=tb, clock=clock, share=share,
                     progress=cfg.run.progress if progress is None else progress, log_every=cfg.run.log_every,
                     wandb=sink)
    metrics = None if run_dir is None else run_dir / "metrics.jsonl"
    if cfg.run.resume and metrics is not None and metrics.exists():
        watch.resumed(read_metrics(metrics))
    return watch
