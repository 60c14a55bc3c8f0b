"""Every store object a procs runtime reads, fuzzed (issue 32 item 6): junk, truncation and bit
flips of the real object, the real object unsealed, sealed under another run's secret, or another
key's sealed object replayed onto this one (another learner's, another incarnation's, or one written
ahead of its time). A reader holding the run secret never takes such an object as truth, never
raises anything but the ValueError its damage path takes, and reads the real object once it lands
on the key (docs/design.md#damage-in-the-store). The live procs run under a forger is at the end
(slow)."""

import json
import os
import random
import signal
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from test_hardening_store import _PROPS, damaged
from test_procs import M, STEPS, variant, world  # noqa: F401 - world is a fixture

from diloco import store as bs
from diloco.algo import auth
from diloco.runtime import procs
from diloco.runtime.procs import child, intake, reports
from diloco.runtime.stop import RunStopped

SECRET, OTHER_RUN = auth.Secret(b"k" * 32), auth.Secret(b"o" * 32)
FRAME = b"DILOCO-frame-bytes" * 4


def _control(name, obj, learner=None, fields=None):
    """(key, write(store, secret, name), read(store)) of control object `name`."""
    def write(store, secret, at=name):
        bs.write_control(store, at, obj, secret, learner)

    def read(store):
        return bs.read_trusted(store, name, SECRET, {}, fields)
    return bs.ctl_key(name), write, read, obj


def _ack():
    def write(store, secret, at=None):
        m, inc = (0, 0) if at is None else at
        bs.write_ack(store, m, inc, 5, secret)
    return bs.ack_key(0, 0), write, lambda store: bs.read_ack(store, 0, 0, SECRET), 5


def _pointer():
    def write(store, secret, at=None):
        bs.publish(store, 0, 3, None, FRAME, (), 2, secret)
    return bs.LATEST, write, lambda store: bs.latest(store, 2, SECRET)[0].version, 3


def _broadcast():
    def write(store, secret, at=(0, 3)):
        if secret is None:
            store.put(bs.broadcast_key(*at, "full"), FRAME)
        else:
            key = bs.broadcast_key(*at, "full")
            store.put(key, auth.seal(secret.runtime_key(), key, FRAME))
    read = lambda store: bs.fetch_fragment(store, 0, 3, True, None, SECRET)  # noqa: E731
    return bs.broadcast_key(0, 3, "full"), write, read, FRAME


def _report():
    record = {"kind": "train", "learner": 0, "step": 4, "time": 1.0, "tokens": 8, "loss": 2.0}

    def write(store, secret, at=2):
        reports.write_report(store, at, dict(record), None, secret)
    return reports.rep_key(2, "json"), write, lambda store: reports.read_report(store, 2, SECRET), record


def _event():
    raw = json.dumps({"kind": "Done", "learner": 0, "incarnation": 0, "at": 1.0, "fetched": [],
                      "stalls": []}).encode()

    def write(store, secret, at=(0, 0, 4)):
        key = child.event_key(*at)
        store.put(key, raw if secret is None else auth.seal(secret.learner_key(at[0]), key, raw))
    def read(store):  # the event's JSON, once its tag verifies
        blob = intake.authentic_event(store, SECRET, 0, 0, 4, {})
        return None if blob is None else blob[auth.MAC_HEX + 1:]
    return child.event_key(0, 0, 4), write, read, raw


# What each reader reads, its writer's own write, and where a replay is taken from (another learner,
# incarnation or position of the same kind of object: the same bytes sealed for that key).
READERS = {
    "start": (_control("start", {"t0": 1.5}, fields={"t0": (int, float)}), "ready/0000"),
    "ready": (_control("ready/0001", {"incarnation": 0}, 1, {"incarnation": int}), "ready/0000"),
    "died": (_control("died/0001/0000", {"at": 2.0, "exitcode": -9}), "died/0001/0001"),
    "buried": (_control("buried/0001/0000", {"step": 3, "done": False}, fields={"step": int}), "buried/0000/0000"),
    "claim": (_control("claim/0001", {"incarnation": 2, "token": "t"}, 1, {"incarnation": int}), "claim/0000"),
    "run": (_control("run", {"theta0": "abc"}, fields={"theta0": str}), "procs"),
    "procs": (_control("procs", {"syncer_incarnation": 1}, fields={"syncer_incarnation": int}), "run"),
    "error": (_control("error/learner-0001-0000", {"traceback": "x"}, 1, {"traceback": str}),
              "error/learner-0001-0001"),
    "join": (_control("world/0001/0000/001", {"pid": 7}, 1), "world/0001/0000/002"),
    "ignored": (_control("ignored/0001/0000", {"ignored": {}, "more": 0}, 1), "ignored/0001/0001"),
    "finished": (_control("finished", {"at": 9.0}), "stopped"),
    "ack": (_ack(), (0, 1)),
    "pointer": (_pointer(), None),
    "broadcast": (_broadcast(), (0, 999)),  # a version written ahead of the syncer's
    "report": (_report(), 7),  # a report written ahead
    "event": (_event(), (1, 0, 4)),  # another learner's
}


def forgery(key, write, elsewhere, kind, data) -> bytes:
    """What a forger without the key puts under `key`, built from the real object's bytes."""
    def written(secret, *at) -> dict[str, bytes]:
        probe = bs.BlobStore("memory://")
        write(probe, secret, *at)
        return {k: probe.get(k) for k in probe.list("")}

    if kind == "damaged":
        return data.draw(damaged(written(SECRET)[key]))
    if kind in ("unsealed", "other_run"):
        return written(None if kind == "unsealed" else OTHER_RUN)[key]
    if kind == "replayed" and elsewhere is not None:
        moved = written(SECRET, elsewhere)
        return next(v for k, v in sorted(moved.items()) if k != key)
    return data.draw(hs.binary(max_size=200))


