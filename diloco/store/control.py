"""Control objects: small JSON objects under `ctl/` (start time, readiness, deaths, heartbeats, who
runs where), each overwritten by its one writer.

Reference: docs/design.md#object-store-transport, docs/design.md#damage-in-the-store.

With runtime.auth on, the objects a runtime acts on (SEALED: the start of the clock, readiness,
exit notices, burials) are sealed like learners' events (diloco/algo/auth.py seal): a tag over the
key and the body under the writer's key, the run's own processes' (supervisor, syncer) or the
learner's. A reader holding the secret refuses one that does not verify (ValueError, as for a
malformed one), so someone who can write the store but holds no key cannot start the clock, bury
a live learner or tell a successor where its predecessor stopped.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from diloco.algo import auth
from diloco.store.blobstore import BlobStore, TooLarge
from diloco.store.json_objects import MAX_JSON_BYTES, loads_object, put_json, read_json
from diloco.store.keys import ctl_key

log = logging.getLogger(__name__)
_HEX = re.compile(rb"^[0-9a-f]{%d}$" % auth.MAC_HEX)
# name -> the learner whose key may seal it (group 1), or none: only the runtime's key.
SEALED = (re.compile(r"^start$"), re.compile(r"^buried/\d{4}/\d{4}$"), re.compile(r"^ready/(\d{4})$"),
          re.compile(r"^died/(\d{4})/\d{4}$"),  # a successor started apart writes its predecessor's
          re.compile(r"^claim/(\d{4})$"))  # a learner started apart claims its incarnation
_LEARNERS_ONLY = ("ready/", "claim/")


def _sealed(name: str) -> re.Match | None:
    return next((found for r in SEALED if (found := r.match(name))), None)


def signers(secret: auth.Secret, name: str) -> dict[str, bytes]:
    """Who may write control object `name` (writer -> key); {} if it is not sealed."""
    found = _sealed(name)
    if found is None:
        return {}
    keys = {} if name.startswith(_LEARNERS_ONLY) else {"the runtime": secret.runtime_key()}
    if found.groups():
        m = int(found[1])
        keys[f"learner {m}"] = secret.learner_key(m)
    return keys


def write_control(store: BlobStore, name: str, obj: Any, secret: auth.Secret | None = None,
                  learner: int | None = None) -> None:
    """E.g. write_control(store, "heartbeat/learner-0003", {"incarnation": 1, "step": 40, "t": now}).
    A SEALED name is sealed when `secret` is given: under learner `learner`'s key, else the runtime's."""
    if secret is None or _sealed(name) is None:
        put_json(store, ctl_key(name), obj)
        return
    key = secret.runtime_key() if learner is None else secret.learner_key(learner)
    data = json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()
    store.put(ctl_key(name), auth.seal(key, ctl_key(name), data))


def read_control(store: BlobStore, name: str, secret: auth.Secret | None = None) -> Any:
    """The object, None if there is none; ValueError naming the key if it is malformed or, `secret`
    given and `name` SEALED, if its tag verifies under none of its writers' keys. Without a secret a
    sealed object's tag is dropped unchecked (a run with authentication off, or a tool)."""
    if _sealed(name) is None:
        return read_json(store, ctl_key(name))
    key = ctl_key(name)
    try:
        raw = store.get(key, MAX_JSON_BYTES + auth.MAC_HEX + 1)
    except TooLarge as e:
        raise ValueError(f"{store.url} {e}") from None
    if raw is None:
        return None
    return loads_object(opened(raw, key, None if secret is None else signers(secret, name)), f"{store.url} {key}")


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


def list_control(store: BlobStore, prefix: str = "") -> list[str]:
    """Names (without "ctl/") of the control objects under `prefix`, sorted."""
    return [k[len("ctl/"):] for k in store.list(f"ctl/{prefix}")]
