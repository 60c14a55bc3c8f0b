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
  returns the old or the new object, never a mix), and both lists are strongly consistent. An
  S3-compatible server at another endpoint, its region and the retry deadline are options in the
  URL's query (diloco/runtime/store_s3.py); transient failures are retried there, up to the deadline.
* `memory://`: in-process, private to one BlobStore; for tests.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
import time
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any, Callable, NamedTuple, TypeVar

import tensorstore as ts

from diloco.algo import messages
from diloco.algo.bounds import loads_json
from diloco.runtime import store_s3
from diloco.runtime.store_s3 import StoreUnavailable  # noqa: F401  (re-exported for callers)

log = logging.getLogger(__name__)

_SCHEMES = ("file", "memory", "gs", "s3")
# A portable key: what GCS, S3 and every local filesystem accept alike, without "." / ".." parts.
_KEY = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")
_LOCK_SUFFIX = ".__lock"  # the file driver's temp name; such keys are invalid there
_PREFIX = re.compile(r"^([A-Za-z0-9_.-]+/)*[A-Za-z0-9_.-]*$")
# Pointers, acks and control objects nest a few levels; json.loads alone would raise RecursionError
# on a small object nested 1,000 deep (docs/algorithm.md#bounds-on-what-a-frame-can-claim).
_MAX_DEPTH = 64
# Every JSON object of a run (pointer, acks, control, events, reports) is far below this; a larger
# one is damage, refused before it is read into memory.
MAX_JSON_BYTES = 16 << 20
# Every counter a store object holds (versions, seqs, steps) is below this, as in a frame's header.
MAX_COUNT = messages.MAX_COUNT


class TooLarge(ValueError):
    """An object larger than its reader's bound, left unread (docs/design.md#damage-in-the-store)."""

    def __init__(self, key: str, limit: int):
        super().__init__(f"{key}: larger than {limit} bytes; not read")
        self.key, self.limit = key, limit


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
    base, opts = store_s3.split_options(url)
    scheme, sep, rest = base.partition("://")
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
    if scheme == "s3":
        bucket, _, path = rest.partition("/")
        path = urllib.parse.unquote(path).strip("/")
        return store_s3.s3_spec(bucket, path + "/" if path else "", opts)
    return f"{scheme}://{rest.rstrip('/')}/" if rest else url


class BlobStore:
    """Whole-object put/get/list/delete on a tensorstore kvstore.

    `url`: `file:///abs/dir` or a plain path (file driver), `memory://` (tests; private to this
    object), `gs://bucket/prefix` or `s3://bucket/prefix` (tensorstore's gcs / s3 drivers, with
    their usual credentials; `s3://bucket/prefix?endpoint=http://host:port&region=r&retry_s=60`
    for another S3-compatible server, diloco/runtime/store_s3.py). `sync=False` skips the file
    driver's fsyncs: still atomic for readers, but not durable across a machine crash (a killed
    process loses nothing either way). Pickles as (url, sync), so a spawned process reopens the
    same store (not for memory://).

    On gs:// and s3:// every operation is retried while it fails transiently, for at most the
    URL's `retry_s` (default 60 s), then raises StoreUnavailable (store_s3.call); opening lists
    the store once, so a wrong endpoint or bucket fails here, naming the URL.
    """

    def __init__(self, url: str, *, sync: bool = True):
        self.url, self.sync = url, sync
        scheme = url.partition("://")[0] if isinstance(url, str) else ""
        try:
            self._kv = ts.KvStore.open(_spec(url, sync)).result()
            self._retry_s = (store_s3.retry_s_of(store_s3.split_options(url)[1])
                             if scheme in ("gs", "s3") else None)
            if self._retry_s is not None:
                self._call(lambda: self._kv.list(_prefix_range(LATEST)), "open (list down/latest)")
        except ValueError as e:
            if store_s3.redacted(url) in str(e):
                raise
            raise ValueError(f"cannot open blob store URL {store_s3.redacted(url)!r}: {e}") from None

    def _call(self, op: Callable[[], Any], what: str) -> Any:
        """`op()` resolved; on a network store, with store_s3.call's retries and deadline."""
        if self._retry_s is None:
            return op().result()
        return store_s3.call(op, f"{store_s3.redacted(self.url)} {what}", self._retry_s)

    def __reduce__(self):
        return _reopen, (self.url, self.sync)

    def __repr__(self) -> str:
        return f"BlobStore({self.url!r})"

    def put(self, key: str, data: bytes) -> None:
        key, data = _check_key(key), bytes(data)
        self._call(lambda: self._kv.write(key, data), f"put {key}")

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        """The object, or None if there is none (never written, or deleted e.g. by gc).

        `max_bytes`: raise TooLarge, having read one byte, if the object is larger. A one-byte
        ranged read at offset max_bytes tells: the kvstore refuses a range past the end
        (OUT_OF_RANGE), so a refusal means the object fits and is then read whole. Keys written
        once never change in between; a pointer rewritten by its one writer between the two reads
        is checked again after the read.
        """
        key = _check_key(key)
        if max_bytes is not None:
            try:
                probe = self._call(lambda: self._kv.read(key, byte_range=slice(max_bytes, max_bytes + 1)),
                                   f"get {key}")
            except ValueError as e:
                if "OUT_OF_RANGE" not in str(e):
                    raise
            else:
                if probe.state != "value":
                    return None
                raise TooLarge(key, max_bytes)
        r = self._call(lambda: self._kv.read(key), f"get {key}")
        if r.state != "value":
            return None
        if max_bytes is not None and len(r.value) > max_bytes:
            raise TooLarge(key, max_bytes)
        return bytes(r.value)

    def list(self, prefix: str = "") -> list[str]:
        """Every key under `prefix` (a plain string prefix, not only whole path parts), sorted."""
        keys = _prefix_range(prefix)
        return sorted(k.decode() for k in self._call(lambda: self._kv.list(keys), f"list {prefix}"))

    def delete(self, key: str) -> None:
        """Remove one object; a missing one is not an error (gc and a reader may race)."""
        key = _check_key(key)
        self._call(lambda: self._kv.write(key, None), f"delete {key}")

    def delete_prefix(self, prefix: str) -> None:
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix; it would delete the whole store")
        keys = _prefix_range(prefix)
        self._call(lambda: self._kv.delete_range(keys), f"delete_prefix {prefix}")


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


