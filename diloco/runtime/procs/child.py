"""What every process of a procs run shares, the learner's, the syncer's and the supervisor's: how
a spawned child starts (environment, signals, the run secret, its Setup rebuilt from the config and
with Theta_0 read from the store), the keys and control names they couple by, the exit
statuses, and the largest frame the run can hold.

Reference: docs/design.md#procs.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

import jax

from diloco import store as bs
from diloco.algo import messages
from diloco.algo import syncer as sync
from diloco.config import TrainConfig
from diloco.data.stream import for_process
from diloco.inputs import load_inputs
from diloco.runtime import build as build_setup
from diloco.runtime.build import Setup
from diloco.runtime.procs import theta0

POLL_MIN, POLL_MAX = 0.002, 0.05  # seconds: back-off bounds of every procs poll loop
EXIT_DOWN = 75  # a learner whose chaos tape took all its slices (EX_TEMPFAIL): restarted, not an error
# A learner started apart (diloco/runtime/procs/standalone.py) that finds a newer incarnation of
# itself has claimed its index: the scheduler started a replacement, so this one steps aside.
EXIT_SUPERSEDED = 76
PREFIXES = ("up/", "down/", "ack/", "ctl/", "ev/", "rep/", "init/")  # every key scheme of a procs run
SECRET_FILE = "auth_secret"  # <run>/auth_secret: the run secret a resume needs (mode 0600)


def orphaned(parent: int | None) -> bool:
    """Whether the supervisor that spawned this process is gone; never for a process a scheduler
    started (parent None: scripts/learner.py, a Ray actor), whose lifetime is the scheduler's."""
    return parent is not None and os.getppid() != parent


def in_main_thread() -> bool:
    """Signal handlers can be set only here; a Ray actor runs its methods in worker threads."""
    return threading.current_thread() is threading.main_thread()


def event_key(learner: int, incarnation: int, n: int) -> str:
    return f"ev/{learner:04d}/{incarnation:04d}/{n:012d}"


def died(learner: int, incarnation: int) -> str:
    """Control name the supervisor writes once the process of (learner, incarnation) has exited,
    with its exit code: 0 (finished, its Done the last event) as well as a crash."""
    return f"died/{learner:04d}/{incarnation:04d}"


def buried(learner: int, incarnation: int) -> str:
    """Control name the syncer writes once it has booked that death (the successor may rejoin)."""
    return f"buried/{learner:04d}/{incarnation:04d}"


# The most store keys one process's record of what it ignored lists (the rest are counted): a
# forger can make a reader ignore any number of objects, and the record stays small.
IGNORED_KEYS = 256


def ignored_name(m: int | None, inc: int = 0) -> str:
    """Control name of the record of what learner m's incarnation inc (None: the supervisor) ignored."""
    return "ignored/supervisor" if m is None else f"ignored/{m:04d}/{inc:04d}"


def note_ignored(store: bs.BlobStore, ignored: dict[str, str], secret, m: int | None = None, inc: int = 0) -> None:
    """Record in the store what this process ignored as unauthenticated or malformed (name -> why),
    sealed as its own, for the syncer's summary (intake.gathered_ignored); at most IGNORED_KEYS
    keys, the rest counted."""
    keys = sorted(ignored)
    bs.write_control(store, ignored_name(m, inc), {"ignored": {k: ignored[k] for k in keys[:IGNORED_KEYS]},
                                                   "more": max(len(keys) - IGNORED_KEYS, 0)}, secret, m)


def child_setup(cfg: TrainConfig, store: bs.BlobStore) -> Setup:
    """In a spawned child: the Setup rebuilt from the config (jitted functions do not pickle)
    around the model's shapes, and Theta_0 read from the store, where the supervisor wrote it
    (procs/theta0.py): no child loads the checkpoint's weights or draws the init again, except
    the frozen checkpoint of a LoRA run. Steps compile lazily, so building every learner's (as
    setup.build does) costs little."""
    _, corpus, model, _ = load_inputs(cfg, weights=False)
    # a process of a learner's world reads only its own rows of data=grain's batches (docs/data.md#sharding)
    corpus = dataclasses.replace(corpus, train=for_process(corpus.train, jax.process_index(), jax.process_count()))
    setup = build_setup.build(cfg, corpus, model)
    # sealed under the runtime's key: a forger cannot name another Theta_0 for it to accept
    run = bs.read_trusted(store, "run", setup.policy.auth, {}, {"theta0": str})
    if run is None:
        raise theta0.Theta0Error("the run control ctl/run is missing, malformed or not sealed under the run's "
                                 "key: the store was changed, or holds another run")
    return setup._replace(theta0=theta0.read(store, setup.theta0, run["theta0"], max_frame(setup)))


def keep_secret(cfg: TrainConfig, run_dir: Path | None) -> None:
    """The run secret (runtime.auth) into this process's environment, where every child reads it.
    A run with a directory and no runtime.auth.secret_file keeps it in <run>/auth_secret (0600),
    so that a resume verifies what the learners sealed before the stop with the same keys."""
    r = cfg.runtime
    path = None if run_dir is None or r.auth.secret_file else Path(run_dir) / SECRET_FILE
    if cfg.run.resume and path is not None and path.is_file():
        os.environ[r.auth.secret_env] = path.read_text().strip()
    if build_setup.auth_secret(cfg) is None or path is None or cfg.run.resume:
        return
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.environ[r.auth.secret_env])


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
    if in_main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = bs.BlobStore(store_url, sync=False)
    try:
        body(store, cfg, *args)
    except Exception:
        try:  # sealed as its process's (diloco/store/control.py), so the supervisor believes it
            secret = build_setup.auth_secret(cfg)
        except Exception:  # noqa: BLE001 - the error being reported matters more than the seal
            secret = None
        bs.write_control(store, f"error/{name}", {"traceback": traceback.format_exc()}, secret,
                         bs.learner_of(f"error/{name}"))
        raise


def wait_for(poll: Callable[[], Any], parent: int | None, stopping: Callable[[], bool] = lambda: False) -> Any:
    """Poll with back-off until `poll()` is truthy; None once `stopping()` (SIGTERM); exit if the
    supervisor is gone (orphaned)."""
    poller = bs.Poller(POLL_MIN, POLL_MAX, stop=lambda: orphaned(parent) or stopping())
    found = poller.until(poll)
    if found is None and not stopping():
        raise SystemExit(f"supervisor {parent} is gone")
    return found


def max_frame(setup: Setup) -> int:
    """The largest frame of this run, up or down: the prefix (magic, header length), the header
    bound and the syncer's payload bound (diloco/algo/syncer.py), which no codec's payload exceeds
    and a full FP32 copy (4 bytes a value) is below; a larger object in the store is damage.
    Shapes only: it holds before Theta_0's values are read (child_setup)."""
    return len(messages.MAGIC) + 4 + messages.MAX_HEADER_BYTES + sync.max_payload_of(setup.theta0)
