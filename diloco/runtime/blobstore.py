"""The object-store transport of the procs runtime: a tensorstore kvstore, key schemes and a poller.

Reference: docs/design.md#object-store-transport (procs: a tensorstore kvstore, `file://` by default, the same
code for `gs://` / `s3://`) and docs/design.md#messages (frames are validated by the syncer, not the transport).

Every object is written whole under a key no other write reuses (contributions and broadcasts), or
is a small pointer written by one process (`down/latest`, acks, control), so readers never need a
lock. A reader never sees a torn object:

* `file://`: tensorstore's file driver writes the value to `<key>.__lock`, fsyncs it (unless
  `sync=False`), `rename`s it onto `<key>` and fsyncs the directory; reads open the key's file, so
  they see the old inode or the new one, never a partial one (file_key_value_store.cc, header
  comment "The files containing the values of existing keys are never modified; instead, they are
  replaced via `rename`"; observed with strace on 0.1.86: `rename(".../seq.__lock", ".../seq")`).
  A writer killed mid-write leaves only a `.__lock` file, which List skips and Read never opens.
  The driver has an opt-in `file_io_locking: {"mode": "non_atomic"}` that writes in place; this
  module pins mode "os" (the default) in the spec, so a shared context cannot switch it on.
* `gs://` and `s3://`: a PUT of a whole object is atomic for readers in both services (a GET
  returns the old or the new object, never a mix), and both lists are strongly consistent.
* `memory://`: in-process, private to one BlobStore; for tests.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.parse
from collections.abc import Iterable
from typing import Any, Callable, NamedTuple, TypeVar

import tensorstore as ts

from diloco.algo.bounds import loads_json

_SCHEMES = ("file", "memory", "gs", "s3")
# A portable key: what GCS, S3 and every local filesystem accept alike, without "." / ".." parts.
_KEY = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")
_LOCK_SUFFIX = ".__lock"  # the file driver's temp name; such keys are invalid there
_PREFIX = re.compile(r"^([A-Za-z0-9_.-]+/)*[A-Za-z0-9_.-]*$")
# Pointers, acks and control objects nest a few levels; json.loads alone would raise RecursionError
# on a small object nested 1,000 deep (docs/algorithm.md#bounds-on-what-a-frame-can-claim).
_MAX_DEPTH = 64


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not _KEY.match(key) or "." in parts or ".." in parts or key.endswith(_LOCK_SUFFIX):
        raise ValueError(f"bad blob key {key!r}: want '/'-separated [A-Za-z0-9_.-] parts, no '.' or '..', "
                         f"not ending in {_LOCK_SUFFIX!r}")
    return key


def _prefix_range(prefix: str) -> ts.KvStore.KeyRange:
    if not _PREFIX.match(prefix) or ".." in prefix.split("/"):
        raise ValueError(f"bad blob prefix {prefix!r}")
    if not prefix:
        return ts.KvStore.KeyRange()
    # Keys are ASCII from _KEY's alphabet, so bumping the last character never overflows.
    return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


def _spec(url: str, sync: bool) -> Any:
    """The kvstore spec for a URL or plain path; ValueError naming the URL if it is not one."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"blob store URL must be a non-empty str, got {url!r}")
    scheme, sep, rest = url.partition("://")
    if not sep:  # a plain path: the file driver, made absolute so child processes agree on it
        scheme, rest = "file", os.path.abspath(url)
    elif scheme not in _SCHEMES:
        raise ValueError(f"blob store URL {url!r}: scheme {scheme!r} is not one of {_SCHEMES}")
    if scheme == "file":
        if not rest.startswith("/"):
            raise ValueError(f"blob store URL {url!r}: file:// needs an absolute path (file:///abs/dir)")
        return {"driver": "file", "path": urllib.parse.unquote(rest).rstrip("/") + "/", "file_io_sync": sync,
                "file_io_locking": {"mode": "os"}}
    if scheme in ("gs", "s3") and not rest.split("/")[0]:
        raise ValueError(f"blob store URL {url!r}: {scheme}:// needs a bucket ({scheme}://bucket/prefix)")
    return f"{scheme}://{rest.rstrip('/')}/" if rest else url