def _not_allowed(constant: str) -> Any:
    raise ValueError(f"{constant} is not a value a store object holds")


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):  # "1e400" parses to inf
        raise ValueError(f"{text[:40]} is not a finite number")
    return x


def loads_object(raw: bytes, where: str, finite: bool = True) -> Any:
    """One store object's JSON, nesting bounded; `finite`: NaN, Infinity and numbers that
    overflow to inf are refused too. Every failure is a ValueError naming `where`."""
    kw = dict(parse_constant=_not_allowed, parse_float=_finite) if finite else {}
    try:
        return loads_json(raw, _MAX_DEPTH, **kw)
    except ValueError as e:  # UnicodeDecodeError, a nesting too deep, an int of 5,000 digits too
        raise ValueError(f"{where}: not UTF-8 JSON ({e}): {bytes(raw[:80])!r}") from None


def read_json(store: BlobStore, key: str, finite: bool = True, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON object under `key`, None if there is none; ValueError naming the key if it is
    larger than `max_bytes` (then it is not read), or not JSON (see loads_object)."""
    try:
        raw = store.get(key, max_bytes)
    except TooLarge as e:
        raise ValueError(f"{store.url} {e}") from None
    return None if raw is None else loads_object(raw, f"{store.url} {key}", finite)


def _put_json(store: BlobStore, key: str, obj: Any) -> None:
    store.put(key, json.dumps(obj, separators=(",", ":"), sort_keys=True).encode())


def is_count(x: Any) -> bool:
    """A counter as store objects hold them (versions, seqs, steps): an int in [0, MAX_COUNT)."""
    return type(x) is int and 0 <= x < MAX_COUNT


# Contributions, learner -> syncer.

# What a reader passes on, unread, for a frame over its bound: a prefix declaring a header larger
# than messages.MAX_HEADER_BYTES, which messages.decode refuses as "too_large" right after the magic,
# so the syncer quarantines it by its own rule, and a replay of its input log does the same.
OVERSIZED = messages.MAGIC + struct.pack("<I", messages.MAX_HEADER_BYTES + 1)


def get_frame(store: BlobStore, key: str, max_bytes: int | None) -> bytes | None:
    """A frame object as stored (None if absent), or OVERSIZED, unread, if over `max_bytes`."""
    try:
        return store.get(key, max_bytes)
    except TooLarge:
        log.warning("%s %s: larger than %d bytes, the largest frame this run can make; not read, "
                    "passed on to be quarantined as too_large", store.url, key, max_bytes)
        return OVERSIZED


def send_contribution(store: BlobStore, learner: int, incarnation: int, seq: int, frame: bytes) -> str:
    """Write one contribution frame under its own key; returns the key."""
    key = contribution_key(learner, incarnation, seq)
    store.put(key, frame)
    return key


def poll_contributions(store: BlobStore, seen: set[str], limit: int | None = None,
                       max_bytes: int | None = None) -> list[tuple[str, bytes]]:
    """The contributions not in `seen`, sorted by key, i.e. by (learner, incarnation, seq); at most
    `limit` of them, to bound the memory one poll holds (the rest come on the next poll).

    Updates `seen` in place: adds what it returns and forgets keys no longer listed (deleted by
    gc; keys are never reused, so they cannot come back), which keeps `seen` bounded. Bytes are
    returned as stored, unvalidated: a corrupt object is the syncer's to quarantine, and one over
    `max_bytes` comes back as OVERSIZED without being read. A key deleted between list and get is
    skipped; keys under up/ not in this scheme are ignored.
    """
    listed = [k for k in store.list("up/") if _UP.match(k)]
    seen.intersection_update(listed)
    out = []
    for key in listed:
        if key in seen:
            continue
        if limit is not None and len(out) >= limit:
            break
        data = get_frame(store, key, max_bytes)
        if data is not None:
            out.append((key, data))
            seen.add(key)
    return out


def write_ack(store: BlobStore, learner: int, incarnation: int, seq: int) -> int:
    """Record that the syncer has taken in every contribution of (learner, incarnation) up to `seq`.
    Never lowers a stored ack (a syncer restored from an older checkpoint may repeat itself);
    returns the stored value. A malformed stored ack is overwritten: the syncer is its one writer.
    gc deletes no further than what the syncer itself delivered, whatever an ack says."""
    try:
        current = read_ack(store, learner, incarnation)
    except ValueError as e:
        log.warning("overwriting a malformed ack: %s", e)
        current = None
    if current is not None and current >= seq:
        return current
    _put_json(store, ack_key(learner, incarnation), {"seq": int(seq)})
    return int(seq)


def read_ack(store: BlobStore, learner: int, incarnation: int) -> int | None:
    """The stored ack, None if there is none; ValueError naming the key if it is malformed."""
    key = ack_key(learner, incarnation)
    obj = read_json(store, key)
    if obj is None:
        return None
    if not (isinstance(obj, dict) and is_count(obj.get("seq"))):
        raise ValueError(f"{store.url} {key}: want {{'seq': int in [0, 2**53)}}, got {str(obj)[:200]}")
    return obj["seq"]


# Broadcasts, syncer -> learners.

class Published(NamedTuple):
    version: int
    has_delta: bool
    merged: tuple[Key, ...]  # the contributions this version's merge took in


_FRAGMENT_ID = re.compile(r"0|[1-9][0-9]{0,8}")  # as publish writes them: canonical decimal


def parse_pointer(obj: Any, fragments: int | None, where: str = LATEST) -> dict[int, Published]:
    """The `down/latest` pointer's JSON as fragment -> Published; ValueError naming `where` unless
    every fragment id is one of the run's `fragments` (any, if None), every version a count >= 1,
    `delta` a bool and `merged` a list of [learner, incarnation, seq] counts (other keys are
    ignored, as in every store object: they name nothing a reader acts on)."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{where}: malformed pointer ({why}): {str(obj)[:200]}")

    if not (isinstance(obj, dict) and isinstance(obj.get("fragments"), dict)):
        raise bad("want {'fragments': {id: entry}}")
    out = {}
    for p, e in obj["fragments"].items():
        if not _FRAGMENT_ID.fullmatch(p) or (fragments is not None and int(p) >= fragments):
            raise bad(f"fragment id {p[:20]!r} is not one of the run's {fragments}")
        if not (isinstance(e, dict) and {"version", "delta", "merged"} <= set(e)):
            raise bad(f"fragment {p}: want the keys version, delta, merged")
        if not (is_count(e["version"]) and e["version"] >= 1) or type(e["delta"]) is not bool:
            raise bad(f"fragment {p}: version must be a count >= 1 and delta a bool")
        merged = e["merged"]
        if not (isinstance(merged, list)
                and all(isinstance(k, list) and len(k) == 3 and all(map(is_count, k)) for k in merged)):
            raise bad(f"fragment {p}: merged must be a list of [learner, incarnation, seq]")
        out[int(p)] = Published(e["version"], e["delta"], tuple(tuple(k) for k in merged))
    return out


