"""Token arrays on disk: 1-D zarr v3 arrays with zstd chunks, written through tensorstore.

Reference: the zarr v3 specification (https://zarr-specs.readthedocs.io/en/latest/v3/core/v3.0.html).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tensorstore as ts

# 1 Mi tokens (2 MiB as uint16) per chunk: few files for a corpus, little waste for a tiny one.
CHUNK_TOKENS = 1 << 20
ZSTD_LEVEL = 3


def token_dtype(vocab_size: int) -> str:
    """Narrowest unsigned dtype that holds every id below vocab_size."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def write_tokens(path: Path, ids: np.ndarray, vocab_size: int) -> None:
    """Create a new zarr3 array at `path` holding `ids` (all in [0, vocab_size))."""
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids span [{ids.min()}, {ids.max()}], outside vocab_size={vocab_size}")
    dtype = token_dtype(vocab_size)
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(path)},
        "metadata": {
            "shape": [int(ids.size)],
            "data_type": dtype,
            "chunk_grid": {"name": "regular",
                           "configuration": {"chunk_shape": [max(1, min(CHUNK_TOKENS, ids.size))]}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                       {"name": "zstd", "configuration": {"level": ZSTD_LEVEL}}],
        },
        "create": True,
    }
    store = ts.open(spec).result()
    store.write(ids.astype(dtype)).result()


def read_tokens(path: Path) -> np.ndarray:
    """The whole array at `path`, as int32 in memory."""
    store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)},
                     "open": True}).result()
    return np.asarray(store.read().result()).astype(np.int32)


def build_atomically(final: Path, build: Callable[[Path], None]) -> None:
    """Run `build(tmp)` in a fresh sibling directory, then rename it to `final`.

    A rename within one filesystem is atomic, so a crash or a Ctrl-C mid-build leaves at most a
    hidden temporary directory, never a half-written `final` that a later run would trust.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished the same build first; its result is equivalent, keep it.
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
