"""Control objects: small JSON objects under `ctl/` (start time, readiness, deaths, heartbeats, who
runs where), each overwritten by its one writer.

Reference: docs/design.md#object-store-transport, docs/design.md#damage-in-the-store.

With runtime.auth on, every control object is sealed like learners' events (diloco/algo/auth.py
seal): a tag over the key and the body under its writer's key, the run's own processes'
(supervisor, syncer) or the learner's (`signers`). A reader holding the secret refuses one that
does not verify (ValueError, as for a malformed one), so someone who can write the store but holds
no key cannot start the clock, bury a live learner, tell a successor where its predecessor
stopped, name another Theta_0, finish the run or fail a learner with a forged traceback.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from diloco.algo import auth
from diloco.store.blobstore import BlobStore, TooLarge
from diloco.store.json_objects import MAX_JSON_BYTES, loads_object, put_json
from diloco.store.keys import ctl_key

log = logging.getLogger(__name__)
_HEX = re.compile(rb"^[0-9a-f]{%d}$" % auth.MAC_HEX)
# Names a learner's key may seal (group 1: the learner); the runtime's key seals every other name,
# and exit notices too (a successor started apart writes its predecessor's).
_LEARNERS = (re.compile(r"^ready/(\d{4})$"), re.compile(r"^claim/(\d{4})$"),  # readiness, a claim started apart
             re.compile(r"^world/(\d{4})/\d{4}/\d{3}$"),  # a follower's join record (standalone.joined)
             re.compile(r"^error/learner-(\d{4})-\d{4}(?:-p\d+)?$"),  # its traceback (child.child_main)
             re.compile(r"^ignored/(\d{4})/\d{4}$"),  # what it ignored (procs/child.py note_ignored)
             re.compile(r"^died/(\d{4})/\d{4}$"))
_LEARNERS_ONLY = ("ready/", "claim/", "world/", "error/learner-", "ignored/")


def signers(secret: auth.Secret, name: str) -> dict[str, bytes]:
    """Who may write control object `name` (writer -> key): the runtime, learner m for names of
    learner m (only m for its readiness, claim, join records and errors)."""
    found = next((f for r in _LEARNERS if (f := r.match(name))), None)
    keys = {} if found is not None and name.startswith(_LEARNERS_ONLY) else {"the runtime": secret.runtime_key()}
    if found is not None:
        keys[f"learner {int(found[1])}"] = secret.learner_key(int(found[1]))
    return keys


def learner_of(name: str) -> int | None:
    """The learner whose key seals control object `name` when that learner writes it; None for the
    runtime's names."""
    found = next((f for r in _LEARNERS if (f := r.match(name))), None)
    return None if found is None else int(found[1])


def put_sealed(store: BlobStore, key: str, obj: Any, seal_key: bytes | None) -> None:
    """JSON object `obj` under store key `key`, sealed under `seal_key` (plain JSON if None)."""
    if seal_key is None:
        put_json(store, key, obj)
        return
    data = json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()
    store.put(key, auth.seal(seal_key, key, data))


def read_sealed(store: BlobStore, key: str, keys: dict[str, bytes] | None, finite: bool = True) -> Any:
    """The JSON object under store key `key`, None if there is none; ValueError naming the key if
    it is malformed or, `keys` given (writer -> key), sealed under none of them (see `opened`)."""
    try:
        raw = store.get(key, MAX_JSON_BYTES + auth.MAC_HEX + 1)
    except TooLarge as e:
        raise ValueError(f"{store.url} {e}") from None
    if raw is None:
        return None
    return loads_object(opened(raw, key, keys), f"{store.url} {key}", finite)


def write_control(store: BlobStore, name: str, obj: Any, secret: auth.Secret | None = None,
                  learner: int | None = None) -> None:
    """E.g. write_control(store, "procs", {"supervisor": 4242, ...}, secret). Sealed when `secret`
    is given: under learner `learner`'s key, else the runtime's; plain JSON without one."""
    seal_key = None if secret is None else secret.runtime_key() if learner is None else secret.learner_key(learner)
    put_sealed(store, ctl_key(name), obj, seal_key)


def read_control(store: BlobStore, name: str, secret: auth.Secret | None = None) -> Any:
    """The object, None if there is none; ValueError naming the key if it is malformed or, `secret`
    given, if its tag verifies under none of its writers' keys (`signers`). Without a secret a
    tag is dropped unchecked (a run with authentication off, or a tool)."""
    return read_sealed(store, ctl_key(name), None if secret is None else signers(secret, name))


def opened(raw: bytes, key: str, keys: dict[str, bytes] | None) -> bytes:
    """The data of an object stored under `key`, sealed under one of `keys` (writer -> key; else
    ValueError). keys None (no secret: authentication off, or a tool): a tag, if any, is dropped
    unchecked."""
    if keys is not None:
        return auth.unseal_by(keys, key, raw)
    if raw[auth.MAC_HEX:auth.MAC_HEX + 1] == b" " and _HEX.match(raw[:auth.MAC_HEX]):
        return raw[auth.MAC_HEX + 1:]
    return raw


def read_trusted(store: BlobStore, name: str, secret: auth.Secret | None, ignored: dict | None = None,
                 fields: Mapping[str, type | tuple[type, ...]] | None = None) -> Any:
    """read_control, with an unauthenticated or malformed object (not JSON, or not a dict whose
    `fields` have their types) taken as absent (the real one may land on its key later), logged
    once per name and counted in `ignored` (name -> why). It is read again at the next call."""
    try:
        obj = read_control(store, name, secret)
        if obj is not None and fields and not (isinstance(obj, dict) and all(
                isinstance(obj.get(f), t) for f, t in fields.items())):
            raise ValueError(f"ctl/{name}: not an object with {', '.join(fields)}: {str(obj)[:100]}")
        return obj
    except ValueError as e:
        if ignored is not None and name not in ignored:
            log.error("control object %s ignored: %s", name, e)
            ignored[name] = str(e)[:200]
        return None


def keep_control(store: BlobStore, name: str, obj: Any, secret: auth.Secret | None, ignored: dict | None = None,
                 learner: int | None = None) -> bool:
    """Write control object `name` again if it no longer reads back as `obj` (damaged, or a forger's
    written over it), as its writer does for every object another process waits for: whether it
    was written (docs/design.md#damage-in-the-store)."""
    if read_trusted(store, name, secret, ignored) == obj:
        return False
    log.error("ctl/%s in the store is not the one written; writing it again", name)
    write_control(store, name, obj, secret, learner)
    return True


def list_control(store: BlobStore, prefix: str = "") -> list[str]:
    """Names (without "ctl/") of the control objects under `prefix`, sorted."""
    return [k[len("ctl/"):] for k in store.list(f"ctl/{prefix}")]
