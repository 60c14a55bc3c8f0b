"""Hugging Face checkpoint folders: one model.safetensors or a sharded index, read lazily, written back.

Reference: the safetensors format and `model.safetensors.index.json` layout,
https://huggingface.co/docs/safetensors and transformers' `save_pretrained`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from diloco.hf.source import CheckpointError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _open(path: Path):
    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from err


class SafetensorsFolder:
    """TensorSource over a checkpoint folder; every file's header is checked on opening."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise CheckpointError(f"{index}: not a safetensors index ({err})") from err
        elif (self.folder / SINGLE).exists():
            weight_map = None
        else:
            raise CheckpointError(f"{self.folder}: no {SINGLE} or {INDEX}")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        self._shape: dict[str, tuple[int, ...]] = {}
        self._dtype: dict[str, str] = {}
        self._file: dict[str, Path] = {}
        problems = []
        for name in files:
            path = self.folder / name
            if not path.exists():
                problems.append(f"{path}: listed in {INDEX} but missing")
                continue
            with _open(path) as f:
                for key in f.keys():
                    piece = f.get_slice(key)
                    self._shape[key], self._dtype[key] = tuple(piece.get_shape()), piece.get_dtype()
                    self._file[key] = path
        for key, name in (weight_map or {}).items():
            if self._file.get(key, self.folder / name) != self.folder / name:
                problems.append(f"{index}: {key} is listed in {name} but stored in {self._file[key].name}")
            elif key not in self._file and (self.folder / name).exists():
                problems.append(f"{self.folder / name}: has no tensor {key} (listed in {INDEX})")
        if problems:
            raise CheckpointError("damaged checkpoint:\n  " + "\n  ".join(problems))

    def keys(self) -> list[str]:
        return list(self._file)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shape[key]

    def dtype(self, key: str) -> str:
        return self._dtype[key]

    def where(self, key: str) -> str:
        return str(self._file[key])

    def read(self, key: str) -> np.ndarray:
        with _open(self._file[key]) as f:
            try:
                return np.asarray(f.get_tensor(key), dtype=np.float32)
            except SafetensorError as err:
                raise CheckpointError(f"{self._file[key]}: tensor {key} unreadable ({err})") from err


def _umask() -> int:
    """The process's umask (reading it means setting it; 0o022 for the instant between)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write(folder: Path, tensors: Iterable[tuple[str, np.ndarray]], dtype: str,
          max_shard_bytes: int = 0) -> list[Path]:
    """Write (key, float array) pairs as `dtype`; above max_shard_bytes (0: never) into numbered
    shards with an index, the names transformers' save_pretrained uses. Each shard is written as
    soon as it is full, so the host holds at most one shard."""
    if dtype not in DTYPES:
        raise CheckpointError(f"export dtype {dtype!r} not in {'|'.join(DTYPES)}")
    meta = {"format": "pt"}  # transformers refuses files without a known format tag
    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, np.ndarray] = {}
    total = 0

    def flush():
        path = folder / f".shard-{len(written)}.tmp"
        save_file(shard, str(path), metadata=meta)
        os.chmod(path, 0o666 & ~_umask())  # safetensors creates it 0600; an export is a user's file
        written.append((path, list(shard)))
        shard.clear()

    for key, array in tensors:
        array = np.ascontiguousarray(array.astype(DTYPES[dtype]))
        if max_shard_bytes and shard and sum(a.nbytes for a in shard.values()) + array.nbytes > max_shard_bytes:
            flush()
        shard[key] = array
        total += array.nbytes
    flush()
    if len(written) == 1:
        written[0][0].rename(folder / SINGLE)
        return [folder / SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(written):05d}.safetensors" for i in range(len(written))]
    for name, (path, _) in zip(names, written):
        path.rename(folder / name)
    index = {"metadata": {"total_size": total},
             "weight_map": {k: name for name, (_, keys) in zip(names, written) for k in keys}}
    (folder / INDEX).write_text(json.dumps(index, indent=2))
    return [folder / n for n in names]
