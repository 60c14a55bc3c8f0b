"""Where the ray runtime's learners run: each learner's processes in a placement group of its own,
so that a learner fails alone (docs/cluster.md#ray). The group is either P bundles of
runtime.ray.learner_resources, or with runtime.ray.tpu_topology one whole TPU slice reserved through
ray.util.tpu (docs/cluster.md#tpu-slices-on-ray).

Why a slice through ray.util.tpu: the hosts of a multi-host slice are one interconnect, so a
learner's world must have exactly one process on every host of one slice, never hosts of two
slices. Ray's SlicePlacementGroup does that in two steps: it reserves the slice's head resource
(`TPU-<pod type>-head`, on the slice's worker 0) to learn the slice's name, then places one bundle
per host under the label selector `ray.io/tpu-slice-name` of that slice. Each learner makes its own
(the guide's `pg_per_slice` idea, one group per slice), so two learners never share one.

A restarted actor is placed again in its own group: a learner whose slice lost a host waits for
that slice to come back, as the slice's hosts are the only ones with its label.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from diloco.config import ConfigError, RuntimeConfig


class Placement(NamedTuple):
    group: Any  # the learner's placement group
    bundle: dict[str, float]  # the resources of each bundle: what its actor asks for
    release: Callable[[], None]  # gives the group (and a slice's head reservation) back


def actor_options(resources: dict[str, float]) -> dict:
    """Ray's actor options for a bundle of resources {"CPU": 2, "GPU": 1, "TPU": 4, ...}."""
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    return {"num_cpus": resources.get("CPU", 0.0), "num_gpus": resources.get("GPU", 0.0), "resources": custom}


def slice_shape(r: RuntimeConfig) -> tuple[int, dict[str, float]]:
    """(hosts, each host's bundle) of one slice of runtime.ray.tpu_topology and tpu_version, with
    runtime.ray.learner_resources added to each bundle (a TPU entry there overrides the chips per host).
    ConfigError unless the learner's world fits it: one process per host, the slice's TPU devices
    the learner's devices."""
    from ray.util import tpu

    try:
        hosts, bundle = tpu.get_tpu_worker_resources(r.ray.tpu_topology, r.ray.tpu_version, dict(r.ray.learner_resources))
    except ValueError as e:  # an unknown generation, or chips that do not divide into hosts
        raise ConfigError(f"runtime.ray.tpu_topology={r.ray.tpu_topology} of runtime.ray.tpu_version={r.ray.tpu_version}: {e}") from None
    if hosts != r.world.processes_per_learner:
        raise ConfigError(f"a {r.ray.tpu_version} slice of {r.ray.tpu_topology} has {hosts} host(s): set "
                          f"runtime.world.processes_per_learner={hosts} (got {r.world.processes_per_learner}), one process per host")
    devices = hosts * int(bundle["TPU"])
    if devices != r.devices_per_learner:
        raise ConfigError(f"a {r.ray.tpu_version} slice of {r.ray.tpu_topology} holds {devices} TPU devices ({hosts} host(s) x "
                          f"{int(bundle['TPU'])}): set runtime.devices_per_learner={devices} "
                          f"(got {r.devices_per_learner})")
    return hosts, bundle


def learner_placement(r: RuntimeConfig, m: int, name: str, timeout_s: float) -> Placement:
    """Learner m's placement group (named `name`), ready; ConfigError naming the cluster's
    resources if the cluster cannot place it within `timeout_s`. A slice's shape is checked
    (slice_shape) before Ray starts, not here."""
    P = r.world.processes_per_learner
    if r.ray.tpu_topology:
        from ray.util.tpu import SlicePlacementGroup

        what = f"a {r.ray.tpu_version} slice of {r.ray.tpu_topology} (runtime.ray.tpu_topology)"
        try:
            # SPREAD, Ray's choice for a slice: one bundle per host of the slice.
            handle = SlicePlacementGroup(r.ray.tpu_topology, r.ray.tpu_version, resources_per_bundle=dict(r.ray.learner_resources),
                                         strategy="SPREAD", name=name, head_reservation_timeout_s=timeout_s)
        except ValueError as e:  # checked before anything is reserved
            raise ConfigError(f"runtime.ray.tpu_topology={r.ray.tpu_topology} of runtime.ray.tpu_version={r.ray.tpu_version}: {e}") from None
        except (TimeoutError, RuntimeError) as e:  # no free slice head, or a slice without its name
            raise ConfigError(f"the Ray cluster could not reserve {what} for learner {m} in {timeout_s:.0f} s: {e}; "
                              f"it has {ray.cluster_resources()}") from None
        group, bundle, release = handle.placement_group, handle.bundle_resources, handle.shutdown
    else:
        bundle = dict(r.ray.learner_resources)
        what = f"bundle {bundle}" if P == 1 else f"{P} bundles {bundle}"
        # A world's processes on as few nodes as hold their bundles (PACK): one node if it can,
        # else across nodes, a bundle being what one of its hosts offers (docs/multihost.md#ray).
        group = placement_group([bundle] * P, strategy="STRICT_PACK" if P == 1 else "PACK", name=name)
        release = lambda: remove_placement_group(group)  # noqa: E731
    if not ray.wait([group.ready()], timeout=timeout_s)[0]:
        release()
        raise ConfigError(f"the Ray cluster could not place learner {m}'s {what} in {timeout_s:.0f} s "
                          f"(runtime.ray.learner_resources); it has {ray.cluster_resources()}")
    return Placement(group, bundle, release)
