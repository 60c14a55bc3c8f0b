"""The procs runtime's syncer process: books the learners' event streams from the object store,
drives the syncer state machine, and publishes every merge there.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428); docs/design.md#procs.

It does what threads' syncer thread does, in the same order: for each learner, the events of its
live incarnation in sequence (a step's tokens, then its contributions, fetched by key and
delivered through diloco.algo.replay; applies; done), grace deadlines as they fall due, and every
Publish as a delta + full copy under unique keys before the `down/latest` pointer moves. A death
(`ctl/died/...`, written by the supervisor once the process has exited, so its events are all
there) is booked after that incarnation's last event: its unsent tokens are lost, it leaves the
live set, and `ctl/buried/...` tells the next incarnation where its predecessor stopped. The
next incarnation's `join` event brings it back into the live set.

Reports for the supervisor (train and rejoin records, eval requests with Theta, and the end with
the summary and the final Theta) go out as `rep/<n>.json` (+ `rep/<n>.npz`), in order
(diloco/runtime/procs/reports.py).

Restarts (diloco/runtime/procs/recovery.py): every step of the loop (book one event, fire one
deadline, book one death) is a journal entry, written before it runs and stamped with the clock
time every input it delivers carries; every `run.checkpoint_every` merges the whole state is
checkpointed. A syncer restarted by the supervisor restores the newest checkpoint and executes the
journal after it again, which remakes the same versions: a version the store already has is not
published again, a report the supervisor already read is not written again. The store forgets
booked events, acked contributions and dead incarnations only once the oldest checkpoint kept
covers them, so whatever a replay from any of them needs is still there; learners never wait for
the syncer except at their tau bound, and see the versions they would have seen.

Damage in the store (docs/design.md#damage-in-the-store; the checks are in
diloco/runtime/procs/intake.py): an event or exit notice that does not authenticate
(runtime.auth) is ignored, counted and read again, as the real one may land on its key later; an
authenticated event that is not JSON or not an event of its learner is logged and skipped; a gap
in an event stream (event n missing, a later authenticated one there) is skipped after
GAP_TIMEOUT_S (diloco/runtime/procs/streams.py) with an error logged, at once when the process
has exited; a contribution larger than any frame of the run is passed on unread, to be
quarantined as too_large; a learner that exited 0 without a readable Done event is booked done.

The walk along the event streams is in procs/streams.py, the store reads and their checks in
procs/intake.py, the restart in procs/recovery.py; this loop, its deadlines and journal entries
share the one SyncerHost and clock.
"""

from __future__ import annotations

import heapq
import logging
import os
import signal
import time
from pathlib import Path

from diloco import report
from diloco import store as bs
from diloco.algo import auth, ledger, quorum
from diloco.algo import syncer as sync
from diloco.algo.replay import Input
from diloco.config import TrainConfig
from diloco.runtime import events as ev
from diloco.runtime import keepup
from diloco.runtime.host import HostedRuntime, SyncerHost
from diloco.runtime.procs.child import (POLL_MAX, POLL_MIN, buried, child_main, child_setup, event_key,
                                        in_main_thread, max_frame)
from diloco.runtime.procs import streams
from diloco.runtime.procs.intake import gathered_ignored, ignored_summary, listed_events, parse_event, read_event
from diloco.runtime.procs.recovery import Recovery
from diloco.runtime.procs.reports import write_report
from diloco.runtime.runlog import write_decisions
from diloco.runtime.walltape import chaos_tape

log = logging.getLogger(__name__)

GC_EVERY = 1.0  # seconds between acks + garbage collection of old versions and booked events


