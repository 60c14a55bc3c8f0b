"""The syncer's side of every runtime: its state, the token, byte and time ledgers and the input log,
with one method per thing a runtime reports. Sim calls it from its event loop, threads from the
syncer thread (its only owner), so the booking rules are written once.

Reference: DESIGN.md "Ledgers" and "The two state machines".
"""

from __future__ import annotations

from typing import Callable

from diloco.algo import ledger, timeline, traffic
from diloco.algo import syncer as sync
from diloco.algo.replay import Input, apply as deliver
from diloco.runtime.setup import Setup
from diloco.runtime.summary import run_summary

# (learner, frame, fragment, full) -> None: hand a broadcast to the runtime's transport
Transport = Callable[[int, bytes, int, bool], None]


class SyncerHost:
    """Not thread-safe: exactly one owner (the sim loop, or the threads runtime's syncer thread)."""

    def __init__(self, setup: Setup, learners: dict[int, int], inputs=None,
                 on_deadline: Callable[[int, float], None] | None = None, transport: Transport | None = None):
        self.setup, self.policy = setup, setup.policy
        self.inputs = inputs  # every syncer input, in delivery order: the replayable tape
        self.state = sync.init(setup.policy, setup.fragments, setup.theta0, dict(learners))
        self.tokens = ledger.token_ledger(len(setup.fragments))
        self.bytes = traffic.byte_ledger()
        self.time = timeline.time_ledger()
        self.stalls = 0
        self.on_deadline = on_deadline or (lambda p, at: None)
        self.transport = transport or (lambda m, frame, p, full: None)
        self.incarnations = dict(learners)  # every learner ever started -> its newest incarnation
        self.alive = set(learners)
        self.inputs_seen = 0  # syncer inputs delivered: where a resumed run's input log continues

    # --- what learners did ----------------------------------------------------------------------
    def step(self, m: int, inc: int, start: float, end: float, tokens: int, now: float) -> None:
        """A step of `tokens`: fewer than a full batch means slices were down, and that share of
        the step's chip time is booked "degraded", not compute (goodput counts live chips)."""
        share = tokens / (self.setup.spec.batch_size * self.setup.spec.seq_len)
        self.time = timeline.add_step(self.time, m, start, end, share)
        self.tokens = ledger.process(self.tokens, m, inc, tokens)
        self.deliver(Input("step_time", now, (m, end - start)))

    def sent(self, m: int, inc: int, at: float, sends, frames) -> None:
        """Book contributions as they leave learner m (the runtime delivers them, maybe later)."""
        for send, frame in zip(sends, frames):
            self.tokens = ledger.send(self.tokens, m, inc, send.fragment, send.seq)
            self.bytes = traffic.add_bytes(self.bytes, at, len(frame), "up", m, send.fragment,
                                           self.setup.spec.up_spec)

    def applied(self, m: int, inc: int, fragments) -> None:
        for p in fragments:
            self.tokens = ledger.apply(self.tokens, m, inc, p)

    def stalled(self, m: int, start: float, end: float) -> None:
        self.time = timeline.add_time(self.time, m, "stall", start, end)
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
        for p, frame in sync.full_frames(self.state).items():
            self.bytes = traffic.add_bytes(self.bytes, now, len(frame), "down", m, p, "fp32")
        self.deliver(Input("live", now, self.live()))

    def book_time(self, m: int, state: str, start: float, end: float) -> None:
        self.time = timeline.add_time(self.time, m, state, start, end)

    def live(self) -> tuple[tuple[int, int], ...]:
        return tuple(sorted((m, self.incarnations[m]) for m in self.alive))

    # --- the syncer ------------------------------------------------------------------------------
    def deliver(self, event: Input) -> None:
        self.inputs_seen += 1
        if self.inputs is not None:
            self.inputs.append(event)
        self.state, actions = deliver(self.policy, self.state, event)
        for a in actions:
            if isinstance(a, sync.SetDeadline):
                self.on_deadline(a.fragment, a.at)
            elif isinstance(a, sync.Outcome) and a.key is not None:
                self.tokens = ledger.resolve(self.tokens, a.key, a.outcome, a.into)
            elif isinstance(a, sync.Publish):
                for m, frame in sorted(a.frames.items()):
                    full = m in a.full
                    codec = "fp32" if full else self.policy.down_spec
                    self.bytes = traffic.add_bytes(self.bytes, event.at, len(frame), "down", m, a.fragment, codec)
                    self.transport(m, frame, a.fragment, full)

    def extra_down(self, m: int, at: float, nbytes: int, fragment: int) -> None:
        """Bytes the transport added on its own (a catch-up copy replacing a backlog)."""
        self.bytes = traffic.add_bytes(self.bytes, at, nbytes, "down", m, fragment, "fp32")

    def summary(self, *, clock: str, end: float, window: float) -> dict:
        return run_summary(self.state, self.tokens, self.bytes, self.time, clock=clock, end=end,
                           window=window, stalls=self.stalls)


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