def latest(store: BlobStore, fragments: int | None = None) -> dict[int, Published]:
    """fragment -> its newest published version, from the `down/latest` pointer ({} before any);
    ValueError naming the key if the pointer is malformed (see parse_pointer)."""
    obj = read_json(store, LATEST)
    return {} if obj is None else parse_pointer(obj, fragments, f"{store.url} {LATEST}")


def _rebuilt(store: BlobStore, fragments: int | None) -> dict[int, Published]:
    """A pointer from what the store lists: per fragment, the newest version with a full copy."""
    out: dict[int, Published] = {}
    keys = set(store.list("down/"))
    for key in sorted(keys):
        m = _DOWN.match(key)
        if m and m[3] == "full" and (fragments is None or int(m[1]) < fragments):
            p, v = int(m[1]), int(m[2])
            out[p] = Published(v, broadcast_key(p, v, "delta") in keys, ())
    return out


def latest_or_rebuilt(store: BlobStore, fragments: int | None = None) -> dict[int, Published]:
    """The pointer as its one writer (the syncer) reads it: a malformed one is logged and rebuilt
    from the listed full copies (their merged keys are lost; readers take those from the frames)."""
    try:
        return latest(store, fragments)
    except ValueError as e:
        pointer = _rebuilt(store, fragments)
        log.error("rebuilding a malformed pointer from the store's full copies (%s): %s",
                  {p: e.version for p, e in pointer.items()}, e)
        return pointer