class ProcSyncer(HostedRuntime):
    """Owns the SyncerHost (state and ledgers, booked by the same rules as in sim and threads), the
    deadlines and the event cursors. `restart`: a predecessor died; restore its checkpoint and
    journal. `reports_read`: how many of the reports the supervisor has read (not written again)."""

    def __init__(self, store: bs.BlobStore, cfg: TrainConfig, run_dir: Path | None, want_evals: bool,
                 restart: bool = False, reports_read: int = 0, resume: dict | None = None):
        """resume: a resumed run ({"at": the stopped run's clock, "learners": those restarted}):
        restored as after a crash, on a new clock that starts at `at` once those have compiled."""
        self.store, self.cfg, self.want_evals = store, cfg, want_evals
        self.restart, self.reports_read, self.resume = restart or resume is not None, reports_read, resume
        self.setup = s = child_setup(cfg, store)
        self.M = cfg.runtime.learners
        # Learners fetch broadcasts from the store and report what they fetched (learners_fetch).
        self.host = SyncerHost(s, {m: 0 for m in range(self.M)}, on_deadline=self._arm,
                               on_publish=self._publish, learners_fetch=True, on_step=self._on_step,
                               pace=None if restart else keepup.plan(cfg),  # a restart's learners are running
                               on_merge=self._report, log_refusals=cfg.run.log_refusals)
        self.current = dict.fromkeys(range(self.M), 0)  # incarnation booked now
        self.cursor = dict.fromkeys(range(self.M), 0)  # its next event number
        self.steps = dict.fromkeys(range(self.M), 0)  # last step booked per learner
        self.died_at: dict[int, float] = {}
        self.delivered: dict[tuple[int, int], int] = {}  # (learner, incarnation) -> last seq delivered
        self.graves: set[tuple[int, int]] = set()  # dead incarnations whose objects are still stored
        self.deadlines: list[tuple[float, int, int]] = []  # grace timers (at, order, fragment), a heap
        self.order = 0  # tie-break of deadlines set at the same time
        self.reports = 0
        self.run_dir = run_dir
        self.recovery = Recovery(cfg, run_dir)
        self.replaying = False  # executing the journal of a predecessor
        self.t0 = 0.0
        self.now = 0.0  # the clock time of the journal entry being executed
        self.stopping = False
        self.parent = os.getppid()  # the supervisor: if it is gone, nobody waits for the result
        self.max_frame = max_frame(s)  # a contribution object larger than this is not read
        self.gap_timeout = streams.GAP_TIMEOUT_S
        self.heard = dict.fromkeys(range(self.M), time.monotonic())  # a stream's last event or listing
        self.gaps: dict[tuple[int, int, int], float] = {}  # (m, inc, n) missing -> when first seen
        self.skipped = 0  # events and gaps skipped as damage (each logged)
        # Store objects ignored as unauthenticated or malformed, key -> why (each logged once): a
        # forger's object is never taken as truth, and never blocks the real one landing on its key.
        self.ignored: dict[str, str] = {}
        self.secret = s.policy.auth
        self.burials: dict[tuple[int, int], dict] = {}  # written, until the successor's first event (_keep_controls)

    def clock(self) -> float:
        return time.time() - self.t0

    def _nap(self, dt: float) -> None:
        """Back-off sleep, cut short by the next grace deadline."""
        if os.getppid() != self.parent:
            raise SystemExit(f"supervisor {self.parent} is gone")
        if self.deadlines:
            dt = min(dt, self.deadlines[0][0] - self.clock())
        time.sleep(max(0.0, dt))

    def run(self) -> None:
        try:
            entries = self.recovery.open(self, self.restart)
            self._replay(entries)  # before the clock: every entry carries the time it ran at
            self._start_clock()
            poller, last_gc = bs.Poller(POLL_MIN, POLL_MAX, sleep=self._nap), 0.0
            while not self.stopping:
                now = self.clock()
                while self.deadlines and self.deadlines[0][0] <= now:
                    self._do({"do": "deadline", "fragment": self.deadlines[0][2]})
                active = [streams.poll(self, m) for m in range(self.M)]
                if len(self.host.done) == self.M and not self.deadlines:
                    break  # `done` is each learner's last event, so everything has been booked
                if now - last_gc >= GC_EVERY:
                    self._keep_controls()
                    self.collect()
                    last_gc = now
                poller.wait(any(active))
            if self.stopping:  # SIGTERM: book what the stopped learners wrote, a final checkpoint, the summary
                for m in range(self.M):
                    streams.drain(self, m, self.current[m])
                self.recovery.maybe_save(self, final=True)
            self.finish()
        finally:
            self.recovery.close(self)

    def _start_clock(self) -> None:
        """Once every learner has compiled, as threads' barrier does; a restarted syncer keeps the
        clock its learners already run on, a resumed one starts it where the stopped run ended."""
        started = bs.read_trusted(self.store, "start", self.secret, self.ignored, {"t0": (int, float)})
        if started is not None:
            self.t0 = started["t0"]
            self.recovery.keep_clock(self.t0)
            return
        kept = self.recovery.kept_clock() if self.restart and self.resume is None else None
        if kept is not None:  # its ctl/start gone or forged: the clock its learners run on, from its own record
            self.t0 = kept
            bs.write_control(self.store, "start", {"t0": self.t0}, self.secret)
            return
        waiting = range(self.M) if self.resume is None else self.resume["learners"]
        ready = bs.Poller(POLL_MIN, POLL_MAX, stop=lambda: self.stopping or os.getppid() != self.parent)
        ready.until(lambda: all(bs.read_trusted(self.store, f"ready/{m:04d}", self.secret, self.ignored,
                                                {"incarnation": int}) for m in waiting))
        self.t0 = time.time() - (0.0 if self.resume is None else self.resume["at"])
        self.recovery.keep_clock(self.t0)
        if not self.stopping:
            bs.write_control(self.store, "start", {"t0": self.t0}, self.secret)

    def _keep_controls(self) -> None:
        """Write ctl/start, and the burial each successor still waits for, again if it no longer
        reads back as written (damaged, or a forger's written over it): a learner that starts
        later waits for them, and would wait forever."""
        kept = {"start": {"t0": self.t0}, **{buried(m, inc): rec for (m, inc), rec in self.burials.items()
                                              if self.current[m] == inc + 1 and self.cursor[m] == 0}}
        self.burials = {k: v for k, v in self.burials.items() if buried(*k) in kept}
        for name, record in kept.items():
            bs.keep_control(self.store, name, record, self.secret, self.ignored)

    # --- the loop's entries (diloco/runtime/procs/recovery.py) ---------------------------------
    def _do(self, entry: dict, raw: bytes | None = None) -> None:
        """Journal one entry at the current clock time, then execute it."""
        entry["t"] = self.clock()
        self.recovery.log(entry)
        self._exec(entry, raw)
        self.recovery.maybe_save(self)

    def _exec(self, entry: dict, raw: bytes | None) -> None:
        self.now, kind = entry["t"], entry["do"]
        if kind == "event":
            m, inc, n = entry["m"], entry["inc"], entry["n"]
            if (inc, n) != (self.current[m], self.cursor[m]):
                raise RuntimeError(f"journal entry {entry} does not follow learner {m}'s incarnation "
                                   f"{self.current[m]} event {self.cursor[m]}")
            self.cursor[m] += 1
            try:
                if self.setup.policy.auth is not None:  # forged, moved or damaged: skipped like malformed
                    raw = auth.unseal(self.setup.policy.auth, m, event_key(m, inc, n), raw)
                data = parse_event(raw, m, inc, len(self.setup.fragments), self.setup.spec.rows_of(m)
                                   * self.setup.spec.seq_len, self.delivered.get((m, inc), -1))
            except ValueError as e:
                self.skipped += 1
                log.error("learner %d incarnation %d event %d skipped: %s", m, inc, n, e)
                return
            self._on_event(m, inc, data)
        elif kind == "skip":  # a gap in the stream: the events from n to `to` are missing
            m, inc = entry["m"], entry["inc"]
            if (inc, entry["n"]) != (self.current[m], self.cursor[m]) or entry["to"] <= entry["n"]:
                raise RuntimeError(f"journal entry {entry} does not follow learner {m}'s incarnation "
                                   f"{self.current[m]} event {self.cursor[m]}")
            self.cursor[m] = entry["to"]
            self.host.lost_events(m, inc, entry["n"], entry["to"] - 1, self.steps[m], self.cfg.run.steps)
        elif kind == "done":  # it exited 0, but its Done event never came: its last event is lost
            self.host.on_event(ev.Done(entry["m"], entry["inc"], entry["at"]), self.now)
        elif kind == "deadline":
            _, _, p = heapq.heappop(self.deadlines)
            if p != entry["fragment"]:
                raise RuntimeError(f"journal entry {entry}: the earliest deadline is fragment {p}'s")
            self.host.deliver(Input("deadline", self.now, p))
        elif kind == "bury":
            self._bury(entry["m"], entry["inc"], entry["at"])
        else:
            raise ValueError(f"unknown journal entry {entry}")

    def _replay(self, entries: list[dict]) -> None:
        """A restarted syncer executes its predecessor's entries after the checkpoint again."""
        self.replaying = True
        for entry in entries:
            raw = None
            if entry["do"] == "event":
                raw = read_event(self.store, entry["m"], entry["inc"], entry["n"])
                if raw is None:
                    raise RuntimeError(f"journal entry {entry}: the event is gone from the store, so the "
                                       f"checkpoint restored is older than the one the store was collected to")
            self._exec(entry, raw)
        self.replaying = False

    # --- booking (diloco/runtime/procs/streams.py walks the streams) ---------------------------
    def _on_event(self, m: int, inc: int, data: dict) -> None:
        """Book one learner event (diloco/runtime/events.py), its contributions read from the store."""
        frames = tuple(bs.get_frame(self.store, bs.contribution_key(m, inc, seq), self.max_frame)
                       for _, seq in data.get("sends", ()))
        e = ev.from_json(data, frames)
        if isinstance(e, ev.Rejoined):  # the syncer, not the learner, knows when its predecessor died
            e = e._replace(died_at=self.died_at.pop(m, e.at))
            self.steps[m] = e.rejoin["step"]
        self.host.on_event(e, self.now)
        if isinstance(e, (ev.StepDone, ev.Flushed)) and e.sends:
            self.delivered[(m, inc)] = e.sends[-1][1]
        if isinstance(e, ev.Rejoined):
            # with its down and restarting intervals: what recovery took, as the host booked it
            self._report({"kind": "rejoin", "time": e.at, "died_at": e.died_at, "down_until": e.down_until,
                          **e.rejoin})

    def _on_step(self, e: ev.StepDone) -> None:
        """A step is booked; its contributions are not delivered yet."""
        self.steps[e.learner] = e.step
        if e.loss is not None:
            self._report({"kind": "train", "learner": e.learner, "step": e.step, "time": e.end,
                          "tokens": e.step * e.tokens, "loss": e.loss})
        if e.learner == 0 and self.want_evals and report.due(e.step, self.cfg.run.eval_every, self.cfg.run.steps):
            # As in sim and threads: the global model as it stood when learner 0 finished the step.
            self._report({"kind": "eval", "step": e.step, "time": e.end,
                          "tokens": int(self.host.tokens.processed[0]), "merges": self.host.state.merges},
                         sync.theta(self.host.state))

    def _bury(self, m: int, inc: int, at: float) -> None:
        """Book the death of (m, inc): unsent tokens lost, out of the live set, successor told."""
        last = self.host.time.open.get(m)
        self.host.book_time(m, "down", at if last is None else last[2], at)  # the step it died in
        self.host.on_event(ev.Died(m, inc, at), self.now)
        self.died_at[m] = at
        self.current[m], self.cursor[m] = inc + 1, 0
        self.graves.add((m, inc))  # its objects go once a checkpoint covers this (collect)
        self.burials[(m, inc)] = {"step": self.steps[m], "done": m in self.host.done}
        bs.write_control(self.store, buried(m, inc), self.burials[(m, inc)], self.secret)

    def _arm(self, p: int, at: float) -> None:
        heapq.heappush(self.deadlines, (at, self.order, p))
        self.order += 1

    def _publish(self, a: sync.Publish) -> None:
        """The delta (what learners holding the previous version were sent) and the full copy.
        Learners report what they fetch, so down bytes are booked from their events. Replaying,
        a version the store already has is the one being remade: it stays as it is."""
        P = len(self.setup.fragments)
        if self.replaying:
            pub = bs.latest_or_rebuilt(self.store, P, self.secret).get(a.fragment)
            if pub is not None and a.version <= pub.version:
                return
        delta = next((f for m, f in sorted(a.frames.items()) if m not in a.full), None)
        full = a.frames[a.full[0]] if a.full else _full_frame(self.host.state, a.fragment, a.version, a.merged)
        bs.publish(self.store, a.fragment, a.version, delta, full, a.merged, P, self.secret)

    # --- outputs ------------------------------------------------------------------------------
    def _report(self, record: dict, theta: dict | None = None) -> None:
        n = self.reports
        self.reports += 1
        if n < self.reports_read:  # a predecessor wrote it and the supervisor has it
            return
        write_report(self.store, n, record, theta, self.secret)

    def collect(self, final: bool = False) -> None:
        """Ack what was delivered, gc old versions and acked contributions, drop booked events and
        dead incarnations' objects: as far as the newest completed checkpoint covers them (all that
        is booked if there are no checkpoints, or `final`ly, once the end report is out)."""
        c = self.recovery.covered(self, final)
        for (m, inc), seq in c.delivered.items():
            bs.write_ack(self.store, m, inc, seq, self.secret)
        bs.gc(self.store, max(2, self.setup.policy.history), c.delivered, self.secret)
        for m, inc in c.graves:  # its contributions were all delivered or never named by an event
            self.store.delete_prefix(f"up/{m:04d}/{inc:04d}/")
            self.store.delete_prefix(f"ev/{m:04d}/{inc:04d}/")
        self.graves -= c.graves
        for m, inc in c.current.items():
            for n in listed_events(self.store, m, inc):
                if n < c.cursor[m]:
                    self.store.delete(event_key(m, inc, n))

    def finish(self) -> None:
        end = self.clock()
        window = quorum.slowest_step_time(self.syncer.step_times) or self.cfg.runtime.step_time
        tape = chaos_tape(self.cfg)  # as every learner process derives it (diloco/runtime/walltape.py)
        summary = self.host.summary(clock="wall", end=end, window=window, tape=tape,
                                    scale=self.cfg.chaos.wall_scale)
        summary.update(ignored_summary(*gathered_ignored(self.store, self.secret, self.ignored)))
        if self.run_dir is not None:
            write_decisions(self.run_dir / "decisions.jsonl", self.syncer.decisions)
        self._report({"kind": "end", "time": end, "summary": summary, "steps": self.steps,
                      "tokens": ledger.token_totals(self.tokens), "dead": sorted(self.tokens.dead),
                      "finished_at": self.host.finished_at, "merges": self.syncer.merges,
                      "processed0": int(self.tokens.processed[0]), "complete": len(self.host.done) == self.M,
                      "skipped": self.skipped},
                     sync.theta(self.syncer))
        # The result is with the supervisor: nothing is replayed any more, so the store keeps only
        # the newest versions, acks and control. Not at a stop: a resume replays from the
        # checkpoints kept, and reads what the stopped learners wrote after them.
        if not self.stopping:
            self.collect(final=True)


