"""Control objects authenticated under the run secret (issue 32 item 2): someone who can write the
store but holds no key cannot bury a live learner, start the clock, or block the real object that
lands on a key later (docs/design.md#damage-in-the-store)."""

import json
import logging
import signal
from types import SimpleNamespace

import pytest
from conftest import alongside

from diloco import report
from diloco import store as bs
from diloco.algo import auth
from diloco.runtime import procs
from diloco.runtime.procs import child, intake, streams
from diloco.runtime.procs.standalone import claim
from diloco.runtime.procs.supervisor import Procs
from test_hardening_store import small, syncer  # noqa: F401 - fixtures
from test_procs import M, STEPS, variant, world  # noqa: F401 - world is a fixture

SECRET = auth.Secret(b"k" * 32)
NOTICE = {"at": 2.0, "exitcode": -9}


def _forgeries(name: str, obj: dict) -> dict[str, bytes]:
    """What a forger without the key can put under ctl/<name>, and one moved from another name."""
    raw = json.dumps(obj).encode()
    key = bs.ctl_key(name)
    other = auth.Secret(b"x" * 32).runtime_key()
    return {"junk": b"\x00junk", "unsealed": raw, "other_secret": auth.seal(other, key, raw),
            "moved": auth.seal(SECRET.runtime_key(), bs.ctl_key("died/0009/0000"), raw)}


@pytest.mark.parametrize("forgery", ["junk", "unsealed", "other_secret", "moved"])
def test_a_forged_control_object_is_refused_and_taken_as_absent(forgery, caplog):
    store = bs.BlobStore("memory://")
    name = child.died(0, 0)
    store.put(bs.ctl_key(name), _forgeries(name, NOTICE)[forgery])
    with pytest.raises(ValueError, match="ctl/died/0000/0000"):
        bs.read_control(store, name, SECRET)
    ignored = {}
    with caplog.at_level(logging.ERROR):
        assert bs.read_trusted(store, name, SECRET, ignored) is None
        assert bs.read_trusted(store, name, SECRET, ignored) is None
    assert list(ignored) == [name] and caplog.text.count("ignored") == 1  # logged and counted once
    bs.write_control(store, name, NOTICE, SECRET)  # the real one lands on the key: read at once
    assert bs.read_trusted(store, name, SECRET, ignored) == NOTICE


def test_each_control_object_verifies_only_under_its_writers_keys():
    store = bs.BlobStore("memory://")
    bs.write_control(store, "start", {"t0": 1.0}, SECRET, learner=0)  # a learner cannot start the clock
    bs.write_control(store, "ready/0001", {"incarnation": 0}, SECRET)  # nor the runtime say it is ready
    bs.write_control(store, child.died(1, 0), NOTICE, SECRET, learner=0)  # nor learner 0 bury learner 1
    bs.write_control(store, child.buried(0, 0), {"step": 1, "done": False}, SECRET, learner=0)
    for name in ("start", "ready/0001", child.died(1, 0), child.buried(0, 0)):
        with pytest.raises(ValueError, match="unauthenticated"):
            bs.read_control(store, name, SECRET)
        assert bs.read_control(store, name) is not None  # a reader without a secret (a tool) drops the tag
    bs.write_control(store, child.died(1, 0), NOTICE, SECRET, learner=1)  # its successor, started apart
    assert bs.read_control(store, child.died(1, 0), SECRET) == NOTICE
    # every other control object too (issue 32): the runtime's under its key, a learner's under its own
    runtime = ("run", "procs", "reports", "stopped", "finished", "error/syncer")
    learners = ("error/learner-0001-0000", "error/learner-0001-0000-p2", "world/0001/0000/001")
    for name in runtime + learners:
        bs.write_control(store, name, {"x": 1}, SECRET, learner=0 if name in runtime else 2)
        with pytest.raises(ValueError, match="unauthenticated"):
            bs.read_control(store, name, SECRET)
        bs.write_control(store, name, {"x": 1}, SECRET, learner=None if name in runtime else 1)
        assert bs.read_control(store, name, SECRET) == {"x": 1} and store.get(bs.ctl_key(name)) != b'{"x":1}'
    bs.write_control(store, "error/learner-0001-0000", {"x": 1}, SECRET)  # the runtime fails no learner
    with pytest.raises(ValueError, match="unauthenticated"):
        bs.read_control(store, "error/learner-0001-0000", SECRET)
    bs.write_control(store, "procs", {"x": 1})  # without a secret (authentication off): plain JSON
    assert store.get("ctl/procs") == b'{"x":1}'