@settings(**{**_PROPS, "max_examples": 120})
@given(hs.data(), hs.sampled_from(sorted(READERS)), hs.sampled_from(["junk", "damaged", "unsealed", "other_run",
                                                                    "replayed"]))
def test_no_reader_believes_a_forged_object_nor_is_blocked_by_it(data, reader, kind):
    (key, write, read, real), elsewhere = READERS[reader]
    store = bs.BlobStore("memory://")
    forged = forgery(key, write, elsewhere, kind, data)
    store.put(key, forged)
    probe = bs.BlobStore("memory://")
    write(probe, SECRET)
    try:
        got = read(store)
    except ValueError:
        got = None
    # believed only if the bytes are the real object's, sealed by its writer (flips that cancel out)
    assert got in (None, {}) or forged == probe.get(key), (reader, kind, got)
    write(store, SECRET)  # the real object lands on the key: read at once
    assert read(store) == real


# --- a live procs run under a forger (slow) -----------------------------------------------------

TARGETS = ("ev/{m:04d}/0000/{ahead:012d}", "ctl/died/{m:04d}/0000", "ctl/start", "ctl/ready/{m:04d}",
           "ctl/buried/{m:04d}/0000", "down/latest", "down/0000/{ahead:012d}.full", "down/0001/{ahead:012d}.delta",
           "ack/{m:04d}/0000", "rep/{ahead:012d}.json", "ctl/error/learner-{m:04d}-0000", "ctl/ignored/{m:04d}/0000",
           "ctl/finished", "ctl/stopped", "ctl/procs")
ATTACK = hs.tuples(hs.sampled_from(TARGETS), hs.integers(0, M - 1), hs.integers(0, STEPS + 8),
                   hs.sampled_from(["junk", "truncated", "replayed", "other_run"]), hs.floats(0.0, 1.0))


def _payload(store, kind, key, rng) -> bytes | None:
    """Junk, a real object of the run cut short, a real object of another key replayed here, or one
    sealed under another run's secret."""
    if kind == "junk":
        return rng.randbytes(rng.randrange(1, 64))
    listed = [k for p in ("ev/", "ctl/", "down/", "ack/", "rep/") for k in store.list(p) if k != key]
    real = store.get(rng.choice(listed)) if listed else None
    if real is None:
        return None
    if kind == "truncated":
        return real[:rng.randrange(0, len(real))]
    if kind == "other_run":
        return auth.seal(OTHER_RUN.runtime_key(), key, real[auth.MAC_HEX + 1:])
    return real


@pytest.mark.slow  # one procs run per example (about 70 s each here, at a load average of 20)
@settings(**{**_PROPS, "max_examples": 3})
@given(hs.lists(ATTACK, min_size=4, max_size=12), hs.integers(0, 2 ** 16))
def test_a_live_procs_run_under_store_fuzzing_ends_right_or_with_a_clear_error(world, tmp_path_factory,  # noqa: F811
                                                                              attacks, seed):
    """Forged objects written to every key scheme a runtime reads, at random times during the run:
    ahead of their time, over real ones, replayed from other keys, under another run's secret. The
    run either books every learner to run.steps with a balanced ledger, or fails with a clear
    error; never a hang, never a normal end with steps unbooked."""
    cfg, setup, run_dir = variant(world, tmp_path_factory.mktemp("fuzz"))
    stop, rng, done = threading.Event(), random.Random(seed), []

    def forger():
        store = bs.BlobStore(f"file://{run_dir}/store")
        while not stop.is_set() and bs.read_control(store, "run") is None:  # the store is cleared first
            stop.wait(0.01)
        for target, m, ahead, kind, when in sorted(attacks, key=lambda a: a[-1]):
            if stop.wait(when * 4.0):
                return
            key = target.format(m=m, ahead=ahead)
            raw = _payload(store, kind, key, rng)
            if raw is not None:
                store.put(key, raw)
                done.append((key, kind))

    watchdog = threading.Timer(400.0, lambda: os.kill(os.getpid(), signal.SIGINT))  # a hang ends as a stop
    thread = threading.Thread(target=forger)
    watchdog.start()
    thread.start()
    try:
        rt, summary = procs.run(cfg, setup, run_dir, None)
    except RunStopped:
        pytest.fail(f"the run hung under {done}")
    except Exception as e:  # noqa: BLE001 - a clear error is an allowed end: it must say what failed
        assert str(e).strip() and not isinstance(e, (AssertionError, KeyError, TypeError, AttributeError)), repr(e)
        print(f"failed clearly under {done}: {str(e)[:300]}")
        return
    finally:
        stop.set()
        watchdog.cancel()
        thread.join()
    assert rt.finished["complete"] and summary["token_ledger_imbalance"] == 0, done
    if "events_lost" not in summary:  # else the steps of the lost events are booked lost, below
        assert rt.finished["steps"] == {str(m): STEPS for m in range(M)}, done
    tokens = len(setup.fragments) * M * STEPS * cfg.data.batch_size * cfg.data.seq_len
    assert rt.finished["tokens"]["processed"] == tokens, (done, rt.finished["tokens"])
    print(f"ended right under {done}; {summary.get('store_objects_ignored', 0)} objects ignored, "
          f"{summary.get('events_lost', 0)} events lost")
