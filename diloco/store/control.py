"""Control objects: small JSON objects under `ctl/` (start time, readiness, deaths, heartbeats, who
runs where), each overwritten by its one writer.

Reference: docs/design.md#object-store-transport.
"""

from __future__ import annotations

from typing import Any

from diloco.store.blobstore import BlobStore
from diloco.store.json_objects import put_json, read_json
from diloco.store.keys import ctl_key


def write_control(store: BlobStore, name: str, obj: Any) -> None:
    """E.g. write_control(store, "heartbeat/learner-0003", {"incarnation": 1, "step": 40, "t": now})."""
    put_json(store, ctl_key(name), obj)


def read_control(store: BlobStore, name: str) -> Any:
    return read_json(store, ctl_key(name))


def list_control(store: BlobStore, prefix: str = "") -> list[str]:
    """Names (without "ctl/") of the control objects under `prefix`, sorted."""
    return [k[len("ctl/"):] for k in store.list(f"ctl/{prefix}")]