@pytest.mark.parametrize("forgery", ["junk", "unsealed"])
def test_a_forged_exit_notice_never_buries_a_live_learner(syncer, forgery):  # noqa: F811
    """One junk notice under ctl/died/<m>/<inc> made the syncer bury a live learner (taken as a crash
    now), and the run hung after the others finished."""
    store, rt, tokens = syncer
    name = child.died(0, 0)
    store.put(bs.ctl_key(name), _forgeries(name, NOTICE)[forgery])
    assert not streams.poll(rt, 0) and not streams.poll(rt, 0)
    assert rt.current[0] == 0 and not rt.host.tokens.dead and name in rt.ignored
    assert bs.read_control(store, child.buried(0, 0)) is None
    bs.write_control(store, name, NOTICE, rt.secret)  # the supervisor's, when it has exited
    assert streams.poll(rt, 0) and rt.current[0] == 1 and (0, 0) in rt.host.tokens.dead
    assert bs.read_control(store, child.buried(0, 0), rt.secret) == {"step": 0, "done": False}
    assert intake.ignored_summary(rt.ignored) == {"store_objects_ignored": 1, "ignored_events": 0,
                                                  "ignored_controls": 1}


def test_a_forged_start_is_ignored_and_the_syncer_starts_the_clock(syncer):  # noqa: F811
    store, rt, _ = syncer
    store.put(bs.ctl_key("start"), b'{"t0": "junk"}')
    store.put(bs.ctl_key("ready/0000"), b'{"incarnation": 0}')  # forged too: it would wait for it
    bs.write_control(store, "ready/0001", {"incarnation": 0}, rt.secret, learner=1)
    bs.write_control(store, "ready/0000", {"incarnation": 0}, rt.secret, learner=0)
    rt._start_clock()
    assert isinstance(rt.t0, float) and "start" in rt.ignored
    assert bs.read_control(store, "start", rt.secret) == {"t0": rt.t0}


def test_the_supervisor_writes_again_an_exit_notice_written_over():
    """A damaged or forged notice over a dead learner's: the syncer ignores it, so the supervisor
    writes its own again until the syncer has buried the incarnation."""
    store = bs.BlobStore("memory://")
    sup = SimpleNamespace(store=store, secret=SECRET, notices={}, renoticed=0.0, ignored={})
    Procs._notice(sup, 0, 0, NOTICE)
    store.put(bs.ctl_key(child.died(0, 0)), b"junk")
    Procs._renotice(sup)
    assert bs.read_control(store, child.died(0, 0), SECRET) == NOTICE
    bs.write_control(store, child.buried(0, 0), {"step": 3, "done": False}, SECRET)
    sup.renoticed = 0.0
    Procs._renotice(sup)
    assert sup.notices == {}  # buried: nothing left to guard


def test_a_successor_started_apart_writes_over_a_forged_notice_of_its_predecessor():
    store = bs.BlobStore("memory://")
    assert claim(store, 2, "a", secret=SECRET) == 0
    store.put(bs.ctl_key(child.died(2, 0)), b'{"at": 1.0, "exitcode": 0}')  # unsealed: ignored
    assert claim(store, 2, "b", secret=SECRET) == 1
    assert bs.read_control(store, child.died(2, 0), SECRET) == {"at": 0.0, "exitcode": -signal.SIGKILL}


def test_the_summary_says_what_was_ignored():
    summary = {"learner_deaths": 0, "token_ledger_imbalance": 0,
               **intake.ignored_summary({"ev/0000/0000/000000000001": "x", "died/0000/0000": "y"})}
    text = report.render_summary(summary, "run")
    assert "2 store objects ignored (1 events, 1 control objects" in text


