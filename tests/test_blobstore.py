"""The procs runtime's object-store transport: atomic objects, key schemes, publish order, gc, back-off."""

import multiprocessing as mp
import os
import pickle
import threading
import time

import numpy as np
import pytest

from diloco import store as bs
from diloco.algo import messages
from diloco.store import BlobStore, Poller


def frame(seq, n_floats=4, learner=0, incarnation=0, kind="contribution", version=0):
    """A valid frame whose payload is n_floats copies of seq (1 MiB at n_floats = 262144)."""
    payload = np.full(n_floats, seq, np.float32).tobytes()
    header = {"kind": kind, "learner": learner, "incarnation": incarnation, "seq": seq, "fragment": 0,
              "base_version": 0, "version": version, "c_steps": 1, "c_tokens": 8, "codec": "fp32",
              "delta_against": None,
              "tensors": [{"path": ["w"], "shape": [n_floats], "dtype": "float32", "nbytes": len(payload)}]}
    return messages.encode(header, payload)


@pytest.fixture(params=["file", "memory"])
def store(request, tmp_path):
    return BlobStore(f"file://{tmp_path}/store" if request.param == "file" else "memory://")


def test_round_trip_missing_and_delete(store):
    data = bytes(range(256)) * 10
    store.put("up/learner-3/inc-1/seq-000042", data)
    assert store.get("up/learner-3/inc-1/seq-000042") == data
    assert store.get("up/learner-3/inc-1/seq-000043") is None
    store.put("up/learner-3/inc-1/seq-000042", b"")  # an empty object exists, unlike a missing one
    assert store.get("up/learner-3/inc-1/seq-000042") == b""
    store.delete("up/learner-3/inc-1/seq-000042")
    store.delete("up/learner-3/inc-1/seq-000042")  # deleting what is gone is not an error
    assert store.get("up/learner-3/inc-1/seq-000042") is None


def test_list_is_sorted_and_prefix_is_a_string_prefix(store):
    keys = ["up/0002/0000/000000000001", "up/0001/0001/000000000000", "up/0001/0000/000000000010",
            "up/0001/0000/000000000009", "down/latest", "upx", "ack/0001/0000"]
    for k in keys:
        store.put(k, k.encode())
    assert store.list() == sorted(keys)
    assert store.list("up/") == ["up/0001/0000/000000000009", "up/0001/0000/000000000010",
                                 "up/0001/0001/000000000000", "up/0002/0000/000000000001"]
    assert store.list("up") == sorted(k for k in keys if k.startswith("up"))
    assert store.list("up/0001/0000/") == ["up/0001/0000/000000000009", "up/0001/0000/000000000010"]
    assert store.list("nothing/") == []
    store.delete_prefix("up/0001/")
    assert store.list("up/") == ["up/0002/0000/000000000001"]
    with pytest.raises(ValueError, match="non-empty prefix"):
        store.delete_prefix("")


def test_plain_path_and_pickle_reopen_the_same_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    BlobStore("rel/store").put("ctl/x", b"1")
    again = pickle.loads(pickle.dumps(BlobStore(f"file://{tmp_path}/rel/store/", sync=False)))
    assert again.get("ctl/x") == b"1" and again.sync is False


@pytest.mark.parametrize("url, why", [
    ("ftp://host/dir", "scheme 'ftp'"), ("", "non-empty"), ("file://relative/dir", "absolute path"),
    ("gs://", "needs a bucket"), ("s3:///prefix", "needs a bucket"), ("http://x/y", "scheme 'http'"),
])
def test_bad_url_raises_value_error_naming_it(url, why):
    with pytest.raises(ValueError, match=why) as e:
        BlobStore(url)
    assert repr(url) in str(e.value)


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "a/./b", "a/", "x.__lock", "sp ace"])
def test_bad_keys_are_refused(key):
    with pytest.raises(ValueError, match="bad blob key"):
        BlobStore("memory://").put(key, b"")


def test_key_schemes_sort_numerically():
    assert bs.contribution_key(3, 1, 42) == "up/0003/0001/000000000042"
    assert bs.parse_contribution_key("up/0003/0001/000000000042") == (3, 1, 42)
    assert bs.parse_contribution_key("up/3/1/42") is None
    assert bs.broadcast_key(2, 7, "full") == "down/0002/000000000007.full"
    assert bs.ack_key(3, 1) == "ack/0003/0001"
    keys = [bs.contribution_key(m, i, s) for m, i, s in [(10, 0, 2), (2, 0, 10), (2, 0, 9), (2, 1, 0)]]
    assert [bs.parse_contribution_key(k) for k in sorted(keys)] == [
        (2, 0, 9), (2, 0, 10), (2, 1, 0), (10, 0, 2)]


