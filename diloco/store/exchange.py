"""The run's traffic through the store: contributions up, acks, broadcasts and their pointer down, gc.

Reference: docs/design.md#object-store-transport. A learner writes each contribution under its own
key; the syncer takes them in, acks them, publishes each merged fragment's objects before the
`down/latest` pointer that names them, and deletes what no reader needs any more.
"""

from __future__ import annotations

import logging
import re
import struct
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from diloco.algo import auth, messages
from diloco.store.blobstore import BlobStore, TooLarge
from diloco.store.control import opened, put_sealed, read_sealed
from diloco.store.json_objects import is_count
from diloco.store.keys import (DOWN, LATEST, UP, Key, ack_key, broadcast_key, contribution_key,
                               parse_contribution_key)

log = logging.getLogger(__name__)


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
    listed = [k for k in store.list("up/") if UP.match(k)]
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


def _runtime(secret: auth.Secret | None) -> dict[str, bytes] | None:
    """The writers of the syncer's objects (acks, the pointer): the runtime's key, with a secret."""
    return None if secret is None else {"the runtime": secret.runtime_key()}


def write_ack(store: BlobStore, learner: int, incarnation: int, seq: int, secret: auth.Secret | None = None) -> int:
    """Record that the syncer has taken in every contribution of (learner, incarnation) up to `seq`,
    sealed under the runtime's key with the run `secret` (runtime.auth).
    Never lowers a stored ack (a syncer restored from an older checkpoint may repeat itself);
    returns the stored value. A malformed or unauthenticated stored ack is overwritten: the syncer
    is its one writer. gc deletes no further than what the syncer itself delivered, whatever an
    ack says."""
    try:
        current = read_ack(store, learner, incarnation, secret)
    except ValueError as e:
        log.warning("overwriting a malformed ack: %s", e)
        current = None
    if current is not None and current >= seq:
        return current
    put_sealed(store, ack_key(learner, incarnation), {"seq": int(seq)}, secret and secret.runtime_key())
    return int(seq)


def read_ack(store: BlobStore, learner: int, incarnation: int, secret: auth.Secret | None = None) -> int | None:
    """The stored ack, None if there is none; ValueError naming the key if it is malformed or, with
    the run `secret`, not sealed under the runtime's key."""
    key = ack_key(learner, incarnation)
    obj = read_sealed(store, key, _runtime(secret))
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


def latest(store: BlobStore, fragments: int | None = None, secret: auth.Secret | None = None) -> dict[int, Published]:
    """fragment -> its newest published version, from the `down/latest` pointer ({} before any);
    ValueError naming the key if the pointer is malformed (see parse_pointer) or, with the run
    `secret` (runtime.auth), not sealed under the runtime's key: a forger's pointer is never
    followed, nor does it make the syncer's next version look old."""
    obj = read_sealed(store, LATEST, _runtime(secret))
    return {} if obj is None else parse_pointer(obj, fragments, f"{store.url} {LATEST}")


def _rebuilt(store: BlobStore, fragments: int | None, secret: auth.Secret | None) -> dict[int, Published]:
    """A pointer from what the store lists: per fragment, the newest version with a full copy that,
    with the run `secret`, is sealed under the runtime's key (read to check it: a forger's full
    copies written ahead of the syncer's versions would otherwise make its next publish raise)."""
    keys = set(store.list("down/"))
    listed: dict[int, list[int]] = {}
    for key in keys:
        m = DOWN.match(key)
        if m and m[3] == "full" and (fragments is None or int(m[1]) < fragments):
            listed.setdefault(int(m[1]), []).append(int(m[2]))
    out: dict[int, Published] = {}
    for p, versions in sorted(listed.items()):
        for v in sorted(versions, reverse=True):
            try:
                if secret is not None and get_broadcast(store, broadcast_key(p, v, "full"), None, secret) is None:
                    continue  # collected since the listing
            except ValueError as e:
                log.error("pointer rebuild: %s is not the syncer's (%s); not taken", broadcast_key(p, v, "full"), e)
                continue
            out[p] = Published(v, broadcast_key(p, v, "delta") in keys, ())
            break
    return out


def latest_or_rebuilt(store: BlobStore, fragments: int | None = None,
                      secret: auth.Secret | None = None) -> dict[int, Published]:
    """The pointer as its one writer (the syncer) reads it: a malformed one is logged and rebuilt
    from the listed full copies (their merged keys are lost; readers take those from the frames)."""
    try:
        return latest(store, fragments, secret)
    except ValueError as e:
        pointer = _rebuilt(store, fragments, secret)
        log.error("rebuilding a malformed pointer from the store's full copies (%s): %s",
                  {p: e.version for p, e in pointer.items()}, e)
        return pointer


