"""Which devices each learner runs on: a rule over the visible device list, kept pure so it can be
tested with fake devices and predicted by whoever lays out a cluster (docs/pathways.md#which-devices-a-learner-gets).

Three cases, tried in order:

* One learner per process (procs, ray) and the process sees exactly `per_learner` devices: a
  host or Ray actor given only its own accelerators. Every learner id maps to all of them, since
  this process runs one learner and which one is not a device question.
* The devices carry `slice_index` and name more than one slice (TPU multislice, e.g. one
  single-controller Pathways client): learners are cut from each slice separately, slices in
  slice_index order, so no learner spans two slices. Slices are joined only by the data-centre
  network; a learner's all-reduce over it would be the lock-step coupling DiLoCo exists to avoid.
* Otherwise the list in order: learner m takes devices[m*D:(m+1)*D], as it always has.
"""

from __future__ import annotations

from typing import Any, Sequence

from diloco.config import ConfigError


def slices(devices: Sequence[Any]) -> list[tuple[int, tuple[Any, ...]]] | None:
    """(slice_index, its devices in the given order) for each slice, in slice_index order; None
    unless every device names a slice (CPU and GPU devices have no slice_index)."""
    index = [getattr(d, "slice_index", None) for d in devices]
    if not devices or any(not isinstance(s, int) for s in index):
        return None
    return [(s, tuple(d for d, i in zip(devices, index) if i == s)) for s in sorted(set(index))]


def _describe(groups: list[tuple[int, tuple[Any, ...]]]) -> str:
    sizes = {len(ds) for _, ds in groups}
    if len(sizes) == 1:
        return f"{len(groups)} slices of {sizes.pop()} devices"
    return f"{len(groups)} slices (" + ", ".join(f"slice {s}: {len(ds)} devices" for s, ds in groups) + ")"


def learner_devices(devices: Sequence[Any], learners: int, per_learner: int, *,
                    one_per_process: bool = False) -> list[tuple[Any, ...]]:
    """Learner m's devices for m in 0..learners-1, by the rule in this module's docstring.

    `one_per_process`: this process runs a single learner (procs, ray), so seeing exactly
    `per_learner` devices means they are that learner's. ConfigError, naming the numbers, when
    the learners do not fit.
    """
    devices = tuple(devices)
    D, M = per_learner, learners
    groups = slices(devices)
    if one_per_process and len(devices) == D:
        if groups is not None and len(groups) > 1:
            raise ConfigError(f"this process sees runtime.devices_per_learner={D} devices, but they lie in "
                              f"{_describe(groups)}: a learner's devices must lie inside one slice")
        return [devices] * M
    if groups is None or len(groups) == 1:
        if M * D > len(devices):
            raise ConfigError(f"runtime.learners={M} x runtime.devices_per_learner={D} = {M * D} devices, "
                              f"but only {len(devices)} are visible")
        return [devices[m * D:(m + 1) * D] for m in range(M)]
    largest = max(len(ds) for _, ds in groups)
    if D > largest:
        raise ConfigError(f"runtime.devices_per_learner={D} is more than a slice holds ({_describe(groups)}): "
                          f"a learner's devices must lie inside one slice, so devices_per_learner can be at "
                          f"most {largest}")
    blocks = [ds[k * D:(k + 1) * D] for _, ds in groups for k in range(len(ds) // D)]
    if M > len(blocks):
        raise ConfigError(f"runtime.learners={M} learners of runtime.devices_per_learner={D} do not fit in "
                          f"{_describe(groups)}: inside slices there is room for {len(blocks)} (a learner "
                          f"never spans two slices); lower runtime.learners or runtime.devices_per_learner")
    return blocks[:M]
