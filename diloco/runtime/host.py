"""The syncer's side of every runtime: its state, the token, byte and time ledgers and the input log.
Every runtime reports what its learners did as typed events (diloco/runtime/events.py) through
`on_event`, so the booking rules are written once: sim calls it from its event loop, threads
from the syncer thread (its only owner), procs from the syncer process.

Reference: docs/design.md#ledgers and docs/design.md#learner-events.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Callable

from diloco.algo import hostpool, ledger, roundsum, timeline, traffic
from diloco.algo import syncer as sync
from diloco.algo.eventlog import newest
from diloco.algo.replay import Input, apply as deliver
from diloco.chaos import tapes
from diloco.runtime import events as ev
from diloco.runtime import keepup
from diloco.runtime.build import Setup
from diloco.runtime.summary import merge_record, run_summary

log = logging.getLogger(__name__)

# (learner, frame, fragment, full) -> None: hand a broadcast to the runtime's transport
Transport = Callable[[int, bytes, int, bool], None]


class SyncerHost:
    """Not thread-safe: exactly one owner (the sim loop, or the threads runtime's syncer thread)."""

    def __init__(self, setup: Setup, learners: dict[int, int], inputs=None,
                 on_deadline: Callable[[int, float], None] | None = None, transport: Transport | None = None,
                 on_publish: Callable[[sync.Publish], None] | None = None, learners_fetch: bool = False,
                 on_step: Callable[[ev.StepDone], None] | None = None, pace: keepup.Plan | None = None,
                 on_merge: Callable[[dict], None] | None = None, log_refusals: bool = False):
        """learners_fetch: learners pull broadcasts themselves and report what they fetched (procs),
        so down bytes are booked from their events, not per Publish; their clocks are several
        processes' wall clocks, so an interval starting a hair before the previous one ended is
        clipped rather than an error. on_publish sees every whole Publish (procs stores it).
        on_step sees each step once it is booked and before its contributions are delivered: the
        global model as it stood when the learner finished the step (evals, reports).
        on_merge sees each merge's metrics record (summary.merge_record), for the run's metrics;
        log_refusals: and each refused frame's record as kind "refusal" (run.log_refusals: the state
        keeps only counts and the latest, docs/design.md#damage-in-the-store).
        pace: check whether the syncer keeps up (docs/design.md#does-the-syncer-keep-up); its rounds
        are timed here, before any clock starts, on copies of the state."""
        self.setup, self.policy = setup, setup.policy
        self.learners_fetch = learners_fetch
        self.on_publish = on_publish or (lambda action: None)
        self.on_step = on_step or (lambda event: None)
        self.on_merge, self.log_refusals = on_merge, log_refusals
        self.counted = traffic.Sent()  # the byte ledger's chunks summed so far (merge records)
        self.inputs = inputs  # every syncer input, in delivery order: the replayable tape
        self.state = sync.init(setup.policy, setup.fragments, setup.theta0, dict(learners))
        roundsum.warm()  # before any clock starts: a merge's first fold compiles nothing
        self.busy_s = 0.0  # real seconds inside `deliver`: the syncer's work
        self.pace, self.pace_share, self.step_seconds = pace, None, []
        self.rounds = None if pace is None else keepup.measure(setup.policy, self.state, len(learners),
                                                               setup.spec.up_codec, setup.spec.up_spec)
        if pace is not None and pace.step_s is not None:
            self.check_pace(pace.step_s)
        self.tokens = ledger.token_ledger(len(setup.fragments))
        self.bytes = traffic.byte_ledger()
        self.time = timeline.time_ledger()
        self.stalls = 0
        self.on_deadline = on_deadline or (lambda p, at: None)
        self.transport = transport or (lambda m, frame, p, full: None)
        self.incarnations = dict(learners)  # every learner ever started -> its newest incarnation
        self.alive = set(learners)
        self.inputs_seen = 0  # syncer inputs delivered: where a resumed run's input log continues
        self.done: set[int] = set()  # learners whose Done was booked
        self.finished_at: dict[int, float] = {}  # learner -> time of its Done
        self.refused_events = 0  # learner events that could not be booked (repeats, forgeries)
        self.gaps: dict[tuple[int, int], dict] = {}  # (learner, incarnation) -> events lost, not yet booked
        self.events_lost: list[dict] = []  # each gap booked: its evidence and the steps and tokens lost

    def adopt(self, state: sync.SyncerState) -> None:
        """Take a restored syncer state (procs restart), the live set with it."""
        self.state = state
        self.incarnations.update(state.live)
        self.alive = set(state.live)

    # --- one booking rule per event -------------------------------------------------------------
    def on_event(self, e: ev.Event, now: float, deliver: bool = True) -> None:
        """Book learner event `e`, which the syncer takes at time `now`. deliver=False: the runtime
        delivers the contributions itself, later (sim's modelled link)."""
        m, inc = e.learner, e.incarnation
        why = self.unbookable(e)
        if why:  # a repeated or forged event: booking it would break the ledger's equation
            self.refused_events += 1
            log.warning("learner event refused, nothing booked: %s (%s)", why, type(e).__name__)
            return
        if (m, inc) in self.gaps and not isinstance(e, ev.Applied):
            self.gap_closed(e, now)
        for at, p, nbytes, codec in getattr(e, "fetched", ()):
            self.bytes = traffic.add_bytes(self.bytes, at, nbytes, "down", m, p, codec)
        for start, end in getattr(e, "stalls", ()):
            self.stalled(m, start, end)
        if isinstance(e, (ev.StepDone, ev.Flushed)):
            if isinstance(e, ev.StepDone):
                self.step(m, inc, e.start, e.end, e.tokens, now, e.rows)
                self.on_step(e)
            self.sent(m, inc, e.end if isinstance(e, ev.StepDone) else e.at, e.sends, e.frames)
            for (_, seq), frame in zip(e.sends, e.frames) if deliver else ():
                if frame is not None:
                    self.deliver(Input("contribution", now, bytes(frame)), sent=(m, inc, seq))
        elif isinstance(e, ev.Applied):
            self.applied(m, inc, e.fragments)
        elif isinstance(e, ev.Died):
            self.died(m, inc, e.at)
        elif isinstance(e, ev.Rejoined):
            if e.down_until > e.died_at:  # none when its devices were back at once (a kill drill)
                self.book_time(m, "down", e.died_at, e.down_until)
            self.book_time(m, "restarting", e.down_until, e.at)
            self.rejoined(m, inc, e.at)
        elif isinstance(e, ev.Done):  # its last event: every contribution it sent was delivered
            self.done.add(m)
            self.finished_at[m] = e.at
            self.finish(m, inc, now)
        else:
            raise TypeError(f"not a learner event: {e!r}")

    def unbookable(self, e: ev.Event) -> str:
        """Why event `e` cannot be booked as it stands, or "" (checked before any of it is)."""
        m, inc = e.learner, e.incarnation
        P = len(self.setup.fragments)
        sends = getattr(e, "sends", ())
        if isinstance(e, ev.Rejoined):  # a scavenged learner's first event: it joins, never started
            if m in self.incarnations and inc <= self.incarnations[m]:
                return f"learner {m} is already at incarnation {self.incarnations[m]}, not before {inc}"
        elif m not in self.incarnations:
            return f"learner {m} was never started"
        if isinstance(e, (ev.StepDone, ev.Flushed)) and (m, inc) in self.tokens.dead:
            return f"learner {m} incarnation {inc} is dead"
        if any(not 0 <= p < P for p, _ in sends) or any(not 0 <= p < P for p in getattr(e, "fragments", ())):
            return f"a fragment outside 0..{P - 1}"
        last = self.time.open.get(m)
        if isinstance(e, ev.StepDone) and not self.learners_fetch and last is not None and e.start < last[2]:
            return f"its step from {e.start} overlaps what learner {m} did until {last[2]}"
        if any((m, inc, seq) in self.tokens.in_flight for _, seq in sends):
            return f"it repeats a send of learner {m} incarnation {inc} still in flight"
        if len(set(sends)) != len(sends) or len(getattr(e, "frames", sends)) != len(sends):
            return "its sends and frames do not pair up"
        return ""

    # --- what learners did ----------------------------------------------------------------------
    def step(self, m: int, inc: int, start: float, end: float, tokens: int, now: float, rows: int = 0) -> None:
        """A step of `tokens` over `rows` batch rows (0: all): fewer rows mean slices were down, and
        that share of the step's chip time is booked "degraded", not compute (goodput counts live
        chips)."""
        full = self.setup.spec.rows_of(m)
        share = min(rows, full) / full if rows else 1.0
        split = timeline.step_split(start, end, share)
        self.book_time(m, "compute", start, split)
        if split < end:
            self.book_time(m, "degraded", split, end)
        self.tokens = ledger.process(self.tokens, m, inc, tokens)
        self.deliver(Input("step_time", now, (m, end - start)))
        if self.pace is not None and self.pace_share is None:  # a wall clock: learn the step time
            self.step_seconds.append(end - start)
            if len(self.step_seconds) >= keepup.STEPS_PER_LEARNER * len(self.incarnations):
                self.check_pace(max(statistics.median(self.step_seconds), self.pace.period_s))

    def check_pace(self, step_s: float) -> None:
        """The syncer's predicted share of the wall at learner steps of step_s; one warning if > 1."""
        if step_s <= 0:
            return
        self.pace_share = keepup.share(self.rounds.seconds, self.pace.H, step_s)
        why = keepup.warning(self.rounds, self.pace.H, step_s, self.setup.spec.up_spec,
                             len(os.sched_getaffinity(0)), hostpool.threads())
        if why:
            log.warning(why)

    def sent(self, m: int, inc: int, at: float, sends, frames) -> None:
        """Book contributions, (fragment, seq) pairs, as they leave learner m (the runtime delivers
        them, maybe later); a frame None was lost before the syncer could read it."""
        for (p, seq), frame in zip(sends, frames):
            self.tokens = ledger.send(self.tokens, m, inc, p, seq)
            if frame is None:
                self.tokens = ledger.resolve(self.tokens, (m, inc, seq), "lost")
            else:
                self.bytes = traffic.add_bytes(self.bytes, at, len(frame), "up", m, p, self.setup.spec.up_spec)

    def lost_events(self, m: int, inc: int, first: int, last: int, after_step: int, final_step: int) -> None:
        """Events first..last of learner m's incarnation inc never reached the syncer (a gap in its
        stream: diloco/runtime/procs/syncer.py), after it had booked `after_step` steps. Their steps are
        booked processed and lost by the next event that tells how many there were: a step (its
        number, at its token count), or the final sync or Done (`final_step`, at a full batch);
        a death tells nothing, and the gap is recorded with its steps unknown
        (docs/design.md#damage-in-the-store)."""
        gap = self.gaps.setdefault((m, inc), {"learner": m, "incarnation": inc, "events": [first, last],
                                              "after_step": after_step, "final_step": final_step})
        gap["events"][1] = last  # a second gap before the next step: one stretch of lost steps

    def gap_closed(self, e: ev.Event, now: float) -> None:
        """The gap of e's incarnation is closed by `e`: its steps are booked lost and, as the
        learner took them and counts them in its next contribution's c_steps, credited to its
        claims (a lost_steps input, before e's own step and contributions), so that contribution is
        not refused as bad_counter (docs/algorithm.md#claims-checked-against-observation)."""
        gap = self.gaps.pop((e.learner, e.incarnation))
        steps, tokens = None, 0
        if isinstance(e, ev.StepDone):
            steps = max(e.step - 1 - gap["after_step"], 0)
            tokens = steps * e.tokens
        elif isinstance(e, (ev.Flushed, ev.Done)):
            steps = max(gap["final_step"] - gap["after_step"], 0)
            tokens = steps * self.setup.spec.rows_of(e.learner) * self.setup.spec.seq_len
        if tokens:
            self.tokens = ledger.lose(self.tokens, e.learner, e.incarnation, tokens)
        if steps and self.incarnations.get(e.learner) == e.incarnation and e.learner in self.alive:
            self.deliver(Input("lost_steps", now, (e.learner, steps)))
        self.events_lost.append({"learner": e.learner, "incarnation": e.incarnation, "events": gap["events"],
                                 "after_step": gap["after_step"], "steps": steps, "tokens": tokens})
        log.error("learner %d incarnation %d: events %d to %d were lost; %s", e.learner, e.incarnation,
                  *gap["events"], "its steps are unknown (no later step or final sync tells)" if steps is None else
                  f"{steps} steps after step {gap['after_step']} ({tokens:,} tokens) booked lost")

    def applied(self, m: int, inc: int, fragments) -> None:
        for p in fragments:
            self.tokens = ledger.apply(self.tokens, m, inc, p)

    def stalled(self, m: int, start: float, end: float) -> None:
        self.book_time(m, "stall", start, end)
        self.stalls += 1

    def died(self, m: int, inc: int, now: float) -> None:
        """Learner m's incarnation inc is gone: its unsent work is lost, it leaves the live set."""
        self.tokens = ledger.die(self.tokens, m, inc)
        self.alive.discard(m)
        self.deliver(Input("live", now, self.live()))

    def rejoined(self, m: int, inc: int, now: float) -> None:
        """Learner m is back as incarnation inc, holding the current Theta (a full copy of each
        fragment, booked here as the bytes it fetched)."""
        self.incarnations[m] = inc
        self.alive.add(m)
        if not self.learners_fetch:  # else the learner reported what it fetched
            for p, frame in sync.full_frames(self.state).items():
                self.bytes = traffic.add_bytes(self.bytes, now, len(frame), "down", m, p, "fp32")
        self.deliver(Input("live", now, self.live()))

    def finish(self, m: int, inc: int, now: float) -> None:
        """Learner m's incarnation inc finished training and the syncer has every contribution it
        sent: rounds stop waiting for it (docs/algorithm.md#finished-learners)."""
        if m in self.alive and self.incarnations.get(m) == inc and m not in self.state.finished:
            self.deliver(Input("finished", now, (m, inc)))

    def finish_done(self) -> None:
        """Every learner whose Done was booked, told finished at its Done's time: a no-op but for a
        checkpoint saved before the syncer kept the finished set (docs/algorithm.md#finished-learners)."""
        for m in sorted(self.done):
            self.finish(m, self.incarnations.get(m, -1), self.finished_at.get(m, 0.0))

    def book_time(self, m: int, state: str, start: float, end: float) -> None:
        if self.learners_fetch:
            last = self.time.open.get(m)
            start = start if last is None else max(start, last[2])
            if end <= start:
                return
        self.time = timeline.add_time(self.time, m, state, start, end)

    def live(self) -> tuple[tuple[int, int], ...]:
        return tuple(sorted((m, self.incarnations[m]) for m in self.alive))

    # --- the syncer ------------------------------------------------------------------------------
    def deliver(self, event: Input, sent: tuple[int, int, int] | None = None) -> None:
        """Give the syncer one input. `sent`: the key of the send whose frame this is, known from the
        event that named it, so a frame too damaged to name itself (checksum, truncation, header)
        still resolves its tokens, as dropped, instead of staying in flight forever."""
        started = time.perf_counter()
        try:
            self._deliver(event, sent)
        finally:
            self.busy_s += time.perf_counter() - started

    def _deliver(self, event: Input, sent: tuple[int, int, int] | None) -> None:
        self.inputs_seen += 1
        if self.inputs is not None:
            self.inputs.append(event)
        decided, refused = len(self.state.decisions), self.state.refusals.total
        self.state, actions = deliver(self.policy, self.state, event)
        for a in actions:
            if isinstance(a, sync.SetDeadline):
                self.on_deadline(a.fragment, a.at)
            elif isinstance(a, sync.Outcome):  # neither key known: counted as unmatched, no tokens
                self.tokens = ledger.resolve(self.tokens, a.key or sent, a.outcome, a.into)
            elif isinstance(a, sync.Publish):
                self.on_publish(a)
                if self.learners_fetch:
                    continue
                for m, frame in sorted(a.frames.items()):
                    full = m in a.full
                    codec = "fp32" if full else self.policy.down_spec
                    self.bytes = traffic.add_bytes(self.bytes, event.at, len(frame), "down", m, a.fragment, codec)
                    self.transport(m, frame, a.fragment, full)
        if self.on_merge is not None:  # after the actions: a merge's broadcast is in its bytes_down
            self._merged(decided)
            for r in newest(self.state.refusals, refused) if self.log_refusals else ():
                self.on_merge({"kind": "refusal", "time": r["at"], **r})

    def _merged(self, decided: int) -> None:
        """The metrics record of every merge among the decisions from index `decided` on."""
        decisions = self.state.decisions
        new = [decisions[i] for i in range(decided, len(decisions)) if decisions[i]["event"] == "merge"]
        if not new:
            return
        up, down, self.counted = traffic.sent(self.bytes, self.counted)
        for k, d in enumerate(new):
            self.on_merge(merge_record(self.state, d, self.state.merges - len(new) + 1 + k, self.tokens,
                                       (up, down), self.time, self.stalls))

    def extra_down(self, m: int, at: float, nbytes: int, fragment: int) -> None:
        """Bytes the transport added on its own (a catch-up copy replacing a backlog)."""
        self.bytes = traffic.add_bytes(self.bytes, at, nbytes, "down", m, fragment, "fp32")

    def summary(self, *, clock: str, end: float, window: float, tape=None, scale: float = 1.0) -> dict:
        """`tape` (diloco/chaos/tapes.py): the run's failure tape, read at `scale` clock seconds per
        tape second (chaos.wall_scale on a wall clock); what it injected by `end` is counted."""
        return run_summary(self.state, self.tokens, self.bytes, self.time, clock=clock, end=end,
                           window=window, stalls=self.stalls, busy_s=self.busy_s, pace_share=self.pace_share,
                           events_lost=self.events_lost + [{**g, "steps": None, "tokens": 0} for g in self.gaps.values()],
                           round_s=None if self.rounds is None else max(self.rounds.seconds),
                           injected=None if tape is None else tapes.injected(tape, end / scale))


class HostedRuntime:
    """Read access a runtime gives to what its SyncerHost owns (for summaries, tests, notebooks)."""

    host: SyncerHost

    @property
    def syncer(self) -> sync.SyncerState:
        return self.host.state

    @property
    def tokens(self) -> ledger.TokenLedger:
        return self.host.tokens

    @property
    def bytes(self) -> traffic.ByteLedger:
        return self.host.bytes

    @property
    def time(self) -> timeline.TimeLedger:
        return self.host.time
