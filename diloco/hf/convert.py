"""Apply a family's table: checkpoint tensors -> sharded params (checked first), params -> tensors.

Reference: the abstract-model-then-fill pattern of JAX model libraries (an `nnx.eval_shape`
target, one mapping table per family; docs/models.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from diloco.config import ModelConfig
from diloco.hf.families import Family, expand, strip_prefix
from diloco.hf.source import CheckpointError, TensorSource
from diloco.model import Params, abstract_params


def _flat(tree: Params) -> dict[str, Any]:
    return {".".join(k.key for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _nest(flat: dict[str, Any]) -> Params:
    out: dict = {}
    for path, leaf in flat.items():
        node = out
        *parents, last = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return out


# load_params(shardings=HOST): numpy arrays on the host, on no device. A run's inputs are read so
# (diloco/inputs.py): each trainer or learner then places them straight into its own shardings,
# instead of every weight passing through the first device on its way (docs/design.md#fine-tuning).
HOST = "host"


def _sharding_for(shardings: Any, path: str):
    if shardings is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        return shardings
    return _flat(shardings)[path]


def problems(source: TensorSource, family: Family, cfg: ModelConfig, vocab: int) -> list[str]:
    """Every missing, unexpected or misshapen tensor, each naming its file; [] when it all fits."""
    shapes = {p: tuple(a.shape) for p, a in _flat(abstract_params(cfg, vocab)).items()}
    in_file = strip_prefix(source.keys(), family)
    rows = expand(family, cfg)
    out = []
    for hf, ours, transform in rows:
        if hf not in in_file:
            out.append(f"missing tensor {hf} (for {', '.join(ours)})")
            continue
        want = tuple(transform.hf_shape(tuple(shapes[p] for p in ours)))
        got = tuple(source.shape(in_file[hf]))
        if got != want:
            out.append(f"{source.where(in_file[hf])}: {hf} has shape {list(got)}, the config implies {list(want)}")
    claimed = {hf for hf, _, _ in rows}
    for canonical, key in in_file.items():
        if canonical in claimed or key.endswith(family.ignored):
            continue
        if canonical == "lm_head.weight" and cfg.tie_embeddings:
            continue  # some files keep a copy of the tied head; `load_params` checks it is one
        out.append(f"{source.where(key)}: unexpected tensor {key}")
    return out


def check_fits(source: TensorSource, family: Family, cfg: ModelConfig, vocab: int) -> None:
    """CheckpointError listing every problem (see `problems`) unless the checkpoint fits."""
    found = problems(source, family, cfg, vocab)
    if found:
        raise CheckpointError(f"checkpoint does not fit the {family.name} config "
                              f"({len(found)} problem(s)):\n  " + "\n  ".join(found))


def load_params(source: TensorSource, family: Family, cfg: ModelConfig, vocab: int,
                shardings: Any = None) -> Params:
    """Fill the model's params from `source`, one tensor on the host at a time, each placed with its
    sharding as it is read (a NamedSharding pytree like the params, one Sharding, or None for the
    first device, or HOST for numpy arrays on none). Raises CheckpointError listing every problem
    before anything is read."""
    check_fits(source, family, cfg, vocab)
    in_file = strip_prefix(source.keys(), family)
    flat: dict[str, jax.Array] = {}
    for hf, ours, transform in expand(family, cfg):
        host = source.read(in_file[hf])
        if not np.all(np.isfinite(host)):
            raise CheckpointError(f"{source.where(in_file[hf])}: {hf} holds non-finite values")
        for path, part in zip(ours, transform.to_ours(host)):
            part = np.asarray(part, np.float32)
            if shardings is HOST:
                flat[path] = part
                continue
            # Each device receives only its own slice: no full copy per device.
            flat[path] = jax.make_array_from_callback(part.shape, _sharding_for(shardings, path),
                                                      lambda index, part=part: part[index])
        del host
    if cfg.tie_embeddings and "lm_head.weight" in in_file:
        head = source.read(in_file["lm_head.weight"])
        if not np.array_equal(head, np.asarray(flat["embed.embedding"])):
            raise CheckpointError(f"{source.where(in_file['lm_head.weight'])}: lm_head.weight differs from "
                                  "the embedding, but the config ties them (tie_word_embeddings)")
    return _nest(flat)


def export_tensors(family: Family, cfg: ModelConfig, params: Params) -> Iterator[tuple[str, np.ndarray]]:
    """(HF key, float32 host array) for every tensor the family's checkpoint holds, one at a time."""
    flat = _flat(params)
    for hf, ours, transform in expand(family, cfg):
        yield hf, transform.to_hf(tuple(np.asarray(jax.device_get(flat[p]), np.float32) for p in ours))
