"""Learner authentication: a per-run secret, one key per learner derived from it, and an HMAC-SHA256
tag over every contribution frame (docs/algorithm.md#authenticated-learners).

Without it anyone who can put bytes where the syncer reads them (the object store of procs, a
cluster's network) can claim to be any learner: one forged frame with incarnation + 1 or seq 2**62
would make every later frame of the real learner `dead_incarnation` or `duplicate`. With it, a
frame whose tag does not verify under its claimed learner's key is quarantined `unauthenticated`
before the syncer believes anything its header says.

Keys: key_m = HMAC-SHA256(secret, "diloco/learner/<m>"), so the syncer, holding the secret, checks
every learner, and a host given only key_m (a learner on another machine) can sign as m alone.
The tag covers the header (canonical JSON, the tag itself left out) and the whole payload.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any

MAC_FIELD = "mac"
MAC_HEX = 64  # SHA-256, as hex
MIN_SECRET_BYTES = 16


class Secret:
    """The run secret. Never printed: repr, str and the run's logs show only that one is set."""

    __slots__ = ("_raw",)

    def __init__(self, raw: bytes):
        if len(raw) < MIN_SECRET_BYTES:
            raise ValueError(f"an authentication secret needs at least {MIN_SECRET_BYTES} bytes, got {len(raw)}")
        self._raw = bytes(raw)

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and hmac.compare_digest(self._raw, other._raw)

    def __hash__(self) -> int:
        return hash(("Secret", hashlib.sha256(self._raw).digest()))

    def learner_key(self, learner: int) -> bytes:
        return hmac.new(self._raw, f"diloco/learner/{int(learner)}".encode(), hashlib.sha256).digest()

    def runtime_key(self) -> bytes:
        """The key of the run's own processes (supervisor, syncer): what they write to the store's
        control objects is sealed under it, so no learner key signs as them."""
        return hmac.new(self._raw, b"diloco/runtime", hashlib.sha256).digest()


def _canonical(header: Mapping[str, Any]) -> bytes:
    """The header as signed: sorted keys, no spaces, the tag left out. Headers hold only ints,
    strings, null and lists of them (messages.validate_header), so parsing and dumping again gives
    back exactly these bytes."""
    rest = {k: v for k, v in header.items() if k != MAC_FIELD}
    return json.dumps(rest, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")


def tag(key: bytes, header: Mapping[str, Any], payload: bytes) -> str:
    h = hmac.new(key, _canonical(header), hashlib.sha256)
    h.update(len(payload).to_bytes(8, "little"))  # the boundary between header and payload is signed
    h.update(payload)
    return h.hexdigest()


def verify(secret: Secret, header: Mapping[str, Any], payload: bytes) -> str:
    """Why the frame's tag does not prove it comes from its claimed learner, or "" if it does."""
    got = header.get(MAC_FIELD)
    if got is None:
        return "no mac: this run authenticates learners (runtime.auth)"
    if not isinstance(got, str) or len(got) != MAC_HEX:
        return f"mac must be {MAC_HEX} hex characters"
    want = tag(secret.learner_key(header["learner"]), header, payload)
    if not hmac.compare_digest(got.encode("ascii", "replace"), want.encode("ascii")):
        return f"mac does not verify under learner {header['learner']}'s key"
    return ""


# Objects other than frames that a learner writes where the syncer reads them (procs' event blobs)
# are sealed the same way: the tag covers the object's store key too, so a real event cannot be
# copied to another position of the stream or another learner's.
def seal(key: bytes, name: str, data: bytes) -> bytes:
    """`data`, stored under `name`, prefixed with its tag and a space."""
    return _blob_tag(key, name, data).encode("ascii") + b" " + bytes(data)


def unseal(secret: Secret, learner: int, name: str, blob: bytes) -> bytes:
    """The data of a sealed object of `learner` stored under `name`; ValueError if its tag does not
    verify (forged, damaged, moved, or written without a key)."""
    return unseal_by({f"learner {learner}": secret.learner_key(learner)}, name, blob)


def unseal_by(keys: Mapping[str, bytes], name: str, blob: bytes) -> bytes:
    """The data of an object sealed under any one of `keys` (its writers: name -> key) stored under
    `name`; ValueError, naming the writers tried, if its tag verifies under none."""
    tag_, data = blob[:MAC_HEX], blob[MAC_HEX + 1:]
    ok = len(blob) > MAC_HEX and blob[MAC_HEX:MAC_HEX + 1] == b" "
    if ok and any(hmac.compare_digest(tag_, _blob_tag(k, name, data).encode("ascii")) for k in keys.values()):
        return data
    raise ValueError(f"{name}: its tag does not verify under the key of {' or '.join(keys)} (unauthenticated)")


def _blob_tag(key: bytes, name: str, data: bytes) -> str:
    h = hmac.new(key, b"diloco/object\0" + name.encode("utf-8") + b"\0", hashlib.sha256)
    h.update(data)
    return h.hexdigest()
