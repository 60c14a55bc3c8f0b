"""Codec specs: the string a frame's header names its codec by ("int4+ef+zstd1", "topk+k0.05"), one
spelling per codec, parsed with every fault the sender's (docs/design.md#messages), and the
bound on a fragment's payload at a spec's rate.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable
from typing import Any

from diloco.algo.codecs import Codec, CodecError, make_codec
from diloco.algo.messages import MessageError

MAX_SPEC_CHARS = 64  # "int4+ef+zstd22+b4096+k0.0001" is 28

# Digit counts are bounded so int() never sees thousands of digits; a block above MAX_BLOCK is refused
# by the codec itself, before it allocates anything.
_SPEC_PART = re.compile(r"^(ef|zstd([0-9]{1,3})|b([0-9]{1,12})|k([0-9.eE+-]{1,32})|c([0-9]{1,12})|t([0-9]{1,12}))$")
_DEFAULT_BLOCK, _DEFAULT_TOPK, _DEFAULT_CHUNK, _DEFAULT_CHUNK_K = 64, 0.01, 4096, 32


def codec_spec(name: str, error_feedback: bool = False, zstd_level: int = 0, *,
               block: int = _DEFAULT_BLOCK, topk_fraction: float = _DEFAULT_TOPK,
               chunk: int = _DEFAULT_CHUNK, chunk_k: int = _DEFAULT_CHUNK_K) -> str:
    """The header's codec string, e.g. "int4+ef+zstd1"; non-default block / top-k fraction /
    sparseloco chunk and kept values per chunk are spelled out ("int8+b32", "topk+k0.05",
    "sparseloco+ef+c1024+t16") because the receiver needs them to decode. The error feedback's
    decay is the sender's alone and is not in the spec."""
    parts = [name]
    if error_feedback:
        parts.append("ef")
    if zstd_level:
        parts.append(f"zstd{int(zstd_level)}")
    if block != _DEFAULT_BLOCK:
        parts.append(f"b{int(block)}")
    if topk_fraction != _DEFAULT_TOPK:
        parts.append(f"k{topk_fraction!r}")
    if chunk != _DEFAULT_CHUNK:
        parts.append(f"c{int(chunk)}")
    if chunk_k != _DEFAULT_CHUNK_K:
        parts.append(f"t{int(chunk_k)}")
    return "+".join(parts)


def parse_spec(spec: str) -> dict[str, Any]:
    """make_codec's keyword arguments for a codec string; MessageError("wrong_codec") if malformed.

    Nothing else escapes: the spec comes from a peer's header, so every parse fault is the peer's.
    """
    if not isinstance(spec, str) or len(spec) > MAX_SPEC_CHARS:
        raise MessageError("wrong_codec", f"codec spec must be a str of at most {MAX_SPEC_CHARS} chars, "
                                          f"got {str(spec)[:MAX_SPEC_CHARS]!r}...")
    name, *rest = spec.split("+")
    kw: dict[str, Any] = {"name": name}
    for part in rest:
        m = _SPEC_PART.match(part)
        if not name or m is None:
            raise MessageError("wrong_codec", f"cannot parse codec spec {spec!r} at {part!r}")
        if part == "ef":
            kw["error_feedback"] = True
        elif m.group(2) is not None:
            kw["zstd_level"] = int(m.group(2))
        elif m.group(3) is not None:
            kw["block"] = int(m.group(3))
        elif m.group(5) is not None:
            kw["chunk"] = int(m.group(5))
        elif m.group(6) is not None:
            kw["chunk_k"] = int(m.group(6))
        else:
            try:
                kw["topk_fraction"] = float(m.group(4))
            except ValueError:  # "..", "1e", "-": the character class admits what float() refuses
                raise MessageError("wrong_codec", f"cannot parse codec spec {spec!r} at {part!r}") from None
    if codec_spec(**kw) != spec:  # one spelling per codec, so spec equality means codec equality
        raise MessageError("wrong_codec", f"{spec!r} is not canonical; write {codec_spec(**kw)!r}")
    return kw


def codec_from_spec(spec: str) -> Codec:
    """The codec a header names; MessageError("wrong_codec") for unknown or malformed specs.

    A codec is pure functions, so each spec's is built once and shared: building one (its lookup
    tables) cost about 6 ms, paid twice per contribution the syncer decoded."""
    return _codec_from_spec(spec) if isinstance(spec, str) else _build_codec(spec)


@functools.lru_cache(maxsize=64)
def _codec_from_spec(spec: str) -> Codec:
    return _build_codec(spec)


def _build_codec(spec: str) -> Codec:
    kw = parse_spec(spec)
    name = kw.pop("name")
    try:
        return make_codec(name, **kw)
    except (CodecError, ValueError, KeyError) as e:
        raise MessageError("wrong_codec", f"{spec!r}: {e}") from None


def payload_bound(spec: str, shapes: Iterable[Iterable[int]]) -> int:
    """An upper bound on a fragment's payload at a codec's rate, for decode(max_payload=...).

    Exact for fixed-rate codecs; a codec of unknown size counts as fp32, and zstd adds its
    worst-case expansion (ZSTD_COMPRESSBOUND: n + n/256 + a little per frame).
    """
    kw = parse_spec(spec)
    level = kw.pop("zstd_level", 0)
    base = make_codec(kw.pop("name"), **kw)
    total = 0
    for shape in shapes:
        shape = tuple(shape)
        n = base.payload_bytes(shape)
        n = 4 * math.prod(shape) + 64 if n is None else n
        total += n + (n >> 8) + 256 if level else n
    return total