def test_poll_returns_new_contributions_once_in_key_order(store):
    seen = set()
    assert bs.poll_contributions(store, seen) == []
    for m, s in [(1, 0), (0, 1), (0, 0)]:
        bs.send_contribution(store, m, 0, s, frame(s, learner=m))
    store.put("up/stray", b"not ours")  # outside the scheme: ignored
    first = bs.poll_contributions(store, seen, limit=2)
    got = first + bs.poll_contributions(store, seen)
    assert len(first) == 2
    assert [k for k, _ in got] == [bs.contribution_key(0, 0, 0), bs.contribution_key(0, 0, 1),
                                   bs.contribution_key(1, 0, 0)]
    assert all(messages.decode(f).header["seq"] == bs.parse_contribution_key(k)[2] for k, f in got)
    assert bs.poll_contributions(store, seen) == []
    bs.send_contribution(store, 0, 0, 2, frame(2))
    store.delete(bs.contribution_key(0, 0, 0))  # gc: forgotten by seen, never returned again
    assert [k for k, _ in bs.poll_contributions(store, seen)] == [bs.contribution_key(0, 0, 2)]
    assert bs.contribution_key(0, 0, 0) not in seen and len(seen) == 3


def test_object_deleted_between_list_and_get_is_skipped(store):
    bs.send_contribution(store, 0, 0, 0, frame(0))
    bs.send_contribution(store, 0, 0, 1, frame(1))
    real_get = store.get

    class Racy:  # gc removes seq 0 after the list, before the get
        url = store.url
        list = store.list

        def get(self, key, max_bytes=None):
            if key == bs.contribution_key(0, 0, 0):
                store.delete(key)
            return real_get(key, max_bytes)

    got = bs.poll_contributions(Racy(), set())
    assert [k for k, _ in got] == [bs.contribution_key(0, 0, 1)]


