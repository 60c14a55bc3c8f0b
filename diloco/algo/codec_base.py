"""What every wire codec shares: the Codec type, its errors, and input checks (see codecs.py)."""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import numpy as np

CodecState = Any
# The block formats' code rules (codecs._Format.kind; the loops are codec_kernels.py's)
INT, FP4, TWO_BIT = 0, 1, 2


class CodecError(ValueError):
    """A payload or input the codec refuses: wrong length, corrupt frame, non-finite values."""


class NonFiniteError(CodecError):
    """NaN or Inf in the values to encode or in a decoded payload (a poisoned contribution)."""


class Codec(NamedTuple):
    """A wire format as pure functions, shaped like an optax transformation.

    init(shape) -> per-tensor state (() when stateless); encode(x, state) -> (payload, state);
    decode(payload, shape) -> float32 array; payload_bytes(shape) -> exact size, None for zstd.
    """

    name: str
    init: Callable[[tuple[int, ...]], CodecState]
    encode: Callable[[np.ndarray, CodecState], tuple[bytes, CodecState]]
    decode: Callable[[bytes, tuple[int, ...]], np.ndarray]
    payload_bytes: Callable[[tuple[int, ...]], int | None]


def stateless(shape: tuple[int, ...]) -> CodecState:
    return ()  # stateless codecs; error_feedback's state wraps this


def numel(shape: tuple[int, ...]) -> int:
    # Shapes come from message headers on the decode side, so a bad one is a malformed message.
    shape = tuple(shape)
    if not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
        raise CodecError(f"shape must be a tuple of non-negative ints, got {shape!r}")
    return math.prod(shape)


def flat_f32(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).reshape(-1)


def require_finite(ok: bool, name: str) -> None:
    # Non-finite pseudo-gradients are rejected, not encoded: the syncer quarantines the message.
    if not ok:
        raise NonFiniteError(f"{name}: non-finite values (nan or inf) cannot be encoded or decoded")


def buffer(payload: bytes, expected: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    buf = np.frombuffer(payload, dtype=np.uint8)
    if buf.size != expected:
        raise CodecError(f"{name}: payload is {buf.size} bytes, shape {tuple(shape)} needs {expected}")
    return buf
