"""Which devices each learner gets (diloco/runtime/placement.py, docs/pathways.md#which-devices-a-learner-gets):
inside one slice on multislice hardware, a process's own devices when it sees only one learner's,
and the old index arithmetic everywhere else."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import pytest

from diloco.config import ConfigError, DataConfig, RuntimeConfig, TrainConfig
from diloco.runtime import build
from diloco.runtime.placement import learner_devices, slices


@dataclass(frozen=True)
class TPU:
    """What the rule reads of a multislice TPU device."""
    id: int
    slice_index: int
    platform: str = "tpu"


@dataclass(frozen=True)
class CPU:
    """A device without slice_index, as CPU and GPU devices are."""
    id: int
    platform: str = "cpu"


def two_slices():
    """2 slices of 4 devices, listed alternately, so a rule that cut the list in order would put
    every learner across both."""
    return [TPU(i, i % 2) for i in range(8)]


def test_two_slices_two_learners_get_a_slice_each():
    devs = two_slices()
    got = learner_devices(devs, 2, 4)
    assert [{d.slice_index for d in g} for g in got] == [{0}, {1}]
    assert [[d.id for d in g] for g in got] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_two_learners_per_slice_in_slice_order():
    got = learner_devices(two_slices(), 4, 2)
    assert [[d.id for d in g] for g in got] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert [g[0].slice_index for g in got] == [0, 0, 1, 1]
    # Fewer learners than room: the first sub-meshes in slice order, so slice 1 stays idle.
    assert [[d.id for d in g] for g in learner_devices(two_slices(), 2, 2)] == [[0, 2], [4, 6]]


def test_slices_are_ordered_by_slice_index_not_by_list_position():
    devs = [TPU(i, 1 - i // 2) for i in range(4)]  # slice 1 is listed first
    assert [[d.id for d in g] for g in learner_devices(devs, 2, 2)] == [[2, 3], [0, 1]]
    assert [s for s, _ in slices(devs)] == [0, 1]


def test_learners_that_do_not_fit_inside_slices_are_a_config_error():
    with pytest.raises(ConfigError, match=r"runtime.learners=3 learners of runtime.devices_per_learner=4 do not "
                                          r"fit in 2 slices of 4 devices: inside slices there is room for 2"):
        learner_devices(two_slices(), 3, 4)
    # 8 devices are visible, but a learner of 8 would span the two slices.
    with pytest.raises(ConfigError, match=r"devices_per_learner=8 is more than a slice holds \(2 slices of 4 "
                                          r"devices\).*at most 4"):
        learner_devices(two_slices(), 1, 8)
    # 3 devices a slice hold one learner of 2 each (one device idle): 6 devices, room for 2, not 3.
    with pytest.raises(ConfigError, match="room for 2"):
        learner_devices([TPU(i, i // 3) for i in range(6)], 3, 2)
    with pytest.raises(ConfigError, match=r"3 slices \(slice 0: 4 devices, slice 1: 4 devices, slice 2: 2 devices\)"):
        learner_devices([TPU(i, min(i // 4, 2)) for i in range(10)], 6, 2)


def test_one_slice_or_no_slice_index_keeps_the_index_arithmetic():
    for devs in ([CPU(i) for i in range(8)], [TPU(i, 0) for i in range(8)]):
        got = learner_devices(devs, 4, 2)
        assert got == [tuple(devs[2 * m:2 * m + 2]) for m in range(4)]
        assert learner_devices(devs, 3, 2) == got[:3]  # leftover devices stay unused, as before
    with pytest.raises(ConfigError, match=r"runtime.learners=4 x runtime.devices_per_learner=2 = 8 devices, "
                                          r"but only 6 are visible"):
        learner_devices([CPU(i) for i in range(6)], 4, 2)


def test_a_process_that_sees_only_its_own_devices_uses_them_whatever_learner_it_runs():
    own = [CPU(6), CPU(7)]  # a host or Ray actor given learner m's two accelerators, for any m
    assert learner_devices(own, 4, 2, one_per_process=True) == [tuple(own)] * 4
    slice1 = [TPU(5, 1), TPU(7, 1)]
    assert learner_devices(slice1, 4, 2, one_per_process=True) == [tuple(slice1)] * 4
    # In one process (threads) M learners need M disjoint sub-meshes: two devices are not enough.
    with pytest.raises(ConfigError, match="only 2 are visible"):
        learner_devices(own, 4, 2)
    with pytest.raises(ConfigError, match="lie in 2 slices of 1 devices: a learner's devices must lie inside one"):
        learner_devices([TPU(0, 0), TPU(1, 1)], 4, 2, one_per_process=True)
    # Seeing every learner's devices, a process cuts learner m's out as any other would.
    every = [CPU(i) for i in range(8)]
    assert learner_devices(every, 4, 2, one_per_process=True) == learner_devices(every, 4, 2)


def cfg_of(kind: str, learners: int, per_learner: int) -> TrainConfig:
    return TrainConfig(algo="diloco", data=DataConfig(batch_size=8),
                       runtime=RuntimeConfig(kind=kind, learners=learners, devices_per_learner=per_learner))


def mesh_devices(meshes) -> list[list[int]]:
    return [[d.id for d in m.devices.flat] for m in meshes]


def test_learner_meshes_on_cpu_devices_are_unchanged():
    """The real CPU devices have no slice_index: learner m's sub-mesh is devices[2m:2m+2] (the
    golden runs depend on it), sim's one shared sub-mesh the first two."""
    assert jax.device_count() == 8 and not hasattr(jax.devices()[0], "slice_index")
    ids = [d.id for d in jax.devices()]
    for kind in ("threads", "procs"):
        assert mesh_devices(build.learner_meshes(cfg_of(kind, 4, 2))) == [ids[2 * m:2 * m + 2] for m in range(4)]
    assert mesh_devices(build.learner_meshes(cfg_of("sim", 4, 2))) == [ids[:2]]


def test_a_procs_learner_process_that_sees_two_devices_builds_on_them(monkeypatch):
    """A procs learner process (child_setup -> build.build -> learner_meshes) on a host that shows
    it only devices 6 and 7 runs any learner there; threads, one process, still needs all 8."""
    own = jax.devices()[6:]
    monkeypatch.setattr(jax, "devices", lambda *a: list(own))
    meshes = build.learner_meshes(cfg_of("procs", 4, 2))
    assert mesh_devices(meshes) == [[own[0].id, own[1].id]] * 4
    build.check_devices(cfg_of("ray", 4, 2))
    with pytest.raises(ConfigError, match=r"runtime.learners=4 x runtime.devices_per_learner=2 = 8 devices, but "
                                          r"only 2 are visible \(on CPU set XLA_FLAGS"):
        build.check_devices(cfg_of("threads", 4, 2))


def test_build_lays_learners_out_by_slice(monkeypatch):
    """check_devices sees the slice rule too, so a run that cannot fit fails before it starts."""
    monkeypatch.setattr(jax, "devices", lambda *a: two_slices())
    assert [[d.id for d in g] for g in build.learner_device_lists(cfg_of("threads", 4, 2), jax.devices())] == \
        [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert [[d.id for d in g] for g in build.learner_device_lists(cfg_of("sim", 4, 2), jax.devices())] == [[0, 2]]
    # 8 devices are enough by count, but a learner of 8 would span both slices.
    with pytest.raises(ConfigError, match="devices_per_learner=8 is more than a slice holds"):
        build.check_devices(cfg_of("threads", 1, 8))
