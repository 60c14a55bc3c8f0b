"""A fragment's payload: its tensors encoded in sorted path order, one codec payload each, and
decoded and checked against the shapes the receiver expects (docs/design.md#messages).

The payload of a fragment is the concatenation, in header order, of each tensor's codec payload;
`tensors[i].nbytes` says where one ends. Tensors are float32 on the wire whatever the codec:
decoding and merging happen in FP32 (docs/algorithm.md#codecs). Every fault is a
messages.MessageError with one of messages.PAYLOAD_REASONS.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from diloco.algo import hostpool
from diloco.algo.codec_specs import codec_from_spec
from diloco.algo.codecs import Codec, CodecError, NonFiniteError
from diloco.algo.messages import MessageError

Path = tuple[str, ...]
DTYPES = ("float32",)  # the wire dtype; codecs decode to float32 and merges run in FP32


def pack_fragment(
    values: Mapping[Path, Any], codec: Codec, states: Mapping[Path, Any] | None = None,
) -> tuple[list[dict[str, Any]], bytes, dict[Path, Any]]:
    """Encode a fragment's tensors, in sorted path order (the order of Fragment.paths).

    `states` holds each tensor's codec state (error-feedback residual); a missing one starts from
    codec.init. Returns the header's tensors list, the payload and the new states.
    """
    states = {} if states is None else states
    tensors, chunks, new_states = [], [], {}
    for path in sorted(values):
        x = np.asarray(values[path])
        if not np.issubdtype(x.dtype, np.floating):
            raise TypeError(f"{path}: only floating tensors travel as fragments, got {x.dtype}")
        x = x.astype(np.float32, copy=False)  # lossless from bf16/f16; the wire dtype is float32
        state = states[path] if path in states else codec.init(x.shape)
        chunk, new_states[path] = codec.encode(x, state)
        chunks.append(chunk)
        tensors.append({"path": list(path), "shape": list(x.shape), "dtype": "float32", "nbytes": len(chunk)})
    return tensors, b"".join(chunks), new_states


def unpack_fragment(
    header: Mapping[str, Any], payload: bytes, codec: Codec | None,
    expected: Mapping[Path, tuple[Iterable[int], Any]],
) -> dict[Path, np.ndarray]:
    """Decode and check a fragment's tensors against `expected` {path: (shape, dtype)}.

    `codec=None` decodes with the codec the header names; a given codec must match the header's
    spec (compared through codec_from_spec, since the wire names the codec by its spec).
    """
    named = codec_from_spec(header["codec"])
    if codec is None:
        codec = named
    elif _decoder_name(codec.name) != _decoder_name(named.name):
        raise MessageError("wrong_codec", f"header codec {header['codec']!r}, receiver decodes {codec.name!r}")
    _check_paths(header, expected)
    # Checked in tensor order, the first fault raised, as a loop would; the decodes themselves
    # run concurrently (zstd and the block kernels release the GIL; hostpool.py).
    jobs, fault, offset = [], None, 0
    for t in header["tensors"]:
        path, shape = tuple(t["path"]), tuple(t["shape"])
        fault = _tensor_fault(t, expected)
        if fault is not None:
            break
        jobs.append((path, shape, payload[offset:offset + t["nbytes"]]))
        offset += t["nbytes"]
    decoded = hostpool.run([lambda job=job: _decode_one(codec, *job) for job in jobs], len(payload) >= hostpool.CHUNK)
    out: dict[Path, np.ndarray] = {}
    for (path, _, _), x in zip(jobs, decoded):
        if isinstance(x, MessageError):
            raise x
        # Finite already: every codec refuses non-finite values on decode (NonFiniteError), so a
        # second pass over the values here would only cost time (docs/algorithm.md#codecs).
        out[path] = x
    if fault is not None:
        raise fault
    if offset != len(payload):
        raise MessageError("codec_error", f"tensors cover {offset} bytes of a {len(payload)}-byte payload")
    return out


def _decode_one(codec: Codec, path: Path, shape: tuple, chunk: bytes) -> np.ndarray | MessageError:
    """One tensor decoded and checked, or the MessageError saying why not."""
    try:
        x = np.asarray(codec.decode(chunk, shape))
    except CodecError as e:
        return MessageError("non_finite" if isinstance(e, NonFiniteError) else "codec_error", f"{path}: {e}")
    if x.shape != shape or x.dtype != np.float32:
        return MessageError("codec_error", f"{path}: decoded {x.dtype}{list(x.shape)}, want float32{list(shape)}")
    return x


def _check_paths(header: Mapping[str, Any], expected: Mapping[Path, Any]) -> None:
    got = {tuple(t["path"]) for t in header["tensors"]}
    if got != set(expected):
        missing, extra = sorted(set(expected) - got), sorted(got - set(expected))
        raise MessageError("wrong_shape", f"missing tensors {missing}, unexpected tensors {extra}")


def _tensor_fault(t: Mapping[str, Any], expected: Mapping[Path, tuple[Iterable[int], Any]]) -> MessageError | None:
    """Why a header's tensor entry does not match what the receiver expects, or None."""
    path, shape = tuple(t["path"]), tuple(t["shape"])
    want_shape, want_dtype = expected[path]
    if shape != tuple(want_shape):
        return MessageError("wrong_shape", f"{path}: header shape {shape}, expected {tuple(want_shape)}")
    if t["dtype"] not in DTYPES or np.dtype(want_dtype) != np.dtype(t["dtype"]):
        return MessageError("wrong_dtype", f"{path}: header dtype {t['dtype']}, expected {np.dtype(want_dtype)}")
    return None


def tensor_layout(header: Mapping[str, Any], expected: Mapping[Path, tuple[Iterable[int], Any]]
                  ) -> list[tuple[Path, tuple[int, ...]]]:
    """Each tensor's (path, shape) in payload order, checked against `expected` {path: (shape,
    dtype)} as unpack_fragment checks them: for a receiver that decodes the payload elsewhere
    (a learner's devices, diloco/algo/device_codecs.py)."""
    _check_paths(header, expected)
    for t in header["tensors"]:
        fault = _tensor_fault(t, expected)
        if fault is not None:
            raise fault
    return [(tuple(t["path"]), tuple(t["shape"])) for t in header["tensors"]]


def _decoder_name(name: str) -> str:
    """A codec's name without its error_feedback(...) wrapper, which changes encode but not decode."""
    start = name.find("error_feedback(")
    if start < 0:
        return name
    i, depth = start + len("error_feedback("), 1
    inner = i
    while depth:
        depth += {"(": 1, ")": -1}.get(name[i], 0)
        i += 1
    return name[:start] + name[inner:i - 1] + name[i:]
