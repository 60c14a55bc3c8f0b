"""Damage in the object store of the procs runtime: whatever a pointer, ack, control object, event
or contribution holds, its reader takes it or refuses it on the documented path (ValueError, or a
quarantine), falls back to another copy, reports what it skipped, and never spins, crashes or hangs
(docs/design.md#damage-in-the-store).

Each test is built from the trigger of one defect of issue 16; the property tests at the end
damage valid objects at random."""

import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from diloco import store as bs
from diloco.algo import auth, ledger, messages
from diloco.algo import syncer as sync
from diloco.config import validate
from diloco.runtime import events as ev
from diloco.runtime.procs import child, downlink, streams, theta0
from diloco.runtime.procs import intake, reading
from diloco.runtime.procs import learner as pl
from diloco.runtime.procs import syncer as ps
from diloco.runtime.syncer_ckpt import host_in, host_out
from syncer_frames import THETA0, frame, policy, start
from test_procs import M, STEPS, merge_versions, variant, world  # noqa: F401 - world is a fixture

P = 2  # fragments in tests/test_procs.py's config


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """tests/test_procs.py's procs config and its Setup, built once (no process is started)."""
    from diloco.data import load_corpus
    from diloco.model import build
    from diloco.runtime import build as build_setup
    from test_procs import make_cfg

    cfg = make_cfg(tmp_path_factory.mktemp("store"))
    corpus = load_corpus(cfg.data)
    return cfg, build_setup.build(cfg, corpus, build(cfg.model, corpus.vocab_size, cfg.run.seed))


def _store_for(setup) -> bs.BlobStore:
    """A fresh store with the run's Theta_0 and its fingerprint, as the supervisor writes them for its
    children."""
    store = bs.BlobStore("memory://")
    theta0.publish(store, setup.theta0)
    bs.write_control(store, "run", {"theta0": theta0.fingerprint(setup.theta0), "learners": 2}, setup.policy.auth)
    return store


def _at_version(setup, p: int, v: int) -> tuple[bytes, dict]:
    """Fragment p's full copy at version v (Theta_0 + v), and its values."""
    st = sync.init(setup.policy, setup.fragments, setup.theta0, {})
    fs = st.fragments[p]
    values = {k: x + np.float32(v) for k, x in fs.theta.items()}
    frags = list(st.fragments)
    frags[p] = fs._replace(theta=values, version=v, refs=((v, values),))
    return sync.full_frame(st._replace(fragments=tuple(frags)), p), values


