"""The runtimes' pieces implement the named interfaces (diloco/runtime/interfaces.py), so a new
runtime can be written against them: every launcher is a Launcher, whatever it starts a Child."""

import multiprocessing as mp

import pytest

from diloco import store as bs
from diloco.runtime import interfaces as api
from diloco.runtime.procs.launch import Local
from diloco.runtime.procs.launchers import launcher_for
from diloco.runtime.procs.learner import ProcLearner
from diloco.runtime.procs.standalone import External
from diloco.runtime.threads.learners import _ThreadPort
from diloco.runtime.world_group import WorldGroup


def test_concrete_pieces_satisfy_the_protocols(tmp_path):
    store = bs.BlobStore(f"file://{tmp_path / 'store'}")
    assert isinstance(store, api.BlobStore)
    for port in (ProcLearner, _ThreadPort):  # the two ports of the one wall-clock learner loop
        assert all(callable(getattr(port, name, None))
                   for name in ("clock", "poll", "wait", "emit", "check", "log")), port


def test_every_launcher_is_a_launcher_and_starts_children():
    assert isinstance(Local(), api.Launcher) and isinstance(External(), api.Launcher)
    assert Local.starts_learners and not External.starts_learners
    assert isinstance(mp.get_context("spawn").Process(), api.Child)
    assert isinstance(WorldGroup(print, (), 2), api.Child)
    with pytest.raises(AssertionError, match="started apart"):
        External().spawn_learner(0, 0, False)


def test_the_config_picks_the_launcher():
    from diloco.config import RuntimeConfig, TrainConfig
    procs = TrainConfig(runtime=RuntimeConfig(kind="procs"))
    assert type(launcher_for(procs)) is Local
    apart = TrainConfig(runtime=RuntimeConfig(kind="procs", launch="external"))
    assert type(launcher_for(apart)) is External


def test_the_ray_launcher_is_a_launcher_and_its_calls_are_children():
    ray_runtime = pytest.importorskip("diloco.runtime.ray_runtime")
    from diloco.config import RuntimeConfig, TrainConfig
    launcher = launcher_for(TrainConfig(runtime=RuntimeConfig(kind="ray")))
    assert type(launcher) is ray_runtime.RayLauncher and isinstance(launcher, api.Launcher)
    for child in (ray_runtime.RayChild, ray_runtime.RayWorld):
        assert all(hasattr(child, name) for name in ("exitcode", "terminate", "kill", "join")), child
