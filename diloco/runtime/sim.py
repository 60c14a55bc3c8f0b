"""The sim runtime: a virtual clock, modelled learner speeds and links, real JAX steps run one after
another. Deterministic given the config's seeds, so experiments and tests replay exactly.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428); DESIGN.md "Runtimes".

Each event is (time, order, kind, data) on a heap. A learner's step takes its modelled time
(step_time x speed x jitter); a message takes latency + bytes / bandwidth on its learner's link,
one message at a time per direction. The syncer merges in zero virtual time.
"""

from __future__ import annotations

import heapq
import itertools
from pathlib import Path
from typing import Any, Callable

import numpy as np

from diloco import report
from diloco.algo import ledger, timeline, traffic
from diloco.algo import syncer as sync
from diloco.algo.replay import Input, apply as deliver
from diloco.config import TrainConfig
from diloco.runtime.setup import Setup, new_unit
from diloco.runtime.summary import run_summary
from diloco.runtime.tape import InputLog, run_outputs, write_decisions


class Sim:
    """Event loop state; `run` drives it to the end. One object per run, closed over nothing global."""

    def __init__(self, cfg: TrainConfig, setup: Setup, writer: report.MetricsWriter | None,
                 evaluate: Callable[[dict], float] | None, inputs: InputLog | None = None):
        self.cfg, self.setup, self.writer, self.evaluate = cfg, setup, writer, evaluate
        self.inputs = inputs  # every syncer input, in delivery order: the replayable tape
        r = cfg.runtime
        self.M = r.learners
        self.speeds = list(r.speeds) or [1.0] * self.M
        self.rng = np.random.default_rng([r.seed, 7])
        self.heap: list = []
        self.order = itertools.count()
        self.syncer = sync.init(setup.policy, setup.fragments, setup.theta0, {m: 0 for m in range(self.M)})
        self.units = [new_unit(setup, m, 0, self.syncer) for m in range(self.M)]
        self.tokens = ledger.token_ledger(len(setup.fragments))
        self.bytes = traffic.byte_ledger()
        self.time = timeline.time_ledger()
        self.link_up = [0.0] * self.M
        self.link_down = [0.0] * self.M
        self.stalled_since: dict[int, float] = {}
        self.stall_armed: dict[int, int] = {}
        self.waking: set[int] = set()  # learners with a step event on the heap
        self.flushed: set[int] = set()  # learners that sent their final contributions  # learner -> seq of the send its stall limit watches
        self.stalls = 0
        self.now = 0.0
        self.evals: list[tuple[float, int, float]] = []

    def push(self, t: float, kind: str, *data: Any) -> None:
        heapq.heappush(self.heap, (t, next(self.order), kind, data))

    def run(self) -> dict:
        for m in range(self.M):
            self._wake(m, 0.0)
        while self.heap:
            self.now, _, kind, data = heapq.heappop(self.heap)
            getattr(self, f"_on_{kind}")(*data)
        return self.summary()

    # --- learners -----------------------------------------------------------------------------
    def _wake(self, m: int, t: float) -> None:
        """Schedule learner m's next step unless one is already scheduled (a fragment arrival and a
        stall limit can fall on the same instant; the learner must still step only once)."""
        if m not in self.waking:
            self.waking.add(m)
            self.push(t, "step", m)

    def _on_step(self, m: int) -> None:
        self.waking.discard(m)
        unit, r = self.units[m], self.cfg.runtime
        for q in unit.apply_due():
            self.tokens = ledger.apply(self.tokens, m, unit.ls.incarnation, q.fragment)
        blocked = unit.blocking()
        if blocked is not None:
            if m not in self.stalled_since:
                self.stalled_since[m] = self.now
                self.stalls += 1
            if self.stall_armed.get(m) != blocked.seq:  # one limit per blocking send
                self.stall_armed[m] = blocked.seq
                limit = r.stall_limit_steps * r.step_time * self.speeds[m]
                self.push(self.now + limit, "stall_limit", m, blocked.fragment, blocked.seq)
            return
        if m in self.stalled_since:
            self.time = timeline.add_time(self.time, m, "stall", self.stalled_since.pop(m), self.now)
        if unit.ls.step >= self.cfg.run.steps:
            if self.cfg.fragments.final_sync and m not in self.flushed:
                self.flushed.add(m)
                self._send(m, self.now, unit.flush())
            return
        log = report.due(unit.ls.step + 1, self.cfg.run.log_every, self.cfg.run.steps)
        result = unit.step(fetch_loss=log)
        inc = unit.ls.incarnation
        duration = r.step_time * self.speeds[m] * max(0.1, 1.0 + r.jitter * self.rng.standard_normal())
        end = self.now + duration
        self.time = timeline.add_time(self.time, m, "compute", self.now, end)
        self.tokens = ledger.process(self.tokens, m, inc, result.tokens)
        self._syncer(Input("step_time", self.now, (m, duration)))
        self._send(m, end, result)
        if log and self.writer is not None:
            self.writer.write({"kind": "train", "learner": m, "step": unit.ls.step, "time": end,
                               "tokens": unit.ls.step * result.tokens, "loss": result.loss})
        if m == 0 and self.evaluate is not None and report.due(unit.ls.step, self.cfg.run.eval_every,
                                                               self.cfg.run.steps):
            self._eval(end)
        self._wake(m, end)

    def _send(self, m: int, end: float, result) -> None:
        """Book and ship a step's (or the final flush's) contributions over learner m's link."""
        r, inc = self.cfg.runtime, self.units[m].ls.incarnation
        for send, frame in zip(result.sends, result.frames):
            self.tokens = ledger.send(self.tokens, m, inc, send.fragment, send.seq)
            self.bytes = traffic.add_bytes(self.bytes, end, len(frame), "up", m, send.fragment,
                                          self.setup.spec.up_spec)
            start = max(end, self.link_up[m])
            self.link_up[m] = start + len(frame) / r.bandwidth
            self.push(self.link_up[m] + r.latency, "contribution", frame)

    def _on_stall_limit(self, m: int, fragment: int, seq: int) -> None:
        unit = self.units[m]
        blocked = unit.blocking()
        if m in self.stalled_since and blocked is not None and blocked.seq == seq:
            unit.give_up(fragment)
            self._wake(m, self.now)

    def _on_fragment(self, m: int, frame: bytes) -> None:
        self.units[m].receive(frame)
        if m in self.stalled_since and self.units[m].blocking() is None:
            self._wake(m, self.now)

    # --- syncer -------------------------------------------------------------------------------
    def _syncer(self, event: Input) -> None:
        if self.inputs is not None:
            self.inputs.append(event)
        self.syncer, actions = deliver(self.setup.policy, self.syncer, event)
        self._act(actions)

    def _on_contribution(self, frame: bytes) -> None:
        self._syncer(Input("contribution", self.now, frame))

    def _on_deadline(self, p: int) -> None:
        self._syncer(Input("deadline", self.now, p))

    def _act(self, actions: tuple) -> None:
        r = self.cfg.runtime
        for a in actions:
            if isinstance(a, sync.SetDeadline):
                self.push(a.at, "deadline", a.fragment)
            elif isinstance(a, sync.Outcome) and a.key is not None:
                self.tokens = ledger.resolve(self.tokens, a.key, a.outcome, a.into)
            elif isinstance(a, sync.Publish):
                for m, frame in sorted(a.frames.items()):
                    codec = "fp32" if m in a.full else self.setup.policy.down_spec
                    self.bytes = traffic.add_bytes(self.bytes, self.now, len(frame), "down", m, a.fragment, codec)
                    start = max(self.now, self.link_down[m])
                    self.link_down[m] = start + len(frame) / r.bandwidth
                    self.push(self.link_down[m] + r.latency, "fragment", m, frame)

    # --- outputs ------------------------------------------------------------------------------
    def _eval(self, t: float) -> None:
        loss = self.evaluate(sync.theta(self.syncer))
        step = self.units[0].ls.step
        self.evals.append((t, step, loss))
        if self.writer is not None:
            tokens = int(self.tokens.processed[0])
            self.writer.write({"kind": "eval", "step": step, "time": t, "tokens": tokens,
                               "eval_loss": loss, "merges": self.syncer.merges})

    def summary(self) -> dict:
        return run_summary(self.syncer, self.tokens, self.bytes, self.time, clock="virtual",
                           end=self.now, window=self.cfg.runtime.step_time, stalls=self.stalls)


def run(cfg: TrainConfig, setup: Setup, run_dir: Path | None,
        evaluate: Callable[[dict], float] | None) -> tuple[Sim, dict]:
    """Run Decoupled DiLoCo in virtual time; returns the finished Sim (for its state) and a summary."""
    with run_outputs(run_dir) as (writer, inputs):
        sim = Sim(cfg, setup, writer, evaluate, inputs)
        summary = sim.run()
        if evaluate is not None:
            sim._eval(sim.now)
            summary["eval_loss"] = sim.evals[-1][2]
        if run_dir is not None:
            write_decisions(run_dir / "tape.jsonl", sim.syncer.tape)
        return sim, summary
