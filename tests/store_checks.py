"""What every network blob store must do, checked the same way over each protocol
(tests/test_blobstore_s3.py, tests/test_blobstore_gcs.py): round-trips, the run's key schemes, an
outage ridden out with nothing lost, and a procs run over the store (docs/design.md#object-store-transport)."""

from __future__ import annotations

import pickle
import threading
import time
from typing import Callable

import pytest

from diloco import store as bs
from diloco.store import network


def fill(store: bs.BlobStore, n: int, tag: str) -> dict[str, bytes]:
    out = {}
    for i in range(n):
        key, data = f"seq/{tag}/{i:04d}", f"{tag}-{i}".encode() * (1 + i)
        store.put(key, data)
        out[key] = data
    return out


def round_trip(store: bs.BlobStore, other: bs.BlobStore, small: bytes = b"") -> None:
    """Put, get (with and past max_bytes), list by prefix, rewrite, delete, delete_prefix on an empty
    `store`; `other` is the same bucket under another prefix, which sees none of it. `small`: the
    one-key object's body (empty, unless the server fails an empty upload)."""
    assert store.get("a/b") is None and store.list() == []
    store.put("a/b", b"hello")
    store.put("a/c", bytes(range(256)) * 4096)  # 1 MiB
    store.put("b", small)
    assert store.get("a/b") == b"hello" and store.get("a/c") == bytes(range(256)) * 4096 and store.get("b") == small
    assert store.list() == ["a/b", "a/c", "b"] and store.list("a/") == ["a/b", "a/c"] and store.list("a/c") == ["a/c"]
    assert store.get("a/c", max_bytes=1 << 20) is not None
    with pytest.raises(bs.TooLarge):
        store.get("a/c", max_bytes=(1 << 20) - 1)
    store.put("a/b", b"again")  # a pointer's one writer rewrites it
    assert store.get("a/b") == b"again"
    store.delete("a/b")
    store.delete("a/b")  # a missing one is not an error
    assert store.get("a/b") is None and store.list() == ["a/c", "b"]
    store.delete_prefix("a/")
    assert store.list() == ["b"]
    assert other.list() == []  # the prefix is the store's
    assert pickle.loads(pickle.dumps(store)).list() == ["b"]  # a spawned process reopens it from its URL


def key_schemes(store: bs.BlobStore) -> None:
    """Contributions, broadcasts and their pointer, acks, gc and control objects."""
    keys = [bs.send_contribution(store, m, 0, seq, f"frame {m} {seq}".encode()) for m in (1, 0) for seq in (0, 1)]
    assert keys[0] == "up/0001/0000/000000000000"
    seen: set[str] = set()
    got = bs.poll_contributions(store, seen)
    assert [bs.parse_contribution_key(k) for k, _ in got] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    assert bs.poll_contributions(store, seen) == []
    bs.publish(store, 0, 1, None, b"full 1", [(0, 0, 0)], fragments=2)
    bs.publish(store, 0, 2, b"delta 2", b"full 2", [(0, 0, 1)], fragments=2)
    assert bs.latest(store, 2) == {0: bs.Published(2, True, ((0, 0, 1),))}
    assert bs.fetch_fragment(store, 0, 2, want_full=False) == b"delta 2"
    assert bs.full_versions(store, 0) == [1, 2]
    assert bs.write_ack(store, 0, 0, 1) == 1 and bs.write_ack(store, 0, 0, 0) == 1 and bs.read_ack(store, 0, 0) == 1
    deleted = bs.gc(store, keep_versions=1, delivered={(0, 0): 1})
    assert deleted == ["down/0000/000000000001.full", "up/0000/0000/000000000000", "up/0000/0000/000000000001"]
    bs.write_control(store, "heartbeat/learner-0000", {"step": 3})
    assert bs.read_control(store, "heartbeat/learner-0000") == {"step": 3}
    assert bs.list_control(store) == ["heartbeat/learner-0000"]


def rides_out_an_outage(store: bs.BlobStore, stop: Callable[[], None], start: Callable[[], None]) -> None:
    """Writes and reads made while the server is stopped for 3 s complete once it is back, with
    nothing lost (`store` opened with a deadline well past 3 s)."""
    written = fill(store, 5, "before")
    restarted = threading.Event()

    def outage():
        stop()
        time.sleep(3)
        start()
        restarted.set()

    t = threading.Thread(target=outage)
    t0 = time.monotonic()
    t.start()
    written |= fill(store, 10, "during")  # the first of these waits for the server
    seen = {k: store.get(k) for k in written}
    t.join()
    assert restarted.is_set() and time.monotonic() - t0 >= 3
    assert seen == written and store.list("seq/") == sorted(written)


def fails_past_its_deadline(store: bs.BlobStore, stop: Callable[[], None]) -> None:
    """A store opened with retry_s=1.5 whose server is gone raises StoreUnavailable, naming the
    operation and the deadline, long before the 60 s it would retry by default
    (a bound no busy machine reaches)."""
    stop()
    t0 = time.monotonic()
    with pytest.raises(bs.StoreUnavailable, match=r"put up/x: the store kept failing for 1.5 s"):
        store.put("up/x", b"frame")
    assert time.monotonic() - t0 < network.DEFAULT_RETRY_S / 2


def procs_run_balanced(rt, summary, cfg, steps: int, learners: int, fragments: int) -> None:
    """A procs run (tests/test_procs.py's) over the store: complete, every step booked once."""
    assert rt.syncer.exitcode == 0 and rt.finished["complete"]
    assert rt.finished["steps"] == {str(m): steps for m in range(learners)}
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    assert rt.finished["tokens"]["processed"] == fragments * learners * steps * tokens_per_step
    assert summary["token_ledger_imbalance"] == 0 and summary["merges"] > 0
