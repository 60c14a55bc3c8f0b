"""A chaos drill of the procs runtime: a failure-free run, then the same config while a thread
SIGKILLs a random learner about every `every` seconds and the syncer once; compared on the token
ledger, the merge versions and the global eval loss at an equal number of merged tokens.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), section 6 (learners fail and
rejoin while the global model advances); docs/experiments.md#chaos-drill.

Both axes come from each run's `syncer_inputs.bin`, replayed through the syncer state machine:
merged tokens are the ledger's (diloco/algo/ledger.py: a contribution holds the tokens since its
learner's previous send of that fragment, i.e. c_tokens less the previous send's when no apply
came between, which an unchanged base version shows), booked at each merge's Outcomes; processed
tokens count the step_time inputs (one per step event). The replay's merged total must equal the
ledger's in summary.json, and its final eval the run's. The global model is evaluated after the
merges where the curves are compared, not only at the run's eval records: those come with learner
0's steps, and a chaos run's learner 0 is sometimes down.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import os
import shutil
import signal
import threading
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import numpy as np

from diloco import report
from diloco import store as bs
from diloco.algo import messages
from diloco.algo import syncer as sync
from diloco.algo.replay import Input, apply as deliver
from diloco.config import TrainConfig
from diloco.runtime.procs.supervisor import MAX_RESTARTS
from diloco.runtime.procs.recovery import CHECKPOINTS, INPUTS
from diloco.run import global_evaluator
from diloco.experiments.drill_report import checks, markdown, recovery, rows  # noqa: F401  (the drill's API)
from diloco.runtime.runlog import read_decisions, read_inputs
from diloco.store import network

POLL = 0.1  # seconds between the killer's looks at the store


def next_gap(rng: np.random.Generator, every: float, schedule: str) -> float:
    """Seconds to the next learner kill: exponential with mean `every` (a Poisson process) or fixed."""
    if schedule == "poisson":
        return float(rng.exponential(every))
    if schedule == "fixed":
        return float(every)
    raise ValueError(f"unknown kill schedule {schedule!r}; known: poisson, fixed")


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (killing a zombie succeeds and does nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no procfs: trust kill(0)
    return state not in ("Z", "X")


class Killer:
    """SIGKILLs learners of a procs run at seeded random times once it has started (only learners
    whose current incarnation has compiled, i.e. written `ctl/ready/<m>`, and never one that a
    further death would take past the supervisor's MAX_RESTARTS), and the syncer once, when
    `syncer_after` versions are published and a syncer checkpoint exists. `kills` records each."""

    def __init__(self, store_url: str, run_dir: Path, every: float, schedule: str, seed: int,
                 syncer_after: int | None):
        self.url, self.run_dir, self.every, self.schedule = store_url, Path(run_dir), every, schedule
        self.rng = np.random.default_rng([seed, 2604])
        self.syncer_after = syncer_after
        self.kills: list[dict] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="chaos-killer", daemon=True)

    def __enter__(self) -> Killer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _main(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # reported with the results, never silently lost
            self.error = e

    def _read(self, store: bs.BlobStore, name: str):
        try:
            return bs.read_control(store, name)
        except ValueError:  # the supervisor is clearing a store left by an earlier run
            return None

    def _loop(self) -> None:
        store = bs.BlobStore(self.url, sync=False)
        while (start := self._read(store, "start")) is None:
            if self._stop.wait(POLL):
                return
        # Kill times on the syncer's clock (its t0 is wall time), so they line up with the decision records.
        t0 = time.monotonic() - (time.time() - start["t0"])
        next_kill = time.monotonic() + next_gap(self.rng, self.every, self.schedule)
        while not self._stop.wait(POLL):
            procs = self._read(store, "procs")
            if procs is None:
                continue
            syncer_kills = sum(k["target"] == "syncer" for k in self.kills)
            if procs["syncer_incarnation"] >= syncer_kills and not _running(procs["syncer"]):
                return  # a syncer nobody killed has exited: the run is over, a learner killed now stays dead
            now = time.monotonic()
            if self._syncer_due(store, procs):
                self._kill("syncer", procs["syncer_incarnation"], procs["syncer"], now - t0, store)
            if now >= next_kill:
                live = [(int(m), x) for m, x in sorted(procs["learners"].items())
                        if x["incarnation"] < MAX_RESTARTS - 1 and _running(x["pid"])
                        and (self._read(store, f"ready/{int(m):04d}") or {}).get("incarnation") == x["incarnation"]]
                if live:  # else try again at the next look
                    m, x = live[int(self.rng.integers(len(live)))]
                    self._kill(f"learner-{m}", x["incarnation"], x["pid"], now - t0, store)
                    next_kill = now + next_gap(self.rng, self.every, self.schedule)

    def _syncer_due(self, store: bs.BlobStore, procs: dict) -> bool:
        if self.syncer_after is None or any(k["target"] == "syncer" for k in self.kills):
            return False
        saved = self.run_dir / CHECKPOINTS
        checkpointed = saved.is_dir() and any(d.name.isdigit() for d in saved.iterdir())
        published = sum(pub.version for pub in bs.latest(store).values())
        return checkpointed and published >= self.syncer_after and _running(procs["syncer"])

    def _kill(self, target: str, incarnation: int, pid: int, t: float, store: bs.BlobStore) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        versions = sum(pub.version for pub in bs.latest(store).values())
        self.kills.append({"t": round(t, 2), "target": target, "incarnation": incarnation, "pid": pid,
                           "published_versions": versions})


# --- what a finished run shows -----------------------------------------------------------------

def merge_versions(tape: list[dict]) -> dict[int, list[int]]:
    versions = defaultdict(list)
    for r in tape:
        if r["event"] == "merge":
            versions[r["fragment"]].append(r["version"])
    return dict(versions)


def partial_merges(tape: list[dict], learners: int) -> list[dict]:
    """Merges that admitted fewer than all learners: where a round split (or a learner was down).
    RDA keeps each merge's norm, so a split round moves Theta about twice as far as a whole one."""
    return [{"at": round(e["at"], 2), "fragment": e["fragment"], "admitted": e["admitted"]}
            for e in tape if e["event"] == "merge" and len(e["admitted"]) < learners]


def versions_consecutive(versions: dict[int, list[int]]) -> bool:
    """Every fragment's merges made versions 1..n in order: none skipped, none made twice."""
    return all(vs == list(range(1, len(vs) + 1)) for vs in versions.values())


class SendTokens:
    """A contribution's ledger tokens from its header: c_tokens counts since the fragment's last
    apply, the ledger since its last send or apply, so subtract the previous send's c_tokens when
    the base version (the version held, which every apply raises) has not moved since."""

    def __init__(self):
        self.last: dict[tuple[int, int, int], tuple[int, int]] = {}  # (m, inc, p) -> (base, c_tokens)

    def __call__(self, h: dict) -> int:
        key = (h["learner"], h["incarnation"], h["fragment"])
        before = self.last.get(key)
        self.last[key] = (h["base_version"], h["c_tokens"])
        if before is not None and before[0] == h["base_version"]:
            return h["c_tokens"] - before[1]
        return h["c_tokens"]


class Curve(NamedTuple):
    """One run, per merge count k = 0..n, rebuilt from its syncer inputs."""

    merged: list[int]  # ledger tokens in the merges so far, summed over fragments
    processed: list[int]  # tokens of every step booked (all learners, fragment 0) when merge k was made
    loss: dict[int, float]  # eval loss of the global Theta after k merges, where evaluated


def replay_curve(setup, learners: int, inputs: Iterable[Input], tokens_per_step: int,
                 evaluate: Callable[[dict], float] | None = None, at: Iterable[int] = ()) -> Curve:
    """The syncer replayed from its inputs (every step event delivered one step_time input; each
    merge is a Publish then an Outcome "merged" per key, booked, with "carried", as
    diloco.algo.ledger.resolve books them); Theta evaluated after the merges `at`."""
    st = sync.init(setup.policy, setup.fragments, setup.theta0, dict.fromkeys(range(learners), 0))
    at = set(at)
    tokens_of, in_flight, steps = SendTokens(), {}, 0
    curve = Curve([0], [0], {})
    if evaluate is not None and 0 in at:
        curve.loss[0] = evaluate(sync.theta(st))
    for event in inputs:
        if event.kind == "step_time":
            steps += 1
        elif event.kind == "contribution":
            try:
                h = messages.decode(event.data).header
                in_flight[(h["learner"], h["incarnation"], h["seq"])] = tokens_of(h)
            except messages.MessageError:
                pass  # quarantined unread: the ledger has no tokens for it either
        before = st.merges
        st, actions = deliver(setup.policy, st, event)
        for a in actions:
            if isinstance(a, sync.Publish):
                curve.merged.append(curve.merged[-1])
                curve.processed.append(steps * tokens_per_step)
            elif isinstance(a, sync.Outcome) and a.key in in_flight:
                n = in_flight.pop(a.key)
                if a.outcome == "merged":
                    curve.merged[-1] += n
                elif a.outcome == "carried" and a.into in in_flight:
                    in_flight[a.into] += n
        if evaluate is not None and any(before < k <= st.merges for k in at):
            curve.loss[st.merges] = evaluate(sync.theta(st))
    if len(curve.merged) - 1 != st.merges:
        raise RuntimeError(f"replay made {st.merges} merges but published {len(curve.merged) - 1}")
    return curve


def bracket(xs: list[int], x: float) -> set[int]:
    """The merge counts whose values of a nondecreasing axis enclose x."""
    k = max(0, bisect.bisect_right(xs, x) - 1)
    return {k, min(k + 1, len(xs) - 1)}


def loss_at(points: list[tuple[float, float]], x: float) -> float:
    """Eval loss at x, linear between evaluated points (x within their range)."""
    xs, ys = zip(*sorted(points))
    if not xs[0] <= x <= xs[-1]:
        raise ValueError(f"{x} tokens outside the evaluated range [{xs[0]}, {xs[-1]}]")
    return float(np.interp(x, xs, ys))


def compare(free: list[tuple[float, float]], other: list[tuple[float, float]]) -> dict:
    """Both curves at the tokens the shorter one reached: relative difference other / free - 1."""
    x = min(max(p[0] for p in free), max(p[0] for p in other))
    lf, lo = loss_at(free, x), loss_at(other, x)
    return {"tokens": x, "eval_loss_free": lf, "eval_loss": lo, "relative": lo / lf - 1.0}


AXES = ("merged", "processed")


def curve_points(curve: Curve, axis: str, P: int) -> list[tuple[float, float]]:
    """(tokens, loss) at every evaluated merge count; merged tokens per fragment (summed / P),
    since every token's work is split over the P fragments."""
    xs = curve.merged if axis == "merged" else curve.processed
    scale = P if axis == "merged" else 1
    return [(xs[k] / scale, loss) for k, loss in sorted(curve.loss.items())]


def observe(run_dir: Path, store_url: str) -> dict:
    """Ledger, versions and restarts of a finished run, from its outputs and its store's control."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = report.read_metrics(run_dir / "metrics.jsonl")
    tape = read_decisions(run_dir / "decisions.jsonl")
    versions = merge_versions(tape)
    procs = bs.read_control(bs.BlobStore(store_url), "procs")
    return {
        "summary": summary,
        "token_ledger_imbalance": summary["token_ledger_imbalance"],
        "versions_consecutive": versions_consecutive(versions),
        "versions": {str(p): len(vs) for p, vs in sorted(versions.items())},
        "partial_merges": partial_merges(tape, summary["learners"]),
        "learner_restarts": {m: x["incarnation"] for m, x in sorted(procs["learners"].items())},
        "syncer_restarts": procs["syncer_incarnation"],
        "rejoins": [[r["learner"], r["incarnation"], r["step"]] for r in records if r["kind"] == "rejoin"],
    }


def run_drill(cfg: TrainConfig, out: Path, every: float, syncer_at: float, seed: int, schedule: str,
              noise: bool = False, train: Callable[[TrainConfig], dict] | None = None) -> dict:
    """The runs (out/free, out/free2 with `noise`, out/chaos), then the comparison; `train` is
    diloco.run.run (injectable)."""
    from diloco.run import run as train_run

    if cfg.algo != "diloco" or cfg.runtime.kind != "procs" or cfg.run.checkpoint_every <= 0:
        raise ValueError(f"the drill needs algo=diloco runtime=procs run.checkpoint_every > 0, got "
                         f"{cfg.algo}, {cfg.runtime.kind}, {cfg.run.checkpoint_every}")
    train = train or train_run
    result: dict = {"every_s": every, "schedule": schedule, "syncer_at": syncer_at, "seed": seed}
    names = ["free", "free2", "chaos"] if noise else ["free", "chaos"]
    for name in names:
        run_dir = (out / name).absolute()
        shutil.rmtree(run_dir, ignore_errors=True)  # the drill's own directory: a stale store would confuse the killer
        c = replace(cfg, run=replace(cfg.run, out_dir=str(run_dir)))
        url = network.run_store_url(cfg.runtime, f"file://{run_dir / 'store'}")  # as the supervisor opens it
        killer = None
        if name == "chaos":
            after = max(1, math.ceil(syncer_at * result["free"]["summary"]["merges"]))
            killer = Killer(url, run_dir, every, schedule, seed, after)
        start = time.monotonic()
        with killer or contextlib.nullcontext():
            train(c)
        result[name] = {"wall_s": round(time.monotonic() - start, 1), **observe(run_dir, url)}
        if killer is not None:
            if killer.error is not None:
                raise RuntimeError(f"the killer thread failed: {killer.error!r}") from killer.error
            tape = read_decisions(run_dir / "decisions.jsonl")
            result[name].update(kills=recovery(tape, killer.kills), syncer_kill_after_versions=after)
    return analyse(cfg, out, result, names)


def analyse(cfg: TrainConfig, out: Path, result: dict, names: list[str]) -> dict:
    """Curves, comparisons and checks of finished runs out/<name> (result[name] from observe)."""
    from diloco.data import load_corpus
    from diloco.model import build
    from diloco.runtime import build as build_setup

    # Dense evaluations after the fact: eval records come only with learner 0's steps, so a run
    # whose learner 0 is down has none for a while. Two replays: where to evaluate, then evaluate.
    corpus = load_corpus(cfg.data)
    model = build(cfg.model, corpus.vocab_size, cfg.run.seed)
    setup = build_setup.build(cfg, corpus, model)
    evaluate = global_evaluator(cfg, corpus, model, setup)  # what diloco.run evaluates
    M, P, per_step = cfg.runtime.learners, cfg.fragments.count, cfg.data.batch_size * cfg.data.seq_len
    inputs = {n: list(read_inputs(out.absolute() / n / INPUTS)) for n in names}
    bare = {n: replay_curve(setup, M, inputs[n], per_step) for n in names}
    at = {n: {0, len(c.merged) - 1, *range(0, len(c.merged), max(1, len(c.merged) // 20))} for n, c in bare.items()}
    for axis, scale in (("merged", P), ("processed", 1)):
        x = min(getattr(c, axis)[-1] / scale for c in bare.values())
        for n, c in bare.items():
            at[n] |= bracket([v / scale for v in getattr(c, axis)], x)
    curves = {n: replay_curve(setup, M, inputs[n], per_step, evaluate, at[n]) for n in names}
    for n, c in curves.items():
        result[n]["merged_tokens_rebuilt"] = c.merged[-1]
        result[n]["merged_tokens_ledger"] = round(
            result[n]["summary"]["tokens_merged_share"] * P * result[n]["summary"]["tokens_processed"])
        result[n]["final_eval_rebuilt"] = c.loss[len(c.merged) - 1]
        result[n]["curve"] = [{"merges": k, "merged": c.merged[k] / P, "processed": c.processed[k], "eval_loss": v}
                              for k, v in sorted(c.loss.items())]
    result["compare"] = {axis: compare(curve_points(curves["free"], axis, P), curve_points(curves["chaos"], axis, P))
                         for axis in AXES}
    result["compare"]["final"] = compare([(1, result["free"]["summary"]["eval_loss"])],
                                         [(1, result["chaos"]["summary"]["eval_loss"])])
    if "free2" in names:  # two failure-free runs differ by wall-clock timing alone: the chaos run against each
        result["noise"] = {axis: compare(curve_points(curves["free"], axis, P),
                                         curve_points(curves["free2"], axis, P)) for axis in AXES}
        result["compare_free2"] = {axis: compare(curve_points(curves["free2"], axis, P),
                                                 curve_points(curves["chaos"], axis, P)) for axis in AXES}
    result["checks"] = checks(result, names)
    return result