def _flip(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


# --- item 13: pointer and ack parsing -----------------------------------------------------------

def _pointer(**entry) -> bytes:
    e = {"version": 3, "delta": True, "merged": [[0, 0, 1]], **entry}
    return json.dumps({"fragments": {"0": e}}).encode()


@pytest.mark.parametrize("raw, why", [
    (_pointer(version=3).replace(b": 3,", b": 1e400,"), "finite"),  # inf: int(inf) raised OverflowError
    (_pointer(version="1e400"), "version"),
    (_pointer(version=True), "version"),
    (_pointer(version=0), "version"),
    (_pointer(version=-3), "version"),
    (_pointer(version=2 ** 60), "version"),
    (_pointer(merged="abc"), "merged"),  # was accepted as ('a',), ('b',), ('c',)
    (_pointer(merged=[[0, 0]]), "merged"),
    (_pointer(merged=[[0, 0, -1]]), "merged"),
    (_pointer(delta=1), "delta"),
    (_pointer(delta=None), "delta"),
    (json.dumps({"fragments": {"0": {"version": 3, "delta": True}}}).encode(), "keys"),
    (json.dumps({"fragments": {"7": {"version": 3, "delta": True, "merged": []}}}).encode(), "fragment id"),
    (json.dumps({"fragments": {"+1": {"version": 3, "delta": True, "merged": []}}}).encode(), "fragment id"),
    (json.dumps({"fragments": {"01": {"version": 3, "delta": True, "merged": []}}}).encode(), "fragment id"),
    (json.dumps({"fragments": []}).encode(), "fragments"),
    (b'{"fragments": {"0": {"version": ' + b"9" * 5000 + b', "delta": true, "merged": []}}}', "JSON"),
    (b"[" * 5000, "JSON"),
])
def test_a_malformed_pointer_is_a_value_error_naming_the_key(raw, why):
    store = bs.BlobStore("memory://")
    store.put(bs.LATEST, raw)
    with pytest.raises(ValueError, match=why) as e:
        bs.latest(store, P)  # P: the run's fragments; an id outside them is damage (was a KeyError later)
    assert "down/latest" in str(e.value)


def test_a_pointer_too_large_is_refused_unread():
    store = bs.BlobStore("memory://")
    store.put(bs.LATEST, b" " * (bs.MAX_JSON_BYTES + auth.MAC_HEX + 2))  # + a seal's tag and space
    with pytest.raises(ValueError, match="larger than"):
        bs.latest(store)


def test_an_ack_that_grew_never_makes_gc_delete_an_undelivered_contribution():
    """One flipped digit raised the ack from 3 to 93; gc deleted seqs 4..9, which the syncer had not
    delivered, and then booked them as lost ("cannot happen")."""
    store = bs.BlobStore("memory://")
    for seq in range(10):
        bs.send_contribution(store, 0, 0, seq, b"c")
    bs.write_ack(store, 0, 0, 3)
    store.put(bs.ack_key(0, 0), b'{"seq":93}')
    deleted = bs.gc(store, 2, delivered={(0, 0): 3})
    assert deleted == [bs.contribution_key(0, 0, s) for s in range(4)]
    assert store.list("up/") == [bs.contribution_key(0, 0, s) for s in range(4, 10)]
    # an ack below what was delivered deletes no further than the ack; none deletes nothing
    bs.send_contribution(store, 1, 0, 0, b"c")
    store.put(bs.ack_key(0, 0), b'{"seq":5}')
    assert bs.gc(store, 2, delivered={(0, 0): 8, (1, 0): 0}) == [bs.contribution_key(0, 0, s) for s in (4, 5)]


@pytest.mark.parametrize("raw", [b'{"seq": 1e400}', b'{"seq": "7"}', b'{"seq": -1}', b'{"sq": 7}',
                                 b"\xff", b"[" * 3000, b'{"seq": true}'])
def test_a_malformed_ack_keeps_its_contributions_and_is_overwritten_by_the_syncer(raw, caplog):
    store = bs.BlobStore("memory://")
    bs.send_contribution(store, 0, 0, 0, b"c")
    store.put(bs.ack_key(0, 0), raw)
    with pytest.raises(ValueError, match="ack/0000/0000"):
        bs.read_ack(store, 0, 0)
    with caplog.at_level(logging.WARNING, logger="diloco.store.exchange"):
        assert bs.gc(store, 2, delivered={(0, 0): 0}) == []
        assert bs.write_ack(store, 0, 0, 0) == 0
    assert "ack/0000/0000" in caplog.text
    assert bs.gc(store, 2, delivered={(0, 0): 0}) == [bs.contribution_key(0, 0, 0)]


def test_the_syncer_rebuilds_a_malformed_pointer_from_the_full_copies_it_listed(caplog):
    store = bs.BlobStore("memory://")
    bs.publish(store, 0, 1, None, b"f1", fragments=P)
    bs.publish(store, 0, 2, b"d2", b"f2", fragments=P)
    bs.publish(store, 1, 1, None, b"g1", fragments=P)
    store.put(bs.LATEST, _flip(store.get(bs.LATEST), 8 * 3))
    assert bs.gc(store, 1, delivered={}) == []  # a malformed pointer deletes no broadcast
    with caplog.at_level(logging.ERROR, logger="diloco.store.exchange"):
        assert bs.latest_or_rebuilt(store, P) == {0: bs.Published(2, True, ()), 1: bs.Published(1, False, ())}
        bs.publish(store, 1, 2, None, b"g2", fragments=P)
    assert "rebuilding" in caplog.text
    assert bs.latest(store, P) == {0: bs.Published(2, True, ()), 1: bs.Published(2, False, ())}


# --- item 14: objects bounded before they are read -----------------------------------------------

class _Reads:
    """Wraps a BlobStore's kvstore and records how many bytes each read returned."""

    def __init__(self, kv):
        self.kv, self.sizes = kv, []

    def __getattr__(self, name):
        return getattr(self.kv, name)

    def read(self, key, **kw):
        result = self.kv.read(key, **kw).result()
        self.sizes.append(len(result.value))

        class Done:
            def result(self_):
                return result
        return Done()


def test_an_oversized_contribution_is_passed_on_unread_and_quarantined_as_too_large():
    """A 64 MiB object raised the syncer's RSS by 192 MB before too_large could run: now one byte
    past the bound is read, and the syncer quarantines the stand-in by its own rule."""
    store = bs.BlobStore("memory://")
    bs.send_contribution(store, 0, 0, 0, b"\0" * (64 << 20))
    good = frame({k: v + 1 for k, v in THETA0[0].items()}, THETA0[0], seq=1)
    bs.send_contribution(store, 0, 0, 1, good)
    store._kv = reads = _Reads(store._kv)
    got = bs.poll_contributions(store, set(), max_bytes=1 << 20)
    assert got == [(bs.contribution_key(0, 0, 0), bs.OVERSIZED), (bs.contribution_key(0, 0, 1), good)]
    assert reads.sizes == [1, len(good)]  # the oversized one: a 1-byte probe; the other: a refused probe, a read
    with pytest.raises(messages.MessageError) as e:
        messages.decode(bs.OVERSIZED)
    assert e.value.reason == "too_large"
    pol = policy()
    st, actions = sync.on_contribution(pol, start(pol), bs.OVERSIZED, 1.0)
    assert st.quarantined == {"too_large": 1} and actions == (sync.Outcome(None, "quarantined:too_large"),)


def test_every_reader_bounds_what_it_reads(small):
    """The bound of a run's frames covers its full copies; events, reports and control are bounded too."""
    _, setup = small
    limit = child.max_frame(setup)
    full, _ = _at_version(setup, 0, 1)
    assert len(full) < limit < 8 * len(full) + (2 << 20)
    store = bs.BlobStore("memory://")
    store.put("ctl/huge", b"0" * (bs.MAX_JSON_BYTES + auth.MAC_HEX + 2))  # past a sealed object's bound
    with pytest.raises(ValueError, match="larger than"):
        bs.read_control(store, "huge")
    assert store.get("ctl/huge", bs.MAX_JSON_BYTES + auth.MAC_HEX + 2) is not None and store.get("ctl/none", 10) is None


# --- items 11 and 12: a learner falls back from a damaged copy to another one ---------------------

def test_rejoin_view_falls_back_from_a_missing_or_corrupt_newest_full_copy(small, caplog):
    """The pointer named a full copy gc had removed (the loop spun with no sleep or limit), or a
    corrupt one (MessageError escaped and failed the run): the older copy gc kept is used."""
    _, setup = small
    store = _store_for(setup)
    for v in (1, 2, 3):
        bs.publish(store, 0, v, None, _at_version(setup, 0, v)[0], fragments=P, secret=setup.policy.auth)
    store.delete(bs.broadcast_key(0, 3, "full"))  # gone between the pointer read and the get
    full2 = store.get(bs.broadcast_key(0, 2, "full"))
    store.put(bs.broadcast_key(0, 2, "full"), _flip(full2, 8 * len(full2) - 1))  # its payload's last bit
    skipped = Counter()
    with caplog.at_level(logging.WARNING, logger="diloco.runtime.procs.reading"):
        view, fetched = reading.store_view(store, setup, timeout_s=120.0, skipped=skipped)  # nothing to wait for
    assert view.fragments[0].version == 1 and view.fragments[1].version == 0
    _, values = _at_version(setup, 0, 1)
    assert all((view.fragments[0].refs[-1][1][k] == values[k]).all() for k in values)
    assert skipped == {"full": 1} and "version 2" in caplog.text
    assert [p for p, _ in fetched] == [0]  # sealed: the corrupt copy is refused unread, not booked as the run's


def test_rejoin_view_gives_up_on_a_fragment_after_its_timeout_and_says_so(small, caplog):
    _, setup = small
    store = _store_for(setup)
    bs.publish(store, 1, 1, None, b"DLC1 not a frame", fragments=P, secret=setup.policy.auth)
    now, sleeps = [0.0], []

    def sleep(dt):
        sleeps.append(dt)
        now[0] += dt

    skipped = Counter()
    with caplog.at_level(logging.ERROR, logger="diloco.runtime.procs.reading"):
        view, _ = reading.store_view(store, setup, timeout_s=3.0, skipped=skipped, sleep=sleep, clock=lambda: now[0])
    assert view.fragments[1].version == 0 and now[0] == pytest.approx(3.0)
    assert sleeps[0] == child.POLL_MIN and max(sleeps) <= child.POLL_MAX  # backs off, never spins
    assert skipped["full"] == 1 and skipped["fragment"] == 1 and "no readable full copy of fragment 1" in caplog.text


@pytest.fixture
def learner(small):
    """A ProcLearner (learner 0, incarnation 0) in this process, over a memory store, and its unit."""
    from diloco.runtime.build import new_unit

    cfg, setup = small
    store = _store_for(setup)
    rt = pl.ProcLearner(store, cfg, None, 0, 0, os.getppid())
    unit = new_unit(rt.setup, 0, 0, sync.init(setup.policy, setup.fragments, setup.theta0, {0: 0}))
    return store, rt, unit


def test_an_undecodable_delta_falls_back_to_the_full_copy_of_the_same_version(learner, small, caplog):
    """The receive loop ended at the corrupt delta and the next poll fetched it again: the intact
    full copy of that version was never tried, and the learner stayed behind until gc."""
    store, rt, unit = learner
    _, setup = small
    full1, values1 = _at_version(setup, 0, 1)
    bs.publish(store, 0, 1, b"DLC1 a damaged delta", full1, fragments=P, secret=rt.setup.policy.auth)
    with caplog.at_level(logging.WARNING, logger="diloco.runtime.procs.downlink"):
        assert downlink.receive(rt, unit)
    assert unit.latest[0][0] == 1 and all((unit.latest[0][1][k] == values1[k]).all() for k in values1)
    assert rt.skipped == {"delta": 1} and unit.dropped_frames == 1 and "000000000001.delta" in caplog.text
    assert [f[2] for f in rt.fetched] == [len(b"DLC1 a damaged delta"), len(full1)]

    # v2: its delta and full copy both damaged, v3 intact: the learner goes on at v3, and the
    # damaged objects are not fetched again at the next poll
    bs.publish(store, 0, 2, b"DLC1 bad", b"DLC1 bad too", fragments=P, secret=rt.setup.policy.auth)
    assert not downlink.receive(rt, unit) and unit.latest[0][0] == 1
    n = len(rt.fetched)
    assert not downlink.receive(rt, unit) and len(rt.fetched) == n
    bs.publish(store, 0, 3, None, _at_version(setup, 0, 3)[0], fragments=P, secret=rt.setup.policy.auth)
    assert downlink.receive(rt, unit) and unit.latest[0][0] == 3
    assert rt.skipped == {"delta": 2, "full": 1} and rt.bad == set()


def test_a_learner_keeps_its_versions_over_a_malformed_pointer_and_logs_it_once(learner, caplog):
    store, rt, unit = learner
    store.put(bs.LATEST, _pointer(version=3).replace(b": 3,", b": 1e400,"))
    with caplog.at_level(logging.WARNING, logger="diloco.runtime.procs.downlink"):
        assert not downlink.receive(rt, unit) and not downlink.receive(rt, unit)
    assert rt.skipped == {"pointer": 2} and caplog.text.count("down/latest") == 1
    bs.publish(store, 0, 9, None, b"x" * (rt.max_frame + 1), fragments=P, secret=rt.setup.policy.auth)  # too large to be a frame
    assert not downlink.receive(rt, unit) and rt.skipped["full"] == 1 and rt.fetched == []  # never read


# --- items 14 and 16: the syncer's event streams ----------------------------------------------------

@pytest.fixture
def syncer(small):
    """A ProcSyncer over a memory store, in this process, without a run directory."""
    cfg, setup = small
    store = _store_for(setup)
    rt = ps.ProcSyncer(store, cfg, None, want_evals=False)
    rt.gap_timeout = 0.0
    return store, rt, cfg.data.batch_size * cfg.data.seq_len


def _put_event(rt, store, m, inc, n, raw: bytes):
    """An event blob as learner m writes it: sealed under its key when the run authenticates."""
    secret = rt.setup.policy.auth
    key = child.event_key(m, inc, n)
    store.put(key, raw if secret is None else auth.seal(secret.learner_key(m), key, raw))


def _emit(rt, store, m, inc, n, event):
    _put_event(rt, store, m, inc, n, json.dumps(ev.to_json(event)).encode())


def test_a_gap_in_an_event_stream_is_skipped_after_its_timeout_and_done_is_booked(syncer, caplog, monkeypatch):
    """Event 2 of learner 0 is missing: its bookkeeping stopped there with no log, and the run hung
    after the learners exited (done was never booked). Learner 1's Done event itself is missing."""
    store, rt, tokens = syncer
    monkeypatch.setattr(streams, "GAP_CHECK_S", 0.0)
    for n in range(5):
        if n != 2:
            _emit(rt, store, 0, 0, n, ev.StepDone(0, 0, n + 1, float(n), n + 0.5, tokens, ()) if n < 4
                  else ev.Done(0, 0, 5.0))
    _emit(rt, store, 1, 0, 0, ev.StepDone(1, 0, 1, 0.0, 0.5, tokens, ()))
    with caplog.at_level(logging.ERROR, logger="diloco.runtime.procs.streams"):
        assert streams.poll(rt, 0) and streams.poll(rt, 1)
        assert rt.host.done == {0} and rt.steps == {0: 4, 1: 1} and rt.cursor == {0: 5, 1: 1}
        bs.write_control(store, child.died(1, 0), {"at": 3.0, "exitcode": 0}, rt.secret)  # the supervisor saw it exit 0
        assert streams.poll(rt, 1)
    assert rt.host.done == {0, 1} and rt.host.finished_at[1] == 3.0
    assert "events 2 to 2 are missing" in caplog.text and "without a readable Done" in caplog.text
    assert rt.skipped == 1 and not streams.poll(rt, 0) and not streams.poll(rt, 1)  # nothing booked twice


def test_the_steps_of_lost_events_are_credited_to_the_learners_claims(syncer, monkeypatch, tmp_path):
    """Steps 3 to 5 of learner 0 were lost with their events: booked lost, and counted for its claims
    as if reported, since its next contribution counts them in c_steps (test_claims.py)."""
    store, rt, tokens = syncer
    monkeypatch.setattr(streams, "GAP_CHECK_S", 0.0)
    for n in (0, 1, 5):
        _emit(rt, store, 0, 0, n, ev.StepDone(0, 0, n + 1, float(n), n + 0.5, tokens, ()))
    assert streams.poll(rt, 0) and rt.steps[0] == 6
    assert rt.host.state.claims.steps[0] == 6 and rt.host.events_lost[0]["steps"] == 3
    from diloco.algo.replay import Input
    from diloco.runtime import runlog
    inputs = runlog.InputLog(tmp_path / "inputs.bin")  # the input log replays it
    inputs.append(Input("lost_steps", 5.0, (0, 3)))
    inputs.close()
    assert list(runlog.read_inputs(tmp_path / "inputs.bin")) == [Input("lost_steps", 5.0, (0, 3))]


def test_a_gap_waits_for_its_timeout_while_the_learner_runs(syncer, monkeypatch):
    store, rt, tokens = syncer
    monkeypatch.setattr(streams, "GAP_CHECK_S", 0.0)
    rt.gap_timeout = 3600.0
    _emit(rt, store, 0, 0, 1, ev.StepDone(0, 0, 2, 1.0, 1.5, tokens, ()))
    assert not streams.poll(rt, 0) and rt.cursor[0] == 0  # maybe a store slow to show event 0: wait
    bs.write_control(store, child.died(0, 0), {"at": 2.0, "exitcode": -9}, rt.secret)
    assert streams.poll(rt, 0) and rt.cursor == {0: 0, 1: 0} and rt.current[0] == 1  # exited: skipped at once, buried
    assert rt.steps[0] == 2 and bs.read_control(store, child.buried(0, 0)) == {"step": 2, "done": False}


@pytest.mark.parametrize("raw", [
    b"not json", b"[" * 3000, b'{"kind": "StepDone"}', b'{"kind": ["StepDone"]}', b"[]", b"7", b'{"kind": "Died", "learner": 0, "incarnation": 0, "at": 1}',
    json.dumps(ev.to_json(ev.StepDone(1, 0, 1, 0.0, 0.5, 1, ()))).encode(),  # another learner's event
    json.dumps(ev.to_json(ev.StepDone(0, 0, 1, 0.0, 0.5, 10 ** 9, ()))).encode(),  # more tokens than a batch
    json.dumps(ev.to_json(ev.StepDone(0, 0, 1, 0.0, 0.5, 1, ((5, 1),)))).encode(),  # no fragment 5
    json.dumps(ev.to_json(ev.StepDone(0, 0, 1, 0.0, 0.5, 1, ((0, 1), (1, 1))))).encode(),  # seq 1 twice
    json.dumps(ev.to_json(ev.Done(0, 0, 1.0, ((2.0, 1.0),)))).encode(),  # a stall ending before it starts
    json.dumps({**ev.to_json(ev.Done(0, 0, 1.0)), "at": "soon"}).encode(),
])
def test_a_malformed_event_is_logged_and_skipped(syncer, raw, caplog):
    store, rt, tokens = syncer
    _put_event(rt, store, 0, 0, 0, raw)
    _emit(rt, store, 0, 0, 1, ev.StepDone(0, 0, 1, 0.0, 0.5, tokens, ()))
    with caplog.at_level(logging.ERROR, logger="diloco.runtime.procs.syncer"):
        assert streams.poll(rt, 0)
    assert rt.cursor[0] == 2 and rt.steps[0] == 1 and rt.skipped == 1 and "event 0 skipped" in caplog.text


@pytest.mark.parametrize("forgery", ["unsealed", "other_key", "moved"])
def test_a_forged_event_is_ignored_and_never_blocks_the_real_one(syncer, forgery, caplog, monkeypatch):
    """Event blobs are sealed under their learner's key and store key: one written without the key,
    with another learner's, or copied from another position is ignored, counted, and read again,
    so the real event that lands on its key later is booked (it used to be skipped for good, and
    with forged keys written ahead of a stream the learner was cut out of the run silently)."""
    store, rt, tokens = syncer
    monkeypatch.setattr(streams, "GAP_CHECK_S", 0.0)
    assert rt.setup.policy.auth is not None  # procs authenticates by default
    raw = json.dumps(ev.to_json(ev.StepDone(0, 0, 1, 0.0, 0.5, tokens, ()))).encode()
    for n in range(4):  # written ahead of the learner's stream, before it writes any of them
        key = child.event_key(0, 0, n)
        if forgery == "unsealed":
            store.put(key, raw)
        elif forgery == "other_key":
            store.put(key, auth.seal(rt.setup.policy.auth.learner_key(1), key, raw))
        else:
            store.put(key, auth.seal(rt.setup.policy.auth.learner_key(0), child.event_key(0, 0, 7), raw))
    with caplog.at_level(logging.ERROR, logger="diloco.runtime.procs.syncer"):
        assert not streams.poll(rt, 0) and not streams.poll(rt, 0)  # nothing booked, nothing skipped: it waits
    assert rt.cursor[0] == 0 and rt.skipped == 0 and "unauthenticated" in caplog.text
    assert sorted(rt.ignored) == [child.event_key(0, 0, n) for n in range(4)]  # each key counted once
    for n in range(3):  # the learner writes its events over the forged ones
        _emit(rt, store, 0, 0, n, ev.StepDone(0, 0, n + 1, float(n), n + 0.5, tokens, ()))
    assert streams.poll(rt, 0) and rt.cursor[0] == 3 and rt.steps[0] == 3 and rt.skipped == 0
    assert rt.host.tokens.processed[0] == 3 * tokens and not rt.host.events_lost  # every real event booked
    assert intake.ignored_summary(rt.ignored) == {"store_objects_ignored": 4, "ignored_events": 4, "ignored_controls": 0}


def test_an_event_too_large_to_read_is_ignored_then_a_gap(syncer, monkeypatch):
    """Larger than any event, so not read (nor its tag checked): ignored as unauthenticated, and the
    learner's next event proves it was lost."""
    store, rt, tokens = syncer
    monkeypatch.setattr(streams, "GAP_CHECK_S", 0.0)
    store.put(child.event_key(0, 0, 0), b" " * (bs.MAX_JSON_BYTES + 1))
    assert not streams.poll(rt, 0) and child.event_key(0, 0, 0) in rt.ignored
    _emit(rt, store, 0, 0, 1, ev.StepDone(0, 0, 2, 1.0, 1.5, tokens, ()))
    assert streams.poll(rt, 0) and rt.cursor[0] == 2 and rt.steps[0] == 2 and rt.skipped == 1


def test_a_forged_event_over_a_real_one_is_a_gap_once_a_later_real_event_proves_it(syncer, monkeypatch):
    """Written over the real event after it landed: the learner's next event is what proves it was
    lost, and the gap is booked lost as any other; a forged later key proves nothing."""
    store, rt, tokens = syncer
    monkeypatch.setattr(streams, "GAP_CHECK_S", 0.0)
    _emit(rt, store, 0, 0, 0, ev.StepDone(0, 0, 1, 0.0, 0.5, tokens, ()))
    store.put(child.event_key(0, 0, 0), b"junk")
    store.put(child.event_key(0, 0, 1), b"junk")
    assert not streams.poll(rt, 0) and rt.cursor[0] == 0  # junk ahead is no evidence of a gap
    _emit(rt, store, 0, 0, 2, ev.StepDone(0, 0, 3, 2.0, 2.5, tokens, ()))
    assert streams.poll(rt, 0) and rt.cursor[0] == 3 and rt.skipped == 1
    assert rt.host.events_lost[0]["events"] == [0, 1]
    ledger.check_balance(rt.host.tokens)


def test_an_oversized_contribution_named_by_an_event_is_quarantined_and_its_tokens_dropped(syncer):
    store, rt, tokens = syncer
    bs.send_contribution(store, 0, 0, 1, b"\0" * (rt.max_frame + 1))
    _emit(rt, store, 0, 0, 0, ev.StepDone(0, 0, 1, 0.0, 0.5, tokens, ((0, 1),)))
    assert streams.poll(rt, 0)
    assert rt.host.state.quarantined == {"too_large": 1}
    assert rt.host.tokens.dropped["quarantined:too_large"][0] == tokens  # the step's tokens of fragment 0
    assert (0, 0, 1) not in rt.host.tokens.in_flight
    ledger.check_balance(rt.host.tokens)


# --- item 17: every kept syncer checkpoint stays restorable ------------------------------------------

@pytest.mark.slow  # 36 s: a kill -9 and a torn checkpoint mid-run
def test_a_torn_newest_syncer_checkpoint_falls_back_to_an_older_one_the_store_still_serves(world, tmp_path):
    """The syncer deleted events and acked contributions as far as its newest checkpoint covered, so
    restoring an older one (the newest torn) replayed journal entries whose events were gone, and
    the run died. Now the store keeps them back to the oldest checkpoint kept: kill -9 the syncer
    once gc has run past its newest checkpoint, tear that one, and the restarted syncer restores
    the one before, replays, and the run finishes as an uninterrupted one would."""
    # paced, so checkpoints (every 4 merges) come seconds apart, more than a gc interval
    cfg, setup, run_dir = variant(world, tmp_path, speeds=(1.0, 2.0), step_period_s=0.25)
    cfg = validate(replace(cfg, run=replace(cfg.run, checkpoint_every=4)))
    killed, stop = [], threading.Event()

    def killer():
        saved, seen = run_dir / "syncer", {}
        while not stop.is_set() and not killed:
            steps = sorted(int(d.name) for d in saved.iterdir() if d.name.isdigit()) if saved.is_dir() else []
            for step in steps:
                seen.setdefault(step, time.monotonic())  # renamed into place: complete
            # two kept, and the newest complete for longer than a gc interval: gc has collected to it
            if len(steps) >= 2 and time.monotonic() - seen[steps[-1]] > 1.5 * ps.GC_EVERY:
                store = bs.BlobStore(f"file://{run_dir}/store")
                os.kill(bs.read_control(store, "procs")["syncer"], signal.SIGKILL)
                (saved / str(steps[-1]) / "meta" / "metadata").write_bytes(b'{"torn')
                killed.append(steps)
            stop.wait(0.005)

    thread = threading.Thread(target=killer)
    thread.start()
    try:
        rt, summary = ps_run(cfg, setup, run_dir)
    finally:
        stop.set()
        thread.join()

    assert killed and ("syncer", 0, -signal.SIGKILL) in rt.exits, (killed, rt.exits)
    assert rt.finished["complete"] and rt.finished["steps"] == {"0": STEPS, "1": STEPS}
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    assert rt.finished["tokens"]["processed"] == P * M * STEPS * tokens_per_step  # no step booked twice
    assert summary["token_ledger_imbalance"] == 0 and summary["merges"] > 0
    for p, vs in merge_versions(run_dir).items():  # no version made twice or skipped
        assert vs == list(range(1, len(vs) + 1)), (p, vs)
    store = bs.BlobStore(f"file://{run_dir}/store")
    assert store.list("rep/") == [] and store.list("ev/") == [] and store.list("up/") == []


def ps_run(cfg, setup, run_dir):
    from diloco.runtime import procs

    return procs.run(cfg, setup, run_dir, None)


# --- property tests: random damage of every kind of store object -----------------------------------

_HOSTILE = [b"1e400", b"-1", b"true", b'"abc"', b"null", b"[]", b"{}", b"NaN", b"-Infinity", b"9" * 30,
            b"9" * 5000, b"[" * 100, b'"\\ud800"', b"\xff\xfe", b"0.5", b"[0,0]"]


def damaged(valid: bytes):
    """Random bytes, bit flips, truncations, splices and hostile JSON tokens put into `valid`."""
    n = len(valid)

    def flips(bits):
        out = valid
        for b in bits:
            out = _flip(out, b)
        return out

    splice = lambda t: valid[:min(t[0], t[1])] + t[2] + valid[max(t[0], t[1]):]  # noqa: E731
    return hs.one_of(
        hs.binary(max_size=2 * n),
        hs.lists(hs.integers(0, 8 * n - 1), min_size=1, max_size=4).map(flips),
        hs.integers(0, n - 1).map(lambda k: valid[:k]),
        hs.tuples(hs.integers(0, n), hs.integers(0, n), hs.binary(max_size=12)).map(splice),
        hs.tuples(hs.integers(0, n), hs.integers(0, n), hs.sampled_from(_HOSTILE)).map(splice),
    )


_PROPS = dict(deadline=None, database=None, max_examples=300,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
_VALID_POINTER = json.dumps({"fragments": {"0": {"version": 3, "delta": True, "merged": [[0, 0, 1], [1, 2, 30]]},
                                           "1": {"version": 12, "delta": False, "merged": []}}}).encode()


@settings(**_PROPS)
@given(hs.data())
def test_a_damaged_pointer_parses_to_valid_entries_or_is_a_value_error(data):
    store = bs.BlobStore("memory://")
    store.put(bs.LATEST, data.draw(damaged(_VALID_POINTER)))
    try:
        pointer = bs.latest(store, P)
    except ValueError:
        return
    for p, e in pointer.items():
        assert p in range(P) and bs.is_count(e.version) and e.version >= 1 and type(e.has_delta) is bool
        assert all(len(k) == 3 and all(map(bs.is_count, k)) for k in e.merged)


@settings(**_PROPS)
@given(hs.data(), hs.integers(0, 12), hs.integers(-1, 12))
def test_a_damaged_ack_never_lets_gc_delete_an_undelivered_contribution(data, ack, delivered):
    store = bs.BlobStore("memory://")
    for seq in range(12):
        bs.send_contribution(store, 0, 0, seq, b"c")
    store.put(bs.ack_key(0, 0), data.draw(damaged(json.dumps({"seq": ack}).encode())))
    try:
        stored = bs.read_ack(store, 0, 0)
    except ValueError:
        stored = None
    assert stored is None or bs.is_count(stored)
    bs.gc(store, 1, delivered={(0, 0): delivered})
    left = {bs.parse_contribution_key(k)[2] for k in store.list("up/")}
    assert set(range(delivered + 1, 12)) <= left  # never past what the syncer delivered
    assert left == set(range(12)) - set(range(min(delivered, -1 if stored is None else stored) + 1))
    assert bs.write_ack(store, 0, 0, max(delivered, 0)) >= max(delivered, 0)  # the syncer can always write


@settings(**_PROPS)
@given(hs.data())
def test_a_damaged_control_object_reads_as_json_or_a_value_error(data):
    store = bs.BlobStore("memory://")
    store.put("ctl/died/0000/0000", data.draw(damaged(b'{"at":12.5,"exitcode":-9}')))
    try:
        bs.read_control(store, "died/0000/0000")
    except ValueError:
        pass


_EVENTS = [ev.StepDone(0, 1, 7, 1.5, 2.25, 512, ((0, 3), (1, 4)), stalls=((1.0, 1.5),), loss=2.5,
                       fetched=((1.2, 0, 900, "int8+zstd1"),)),
           ev.Rejoined(0, 1, 0.0, 1.0, 1.25, {"learner": 0, "incarnation": 1, "step": 4, "restored_from": 4,
                                               "staleness": 0}),
           ev.Applied(0, 1, (0, 1)), ev.Flushed(0, 1, 3.0, ((1, 5),)), ev.Done(0, 1, 4.0)]


@settings(**_PROPS)
@given(hs.data(), hs.sampled_from(_EVENTS))
def test_a_damaged_event_parses_to_an_event_of_its_learner_or_is_a_value_error(data, event):
    raw = data.draw(damaged(json.dumps(ev.to_json(event)).encode()))
    try:
        parsed = intake.parse_event(raw, 0, 1, P, 512, 2)
    except ValueError:
        return
    e = ev.from_json(parsed, (None,) * len(parsed.get("sends", ())))
    assert (e.learner, e.incarnation) == (0, 1) and not isinstance(e, ev.Died)


@settings(**_PROPS)
@given(hs.data())
def test_a_damaged_contribution_object_is_quarantined_or_admitted_never_raised(data):
    valid = frame({k: v + 1 for k, v in THETA0[0].items()}, THETA0[0], seq=1)
    store = bs.BlobStore("memory://")
    bs.send_contribution(store, 0, 0, 1, data.draw(damaged(valid)))
    [(_, got)] = bs.poll_contributions(store, set(), max_bytes=len(valid))
    assert got == bs.OVERSIZED or len(got) <= len(valid)
    pol = policy()
    st, actions = sync.on_contribution(pol, start(pol), got, 1.0)
    outcomes = [a.outcome for a in actions if isinstance(a, sync.Outcome)]
    assert all(o == "merged" or o.split(":", 1)[1] in messages.QUARANTINE_REASONS for o in outcomes if o != "merged")


# --- issue 32 item 4: lost events booked lost (docs/design.md#damage-in-the-store) ------------------
# A learner's events lost in the store (a gap in its stream, skipped by the gap detector) have their
# steps booked processed and lost in the token ledger, with the detector's evidence, so the ledger
# balances and the summary says what was lost.

def _steps(rt, store, m, n_steps, missing, tokens, last=None):
    """Learner m's events 0..n_steps-1 (event n is step n + 1), those in `missing` never written,
    then `last` (Done, say) as event n_steps."""
    for n in range(n_steps):
        if n not in missing:
            _emit(rt, store, m, 0, n, ev.StepDone(m, 0, n + 1, float(n), n + 0.5, tokens, ()))
    if last is not None:
        _emit(rt, store, m, 0, n_steps, last)


def test_the_steps_of_lost_events_are_booked_lost_with_the_evidence(syncer, monkeypatch, caplog):
    store, rt, tokens = syncer
    monkeypatch.setattr(streams, "GAP_CHECK_S", 0.0)
    _steps(rt, store, 0, 6, {2, 3}, tokens)  # steps 3 and 4 lost
    with caplog.at_level(logging.ERROR):
        assert streams.poll(rt, 0)
    assert rt.host.events_lost == [{"learner": 0, "incarnation": 0, "events": [2, 3], "after_step": 2,
                                    "steps": 2, "tokens": 2 * tokens}]
    assert "2 steps after step 2" in caplog.text
    led = rt.host.tokens
    assert led.processed[0] == 6 * tokens and led.lost[0] == 2 * tokens  # the lost steps were processed
    ledger.check_balance(led)
    summary = rt.host.summary(clock="wall", end=10.0, window=1.0)
    assert summary["events_lost"] == 2 and summary["tokens_lost_in_gaps"] == 2 * tokens
    assert summary["tokens_processed"] == 6 * tokens and summary["token_ledger_imbalance"] == 0
    assert summary["lost_events"] == rt.host.events_lost
    # a syncer checkpoint carries them (a restarted procs syncer, a resumed run)
    arrays, meta = host_out(rt.host)
    before = list(rt.host.events_lost)
    rt.host.events_lost, rt.host.gaps = [], {}
    host_in(rt.host, rt.host.state, arrays, meta)
    assert rt.host.events_lost == before


@pytest.mark.parametrize("end", ["done", "died"])
def test_a_gap_at_the_end_of_a_stream(syncer, monkeypatch, end):
    """Lost before the final Done: the steps up to run.steps are lost, at a full batch; before a
    death no later event tells how many there were: recorded, steps unknown."""
    store, rt, tokens = syncer
    monkeypatch.setattr(streams, "GAP_CHECK_S", 0.0)
    steps = rt.cfg.run.steps
    _steps(rt, store, 0, 3, {2}, tokens, ev.Done(0, 0, 9.0) if end == "done" else None)
    if end == "died":
        _emit(rt, store, 0, 0, 3, ev.StepDone(0, 0, 4, 3.0, 3.5, tokens, ()))
        store.delete(child.event_key(0, 0, 3))  # the last event written, then lost: no later one is listed
        _emit(rt, store, 0, 0, 4, ev.Flushed(0, 0, 4.0, ()))
        store.delete(child.event_key(0, 0, 4))
        _emit(rt, store, 0, 0, 5, ev.Applied(0, 0, ()))
        bs.write_control(store, child.died(0, 0), {"at": 6.0, "exitcode": -9}, rt.secret)
    assert streams.poll(rt, 0)
    (gap,) = rt.host.events_lost
    if end == "done":
        assert gap["events"] == [2, 2] and gap["steps"] == steps - 2
        assert gap["tokens"] == (steps - 2) * rt.setup.spec.batch_size * rt.setup.spec.seq_len
        assert rt.host.done == {0}
    else:
        assert gap["events"] == [2, 4] and gap["steps"] is None and gap["tokens"] == 0
        assert (0, 0) in rt.host.tokens.dead
    ledger.check_balance(rt.host.tokens)
