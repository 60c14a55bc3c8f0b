"""The procs runtime's learner process, and what every procs process shares: how a spawned child
rebuilds its Setup from the config, the event keys and the control names.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428); docs/design.md#procs.

The loop is the one threads runs too (diloco/runtime/learner_loop.py: apply_due, blocking with a
stall limit, step, flush at the end); this process is its port, with the queues replaced by
objects in the store (diloco/runtime/blobstore.py):

* up: each contribution under its own key (send_contribution), then a small JSON event
  `ev/<learner>/<incarnation>/<n>` naming it. The syncer books each incarnation's events in n
  order, so it books a step's tokens before the contributions that carry them, as threads does.
  What the learner fetched rides on its next event, so down bytes are booked where they flowed.
* down: the `down/latest` pointer, polled before each step and with back-off while blocked. Every
  version newer than the one held is fetched in order (the delta against the held one if there
  is one, else that version's full copy), so each merge's `merged` keys reach the learner state
  machine as they do from a threads mailbox. A version gc already removed is skipped for the
  newest full copy.
* A restarted incarnation (the supervisor spawns it) compiles, then waits until the syncer has
  booked its predecessor's death (`ctl/buried/...`), and rejoins (diloco/runtime/rejoin.py) from
  the newest full copies in the store: the syncer's current references, never its own init.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from diloco.algo import messages
from diloco.algo import syncer as sync
from diloco.config import TrainConfig
from diloco.data import load_corpus
from diloco.model import build
from diloco.runtime import blobstore as bs
from diloco.runtime import events as ev
from diloco.runtime import build as build_setup
from diloco.runtime.rejoin import LearnerCheckpoints, rejoin_unit
from diloco.runtime.build import Setup, new_unit
from diloco.runtime.learner_loop import run_incarnation
from diloco.runtime.unit import LearnerUnit, Pace
from diloco.runtime.walltape import WallTape, chaos_tape

POLL_MIN, POLL_MAX = 0.002, 0.05  # seconds: back-off bounds of every procs poll loop
EXIT_DOWN = 75  # a learner whose chaos tape took all its slices (EX_TEMPFAIL): restarted, not an error


def event_key(learner: int, incarnation: int, n: int) -> str:
    return f"ev/{learner:04d}/{incarnation:04d}/{n:012d}"


def died(learner: int, incarnation: int) -> str:
    """Control name the supervisor writes once the process of (learner, incarnation) has exited."""
    return f"died/{learner:04d}/{incarnation:04d}"


def buried(learner: int, incarnation: int) -> str:
    """Control name the syncer writes once it has booked that death (the successor may rejoin)."""
    return f"buried/{learner:04d}/{incarnation:04d}"


def fingerprint(theta0: tuple[dict, ...]) -> str:
    """A hash of Theta_0: every process rebuilds it from the config and must get the same one."""
    h = hashlib.sha256()
    for frag in theta0:
        for path in sorted(frag):
            h.update(json.dumps(path).encode() + np.ascontiguousarray(frag[path], np.float32).tobytes())
    return h.hexdigest()[:16]


def child_setup(cfg: TrainConfig, store: bs.BlobStore) -> Setup:
    """In a spawned child: the Setup rebuilt from the config (jitted functions do not pickle).
    Steps compile lazily, so building every learner's (as setup.build does) costs little."""
    corpus = load_corpus(cfg.data)
    model = build(cfg.model, corpus.vocab_size, cfg.run.seed)
    setup = build_setup.build(cfg, corpus, model)
    want = (bs.read_control(store, "run") or {}).get("theta0")
    if want != fingerprint(setup.theta0):
        raise RuntimeError(f"this process rebuilt Theta_0 {fingerprint(setup.theta0)} from the config, the "
                           f"supervisor has {want}: model init must be a pure function of the config")
    return setup


def child_main(name: str, store_url: str, cfg: TrainConfig, cache: str | None, body: Callable, *args: Any) -> None:
    """Entry of every spawned child: environment, signals, then `body(store, cfg, *args)`. A Python
    error is written to `ctl/error/<name>` for the supervisor before the process exits with it."""
    r = cfg.runtime
    flags = os.environ.get("XLA_FLAGS", "")
    # jax reads XLA_FLAGS when its backend starts (the first jax.devices()), not on import.
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={r.learners * r.devices_per_learner}"
    if cache is not None and jax.config.jax_compilation_cache_dir is None:
        # Every process compiles the same model: a restarted learner loads its executables from
        # this cache in about a second instead of compiling them again (about 15 s on CPU).
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # Ctrl-C reaches the whole process group; the supervisor decides what stops, and how.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = bs.BlobStore(store_url, sync=False)
    try:
        body(store, cfg, *args)
    except Exception:
        bs.write_control(store, f"error/{name}", {"traceback": traceback.format_exc()})
        raise


