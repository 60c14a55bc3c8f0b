"""One finished run -> one row of numbers and its eval curve, on a common footing for data-parallel
and Decoupled DiLoCo runs (docs/experiments.md#training-experiments-t1-to-t8).

Decoupled DiLoCo runs report their own virtual clock, goodput and bytes (the sim's ledgers). The
data-parallel trainer has no clock of its own, so it is given the sim's cost model: a step takes
runtime.step_time (the same per-device batch as a learner's step when the global batch is equal)
plus a bf16 ring all-reduce among the M learners' links (diloco.bandwidth.analytic.dp_bytes_per_step) at
runtime.bandwidth and runtime.latency. Under a chaos tape it runs as one elastic job over all M
learners' slices (diloco/chaos/goodput.py, the paper's elastic data parallel): every slice failure
or return pauses the whole job for runtime.restart_s (what the sim charges a learner to come back),
and in between it advances in proportion to its live slices, keeping the global batch.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from diloco.chaos import goodput as gp
from diloco.config import TrainConfig
from diloco.bandwidth.analytic import dp_bytes_per_step

NAN = float("nan")
# Summary keys added after some stored runs were made: such a run is still read (the row gets NaN)
# but is not copied into another experiment as a twin, where retraining gives the full row.
LATE_KEYS = ("peak_rate_up_training",)


def dp_step_s(cfg: TrainConfig, params: int) -> float:
    """Modelled seconds of one data-parallel step: compute, then a ring all-reduce of
    2 (M - 1) latency-bound phases moving dp_bytes_per_step through each link."""
    r = cfg.runtime
    comm = dp_bytes_per_step(params, r.learners) / r.bandwidth + 2 * (r.learners - 1) * r.latency
    return r.step_time + (comm if r.learners > 1 else 0.0)


def elastic_progress(times: np.ndarray, delta: np.ndarray, slices: int, pause_s: float, step_s: float):
    """Elastic data parallel over `slices` slices, given sorted slice events (times, -1 for a
    failure, +1 for a return): (breakpoints, progress in steps at each, rate in steps/s after each)."""
    ps, pe = gp.pauses(times, pause_s, "share")
    bp = np.unique(np.concatenate([[0.0], times, ps, pe]))
    live = slices + np.array([delta[times <= t].sum() for t in bp])
    paused = np.array([bool(np.any((ps <= t) & (t < pe))) for t in bp])
    rate = np.where(paused | (live <= 0), 0.0, live / slices) / step_s
    progress = np.concatenate([[0.0], np.cumsum(rate[:-1] * np.diff(bp))])
    return bp, progress, rate


def tape_slice_events(cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray, int]:
    """(times, -1/+1, slices) of the base learners' slices on the tape a Decoupled DiLoCo run of
    cfg replays; scavenged learners' chips are not the data-parallel job's."""
    from diloco.runtime.walltape import chaos_tape

    tape = chaos_tape(cfg)
    M = cfg.runtime.learners
    ev = [(e.time, -1 if e.kind == "slice_down" else 1) for e in tape.events
          if e.learner < M and e.kind in ("slice_down", "slice_up")]
    return (np.array([t for t, _ in ev], float), np.array([d for _, d in ev], int),
            M * tape.slices_per_learner)


def step_times(bp: np.ndarray, progress: np.ndarray, rate: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Time at which `steps` (floats) of progress are reached, from elastic_progress."""
    out = np.empty(len(steps))
    for j, k in enumerate(steps):
        i = int(np.searchsorted(progress, k, side="left")) - 1
        if i < 0:
            out[j] = 0.0
        elif i + 1 < len(progress):  # crossed inside segment i, whose rate is > 0
            out[j] = bp[i] + (k - progress[i]) / rate[i]
        else:  # past the tape's last change: the final rate holds
            out[j] = bp[-1] + (k - progress[-1]) / rate[-1] if rate[-1] > 0 else math.inf
    return out


def computing_share(bp: np.ndarray, rate: np.ndarray, end: float, step_s: float | None = None) -> float:
    """Share of [0, end] during which the elastic job computes: its uptime. Given step_s, each
    second counts by the share of slices computing (rate x step_s), as the sim's goodput counts a
    learner's step on some of its slices (timeline state "degraded"): its goodput."""
    edges = np.minimum(np.append(bp, max(end, bp[-1])), end)
    weight = (rate > 0) if step_s is None else rate * step_s
    return float(np.sum(np.diff(edges) * weight)) / end if end > 0 else NAN


def contributions(run_dir: Path) -> tuple[set[int], dict[tuple, float]]:
    """(fragments holding the embedding, {contribution key: norm} for the others), from the
    syncer's recorded inputs. A contribution carries Theta(base version) - local weights, so its
    decoded payload is that learner's own delta, whatever the merge rule then does with it."""
    from diloco.algo import messages, payloads
    from diloco.model import is_embedding
    from diloco.runtime.runlog import read_inputs

    path = Path(run_dir) / "syncer_inputs.bin"
    embedding: dict[int, bool] = {}
    norms: dict[tuple, float] = {}
    for event in read_inputs(path) if path.exists() else ():
        if event.kind != "contribution":
            continue
        msg = messages.decode(event.data)
        h = msg.header
        if embedding.setdefault(h["fragment"], any(is_embedding(tuple(t["path"])) for t in h["tensors"])):
            continue
        expected = {tuple(t["path"]): (t["shape"], np.float32) for t in h["tensors"]}
        wire = payloads.unpack_fragment(h, msg.payload, None, expected)
        key = (h["learner"], h["incarnation"], h["seq"])
        norms[key] = float(np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in wire.values())))
    return {f for f, emb in embedding.items() if emb}, norms