class BlobStore:
    """Whole-object put/get/list/delete on a tensorstore kvstore.

    `url`: `file:///abs/dir` or a plain path (file driver), `memory://` (tests; private to this
    object), `gs://bucket/prefix` or `s3://bucket/prefix` (tensorstore's gcs / s3 drivers, with
    their usual credentials). `sync=False` skips the file driver's fsyncs: still atomic for
    readers, but not durable across a machine crash (a killed process loses nothing either way).
    Pickles as (url, sync), so a spawned process reopens the same store (not for memory://).
    """

    def __init__(self, url: str, *, sync: bool = True):
        self.url, self.sync = url, sync
        try:
            self._kv = ts.KvStore.open(_spec(url, sync)).result()
        except ValueError as e:
            if url in str(e):
                raise
            raise ValueError(f"cannot open blob store URL {url!r}: {e}") from None

    def __reduce__(self):
        return _reopen, (self.url, self.sync)

    def __repr__(self) -> str:
        return f"BlobStore({self.url!r})"

    def put(self, key: str, data: bytes) -> None:
        self._kv.write(_check_key(key), bytes(data)).result()

    def get(self, key: str) -> bytes | None:
        """The object, or None if there is none (never written, or deleted e.g. by gc)."""
        r = self._kv.read(_check_key(key)).result()
        return bytes(r.value) if r.state == "value" else None

    def list(self, prefix: str = "") -> list[str]:
        """Every key under `prefix` (a plain string prefix, not only whole path parts), sorted."""
        return sorted(k.decode() for k in self._kv.list(_prefix_range(prefix)).result())

    def delete(self, key: str) -> None:
        """Remove one object; a missing one is not an error (gc and a reader may race)."""
        self._kv.write(_check_key(key), None).result()

    def delete_prefix(self, prefix: str) -> None:
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix; it would delete the whole store")
        self._kv.delete_range(_prefix_range(prefix)).result()


def _reopen(url: str, sync: bool) -> BlobStore:
    return BlobStore(url, sync=sync)


# Key schemes. Zero-padded ids make sorted keys sort by (learner, incarnation, seq) and by
# version, so a list is a deterministic, ordered scan.

LATEST = "down/latest"
Key = tuple[int, int, int]  # (learner, incarnation, seq), as messages.merged_keys
_UP = re.compile(r"^up/(\d{4})/(\d{4})/(\d{12})$")
_DOWN = re.compile(r"^down/(\d{4})/(\d{12})\.(delta|full)$")


def contribution_key(learner: int, incarnation: int, seq: int) -> str:
    return f"up/{learner:04d}/{incarnation:04d}/{seq:012d}"


def parse_contribution_key(key: str) -> Key | None:
    m = _UP.match(key)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def broadcast_key(fragment: int, version: int, kind: str) -> str:
    assert kind in ("delta", "full"), kind
    return f"down/{fragment:04d}/{version:012d}.{kind}"


def ack_key(learner: int, incarnation: int) -> str:
    return f"ack/{learner:04d}/{incarnation:04d}"


def ctl_key(name: str) -> str:
    return _check_key(f"ctl/{name}")


def _json(store: BlobStore, key: str) -> Any:
    raw = store.get(key)
    if raw is None:
        return None
    try:
        return loads_json(raw, _MAX_DEPTH)
    except ValueError as e:  # UnicodeDecodeError and a nesting too deep are ValueErrors too
        raise ValueError(f"{store.url} {key}: not UTF-8 JSON ({e}): {raw[:80]!r}") from None


def _put_json(store: BlobStore, key: str, obj: Any) -> None:
    store.put(key, json.dumps(obj, separators=(",", ":"), sort_keys=True).encode())


# Contributions, learner -> syncer.

def send_contribution(store: BlobStore, learner: int, incarnation: int, seq: int, frame: bytes) -> str:
    """Write one contribution frame under its own key; returns the key."""
    key = contribution_key(learner, incarnation, seq)
    store.put(key, frame)
    return key


def poll_contributions(store: BlobStore, seen: set[str], limit: int | None = None) -> list[tuple[str, bytes]]:
    """The contributions not in `seen`, sorted by key, i.e. by (learner, incarnation, seq); at most
    `limit` of them, to bound the memory one poll holds (the rest come on the next poll).

    Updates `seen` in place: adds what it returns and forgets keys no longer listed (deleted by
    gc; keys are never reused, so they cannot come back), which keeps `seen` bounded. Bytes are
    returned as stored, unvalidated: a corrupt object is the syncer's to quarantine. A key deleted
    between list and get is skipped; keys under up/ not in this scheme are ignored.
    """
    listed = [k for k in store.list("up/") if _UP.match(k)]
    seen.intersection_update(listed)
    out = []
    for key in listed:
        if key in seen:
            continue
        if limit is not None and len(out) >= limit:
            break
        data = store.get(key)
        if data is not None:
            out.append((key, data))
            seen.add(key)
    return out