def wait_for(poll: Callable[[], Any], parent: int) -> Any:
    """Poll with back-off until `poll()` is truthy; exit if the supervisor is gone (orphaned)."""
    poller = bs.Poller(POLL_MIN, POLL_MAX, stop=lambda: os.getppid() != parent)
    found = poller.until(poll)
    if found is None:
        raise SystemExit(f"supervisor {parent} is gone")
    return found


def store_view(store: bs.BlobStore, setup: Setup) -> tuple[sync.SyncerState, dict[int, int]]:
    """The syncer's current references as far as a learner can see them: the newest full copy of
    every published fragment (Theta_0 for the others), as a SyncerState that new_unit and
    rejoin_unit read (refs[-1] and version only); also the bytes fetched per fragment."""
    view = sync.init(setup.policy, setup.fragments, setup.theta0, {})
    frags, fetched = list(view.fragments), {}
    for p, fs in enumerate(frags):
        frame = None
        while frame is None:  # gc may remove the version between the pointer read and the get
            pub = bs.latest(store).get(p)
            if pub is None:
                break
            frame = bs.fetch_fragment(store, p, pub.version, want_full=True)
        if frame is None:
            continue
        msg = messages.decode(frame)
        expected = {path: (x.shape, np.float32) for path, x in fs.theta.items()}
        values = messages.unpack_fragment(msg.header, msg.payload, None, expected)
        version = msg.header["version"]
        frags[p] = fs._replace(theta=values, version=version, refs=((version, values),))
        fetched[p] = len(frame)
    return view._replace(fragments=tuple(frags)), fetched


