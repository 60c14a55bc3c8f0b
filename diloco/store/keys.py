"""Store keys: what a key may be (portable across file, GCS and S3), and the run's key layout.

Reference: docs/design.md#object-store-transport (the table of keys and their one writer).
Zero-padded ids make sorted keys sort by (learner, incarnation, seq) and by version, so a list is
a deterministic, ordered scan.
"""

from __future__ import annotations

import re

# A portable key: what GCS, S3 and every local filesystem accept alike, without "." / ".." parts.
_KEY = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")
_LOCK_SUFFIX = ".__lock"  # the file driver's temp name; such keys are invalid there
_PREFIX = re.compile(r"^([A-Za-z0-9_.-]+/)*[A-Za-z0-9_.-]*$")

LATEST = "down/latest"
Key = tuple[int, int, int]  # (learner, incarnation, seq), as messages.merged_keys
UP = re.compile(r"^up/(\d{4})/(\d{4})/(\d{12})$")
DOWN = re.compile(r"^down/(\d{4})/(\d{12})\.(delta|full)$")  # groups: fragment, version, kind


def check_key(key: str) -> str:
    parts = key.split("/")
    if not _KEY.match(key) or "." in parts or ".." in parts or key.endswith(_LOCK_SUFFIX):
        raise ValueError(f"bad blob key {key!r}: want '/'-separated [A-Za-z0-9_.-] parts, no '.' or '..', "
                         f"not ending in {_LOCK_SUFFIX!r}")
    return key


def check_prefix(prefix: str) -> str:
    """`prefix` if it can begin keys that check_key accepts; else ValueError naming it."""
    if not _PREFIX.match(prefix) or ".." in prefix.split("/"):
        raise ValueError(f"bad blob prefix {prefix!r}")
    return prefix


def theta0_key(fragment: int) -> str:
    """Fragment `fragment` of the run's Theta_0 (its full copy at version 0): written once, before
    the run starts, and never collected, so a learner starting at any time reads it there."""
    return f"init/{fragment:04d}.full"


def contribution_key(learner: int, incarnation: int, seq: int) -> str:
    return f"up/{learner:04d}/{incarnation:04d}/{seq:012d}"


def parse_contribution_key(key: str) -> Key | None:
    m = UP.match(key)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def broadcast_key(fragment: int, version: int, kind: str) -> str:
    assert kind in ("delta", "full"), kind
    return f"down/{fragment:04d}/{version:012d}.{kind}"


def ack_key(learner: int, incarnation: int) -> str:
    return f"ack/{learner:04d}/{incarnation:04d}"


def ctl_key(name: str) -> str:
    return check_key(f"ctl/{name}")