@pytest.mark.slow  # 25-70 s (a procs run); tests above cover each attack on the syncer by default
def test_a_live_procs_run_books_every_step_past_forged_events_and_a_forged_exit_notice(world, tmp_path):  # noqa: F811
    """Issue 32's no-key attacks on a live run: junk written ahead of learner 1's event stream cut it
    out silently (rc 0, "ledger balanced", its steps never booked), and a junk exit notice of live
    learner 0 buried it and hung the run. Now both learners are booked to the end and the summary
    says what was ignored."""
    cfg, setup, run_dir = variant(world, tmp_path)
    forged = []

    def forger(stop):
        store = bs.BlobStore(f"file://{run_dir}/store")
        while not stop.is_set() and bs.read_control(store, "run") is None:  # the store is cleared before
            stop.wait(0.01)
        for n in range(STEPS + 8):
            key = child.event_key(1, 0, n)
            if store.get(key) is None:
                store.put(key, json.dumps({"kind": "Done", "learner": 1, "incarnation": 0, "at": 0.0}).encode())
                forged.append(key)
        store.put(bs.ctl_key(child.died(0, 0)), b'{"at": 0.5, "exitcode": -9}')
        store.put(bs.LATEST, b"junk")  # before the first merge: the learners ignore it (the syncer rebuilds it)

    rt, summary = alongside(forger, lambda: procs.run(cfg, setup, run_dir, None))
    assert len(forged) > STEPS
    assert sorted(rt.exits) == [("learner-0", 0, 0), ("learner-1", 0, 0)]  # nobody buried alive
    assert rt.finished["complete"] and rt.finished["steps"] == {"0": STEPS, "1": STEPS}
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    assert rt.finished["tokens"]["processed"] == len(setup.fragments) * M * STEPS * tokens_per_step
    assert summary["token_ledger_imbalance"] == 0 and "events_lost" not in summary
    # the exit notice (the syncer's) and the pointer (the learners', recorded in ctl/ignored/<m>/<inc>)
    assert summary["ignored_events"] >= 1 and summary["ignored_controls"] == 2


def test_a_control_object_without_the_fields_its_reader_needs_is_taken_as_absent():
    """With authentication off, a junk start ({"t0": "junk"}) is ignored, not a traceback."""
    store, ignored = bs.BlobStore("memory://"), {}
    store.put(bs.ctl_key("start"), b'{"t0": "junk"}')
    assert bs.read_trusted(store, "start", None, ignored, {"t0": (int, float)}) is None and "start" in ignored
    bs.write_control(store, "start", {"t0": 5.0})
    assert bs.read_trusted(store, "start", None, ignored, {"t0": (int, float)}) == {"t0": 5.0}


def test_a_forged_claim_neither_supersedes_a_learner_started_apart_nor_resets_its_incarnation():
    from diloco.runtime.procs.standalone import read_claim
    store = bs.BlobStore("memory://")
    assert claim(store, 1, "a", secret=SECRET) == 0 and read_claim(store, 1, SECRET)["token"] == "a"
    bs.write_control(store, child.died(1, 0), NOTICE, SECRET, learner=1)
    store.put(bs.ctl_key("claim/0001"), b'{"incarnation": 7, "token": "forged"}')  # unsealed
    assert read_claim(store, 1, SECRET) is None  # so learner "a" is not superseded by it
    assert claim(store, 1, "b", secret=SECRET) == 1  # past the notices the store shows, not 8 or 0
    store.put(bs.ctl_key("claim/0001"), b"junk")  # with authentication off too: no traceback
    assert claim(store, 1, "c") == 1 and read_claim(store, 1, None)["token"] == "c"


def test_a_forged_pointer_is_never_followed_nor_blocks_the_syncers_next_version(caplog):
    """A well-formed pointer naming version 999, written without the key, made the syncer's next
    publish raise ("not newer than the published 999") and learners fetch a version never made."""
    store, full = bs.BlobStore("memory://"), b"full copy"
    bs.publish(store, 0, 1, None, full, (), 1, SECRET)
    assert bs.latest(store, 1, SECRET)[0].version == 1 and bs.latest(store, 1)[0].version == 1
    store.put(bs.LATEST, b'{"fragments": {"0": {"version": 999, "delta": false, "merged": []}}}')
    with pytest.raises(ValueError, match="unauthenticated"):
        bs.latest(store, 1, SECRET)
    with caplog.at_level(logging.ERROR):
        pointer = bs.publish(store, 0, 2, None, full, (), 1, SECRET)  # rebuilt from the full copies listed
    assert pointer[0].version == 2 and bs.latest(store, 1, SECRET)[0].version == 2


def test_a_forged_ack_deletes_nothing_and_is_written_over():
    store = bs.BlobStore("memory://")
    for seq in range(3):
        bs.send_contribution(store, 0, 0, seq, b"frame")
    store.put(bs.ack_key(0, 0), b'{"seq": 99}')  # unsealed: gc would have taken it as the syncer's
    with pytest.raises(ValueError, match="unauthenticated"):
        bs.read_ack(store, 0, 0, SECRET)
    assert bs.gc(store, 2, {(0, 0): 2}, SECRET) == []
    assert bs.write_ack(store, 0, 0, 1, SECRET) == 1 and bs.read_ack(store, 0, 0, SECRET) == 1
    assert bs.gc(store, 2, {(0, 0): 2}, SECRET) == [bs.contribution_key(0, 0, s) for s in (0, 1)]


