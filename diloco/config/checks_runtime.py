"""Checks of the runtime's subsections, store, auth, world and ray (docs/design.md#runtimes): each
returns the problems it finds, naming the offending values; diloco_errors in diloco/config/checks.py
calls them.
"""

from __future__ import annotations

import re

from diloco.config.schema_runtime import AuthConfig, RuntimeConfig, StoreConfig
from diloco.store import network

# runtime.world.address: "", host, :port, host:port or [v6]:port (groups: host, port).
WORLD_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]*)(?::([0-9]{1,5}))?")


# The one helper every check module uses, kept in this, the lowest of them, so that checks.py
# imports it without an import cycle.
def check(errors: list[str], ok: bool, message: str) -> None:
    if not ok:
        errors.append(message)


def store_errors(s: StoreConfig) -> list[str]:
    """runtime.store: the procs object store's URL and options (diloco/store/network.py's
    validators: they name the value, and never echo a password an endpoint should not hold)."""
    e: list[str] = []
    scheme = s.url.partition("://")[0] if "://" in s.url else ""
    try:
        network.split_options(s.url)
    except ValueError as err:
        e.append(f"runtime.store.url: {err}")
    for name, ok_schemes, validate in (("endpoint", ("s3",), network.check_endpoint),
                                       ("region", ("s3",), network.check_region)):
        value = getattr(s, name)
        if not value:
            continue
        try:
            validate(value, f"runtime.store.{name}")
        except ValueError as err:
            e.append(str(err))
        check(e, scheme in ok_schemes, f"runtime.store.{name} is set but runtime.store.url="
              f"{network.redacted(s.url)!r} is not an s3:// URL")
    try:
        network.check_retry_s(s.retry_s, "runtime.store.retry_s")
    except ValueError as err:
        e.append(str(err))
    return e


def auth_errors(a: AuthConfig) -> list[str]:
    """runtime.auth: the mode and where the run secret is read from."""
    e: list[str] = []
    check(e, a.mode in ("auto", "on", "off"), f"runtime.auth.mode={a.mode!r} not in auto|on|off")
    check(e, re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", a.secret_env) is not None,
          f"runtime.auth.secret_env={a.secret_env!r} is not an environment variable name")
    return e


def world_errors(r: RuntimeConfig) -> list[str]:
    """runtime.world, a learner of several processes (docs/multihost.md): its processes are started
    and restarted as one by the procs supervisor (their actors by the ray driver), each
    contributing an equal share of the learner's devices."""
    e: list[str] = []
    w = r.world
    P = w.processes_per_learner
    check(e, P >= 1, f"runtime.world.processes_per_learner={P} must be >= 1")
    check(e, P == 1 or r.kind in ("procs", "ray"),
          f"runtime.world.processes_per_learner={P} needs runtime.kind=procs or ray (got {r.kind!r})")
    check(e, 0 <= w.process_index < max(P, 1),
          f"runtime.world.process_index={w.process_index} must be in 0..{P - 1} "
          f"(runtime.world.processes_per_learner={P})")
    check(e, w.process_index == 0 or r.launch == "external",
          f"runtime.world.process_index={w.process_index} needs runtime.launch=external (scripts/learner.py): "
          "the procs supervisor starts every process of a learner itself")
    check(e, WORLD_ADDRESS.fullmatch(w.address) is not None,
          f"runtime.world.address={w.address!r} is not host, host:port or empty")
    check(e, P < 1 or r.devices_per_learner % P == 0,
          f"runtime.devices_per_learner={r.devices_per_learner} is not divisible by "
          f"runtime.world.processes_per_learner={P}: each process of a learner holds an equal share of its devices")
    check(e, w.heartbeat_s >= 1,
          f"runtime.world.heartbeat_s={w.heartbeat_s} must be >= 1 (the coordination service counts "
          "whole seconds)")
    return e


def ray_errors(r: RuntimeConfig) -> list[str]:
    """runtime.ray: the resources of the learners' bundles and the syncer's actor, and a TPU slice
    per learner."""
    e: list[str] = []
    y = r.ray
    for name in ("learner_resources", "syncer_resources"):
        res = getattr(y, name)
        check(e, all(isinstance(v, float) and v >= 0 for v in res.values()) and any(v > 0 for v in res.values()),
              f"runtime.ray.{name}={res} must map Ray resource names to amounts >= 0, at least one > 0")
    check(e, bool(y.tpu_topology) == bool(y.tpu_version),
          f"runtime.ray.tpu_topology={y.tpu_topology!r} and runtime.ray.tpu_version={y.tpu_version!r}: set both "
          "(a slice per learner, e.g. 4x4 and v6e) or neither")
    check(e, not y.tpu_topology or re.fullmatch(r"[0-9]+x[0-9]+(x[0-9]+)?", y.tpu_topology) is not None,
          f"runtime.ray.tpu_topology={y.tpu_topology!r} is not a TPU topology such as 2x2, 4x4 or 2x2x2")
    check(e, not y.tpu_topology or r.kind == "ray",
          f"runtime.ray.tpu_topology={y.tpu_topology!r} needs runtime.kind=ray (got {r.kind!r})")
    return e