class ProcLearner:
    """Learner (m, incarnation) in its own process; owns its unit, writes its own event stream."""

    def __init__(self, store: bs.BlobStore, cfg: TrainConfig, run_dir: Path | None, m: int,
                 incarnation: int, parent: int):
        self.store, self.cfg, self.m, self.inc, self.parent = store, cfg, m, incarnation, parent
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
        self.checkpoints = LearnerCheckpoints(None if run_dir is None else run_dir / "learners",
                                              r.learner_checkpoint_every, cfg.run.keep_checkpoints)
        self.n = 0  # next event number
        self.fetched: list[list] = []  # [time, fragment, bytes, codec], booked with the next event
        self.t0 = 0.0
        self.nap_until = float("inf")
        self.poller = bs.Poller(POLL_MIN, POLL_MAX, sleep=self._nap)

    def clock(self) -> float:
        return time.time() - self.t0  # wall time: every process (and host) shares the syncer's t0

    def _nap(self, dt: float) -> None:
        if os.getppid() != self.parent:
            raise SystemExit(f"supervisor {self.parent} is gone")
        time.sleep(max(0.0, min(dt, self.nap_until - self.clock())))

    def emit(self, event: ev.Event) -> None:
        """Write the next event of this incarnation, with what was fetched since the previous one;
        its contributions go first, each under its own key, so the event can name them."""
        for (_, seq), frame in zip(getattr(event, "sends", ()), getattr(event, "frames", ())):
            bs.send_contribution(self.store, self.m, self.inc, seq, frame)
        data = ev.to_json(event._replace(fetched=tuple(map(tuple, self.fetched))))
        self.store.put(event_key(self.m, self.inc, self.n), json.dumps(data).encode())
        self.n += 1
        self.fetched = []

    def start(self) -> LearnerUnit | None:
        """Compile, pass the start barrier, and (a restarted incarnation) rejoin; None if the
        predecessor had already finished, leaving nothing to do."""
        s, m = self.setup, self.m
        unit = new_unit(s, m, self.inc, sync.init(s.policy, s.fragments, s.theta0, {m: 0}))
        # on Theta_0: compiling costs the same whatever the values
        unit.warm_up(*(() if self.tape is None else self.tape.smaller_batches()))
        bs.write_control(self.store, f"ready/{m:04d}", {"incarnation": self.inc})
        self.t0 = wait_for(lambda: bs.read_control(self.store, "start"), self.parent)["t0"]
        if self.inc == 0:
            return unit
        before = wait_for(lambda: bs.read_control(self.store, buried(m, self.inc - 1)), self.parent)
        if before["done"]:
            return None
        down_until = self.clock()
        if self.tape is not None:  # its slices are still down: wait for the tape to return one
            down_until = max(down_until, self.tape.back_at(m, down_until))
            while self.clock() < down_until:
                self._nap(min(POLL_MAX, down_until - self.clock()))
        view, fetched = store_view(self.store, s)
        now = self.clock()
        self.fetched += [[now, p, n, "fp32"] for p, n in fetched.items()]
        r = self.cfg.runtime
        at_least = Pace.rejoin_step(r.step_period_s, r.rejoin_at, now, self.speed, self.cfg.run.steps)
        unit, how = rejoin_unit(s, m, self.inc, view, self.checkpoints, r.max_rejoin_staleness,
                                before["step"], at_least)
        # died_at is the syncer's to fill in: it booked the predecessor's death
        self.emit(ev.Rejoined(m, self.inc, now, down_until, now, how._asdict()))
        return unit

    def run(self) -> None:
        unit = self.start()
        if unit is None:
            return
        finished = run_incarnation(self, unit, self.cfg, self.speed, self.jitter, self.tape, self.checkpoints)
        if not finished:  # SIGTERM: a final checkpoint between steps; what is unsent is lost
            self.checkpoints.maybe_save(unit, final=True)
            self.checkpoints.close()

    # --- the port of the shared loop (diloco/runtime/learner_loop.py) ---------------------------
    def check(self, unit: LearnerUnit, watch) -> bool:
        if self.tape is not None and not self.tape.alive(self.m, self.clock()):
            self.checkpoints.close()
            sys.exit(EXIT_DOWN)  # all its slices are down: the supervisor starts its successor
        return self.terminating

    def poll(self, unit: LearnerUnit) -> None:
        self.receive(unit)

    def log(self, record: dict) -> None:
        pass  # the loss rides on the StepDone event; the syncer reports it

    def receive(self, unit: LearnerUnit) -> bool:
        """Fetch every published version newer than the one held, in order; True if any arrived."""
        got = False
        for p, pub in sorted(bs.latest(self.store).items()):
            while unit.latest[p][0] < pub.version:
                held = unit.latest[p][0]
                frame, codec = None, "fp32"
                if held + 1 < pub.version or pub.has_delta:
                    frame, codec = bs.fetch_fragment(self.store, p, held + 1, False), self.setup.policy.down_spec
                if frame is None:
                    frame, codec = bs.fetch_fragment(self.store, p, held + 1, True), "fp32"
                if frame is None:  # collected by gc: jump to the newest copy (its answers may be lost)
                    frame = bs.fetch_fragment(self.store, p, pub.version, True)
                if frame is None:  # that one too: the pointer has moved on; the next poll follows it
                    break
                self.fetched.append([self.clock(), p, len(frame), codec])
                if unit.receive(frame) is None:  # undecodable (counted in unit.dropped_frames)
                    break
                got = True
        return got

    def wait(self, unit: LearnerUnit, until: float) -> None:
        """Blocked: one poll, then a back-off nap (never past `until`) if nothing came."""
        if self.receive(unit):
            self.poller.interval = self.poller.min_interval
            return
        self.nap_until = until
        self.poller.wait(False)


def learner_body(store: bs.BlobStore, cfg: TrainConfig, run_dir: Path | None, m: int, incarnation: int,
                 parent: int) -> None:
    rt = ProcLearner(store, cfg, run_dir, m, incarnation, parent)

    def stop(signum, frame):  # SIGTERM (the supervisor stopping, or a preemption notice)
        rt.terminating = True

    signal.signal(signal.SIGTERM, stop)
    rt.run()
    if rt.terminating:  # not done: the supervisor restarts it if the run goes on
        sys.exit(128 + signal.SIGTERM)


def learner_main(store_url: str, cfg: TrainConfig, cache: str | None, run_dir: Path | None, m: int,
                 incarnation: int, parent: int) -> None:
    """Process target of learner m's `incarnation` (spawned by diloco/runtime/procs/supervisor.py)."""
    child_main(f"learner-{m:04d}-{incarnation:04d}", store_url, cfg, cache, learner_body, run_dir, m,
               incarnation, parent)