def test_a_forged_report_is_ignored_until_the_syncers_lands_or_a_later_one_verifies(caplog):
    """A report written ahead of the syncer's was skipped and deleted: the real one then landed on a
    key the supervisor had passed (the end report lost, the run failed)."""
    from diloco.runtime.procs.reports import rep_key, write_report
    store, taken = bs.BlobStore("memory://"), []
    sup = SimpleNamespace(store=store, secret=SECRET, ignored={}, reports=0, setup=SimpleNamespace(theta0=()),
                          _take=lambda record, theta, evaluate: taken.append(record["step"]))
    train = lambda n: {"kind": "train", "learner": 0, "step": n, "time": 1.0, "tokens": 8, "loss": 2.0}  # noqa: E731
    store.put(rep_key(0, "json"), json.dumps(train(7)).encode())  # a forger's, unsealed
    with caplog.at_level(logging.ERROR):
        Procs._read_reports(sup)
        Procs._read_reports(sup)
    assert taken == [] and sup.reports == 0 and list(sup.ignored) == [rep_key(0, "json")]
    write_report(store, 0, train(1), None, SECRET)  # the syncer's lands on its key: read at once
    Procs._read_reports(sup)
    assert taken == [1] and sup.reports == 1
    store.put(rep_key(1, "json"), b"junk")  # the syncer's report 1 damaged: skipped once report 2 verifies
    Procs._read_reports(sup)
    assert taken == [1] and sup.reports == 1
    write_report(store, 2, train(3), None, SECRET)
    Procs._read_reports(sup)
    assert taken == [1, 3] and sup.reports == 3
    store.put(rep_key(3, "json"), b"junk")  # nothing after it, but the syncer has exited: skipped
    Procs._read_reports(sup, exited=True)
    assert sup.reports == 4


def test_a_forged_run_control_error_or_finish_is_not_believed(small):  # noqa: F811
    """ctl/run names the Theta_0 every child checks; ctl/error/<name> fails a learner with its
    traceback; ctl/finished sends a learner started apart home; a follower's join record makes it
    wait for the next world. None of them is believed unless sealed by its writer."""
    from diloco.runtime.procs import theta0
    from diloco.runtime.procs.standalone import await_world, joined
    cfg, setup = small
    store, secret = bs.BlobStore("memory://"), setup.policy.auth
    theta0.publish(store, setup.theta0)
    store.put(bs.ctl_key("run"), json.dumps({"theta0": theta0.fingerprint(setup.theta0)}).encode())
    with pytest.raises(theta0.Theta0Error, match="ctl/run"):
        child.child_setup(cfg, store)
    bs.write_control(store, "run", {"theta0": theta0.fingerprint(setup.theta0)}, secret)
    assert child.child_setup(cfg, store).theta0[0].keys() == setup.theta0[0].keys()
    sup = SimpleNamespace(store=store, secret=secret, ignored={})
    store.put(bs.ctl_key("error/learner-0001-0000"), b'{"traceback": "forged"}')
    bs.write_control(store, "error/learner-0001-0000", {"traceback": "forged"}, secret)  # the runtime's key
    assert Procs._error(sup, "learner-0001-0000") == "" and "error/learner-0001-0000" in sup.ignored
    bs.write_control(store, "error/learner-0001-0000", {"traceback": "real"}, secret, learner=1)
    assert Procs._error(sup, "learner-0001-0000").endswith("real")
    claim(store, 1, "a", {"coordinator": "10.0.0.2:9000", "processes": 2}, secret)
    store.put(bs.ctl_key("finished"), b'{"at": 1.0}')
    store.put(bs.ctl_key(joined(1, 0, 1)), b'{"pid": 1}')
    held = await_world(store, 1, 1, 2, secret)  # neither the forged finish nor the join record holds it back
    assert held["token"] == "a" and bs.read_control(store, joined(1, 0, 1), secret)["pid"] > 1