def test_garbage_and_truncated_objects_come_back_for_the_syncer_to_quarantine(store):
    good = frame(5, n_floats=64)
    bs.send_contribution(store, 0, 0, 0, os.urandom(1000))
    bs.send_contribution(store, 0, 0, 1, good[: len(good) // 2])
    bs.send_contribution(store, 0, 0, 2, b"")
    bs.send_contribution(store, 0, 0, 3, good[:-1] + bytes([good[-1] ^ 1]))
    got = dict(bs.poll_contributions(store, set()))
    assert len(got) == 4
    reasons = []
    for key in sorted(got):
        with pytest.raises(messages.MessageError) as e:
            messages.decode(got[key])
        reasons.append(e.value.reason)
    assert reasons[1:] == ["truncated", "truncated", "checksum"] and reasons[0] in messages.FRAME_REASONS


def test_writer_killed_mid_write_leaves_nothing_visible(tmp_path):
    """The file driver writes <key>.__lock and renames it; kill -9 before the rename leaves only that."""
    store = BlobStore(f"file://{tmp_path}")
    store.put(bs.contribution_key(0, 0, 0), frame(0))
    (tmp_path / "up/0000/0000/000000000001.__lock").write_bytes(frame(1)[:100])
    assert store.list("up/") == [bs.contribution_key(0, 0, 0)]
    assert store.get(bs.contribution_key(0, 0, 1)) is None
    assert [k for k, _ in bs.poll_contributions(store, set())] == [bs.contribution_key(0, 0, 0)]


class Recorder:
    """A BlobStore that logs puts and can die before a given key, as a killed publisher would."""

    def __init__(self, inner, die_before=None):
        self.inner, self.die_before, self.puts = inner, die_before, []
        self.url, self.get, self.list, self.delete = inner.url, inner.get, inner.list, inner.delete

    def put(self, key, data):
        if key == self.die_before:
            raise KeyboardInterrupt("killed")
        self.puts.append(key)
        self.inner.put(key, data)


def test_publish_writes_payloads_before_the_pointer(store):
    rec = Recorder(store)
    assert bs.latest(rec) == {}
    bs.publish(rec, 1, 1, None, b"full1")
    bs.publish(rec, 1, 2, b"delta2", b"full2", merged_keys=[(3, 0, 7), (0, 1, 2), (3, 0, 7)])
    assert rec.puts == ["down/0001/000000000001.full", bs.LATEST,
                        "down/0001/000000000002.delta", "down/0001/000000000002.full", bs.LATEST]
    assert bs.latest(store) == {1: bs.Published(2, True, ((0, 1, 2), (3, 0, 7)))}
    assert bs.fetch_fragment(store, 1, 2, want_full=False) == b"delta2"
    assert bs.fetch_fragment(store, 1, 2, want_full=True) == b"full2"
    assert bs.fetch_fragment(store, 1, 1, want_full=False) is None  # no delta was published
    with pytest.raises(ValueError, match="not newer"):
        bs.publish(store, 1, 2, None, b"again")
    assert bs.fetch_fragment(store, 1, 2, want_full=True) == b"full2"

    dying = Recorder(store, die_before=bs.LATEST)  # killed between payloads and pointer
    with pytest.raises(KeyboardInterrupt):
        bs.publish(dying, 1, 3, b"delta3", b"full3")
    assert bs.latest(store)[1].version == 2  # readers still follow the old, complete version
    bs.publish(store, 1, 3, None, b"full3 again")  # the restarted syncer's v3 has no delta
    assert bs.fetch_fragment(store, 1, 3, want_full=False) is None
    assert bs.fetch_fragment(store, 1, 3, want_full=True) == b"full3 again"
    bs.publish(store, 0, 1, None, b"f0")
    assert {p: e.version for p, e in bs.latest(store).items()} == {0: 1, 1: 3}


def test_gc_keeps_the_last_k_versions_and_unacked_contributions(store):
    for v in range(1, 6):
        bs.publish(store, 0, v, b"d" if v > 1 else None, b"f")
    for v in range(1, 4):
        bs.publish(store, 1, v, None, b"f")
    store.put(bs.broadcast_key(0, 6, "full"), b"in flight")  # payload written, pointer not yet
    store.put(bs.broadcast_key(2, 1, "full"), b"first publish in flight")
    for s in range(5):
        bs.send_contribution(store, 0, 0, s, b"c")
        bs.send_contribution(store, 1, 0, s, b"c")
    bs.send_contribution(store, 0, 1, 0, b"c")
    assert bs.write_ack(store, 0, 0, 2) == 2
    assert bs.write_ack(store, 0, 0, 1) == 2  # acks never go down
    assert bs.read_ack(store, 0, 0) == 2 and bs.read_ack(store, 1, 0) is None

    delivered = {(0, 0): 4, (1, 0): 4, (0, 1): 0}  # the syncer took in everything; gc goes by the acks
    deleted = bs.gc(store, keep_versions=2, delivered=delivered)
    assert deleted == sorted(deleted) and len(deleted) == 5 + 1 + 3
    assert store.list("down/0000/") == ["down/0000/000000000004.delta", "down/0000/000000000004.full",
                                        "down/0000/000000000005.delta", "down/0000/000000000005.full",
                                        "down/0000/000000000006.full"]
    assert store.list("down/0001/") == ["down/0001/000000000002.full", "down/0001/000000000003.full"]
    assert store.list("down/0002/") == [bs.broadcast_key(2, 1, "full")]
    assert store.list("up/0000/") == [bs.contribution_key(0, 0, 3), bs.contribution_key(0, 0, 4),
                                      bs.contribution_key(0, 1, 0)]
    assert len(store.list("up/0001/")) == 5
    assert bs.gc(store, keep_versions=2, delivered=delivered) == []
    assert [k for k in bs.gc(store, keep_versions=1, delivered=delivered) if k.startswith("down/0001/")] == [
        "down/0001/000000000002.full"]
    with pytest.raises(ValueError, match="keep_versions"):
        bs.gc(store, 0, delivered)


def test_malformed_pointers_fail_loudly_naming_the_key(store):
    store.put(bs.LATEST, b"\xff garbage")
    with pytest.raises(ValueError, match="down/latest"):
        bs.latest(store)
    store.put(bs.ack_key(0, 0), b'{"seq": "7"}')
    with pytest.raises(ValueError, match="ack/0000/0000"):
        bs.read_ack(store, 0, 0)


def test_control_objects(store):
    bs.write_control(store, "heartbeat/learner-0001", {"incarnation": 2, "step": 40})
    bs.write_control(store, "heartbeat/learner-0000", {"incarnation": 0, "step": 41})
    bs.write_control(store, "stop", True)
    assert bs.list_control(store, "heartbeat/") == ["heartbeat/learner-0000", "heartbeat/learner-0001"]
    assert bs.read_control(store, "heartbeat/learner-0001") == {"incarnation": 2, "step": 40}
    assert bs.read_control(store, "stop") is True and bs.read_control(store, "nope") is None


class FakeClock:
    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def sleep(self, dt):
        self.sleeps.append(round(dt, 9))
        self.now += dt


def test_backoff_doubles_to_the_cap_and_resets_on_activity():
    c = FakeClock()
    p = Poller(0.1, 1.0, sleep=c.sleep, clock=lambda: c.now)
    for active in [False] * 6 + [True, False, False]:
        assert p.wait(active)
    assert c.sleeps == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 0.1, 0.2, 0.4]


def test_deadline_clips_the_last_sleep_and_ends_run():
    c = FakeClock()
    polls = []
    p = Poller(0.1, 1.0, factor=3.0, deadline=2.0, sleep=c.sleep, clock=lambda: c.now)
    p.run(lambda: polls.append(c.now))
    assert c.sleeps == [0.1, 0.3, 0.9, 0.7] and c.now == pytest.approx(2.0) and len(polls) == 4
    assert Poller(1, 1, deadline=0.0, clock=lambda: 0.0).until(lambda: 0) is None  # already past


def test_until_returns_the_first_truthy_result_and_stop_ends_it():
    c = FakeClock()
    answers = iter([None, [], {}, "v7"])
    assert Poller(0.5, 4.0, sleep=c.sleep, clock=lambda: c.now).until(lambda: next(answers)) == "v7"
    assert c.sleeps == [0.5, 1.0, 2.0]
    stop = threading.Event()
    calls = []

    def poll():
        calls.append(1)
        if len(calls) == 3:
            stop.set()
        return None

    t0 = time.monotonic()
    assert Poller(0.001, 0.002, stop=stop).until(poll) is None  # sleeps on the Event itself
    assert len(calls) == 3 and time.monotonic() - t0 < 1.0
    with pytest.raises(ValueError, match="min_interval"):
        Poller(0.0, 1.0)


def _writer(store, enough, seconds):
    """Child process: 1 MiB frames under fresh keys and over one hot key, as fast as it can, until
    `enough` is set (or `seconds` pass: the parent is gone)."""
    end, seq = time.monotonic() + seconds, 0
    while not enough.is_set() and time.monotonic() < end:
        f = frame(seq, n_floats=1 << 18)
        bs.send_contribution(store, 0, 0, seq, f)
        store.put("ctl/hot", f)  # overwritten in place: the harder case for a torn read
        seq += 1


def test_concurrent_writer_process_never_shows_a_torn_object(tmp_path):
    store = BlobStore(f"file://{tmp_path}", sync=False)  # fsync does not affect atomicity, only durability
    spawn = mp.get_context("spawn")
    # set once the reader has read for 1 s while the child wrote, and seen 5 new frames and 5 hot ones
    enough = spawn.Event()
    child = spawn.Process(target=_writer, args=(store, enough, 600.0))
    child.start()
    seen, fresh, hot, during, first = set(), 0, 0, 0, None
    try:
        deadline = time.monotonic() + 300  # however slow a busy machine makes the child's start
        while child.is_alive() and time.monotonic() < deadline:
            if fresh >= 5 and during >= 5 and time.monotonic() - first >= 1.0:
                enough.set()
            for key, f in bs.poll_contributions(store, seen):
                msg = messages.decode(f)  # raises MessageError on a torn frame
                assert msg.header["seq"] == bs.parse_contribution_key(key)[2]
                assert np.all(np.frombuffer(msg.payload, np.float32) == msg.header["seq"])
                fresh += 1
            f = store.get("ctl/hot")
            if f is not None:
                messages.decode(f)
                hot += 1
                during += child.is_alive()
                first = first or time.monotonic()
    finally:
        enough.set()
        child.join(300)
    assert child.exitcode == 0
    fresh += len(bs.poll_contributions(store, seen))
    assert fresh == len(store.list("up/")) >= 5 and during >= 5
