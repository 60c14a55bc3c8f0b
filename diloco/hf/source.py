"""Where a checkpoint's tensors come from: one small read-only interface over safetensors and GGUF.

Both readers present tensors under Hugging Face transformers' key names and in its (PyTorch)
layout, so one mapping table per model family (diloco/hf/families.py) serves every file format.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from diloco.pretrained import CheckpointError  # noqa: F401 (defined with the name rule, importable from here)


class TensorSource(Protocol):
    """Read-only, lazy view of a checkpoint's tensors: nothing is read until `read(key)`."""

    def keys(self) -> list[str]:
        """Every tensor key, in HF naming (e.g. 'model.layers.0.self_attn.q_proj.weight')."""

    def shape(self, key: str) -> tuple[int, ...]:
        """The tensor's shape in HF (PyTorch) layout, without reading its data."""

    def dtype(self, key: str) -> str:
        """The stored dtype as the file names it ('BF16', 'F32', 'Q4_1', ...)."""

    def where(self, key: str) -> str:
        """The file holding `key`, for error messages."""

    def read(self, key: str) -> np.ndarray:
        """The tensor as a float32 host array in HF layout (upcast or dequantized)."""
