"""Device meshes and shardings for one trainer: batch over (data, fsdp), parameters over fsdp.

A Decoupled DiLoCo learner is an ordinary SPMD trainer on its own sub-mesh (docs/algorithm.md#roles),
so the same helpers build the baseline trainer's mesh and each learner's.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from diloco.config.checks import mesh_errors
from diloco.config import ConfigError, MeshConfig

AXES = ("data", "fsdp")


def make_mesh(cfg: MeshConfig, batch_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp) mesh over `devices` (default: the first cfg.devices visible ones)."""
    visible = list(devices) if devices is not None else jax.devices()
    errors = mesh_errors(cfg, batch_size, len(visible))
    if errors:
        raise ConfigError("invalid mesh:\n  " + "\n  ".join(errors))
    n = cfg.devices or len(visible)
    data = cfg.data if cfg.data > 0 else n // cfg.fsdp
    return Mesh(np.array(visible[:n]).reshape(data, cfg.fsdp), AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch rows are split over every device: FSDP is data parallel for activations."""
    return NamedSharding(mesh, P(AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def leaf_spec(shape: tuple[int, ...], fsdp: int) -> P:
    """Shard the largest dimension divisible by the fsdp axis size; replicate otherwise."""
    if fsdp <= 1 or not shape:
        return P()
    candidates = [(size, -i) for i, size in enumerate(shape) if size % fsdp == 0]
    if not candidates:
        return P()
    dim = -max(candidates)[1]
    return P(*[("fsdp" if i == dim else None) for i in range(len(shape))])


def tree_shardings(mesh: Mesh, tree):
    """Shardings for params, optimizer state or a whole TrainState, decided per leaf by shape.

    Adam moments have the shapes of their parameters, so they land on the same devices.
    """
    fsdp = mesh.shape["fsdp"]
    return jax.tree.map(lambda x: NamedSharding(mesh, leaf_spec(tuple(x.shape), fsdp)), tree)