def write_ack(store: BlobStore, learner: int, incarnation: int, seq: int) -> int:
    """Record that the syncer has taken in every contribution of (learner, incarnation) up to `seq`,
    so gc may delete them. Never lowers a stored ack (a syncer restored from an older checkpoint
    may repeat itself); returns the stored value. One writer: the syncer."""
    current = read_ack(store, learner, incarnation)
    if current is not None and current >= seq:
        return current
    _put_json(store, ack_key(learner, incarnation), {"seq": int(seq)})
    return int(seq)


def read_ack(store: BlobStore, learner: int, incarnation: int) -> int | None:
    obj = _json(store, ack_key(learner, incarnation))
    if obj is None:
        return None
    if not (isinstance(obj, dict) and type(obj.get("seq")) is int):
        raise ValueError(f"{store.url} {ack_key(learner, incarnation)}: want {{'seq': int}}, got {obj!r}")
    return obj["seq"]


# Broadcasts, syncer -> learners.

class Published(NamedTuple):
    version: int
    has_delta: bool
    merged: tuple[Key, ...]  # the contributions this version's merge took in


def latest(store: BlobStore) -> dict[int, Published]:
    """fragment -> its newest published version, from the `down/latest` pointer ({} before any)."""
    obj = _json(store, LATEST)
    if obj is None:
        return {}
    try:
        return {int(p): Published(int(e["version"]), bool(e["delta"]), tuple(tuple(k) for k in e["merged"]))
                for p, e in obj["fragments"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{store.url} {LATEST}: malformed pointer ({e!r}): {obj!r}") from None


def publish(store: BlobStore, fragment: int, version: int, delta_frame: bytes | None, full_frame: bytes,
            merged_keys: Iterable[Key] = ()) -> dict[int, Published]:
    """Publish one merged fragment: its payload objects first, then the `down/latest` pointer.

    A reader that follows the pointer therefore always finds the objects it names. A publisher
    killed between the two leaves the old pointer and objects no reader is directed to; a retry of
    the same version replaces them (a stale delta is deleted when the retry has none), and gc
    reclaims them once the pointer passes them. The pointer is read-modify-written, so there must
    be one publisher (the syncer, one thread). Returns the new pointer contents.
    """
    pointer = latest(store)
    if fragment in pointer and version <= pointer[fragment].version:
        raise ValueError(f"fragment {fragment}: version {version} is not newer than the published "
                         f"{pointer[fragment].version}; objects are never overwritten")
    if delta_frame is not None:
        store.put(broadcast_key(fragment, version, "delta"), delta_frame)
    else:
        store.delete(broadcast_key(fragment, version, "delta"))
    store.put(broadcast_key(fragment, version, "full"), full_frame)
    merged = tuple(sorted({tuple(int(x) for x in k) for k in merged_keys}))
    pointer[fragment] = Published(version, delta_frame is not None, merged)
    _put_json(store, LATEST, {"fragments": {
        str(p): {"version": e.version, "delta": e.has_delta, "merged": [list(k) for k in e.merged]}
        for p, e in sorted(pointer.items())}})
    return pointer


def fetch_fragment(store: BlobStore, fragment: int, version: int, want_full: bool) -> bytes | None:
    """The full copy or the delta of one published version; None if absent (no delta was
    published, or gc removed it: a learner then falls back to the latest full copy)."""
    return store.get(broadcast_key(fragment, version, "full" if want_full else "delta"))


def gc(store: BlobStore, keep_versions: int) -> list[str]:
    """Delete broadcasts older than each fragment's last `keep_versions` published versions, and
    contributions at or below their (learner, incarnation)'s ack. Returns the deleted keys.

    Versions above the pointer (a publish in flight) are kept and do not count, so the version the
    pointer names always survives.
    """
    if keep_versions < 1:
        raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
    pointer = latest(store)
    doomed = []
    by_fragment: dict[int, list[tuple[int, str]]] = {}
    for key in store.list("down/"):
        m = _DOWN.match(key)
        if m:
            by_fragment.setdefault(int(m[1]), []).append((int(m[2]), key))
    for p, entries in by_fragment.items():
        if p not in pointer:
            continue
        published = sorted({v for v, _ in entries if v <= pointer[p].version})
        keep = set(published[-keep_versions:])
        doomed += [k for v, k in entries if v <= pointer[p].version and v not in keep]
    acks: dict[tuple[int, int], int | None] = {}
    for key in store.list("up/"):
        parsed = parse_contribution_key(key)
        if parsed is None:
            continue
        m, inc, seq = parsed
        if (m, inc) not in acks:
            acks[(m, inc)] = read_ack(store, m, inc)
        if acks[(m, inc)] is not None and seq <= acks[(m, inc)]:
            doomed.append(key)
    for key in doomed:
        store.delete(key)
    return sorted(doomed)


# Control and heartbeats: small JSON objects under ctl/, overwritten by their one writer.

def write_control(store: BlobStore, name: str, obj: Any) -> None:
    """E.g. write_control(store, "heartbeat/learner-0003", {"incarnation": 1, "step": 40, "t": now})."""
    _put_json(store, ctl_key(name), obj)


def read_control(store: BlobStore, name: str) -> Any:
    return _json(store, ctl_key(name))


def list_control(store: BlobStore, prefix: str = "") -> list[str]:
    """Names (without "ctl/") of the control objects under `prefix`, sorted."""
    return [k[len("ctl/"):] for k in store.list(f"ctl/{prefix}")]


T = TypeVar("T")


class Poller:
    """Exponential back-off between polls: `min_interval` after activity, times `factor` after each
    idle poll, capped at `max_interval`; ends when `stop` is set or the clock reaches `deadline`.

    Object stores charge per request and have no notifications, so an idle syncer or learner
    backs off, and returns to fast polling as soon as something arrives. `stop` is a predicate or
    anything with `is_set` (threading / multiprocessing Event); with an Event and no `sleep`,
    sleeping waits on the Event, so a stop wakes the poller at once. `sleep` and `clock` are
    injectable so tests run instantly on a fake clock.
    """

    def __init__(self, min_interval: float, max_interval: float, *, factor: float = 2.0,
                 stop: Any = None, deadline: float | None = None,
                 sleep: Callable[[float], Any] | None = None, clock: Callable[[], float] = time.monotonic):
        if not 0 < min_interval <= max_interval or factor < 1:
            raise ValueError(f"want 0 < min_interval <= max_interval and factor >= 1, got "
                             f"{min_interval}, {max_interval}, {factor}")
        self.min_interval, self.max_interval, self.factor = min_interval, max_interval, factor
        self.deadline, self.clock = deadline, clock
        self._stop = stop.is_set if hasattr(stop, "is_set") else (stop or (lambda: False))
        self._sleep = sleep or (stop.wait if hasattr(stop, "wait") else time.sleep)
        self.interval = min_interval  # the next sleep

    def stopped(self) -> bool:
        return bool(self._stop()) or (self.deadline is not None and self.clock() >= self.deadline)

    def wait(self, active: bool) -> bool:
        """Sleep after a poll (reset to min_interval if it found something); False once stopped."""
        if active:
            self.interval = self.min_interval
        if self.stopped():
            return False
        dt = self.interval
        if self.deadline is not None:
            dt = min(dt, self.deadline - self.clock())
        if dt > 0:
            self._sleep(dt)
        self.interval = min(self.interval * self.factor, self.max_interval)
        return not self.stopped()

    def run(self, poll: Callable[[], Any]) -> None:
        """Call `poll` (truthy result = activity) until stop or deadline."""
        while self.wait(bool(poll())):
            pass

    def until(self, poll: Callable[[], T]) -> T | None:
        """Call `poll` until it returns something truthy, which is returned; None on stop or deadline."""
        while True:
            result = poll()
            if result:
                return result
            if not self.wait(False):
                return None


class ControlChannel:
    """The store's control objects (`ctl/<name>`) as a Channel (diloco/runtime/interfaces.py)."""

    def __init__(self, store: BlobStore):
        self.store = store

    def write(self, name: str, message: Any) -> None:
        write_control(self.store, name, message)

    def read(self, name: str) -> Any:
        return read_control(self.store, name)