def test_what_the_learners_and_the_supervisor_ignored_reaches_the_summary(monkeypatch):
    """Only the syncer's ignored objects were counted: a forged ctl/start a learner ignored, or a
    forged report the supervisor ignored, left no trace in the summary."""
    store = bs.BlobStore("memory://")
    child.note_ignored(store, {"start": "forged", bs.LATEST: "forged"}, SECRET, 0, 1)  # learner 0's
    child.note_ignored(store, {"rep/000000000003.json": "forged"}, SECRET)  # the supervisor's
    store.put(bs.ctl_key(child.ignored_name(1, 0)), b'{"ignored": {"x": "y"}, "more": 1000}')  # forged
    monkeypatch.setattr(child, "IGNORED_KEYS", 2)
    child.note_ignored(store, {f"ev/0002/0000/{n:012d}": "junk" for n in range(5)}, SECRET, 2, 0)
    own = {"start": "forged", "ev/0000/0000/000000000009": "junk"}  # the syncer's: start counts once
    seen, more = intake.gathered_ignored(store, SECRET, own)
    assert more == 3 and "x" not in seen and child.ignored_name(1, 0) in own
    assert intake.ignored_summary(seen, more) == {"store_objects_ignored": 10, "ignored_events": 3,
                                                  "ignored_controls": 7}


def test_a_pointer_is_rebuilt_only_from_full_copies_the_syncer_sealed(caplog):
    """Without a readable pointer the syncer rebuilds it from the full copies the store lists: a
    forger's full copy at version 999 made its next publish raise. Broadcasts are sealed under the
    runtime's key now, so a forged copy is neither taken by the rebuild nor applied by a learner."""
    store, full = bs.BlobStore("memory://"), b"full copy"
    bs.publish(store, 0, 1, b"delta", full, (), 1, SECRET)
    assert bs.fetch_fragment(store, 0, 1, True, None, SECRET) == full
    assert bs.fetch_fragment(store, 0, 1, False, None, SECRET) == b"delta"
    store.put(bs.broadcast_key(0, 999, "full"), full)  # unsealed, ahead of the syncer's versions
    store.put(bs.broadcast_key(0, 1, "delta"), b"forged")  # over a real one
    with pytest.raises(ValueError, match="unauthenticated"):
        bs.fetch_fragment(store, 0, 1, False, None, SECRET)
    store.delete(bs.LATEST)  # a learner follows only a sealed pointer; the syncer must rebuild it
    store.put(bs.LATEST, b"junk")
    with caplog.at_level(logging.ERROR):
        assert bs.latest_or_rebuilt(store, 1, SECRET)[0].version == 1
        pointer = bs.publish(store, 0, 2, None, full, (), 1, SECRET)
    assert pointer[0].version == 2 and "not the syncer's" in caplog.text


def test_a_restarted_syncer_keeps_its_clock_past_a_forged_start_and_the_syncer_keeps_start_in_place(
        syncer, tmp_path):  # noqa: F811
    """A forged ctl/start is ignored, and a restarted syncer started a new clock while its learners
    kept theirs; now it takes the clock it recorded beside its journal. A real ctl/start written
    over held back every learner that started later; the syncer now writes it again."""
    store, rt, _ = syncer
    rt.recovery.enabled, rt.recovery.run_dir, rt.restart = True, tmp_path, True
    rt.recovery.keep_clock(1234.5)
    store.put(bs.ctl_key("start"), b'{"t0": 99.0}')  # forged
    rt._start_clock()
    assert rt.t0 == 1234.5 and bs.read_control(store, "start", rt.secret) == {"t0": 1234.5}
    store.put(bs.ctl_key("start"), b'{"t0": 99.0}')
    rt._keep_controls()
    assert bs.read_control(store, "start", rt.secret) == {"t0": 1234.5}


def test_a_stop_landing_between_a_reports_deletion_and_its_count_loses_no_later_report():
    """SIGTERM raises a KeyboardInterrupt in the supervisor wherever it is: once, it landed after
    a report's deletion and before its count, so every later read stopped at the missing key and
    the stop's end report (the partial summary) was never read."""
    from diloco.runtime.procs.reports import rep_key, write_report
    store, taken = bs.BlobStore("memory://"), []
    sup = SimpleNamespace(store=store, secret=SECRET, ignored={}, reports=0, setup=SimpleNamespace(theta0=()),
                          _take=lambda record, theta, evaluate: taken.append(record["step"]))
    for n in range(3):
        write_report(store, n, {"kind": "train", "learner": 0, "step": n, "time": 1.0, "tokens": 8, "loss": 2.0},
                     None, SECRET)
    delete, calls = store.delete, []

    def interrupted_once(key):  # the signal lands just after report 0's JSON is deleted
        delete(key)
        calls.append(key)
        if len(calls) == 1:
            raise KeyboardInterrupt
    store.delete = interrupted_once
    with pytest.raises(KeyboardInterrupt):
        Procs._read_reports(sup)
    assert calls == [rep_key(0, "json")] and taken == [0]
    Procs._read_reports(sup, exited=True)  # as the stop reads the syncer's last reports
    assert taken == [0, 1, 2] and sup.reports == 3