def publish(store: BlobStore, fragment: int, version: int, delta_frame: bytes | None, full_frame: bytes,
            merged_keys: Iterable[Key] = (), fragments: int | None = None,
            secret: auth.Secret | None = None) -> dict[int, Published]:
    """Publish one merged fragment: its payload objects first, then the `down/latest` pointer.

    A reader that follows the pointer therefore always finds the objects it names. A publisher
    killed between the two leaves the old pointer and objects no reader is directed to; a retry of
    the same version replaces them (a stale delta is deleted when the retry has none), and gc
    reclaims them once the pointer passes them. The pointer is read-modify-written, so there must
    be one publisher (the syncer, one thread); a malformed one is rebuilt (latest_or_rebuilt).
    Returns the new pointer contents.
    """
    pointer = latest_or_rebuilt(store, fragments, secret)
    if fragment in pointer and version <= pointer[fragment].version:
        raise ValueError(f"fragment {fragment}: version {version} is not newer than the published "
                         f"{pointer[fragment].version}; objects are never overwritten")
    def put(kind: str, frame: bytes) -> None:  # sealed under the runtime's key (diloco/algo/auth.py)
        key = broadcast_key(fragment, version, kind)
        store.put(key, frame if secret is None else auth.seal(secret.runtime_key(), key, frame))

    if delta_frame is not None:
        put("delta", delta_frame)
    else:
        store.delete(broadcast_key(fragment, version, "delta"))
    put("full", full_frame)
    merged = tuple(sorted({tuple(int(x) for x in k) for k in merged_keys}))
    pointer[fragment] = Published(version, delta_frame is not None, merged)
    obj = {"fragments": {str(p): {"version": e.version, "delta": e.has_delta, "merged": [list(k) for k in e.merged]}
                         for p, e in sorted(pointer.items())}}
    put_sealed(store, LATEST, obj, secret and secret.runtime_key())  # diloco/store/control.py
    return pointer


def get_broadcast(store: BlobStore, key: str, max_bytes: int | None, secret: auth.Secret | None) -> bytes | None:
    """The frame of broadcast object `key`; None if absent; TooLarge, unread, if its frame would be
    over `max_bytes`; ValueError if, with the run `secret` (runtime.auth), it is not sealed under
    the runtime's key (forged, damaged, or moved from another key)."""
    raw = store.get(key, None if max_bytes is None else max_bytes + auth.MAC_HEX + 1)
    return None if raw is None else opened(raw, key, _runtime(secret))


def fetch_fragment(store: BlobStore, fragment: int, version: int, want_full: bool,
                   max_bytes: int | None = None, secret: auth.Secret | None = None) -> bytes | None:
    """The full copy or the delta of one published version; None if absent (no delta was
    published, or gc removed it: a learner then falls back to the latest full copy); TooLarge,
    unread, if over `max_bytes`; ValueError if not sealed under the run `secret`'s runtime key."""
    return get_broadcast(store, broadcast_key(fragment, version, "full" if want_full else "delta"), max_bytes, secret)


def full_versions(store: BlobStore, fragment: int) -> list[int]:
    """The versions of `fragment` whose full copy the store lists, ascending."""
    return sorted(int(m[2]) for k in store.list(f"down/{fragment:04d}/")
                  if (m := DOWN.match(k)) and m[3] == "full")


def gc(store: BlobStore, keep_versions: int, delivered: Mapping[tuple[int, int], int],
       secret: auth.Secret | None = None) -> list[str]:
    """Delete broadcasts older than each fragment's last `keep_versions` published versions, and
    contributions at or below both their (learner, incarnation)'s ack and `delivered`, the last
    seq the syncer itself took in of each. Returns the deleted keys.

    An ack is the syncer's own record in the store, and damage can raise it (one flipped digit);
    `delivered` bounds what gc may believe, so a contribution the syncer has not taken in is never
    deleted, and a malformed ack deletes nothing. Versions above the pointer (a publish in flight)
    are kept and do not count, so the version the pointer names always survives; a malformed
    pointer, or one not sealed under the run `secret`, deletes no broadcast (the syncer's next
    publish rewrites it), and such an ack deletes no contribution.
    """
    if keep_versions < 1:
        raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
    doomed = []
    try:
        pointer = latest(store, None, secret)
    except ValueError as e:
        log.warning("gc keeps every broadcast: %s", e)
        pointer = {}
    by_fragment: dict[int, list[tuple[int, str]]] = {}
    for key in store.list("down/"):
        m = DOWN.match(key)
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
                ack = read_ack(store, m, inc, secret)
            except ValueError as e:
                log.warning("gc keeps every contribution of learner %d incarnation %d: %s", m, inc, e)
                ack = None
            bounds[(m, inc)] = -1 if ack is None else min(ack, delivered.get((m, inc), -1))
        if seq <= bounds[(m, inc)]:
            doomed.append(key)
    for key in doomed:
        store.delete(key)
    return sorted(doomed)