def merge_norms(decisions: list[dict], learners: int, skip: set[int], norms: dict[tuple, float]) -> dict:
    """Over merges of all M learners of non-embedding fragments: the mean norm of the merged delta
    (norm_full) and the mean norm of the contributions merged (norm_single, one learner's delta).
    Averaging M near-orthogonal deltas of norm R gives about R / sqrt(M); RDA keeps R (docs/algorithm.md#merge).
    A merge takes, per learner it names, that learner's latest admitted arrival of the fragment."""
    pending: dict[int, dict[int, tuple]] = {}
    full, single = [], []
    for r in decisions:
        if r.get("fragment") in skip or r.get("event") not in ("arrival", "merge"):
            continue
        waiting = pending.setdefault(r["fragment"], {})
        if r["event"] == "arrival":
            waiting[r["key"][0]] = tuple(r["key"])
            continue
        keys = [waiting.pop(m) for m in r["learners"] if m in waiting]
        mine = [norms[k] for k in keys if k in norms]
        if len(r["learners"]) == learners and mine:
            full.append(r["delta_norm"])
            single.append(float(np.mean(mine)))
    f = float(np.mean(full)) if full else NAN
    s = float(np.mean(single)) if single else NAN
    return {"norm_full": f, "norm_single": s, "norm_ratio": f / s if full and s > 0 else NAN}


def diloco_row(cfg: TrainConfig, summary: dict, records: list[dict], decisions: list[dict],
               skip: set[int], norms: dict[tuple, float]) -> dict:
    r = cfg.runtime
    learner_steps = r.learners * cfg.run.steps  # nominal: what M learners running every step do
    peak = summary["peak_rate_up"] * r.step_time
    # The final sync sends every fragment at once and sets the run's peak whatever the fragments;
    # how flat the strategy keeps the traffic shows in the peak while training (older runs lack it).
    training = summary.get("peak_rate_up_training", NAN) * r.step_time
    mean = summary["bytes_up"] / summary["clock_s"] * r.step_time if summary["clock_s"] > 0 else NAN
    evals = [rec for rec in records if rec.get("kind") == "eval"]
    return {
        "tokens": summary["tokens_processed"], "clock_s": summary["clock_s"],
        "goodput": summary["goodput"], "uptime": summary["uptime"],
        "up_per_step": summary["bytes_up"] / learner_steps, "down_per_step": summary["bytes_down"] / learner_steps,
        "peak_up_per_step": peak, "peak_up_training": training, "peak_over_mean": training / mean if mean > 0 else NAN,
        "merges": summary["merges"], "quarantined": summary["quarantined"], "quorum_mean": summary["quorum_mean"],
        "grace_mean_s": summary["grace_mean_s"], "stalls": summary["stalls"],
        "tokens_merged_share": summary["tokens_merged_share"],
        **merge_norms(decisions, r.learners, skip, norms),
        "curve": [[e["tokens"], e["time"], e["eval_loss"]] for e in evals],
    }


def dp_row(cfg: TrainConfig, summary: dict, records: list[dict]) -> dict:
    M, steps = cfg.runtime.learners, cfg.run.steps
    b = dp_bytes_per_step(summary["params"], M)
    step_s = dp_step_s(cfg, summary["params"])
    evals = [rec for rec in records if rec.get("kind") == "eval"]
    at = np.array([e["step"] for e in evals] + [steps], float)
    if cfg.chaos.enabled:
        events, delta, slices = tape_slice_events(cfg)
        bp, progress, rate = elastic_progress(events, delta, slices, cfg.runtime.restart_s, step_s)
        times = step_times(bp, progress, rate, at)
        end = float(times[-1])
        goodput, uptime = computing_share(bp, rate, end, step_s), computing_share(bp, rate, end)
    else:
        times, goodput, uptime = at * step_s, 1.0, 1.0
    return {
        "tokens": summary["tokens"], "clock_s": float(times[-1]), "goodput": goodput, "uptime": uptime,
        "up_per_step": b, "down_per_step": b, "peak_up_per_step": M * b, "peak_up_training": M * b,
        "peak_over_mean": 1.0,
        "merges": NAN, "quarantined": NAN, "quorum_mean": NAN, "grace_mean_s": NAN, "stalls": NAN,
        "tokens_merged_share": NAN, "norm_full": NAN, "norm_single": NAN, "norm_ratio": NAN,
        "curve": [[e["tokens"], float(t), e["eval_loss"]] for e, t in zip(evals, times)],
    }


def row(cfg: TrainConfig, summary: dict, run_dir: Path) -> dict:
    """Every number the tables and plots use, from a finished run directory."""
    from diloco.report import read_metrics
    from diloco.runtime.runlog import read_decisions

    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    head = {"algo": cfg.algo, "learners": cfg.runtime.learners, "steps": cfg.run.steps,
            "params": summary["params"], "eval_loss": summary["eval_loss"]}
    if cfg.algo == "dp":
        out = {**head, **dp_row(cfg, summary, records)}
    else:
        decisions = read_decisions(run_dir / "decisions.jsonl")
        out = {**head, **diloco_row(cfg, summary, records, decisions, *contributions(run_dir))}
    return {**out, "throughput": throughput(cfg, out["tokens"], out["clock_s"])}


def throughput(cfg: TrainConfig, tokens: int, clock_s: float) -> float:
    """Tokens processed per second of the clock, over what the global batch would process at full
    strength (one step per runtime.step_time): below 1 for pauses, lost slices, stalls and the
    all-reduce; above 1 with scavenged learners. Chip-weighted, unlike goodput."""
    per_step = cfg.data.batch_size * cfg.data.seq_len * (cfg.runtime.learners if cfg.algo == "diloco" else 1)
    return tokens * cfg.runtime.step_time / (clock_s * per_step) if clock_s > 0 else NAN