def _full_frame(st: sync.SyncerState, p: int, version: int, merged: tuple) -> bytes:
    """Fragment p's full copy at `version`, from the refs the syncer keeps (sync.full_frame gives
    the newest; a later merge in the same delivery may already have passed `version`)."""
    fs = st.fragments[p]
    refs = tuple(r for r in fs.refs if r[0] <= version)
    frags = st.fragments[:p] + (fs._replace(refs=refs),) + st.fragments[p + 1:]
    return sync.full_frame(st._replace(fragments=frags), p, merged)


def syncer_body(store: bs.BlobStore, cfg: TrainConfig, run_dir: Path | None, want_evals: bool,
                restart: bool, reports_read: int, resume: dict | None = None, exposed=None) -> None:
    """exposed: given the syncer once built, for a host that stops it without a signal (Ray)."""
    rt = ProcSyncer(store, cfg, run_dir, want_evals, restart, reports_read, resume)
    if exposed is not None:
        exposed(rt)

    def stop(signum, frame):  # SIGTERM from the supervisor: finish with what has been booked
        rt.stopping = True

    if in_main_thread():
        signal.signal(signal.SIGTERM, stop)
    rt.run()


def syncer_main(store_url: str, cfg: TrainConfig, cache: str | None, run_dir: Path | None, want_evals: bool,
                incarnation: int = 0, reports_read: int = 0, resume: dict | None = None) -> None:
    """Process target of the syncer (spawned by diloco/runtime/procs/supervisor.py); incarnation > 0 restores
    the latest checkpoint and journal of the ones before (`resume`: of a stopped run)."""
    child_main("syncer", store_url, cfg, cache, syncer_body, run_dir, want_evals, incarnation > 0, reports_read,
               resume)