def publish(store: BlobStore, fragment: int, version: int, delta_frame: bytes | None, full_frame: bytes,
            merged_keys: Iterable[Key] = (), fragments: int | None = None) -> dict[int, Published]:
    """Publish one merged fragment: its payload objects first, then the `down/latest` pointer.

    A reader that follows the pointer therefore always finds the objects it names. A publisher
    killed between the two leaves the old pointer and objects no reader is directed to; a retry of
    the same version replaces them (a stale delta is deleted when the retry has none), and gc
    reclaims them once the pointer passes them. The pointer is read-modify-written, so there must
    be one publisher (the syncer, one thread); a malformed one is rebuilt (latest_or_rebuilt).
    Returns the new pointer contents.
    """
    pointer = latest_or_rebuilt(store, fragments)
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


def fetch_fragment(store: BlobStore, fragment: int, version: int, want_full: bool,
                   max_bytes: int | None = None) -> bytes | None:
    """The full copy or the delta of one published version; None if absent (no delta was
    published, or gc removed it: a learner then falls back to the latest full copy); TooLarge,
    unread, if over `max_bytes`."""
    return store.get(broadcast_key(fragment, version, "full" if want_full else "delta"), max_bytes)


def full_versions(store: BlobStore, fragment: int) -> list[int]:
    """The versions of `fragment` whose full copy the store lists, ascending."""
    return sorted(int(m[2]) for k in store.list(f"down/{fragment:04d}/")
                  if (m := _DOWN.match(k)) and m[3] == "full")


def gc(store: BlobStore, keep_versions: int, delivered: Mapping[tuple[int, int], int]) -> list[str]:
    """Delete broadcasts older than each fragment's last `keep_versions` published versions, and
    contributions at or below both their (learner, incarnation)'s ack and `delivered`, the last
    seq the syncer itself took in of each. Returns the deleted keys.

    An ack is the syncer's own record in the store, and damage can raise it (one flipped digit);
    `delivered` bounds what gc may believe, so a contribution the syncer has not taken in is never
    deleted, and a malformed ack deletes nothing. Versions above the pointer (a publish in flight)
    are kept and do not count, so the version the pointer names always survives; a malformed
    pointer deletes no broadcast (the syncer's next publish rewrites it).
    """
    if keep_versions < 1:
        raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
    doomed = []
    try:
        pointer = latest(store)
    except ValueError as e:
        log.warning("gc keeps every broadcast: %s", e)
        pointer = {}
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
    bounds: dict[tuple[int, int], int] = {}
    for key in store.list("up/"):
        parsed = parse_contribution_key(key)
        if parsed is None:
            continue
        m, inc, seq = parsed
        if (m, inc) not in bounds:
            try:
                ack = read_ack(store, m, inc)
            except ValueError as e:
                log.warning("gc keeps every contribution of learner %d incarnation %d: %s", m, inc, e)
                ack = None
            bounds[(m, inc)] = -1 if ack is None else min(ack, delivered.get((m, inc), -1))
        if seq <= bounds[(m, inc)]:
            doomed.append(key)
    for key in doomed:
        store.delete(key)
    return sorted(doomed)


# Control and heartbeats: small JSON objects under ctl/, overwritten by their one writer.

def write_control(store: BlobStore, name: str, obj: Any) -> None:
    """E.g. write_control(store, "heartbeat/learner-0003", {"incarnation": 1, "step": 40, "t": now})."""
    _put_json(store, ctl_key(name), obj)


def read_control(store: BlobStore, name: str) -> Any:
    return read_json(store, ctl_key(name))


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
