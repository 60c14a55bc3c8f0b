"""Where a run's starting weights come from (docs/design.md#procs): a run's inputs read a
checkpoint's weights to host memory, never through a device; a procs child reads no weights and
draws no init, but takes Theta_0 from the store, where the supervisor wrote it before the run
control, and refuses a Theta_0 that is missing, damaged, or not the one the run control names."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import tiny_cfg
from test_finetune import make_cfg as ft_cfg
from test_finetune import write_files

from diloco import hf, inputs
from diloco import store as bs
from diloco.hf import convert
from diloco.runtime import build as build_setup
from diloco.runtime.procs import child, theta0


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_files(tmp_path_factory.mktemp("ft"))


def _supervisor(cfg) -> tuple[bs.BlobStore, build_setup.Setup]:
    """What a procs supervisor does before it spawns a child: its own inputs, Theta_0 and the run
    control in a fresh store."""
    cfg, corpus, model, _ = inputs.load_inputs(cfg)
    setup = build_setup.build(cfg, corpus, model)
    store = bs.BlobStore("memory://")
    theta0.publish(store, setup.theta0)
    bs.write_control(store, "run", {"theta0": theta0.fingerprint(setup.theta0), "learners": 2}, setup.policy.auth)
    return store, setup


def _same(a: tuple[dict, ...], b: tuple[dict, ...]) -> bool:
    return [sorted(f) for f in a] == [sorted(f) for f in b] and all(
        np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def _no_weights(monkeypatch):
    """Make reading a checkpoint's weights, or drawing a random init, fail the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a procs child read weights it should take from the store")

    monkeypatch.setattr(convert, "load_params", refuse)
    monkeypatch.setattr(inputs, "build", refuse)


@pytest.mark.parametrize("pretrained", [False, True])
def test_a_child_takes_theta0_from_the_store_and_reads_no_weights(files, tmp_path, monkeypatch, pretrained):
    cfg = ft_cfg(files, "run", algo="diloco", runtime=dict(kind="procs")) if pretrained else \
        tiny_cfg(tmp_path, "procs")
    store, setup = _supervisor(cfg)
    _no_weights(monkeypatch)
    mine = child.child_setup(cfg, store)
    assert _same(mine.theta0, setup.theta0) and mine.fragments == setup.fragments
    assert all(isinstance(x, np.ndarray) and x.dtype == np.float32 for f in mine.theta0 for x in f.values())
    assert sorted(store.list("init/")) == [bs.theta0_key(p) for p in range(len(setup.fragments))]


def test_a_missing_damaged_or_foreign_theta0_is_refused_naming_the_key(tmp_path):
    cfg = tiny_cfg(tmp_path, "procs")
    store, setup = _supervisor(cfg)
    key = bs.theta0_key(1)
    good = store.get(key)

    store.delete(key)
    with pytest.raises(theta0.Theta0Error, match=f"{key} is missing"):
        child.child_setup(cfg, store)
    store.put(key, good[: len(good) // 2])  # torn
    with pytest.raises(theta0.Theta0Error, match=f"{key} is unreadable"):
        child.child_setup(cfg, store)
    # another run's Theta_0 (another seed), well formed: the run control's fingerprint refuses it
    other, _ = _supervisor(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=cfg.run.seed + 1)))
    store.put(key, other.get(key))
    with pytest.raises(theta0.Theta0Error, match="the run control names"):
        child.child_setup(cfg, store)
    store.put(key, good)
    assert _same(child.child_setup(cfg, store).theta0, setup.theta0)


def test_publish_never_rewrites_a_theta0_the_store_holds(tmp_path):
    """A resumed run's supervisor publishes again: what its start wrote stays as it is."""
    cfg = tiny_cfg(tmp_path, "procs")
    store, setup = _supervisor(cfg)
    before = {k: store.get(k) for k in store.list("init/")}
    zeros = tuple({p: np.zeros_like(x) for p, x in f.items()} for f in setup.theta0)
    theta0.publish(store, zeros)
    assert {k: store.get(k) for k in store.list("init/")} == before


def test_a_checkpoint_is_read_to_host_memory_or_as_shapes_only(files):
    path = files / "ckpt"
    on_device = hf.load(path).model.params
    host = hf.load(path, shardings=hf.HOST).model.params
    shapes = hf.load(path, weights=False).model.params
    leaves = jax.tree_util.tree_leaves
    assert all(type(x) is np.ndarray for x in leaves(host))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves(shapes))
    assert jax.tree_util.tree_structure(host) == jax.tree_util.tree_structure(on_device)
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(leaves(on_device), leaves(host)))
    assert [(x.shape, x.dtype) for x in leaves(shapes)] == [(x.shape, x.dtype) for x in leaves(host)]
    # a run's inputs hold the checkpoint on the host, for each trainer to place in its own shardings
    cfg = ft_cfg(files, "run")
    assert all(type(x) is np.ndarray for x in leaves(inputs.load_inputs(cfg).model.params))


def test_shapes_only_still_checks_every_tensor(files, tmp_path):
    """weights=False reads no tensor, but a checkpoint that does not fit is refused all the same."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(files / "ckpt", bad)
    cfg_json = (bad / "config.json").read_text().replace('"intermediate_size": ', '"intermediate_size": 1')
    (bad / "config.json").write_text(cfg_json)
    with pytest.raises(hf.CheckpointError, match="does not fit"):
        hf.load(bad, weights=False)
