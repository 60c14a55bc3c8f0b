"""Options that moved, old key -> new key, and the rewriting of the two places an old key still
arrives: a command-line override, and a plain config dict (a saved run's config.yaml that a resume
or a study reads). Each rewrite prints one deprecation line on stderr naming the new key."""

from __future__ import annotations

import sys
from typing import Any

# The runtime's flat options before it had sections (issue 31). runtime.auth was the mode itself,
# a string: only a string there is the old key (a mapping is the new section).
MOVED = {
    "runtime.store_url": "runtime.store.url",
    "runtime.store_endpoint": "runtime.store.endpoint",
    "runtime.store_region": "runtime.store.region",
    "runtime.store_retry_s": "runtime.store.retry_s",
    "runtime.auth": "runtime.auth.mode",
    "runtime.auth_secret_env": "runtime.auth.secret_env",
    "runtime.auth_secret_file": "runtime.auth.secret_file",
    "runtime.processes_per_learner": "runtime.world.processes_per_learner",
    "runtime.world_heartbeat_s": "runtime.world.heartbeat_s",
    "runtime.process_index": "runtime.world.process_index",
    "runtime.world_address": "runtime.world.address",
    "runtime.ray_address": "runtime.ray.address",
    "runtime.learner_resources": "runtime.ray.learner_resources",
    "runtime.syncer_resources": "runtime.ray.syncer_resources",
    "runtime.tpu_topology": "runtime.ray.tpu_topology",
    "runtime.tpu_version": "runtime.ray.tpu_version",
}


def _notice(old: str, new: str) -> None:
    print(f"warning: {old} is deprecated, use {new}", file=sys.stderr)


def overrides(args: list[str]) -> list[str]:
    """Command-line overrides with each old key (`runtime.store_url=...`, `+runtime.auth=off`)
    renamed to its new key; other arguments unchanged."""
    out = []
    for arg in args:
        key, eq, value = arg.partition("=")
        plus = "+" if key.startswith("+") else ""
        new = MOVED.get(key.lstrip("+")) if eq else None
        if new:
            _notice(key.lstrip("+"), new)
            arg = f"{plus}{new}={value}"
        out.append(arg)
    return out


def upgraded(raw: Any, path: str = "") -> Any:
    """Plain config data at dotted `path` ("" = a whole TrainConfig, "runtime" = its runtime
    section) with each old key found in it, at any depth, moved to its new key; `raw` is not changed."""
    if not isinstance(raw, dict):
        return raw
    out = {k: upgraded(v, f"{path}.{k}" if path else k) for k, v in raw.items()}
    prefix = f"{path}." if path else ""
    for old, new in MOVED.items():
        if not old.startswith(prefix) or "." in old[len(prefix):]:
            continue
        leaf, (*parents, last) = old[len(prefix):], new[len(prefix):].split(".")
        if leaf not in out or (leaf == parents[0] and isinstance(out[leaf], dict)):  # absent, or the new section
            continue
        _notice(old, new)
        value = out.pop(leaf)
        node = out
        for name in parents:
            node[name] = dict(node.get(name) or {})
            node = node[name]
        node[last] = value
    return out
