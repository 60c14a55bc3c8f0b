"""The procs runtime's learner process (what every procs process shares is in
diloco/runtime/procs/child.py).

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428); docs/design.md#procs.

The loop is the one threads runs too (diloco/runtime/learner_loop.py: apply_due, blocking with a
stall limit, step, flush at the end); this process is its port, with the queues replaced by
objects in the store (diloco/store/exchange.py):

* up: each contribution under its own key (send_contribution), then a small JSON event
  `ev/<learner>/<incarnation>/<n>` naming it. The syncer books each incarnation's events in n
  order, so it books a step's tokens before the contributions that carry them, as threads does.
  What the learner fetched rides on its next event, so down bytes are booked where they flowed.
* down: the `down/latest` pointer, polled before each step and with back-off while blocked. Every
  version newer than the one held is fetched in order (the delta against the held one if there
  is one, else that version's full copy), so each merge's `merged` keys reach the learner state
  machine as they do from a threads mailbox. A version gc already removed is skipped for the
  newest full copy. A damaged object (undecodable, or larger than any frame of the run) is
  logged, counted and never fetched again; the next candidate is tried: the full copy of the same
  version after its delta, then the newest full copy, then older ones
  (docs/design.md#damage-in-the-store).
* A restarted incarnation (the supervisor spawns it) compiles, then waits until the syncer has
  booked its predecessor's death (`ctl/buried/...`), waits out its tape's down time and
  `runtime.restart_s`, and rejoins (diloco/runtime/rejoin.py) from the newest readable full copies
  in the store (diloco/runtime/procs/reading.py): the syncer's current references, never its own init.

The down path (taking the broadcasts from the store) is procs/downlink.py's; the other store reads
a learner needs are in procs/reading.py.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from diloco import store as bs
from diloco.algo import auth
from diloco.algo import syncer as sync
from diloco.config import TrainConfig
from diloco.runtime import events as ev
from diloco.runtime import world as learner_world
from diloco.runtime.procs.child import (EXIT_DOWN, EXIT_SUPERSEDED, POLL_MAX, POLL_MIN, buried, child_main, child_setup,
                                        event_key, in_main_thread, max_frame, note_ignored, orphaned, wait_for)
from diloco.runtime.procs import downlink
from diloco.runtime.procs.reading import store_view, view_of_frames
from diloco.runtime.rejoin import LearnerCheckpoints, rejoin_unit
from diloco.runtime.build import new_unit
from diloco.runtime.learner_loop import run_incarnation
from diloco.runtime.pace import Pace
from diloco.runtime.unit import LearnerUnit
from diloco.runtime.walltape import WallTape, chaos_tape
from diloco.train import profile

log = logging.getLogger(__name__)

FENCE_S = 2.0  # seconds between such a learner's looks at its claim


class ProcLearner:
    """Learner (m, incarnation) in its own process; owns its unit, writes its own event stream."""

    def __init__(self, store: bs.BlobStore, cfg: TrainConfig, run_dir: Path | None, m: int,
                 incarnation: int, parent: int | None, resumed: bool = False,
                 superseded: Callable[[], bool] | None = None, world: learner_world.World | None = None):
        """resumed: the first incarnation of a resumed run, coming back from a stop. parent: the
        supervisor's pid (None: started by a scheduler). superseded: whether a newer incarnation
        has claimed this learner (started apart: asked every FENCE_S at step boundaries). world:
        this process's place in the learner's world when the learner spans several processes
        (docs/multihost.md#learner-process); None for a learner of one process."""
        self.store, self.cfg, self.m, self.inc, self.parent = store, cfg, m, incarnation, parent
        self.run_dir = run_dir
        self.resumed, self.superseded, self.fenced_at = resumed, superseded, time.monotonic()
        # Only the leader talks to the syncer: it reads the store's broadcasts and writes events
        # and contributions; followers take its frames and decisions at each step boundary.
        self.world = world
        self.leader = world is None or world.leader
        # The leader: frames its unit took since the last step boundary's broadcast; a follower:
        # those the boundary brought, until its poll gives them to its unit.
        self.accepted: list[bytes] = []
        self.view: sync.SyncerState | None = None  # a rejoin's view of the store (start)
        self.view_frames: list[bytes] = []  # the full copies it holds, for the followers
        # A learner reads syncer states (its references) and never merges: a world's processes
        # skip sync.init's merge compiles, seconds of CPU each that the processes of a world would
        # otherwise pay at once. A learner of one process compiles them as it always has.
        self.merges = world is None
        self.setup = child_setup(cfg, store)
        r = cfg.runtime
        self.speed, self.jitter = (list(r.speeds) or [1.0] * r.learners)[m], r.jitter
        # A chaos tape on the wall clock, as in threads: every process derives the same tape from
        # the config. Fewer slices: a smaller batch; none: the process exits (EXIT_DOWN) and its
        # successor waits for the tape to give a slice back before it rejoins.
        self.tape = WallTape.of(cfg, chaos_tape(cfg))
        if self.tape is not None:
            self.speed, self.jitter = self.tape.tape.speeds[m], self.tape.tape.jitter
        self.terminating = False  # set by SIGTERM: checkpoint and exit at the next step boundary
        # In a world every process saves and restores (Orbax writes each array once and syncs its
        # processes); only the leader clears what a killed save left (a follower clearing while
        # the leader has begun a save would remove that save).
        self.checkpoints = LearnerCheckpoints(None if run_dir is None else run_dir / "learners",
                                              r.learner_checkpoint_every, cfg.run.keep_checkpoints,
                                              primary=self.leader, fail_s=cfg.run.checkpoint_fail_s)
        self.n = 0  # next event number
        self.fetched: list[list] = []  # [time, fragment, bytes, codec], booked with the next event
        self.t0 = 0.0
        self.nap_until = float("inf")
        self.poller = bs.Poller(POLL_MIN, POLL_MAX, sleep=self._nap)
        self.max_frame = max_frame(self.setup)
        self.bad: set[str] = set()  # broadcast keys found unreadable: never fetched again
        self.skipped: Counter = Counter()  # what damage made it skip, by kind (also logged)
        self._bad_pointer: str | None = None  # the last malformed pointer logged, not to log it each poll
        # Store objects ignored as unauthenticated or malformed, name -> why; recorded in the store
        # before the next event (child.note_ignored), so the syncer's summary counts them.
        self.ignored: dict[str, str] = {}
        self.noted = 0

    def clock(self) -> float:
        return time.time() - self.t0  # wall time: every process (and host) shares the syncer's t0

    def _nap(self, dt: float) -> None:
        if orphaned(self.parent):
            raise SystemExit(f"supervisor {self.parent} is gone")
        time.sleep(max(0.0, min(dt, self.nap_until - self.clock())))

    def agree(self, decision: dict | None) -> dict:
        """The leader's decision on every process of the world; as it is in a learner of one."""
        return decision if self.world is None else learner_world.agree(decision if self.leader else None)

    def _leave(self) -> None:
        """A world's clean exit: every process waits for the others (an exit code agreed)."""
        if self.world is not None:
            learner_world.leave_world()

    def emit(self, event: ev.Event) -> None:
        """Write the next event of this incarnation, with what was fetched since the previous one;
        its contributions go first, each under its own key, so the event can name them. A
        follower of a world writes nothing: its leader encoded the very same frames."""
        if not self.leader:
            return None
        for (_, seq), frame in zip(getattr(event, "sends", ()), getattr(event, "frames", ())):
            bs.send_contribution(self.store, self.m, self.inc, seq, frame)
        if len(self.ignored) != self.noted:  # before the event: the record is there by its Done
            note_ignored(self.store, self.ignored, self.setup.policy.auth, self.m, self.inc)
            self.noted = len(self.ignored)
        data = ev.to_json(event._replace(fetched=tuple(map(tuple, self.fetched))))
        key, raw = event_key(self.m, self.inc, self.n), json.dumps(data).encode()
        secret = self.setup.policy.auth  # sealed under this learner's key, as its frames are signed
        self.store.put(key, raw if secret is None else auth.seal(secret.learner_key(self.m), key, raw))
        self.n += 1
        self.fetched = []

    def start(self) -> LearnerUnit | None:
        """Compile, pass the start barrier, and (a restarted incarnation) rejoin; None if the
        predecessor had already finished, leaving nothing to do. In a world the leader alone
        waits and reads the store (_begin); its plan and the full copies it rejoins from reach the
        followers, so every process calls rejoin_unit (an Orbax restore: collective) alike."""
        s, m = self.setup, self.m
        unit = new_unit(s, m, self.inc, sync.init(s.policy, s.fragments, s.theta0, {m: 0}, self.merges))
        # on Theta_0: compiling costs the same whatever the values
        unit.warm_up(*(() if self.tape is None else self.tape.smaller_batches(m)))
        plan = self._begin() if self.leader else None
        if self.world is not None:
            plan = learner_world.agree(plan if self.leader else None)
            # or: a SIGTERM the leader took after its plan was made stays for its first check
            self.t0, self.terminating = plan["t0"], self.terminating or plan["stop"]
            if plan["go"] and plan["rejoin"] is not None:
                frames = learner_world.mirror_frames(self.view_frames if self.leader else None)
                if not self.leader:
                    self.view = view_of_frames(s, frames)
        if not plan["go"]:
            return None
        how = plan["rejoin"]
        if how is None:
            return unit
        r = self.cfg.runtime
        unit, rejoined = rejoin_unit(s, m, self.inc, self.view, self.checkpoints, r.max_rejoin_staleness,
                                     how["stopped_at"], how["at_least"])
        # died_at is the syncer's to fill in: it booked the predecessor's death
        self.emit(ev.Rejoined(m, self.inc, how["now"], how["down_until"], how["now"], rejoined._asdict()))
        return unit

    def _begin(self) -> dict:
        """The leader's part of start: ready, the start barrier, and for a restarted incarnation
        the burial, the down time and the store's view (self.view). The plan: go (False: stopped,
        or nothing left to do), t0, stop, and rejoin (None for incarnation 0: now, down_until,
        the step the predecessor stopped at, the least step to resume at)."""
        m = self.m
        secret, ignored = self.setup.policy.auth, self.ignored  # control objects sealed (diloco/store/control.py)
        ready, kept = {"incarnation": self.inc}, [0.0]
        bs.write_control(self.store, f"ready/{m:04d}", ready, secret, learner=m)
        stopping = lambda: self.terminating  # noqa: E731 - SIGTERM while waiting: nothing to save yet

        def start():
            """ctl/start; one forged or malformed is ignored and read again: the syncer's lands on
            its key. Once a second, its readiness written again if it no longer reads back (the
            syncer waits for it)."""
            found = bs.read_trusted(self.store, "start", secret, ignored, {"t0": (int, float)})
            if found is None and time.monotonic() - kept[0] >= 1.0:
                kept[0] = time.monotonic()
                bs.keep_control(self.store, f"ready/{m:04d}", ready, secret, ignored, m)
            return found

        started = wait_for(start, self.parent, stopping)
        if started is None:
            return {"go": False, "t0": self.t0, "stop": self.terminating, "rejoin": None}
        self.t0 = started["t0"]
        started_at = self.clock()
        if self.inc == 0:
            return {"go": True, "t0": self.t0, "stop": False, "rejoin": None}
        before = wait_for(lambda: bs.read_trusted(self.store, buried(m, self.inc - 1), secret, ignored,
                                                  {"step": int, "done": bool}), self.parent, stopping)
        if before is None or before["done"]:
            return {"go": False, "t0": self.t0, "stop": self.terminating, "rejoin": None}
        r = self.cfg.runtime
        # Resumed: nothing was down, the clock was stopped; waiting for the syncer to book the
        # stop is part of restarting. After a crash, the wait for the burial is down time.
        down_until = started_at if self.resumed else self.clock()
        if self.tape is not None:  # its slices are still down: wait for the tape to return one
            down_until = max(down_until, self.tape.back_at(m, down_until))
        # As in sim and threads, coming back takes runtime.restart_s once the devices are back
        # (here on top of the real spawn and compile, which the process has just paid); not in a
        # resumed run, whose clock was stopped while the processes started and compiled.
        restart_s = 0.0 if self.resumed else r.restart_s
        while self.clock() < down_until + restart_s and not self.terminating:
            self._nap(min(POLL_MAX, down_until + restart_s - self.clock()))
        if self.terminating:
            return {"go": False, "t0": self.t0, "stop": True, "rejoin": None}
        self.view, fetched = store_view(self.store, self.setup, skipped=self.skipped, sleep=self._nap,
                                        frames=None if self.world is None else self.view_frames,
                                        merges=self.merges)
        now = self.clock()
        self.fetched += [[now, p, n, "fp32"] for p, n in fetched]
        at_least = Pace.rejoin_step(r.step_period_s, r.rejoin_at, now, self.speed, self.cfg.run.steps,
                                   self.resumed)
        return {"go": True, "t0": self.t0, "stop": False,
                "rejoin": {"now": now, "down_until": down_until, "stopped_at": before["step"], "at_least": at_least}}

    def run(self) -> None:
        try:
            self._run()
        except SystemExit as e:
            if e.code in (EXIT_DOWN, EXIT_SUPERSEDED):  # agreed by every process of a world: leave together
                self._leave()
            raise
        self._leave()

    def _run(self) -> None:
        unit = self.start()
        if unit is None:
            return
        # learner 0's trace, by its world's leader (docs/design.md#profiling-a-run)
        with profile.for_run(self.cfg, self.run_dir, self.m, self.leader) as trace:
            finished = run_incarnation(self, unit, self.cfg, self.speed, self.jitter, self.tape, self.checkpoints,
                                       trace)
        if not finished:  # SIGTERM: a final checkpoint between steps; what is unsent is lost
            self.checkpoints.maybe_save(unit, final=True)
            self.checkpoints.close()

    # --- the port of the shared loop (diloco/runtime/learner_loop.py) ---------------------------
    def check(self, unit: LearnerUnit, watch) -> bool:
        if self.world is not None:
            return self._check_world(unit)
        if self.tape is not None and not self.tape.alive(self.m, self.clock()):
            self.checkpoints.close()
            sys.exit(EXIT_DOWN)  # all its slices are down: the supervisor starts its successor
        if self._fenced():
            self.checkpoints.close()
            sys.exit(EXIT_SUPERSEDED)
        return self.terminating

    def _fenced(self) -> bool:
        """Started apart: whether a newer incarnation has claimed this learner (asked every
        FENCE_S); what this one writes from then on would be booked by nobody."""
        if self.superseded is None or time.monotonic() - self.fenced_at < FENCE_S:
            return False
        self.fenced_at = time.monotonic()
        if not self.superseded():
            return False
        log.error("learner %d incarnation %d: a newer incarnation has claimed this learner; exiting", self.m, self.inc)
        return True

    def _check_world(self, unit: LearnerUnit) -> bool:
        """check for a process of a world: the leader decides (its tape, its SIGTERM), every
        process acts on that decision at this same step boundary. The leader also takes this
        pass's broadcasts here, so that one broadcast carries the decision and every frame its
        unit took since the last one (in that order), which the followers' units take in `poll`.
        Started apart, the leader alone asks the fence, and a superseded world exits as one."""
        payload = None
        if self.leader:
            downlink.receive(self, unit)
            down = self.tape is not None and not self.tape.alive(self.m, self.clock())
            code = EXIT_DOWN if down else EXIT_SUPERSEDED if self._fenced() else None
            decision = {"exit": code, "stop": self.terminating}
            payload = learner_world.pack_frames([json.dumps(decision).encode(), *self.accepted])
        head, *frames = learner_world.unpack_frames(learner_world.broadcast_from_leader(payload))
        self.accepted = [] if self.leader else frames
        decision = json.loads(head)
        if decision["exit"] is not None:
            self.checkpoints.close()
            sys.exit(decision["exit"])
        # The agreed stop is what every process acts on now; a SIGTERM the leader took during the
        # broadcast stays set, for the next boundary's decision (reset, it would be lost).
        self.terminating = self.terminating or decision["stop"]
        return decision["stop"]

    def poll(self, unit: LearnerUnit) -> None:
        if self.world is None:
            downlink.receive(self, unit)
        elif not self.leader:  # what the leader's unit took, mirrored by _check_world, in its order
            for frame in self.accepted:
                unit.receive(frame)
            self.accepted = []

    def log(self, record: dict) -> None:
        pass  # the loss rides on the StepDone event; the syncer reports it

    def wait(self, unit: LearnerUnit, until: float) -> None:
        """Blocked: one poll, then a back-off nap (never past `until`) if nothing came. A follower
        returns at once: it waits for its leader in the next pass's collectives."""
        if not self.leader:
            return
        if downlink.receive(self, unit):
            self.poller.interval = self.poller.min_interval
            return
        self.nap_until = until
        self.poller.wait(False)


def learner_body(store: bs.BlobStore, cfg: TrainConfig, run_dir: Path | None, m: int, incarnation: int,
                 parent: int | None, resumed: bool = False, superseded: Callable[[], bool] | None = None,
                 exposed: Callable[[ProcLearner], None] | None = None, spec: Any = None) -> None:
    """exposed: given the learner once built, for a host that stops it without a signal (a Ray
    actor sets `terminating` from another thread). spec: this process's WorldSpec
    (diloco/runtime/world_group.py) when the learner is a world of several processes."""
    world = None
    if spec is not None:
        if spec.index and in_main_thread():
            # A follower stops when its leader's agreed decision says so, at the same step boundary
            # as every other process of the world (docs/multihost.md#learner-process).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        r = cfg.runtime
        # Before child_setup starts the backend. On CPU each process contributes its share of
        # the learner's devices (jax_num_cpu_devices wins over an inherited XLA_FLAGS count).
        world = learner_world.join_world(spec.coordinator, spec.processes, spec.index,
                                         heartbeat_s=r.world.heartbeat_s,
                                         cpu_devices=r.devices_per_learner // spec.processes)
    rt = ProcLearner(store, cfg, run_dir, m, incarnation, parent, resumed, superseded, world)
    if exposed is not None:
        exposed(rt)

    def stop(signum, frame):  # SIGTERM (the supervisor stopping, or a preemption notice)
        rt.terminating = True

    if in_main_thread() and rt.leader:
        signal.signal(signal.SIGTERM, stop)
    try:
        rt.run()
    except Exception:
        if world is not None and world.processes > 1:
            # A collective broken by a dead peer raises here moments before the coordination service
            # aborts this process (docs/multihost.md#what-a-dead-peer-does-to-the-others): wait for
            # that verdict, so that a lost peer is not reported as this process's own error.
            time.sleep(2 * cfg.runtime.world.heartbeat_s + 2.0)
        raise
    if rt.terminating:  # not done: the supervisor restarts it if the run goes on
        sys.exit(128 + signal.SIGTERM)


def learner_main(store_url: str, cfg: TrainConfig, cache: str | None, run_dir: Path | None, m: int,
                 incarnation: int, parent: int, resumed: bool = False, spec: Any = None) -> None:
    """Process target of learner m's `incarnation` (spawned by diloco/runtime/procs/supervisor.py);
    `resumed`: the first incarnation of a resumed run; `spec`: this process's WorldSpec when the
    learner spans several processes (its followers' error records carry their index)."""
    name = f"learner-{m:04d}-{incarnation:04d}"
    if spec is not None and spec.index:
        name += f"-p{spec.index}"
    child_main(name, store_url, cfg, cache, learner_body, run_dir, m, incarnation, parent, resumed, None, None,
               spec)
