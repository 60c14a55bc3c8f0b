"""Wire codecs for pseudo-gradients: float32 arrays to bytes and back (docs/algorithm.md#codecs).

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), section 5.

Payloads carry no header (shape, codec name and checksum travel in the message) and are
little-endian. Block formats cut the flattened tensor into blocks of `block` values, the last one
zero-padded, and store one float32 scale per block followed by the codes of the n real values,
packed low bits first. Scales are float32, not float16: pseudo-gradient block maxima routinely fall
below float16's normal range (6e-5), where a float16 scale loses its precision; they cost 32 / block
bits per value. An all-zero block stores scale 0 and decodes to zeros; other scales are floored at
2^-126, the smallest normal float32, so 1 / scale stays finite (blocks below ~1e-36 only).
"""

from __future__ import annotations

import inspect
import math
from fractions import Fraction
from typing import Callable, NamedTuple

import ml_dtypes
import numpy as np
import zstandard

from diloco.algo.codec_base import (  # noqa: F401  (CodecError and NonFiniteError: the public errors)
    Codec, CodecError, CodecState, NonFiniteError, buffer, flat_f32, numel, require_finite, stateless,
)

_TINY = np.float32(2.0**-126)  # smallest normal float32: floor for nonzero block scales
# Block codecs walk the tensor in 256 KB slices so temporaries stay in L2; whole-tensor numpy
# passes are memory bound (about 2x slower, measured).
_CHUNK = 1 << 16
# Decoding a block format allocates at least one whole block per tensor, so a block of 2**24 named
# in a 365-byte frame would cost 64 MiB per tensor: blocks are capped (64 is the default).
MAX_BLOCK = 1 << 16


def fp32() -> Codec:
    """Lossless float32 (the identity codec, for tests and the full-precision broadcast)."""
    name = "fp32"

    def encode(x, state):
        flat = flat_f32(x)
        require_finite(bool(np.isfinite(flat).all()), name)
        return flat.astype("<f4", copy=False).tobytes(), state

    def decode(payload, shape):
        n = numel(shape)
        out = buffer(payload, 4 * n, name, shape).view("<f4").astype(np.float32)
        require_finite(bool(np.isfinite(out).all()), name)
        return out.reshape(shape)

    return Codec(name, stateless, encode, decode, lambda shape: 4 * numel(shape))


def bf16() -> Codec:
    """bfloat16, round to nearest even: relative error <= 2^-8 for normal values."""
    name = "bf16"

    def encode(x, state):
        bits = flat_f32(x).astype(ml_dtypes.bfloat16).view(np.uint16)
        # Exponent all ones is inf or nan: this also catches finite float32 values above bf16's max.
        require_finite(not np.any((bits & 0x7F80) == 0x7F80), name)
        return bits.astype("<u2", copy=False).tobytes(), state

    def decode(payload, shape):
        n = numel(shape)
        bits = buffer(payload, 2 * n, name, shape).view("<u2")
        require_finite(not np.any((bits & 0x7F80) == 0x7F80), name)
        # bf16 is the top half of a float32, so widening is a shift.
        return (bits.astype(np.uint32) << 16).view(np.float32).reshape(shape)

    return Codec(name, stateless, encode, decode, lambda shape: 2 * numel(shape))


class _Format(NamedTuple):
    bits: int  # bits per code: 8, 4 or 2
    levels: float  # stored scale = absmax / levels; encode sees x / scale in [-levels, levels]
    to_codes: Callable[[np.ndarray], np.ndarray]  # x / scale (float32, clobbered) -> uint8 codes
    lut: np.ndarray  # float32 value of each code, in units of scale


def _int_format(bits: int) -> _Format:
    qmax = 2 ** (bits - 1) - 1

    def to_codes(y):
        np.rint(y, out=y)
        return y.astype(np.int8).view(np.uint8)  # two's complement; _pack drops the high bits

    codes = np.arange(1 << bits)
    lut = np.where(codes > qmax, codes - (1 << bits), codes).astype(np.float32)
    return _Format(bits, float(qmax), to_codes, lut)


def _fp4_format() -> _Format:
    mags = np.array([0.0] + [2.0 ** (e - 7) for e in range(1, 8)], dtype=np.float32)
    lut = np.concatenate([mags, -mags])
    # Every boundary of linear nearest rounding onto {0, 2^-6, ..., 1} is a power of two (2^-7)
    # or 1.5 times one, so the code depends only on a float's top 10 bits (sign, exponent, first
    # mantissa bit). Classify the midpoint of each of the 1024 classes by brute force, once.
    mids = ((np.arange(1024, dtype=np.uint32) << 22) | (1 << 21)).view(np.float32)
    with np.errstate(invalid="ignore"):  # exponent 255 classes are nan; inputs never reach them
        nearest = np.argmin(np.abs(np.abs(mids)[:, None] - mags[None, :]), axis=1)
    by_class = (nearest | np.where(np.signbit(mids) & (nearest > 0), 8, 0)).astype(np.uint8)

    def to_codes(y):
        return np.take(by_class, y.view(np.uint32) >> np.uint32(22), mode="clip")

    return _Format(4, 1.0, to_codes, lut)


def _two_bit_format() -> _Format:
    def to_codes(y):
        # y in [-3, 3]; levels -3, -1, 1, 3 sit at u = (y + 3) / 2 = 0, 1, 2, 3.
        y += 3.0
        y *= 0.5
        np.rint(y, out=y)
        np.clip(y, 0.0, 3.0, out=y)
        return y.astype(np.uint8)

    return _Format(2, 3.0, to_codes, np.array([-3.0, -1.0, 1.0, 3.0], dtype=np.float32))


def _pack(codes: np.ndarray, bits: int, out: np.ndarray) -> None:
    """Packs uint8 codes into `out`, first code lowest; shift-or on wider little-endian views is
    several times faster than strided per-position numpy ops."""
    if bits == 8:
        np.copyto(out, codes)
    elif bits == 4:
        v = codes.view("<u2") & np.uint16(0x0F0F)
        np.copyto(out, v | (v >> np.uint16(4)), casting="unsafe")  # keeps the low byte
    else:
        v = codes.view("<u4") & np.uint32(0x03030303)
        v |= v >> np.uint32(6)
        np.copyto(out, v | (v >> np.uint32(12)), casting="unsafe")


def _byte_table(lut: np.ndarray, bits: int) -> np.ndarray:
    """For each byte value, the float32 values of the codes it packs, as one wide item."""
    per = 8 // bits
    byte = np.arange(256)[:, None]
    codes = (byte >> (bits * np.arange(per))[None, :]) & ((1 << bits) - 1)
    wide = {1: np.float32, 2: np.uint64, 4: np.complex128}[per]
    return np.ascontiguousarray(lut[codes], dtype=np.float32).view(wide).reshape(256)


def _block_codec(name: str, fmt: _Format, block: int) -> Codec:
    per = 8 // fmt.bits
    if not isinstance(block, (int, np.integer)) or not 1 <= block <= MAX_BLOCK or block % per:
        raise ValueError(f"{name}: block must be a positive multiple of {per} up to {MAX_BLOCK}, got {block!r}")
    block = int(block)
    chunk = block * max(1, _CHUNK // block)
    starts = np.arange(0, chunk, block)  # block offsets within a chunk, for reduceat
    table = _byte_table(fmt.lut, fmt.bits)
    levels = np.float32(fmt.levels)

    def sizes(shape):
        n = numel(shape)
        nb = -(-n // block)
        return n, nb, 4 * nb + -(-n // per)

    def encode(x, state):
        flat = flat_f32(x)
        n, nb, size = sizes(flat.shape)
        padded = nb * block
        if padded != n:
            flat = np.concatenate([flat, np.zeros(padded - n, np.float32)])
        buf = np.empty(4 * nb + padded // per, dtype=np.uint8)
        scales = buf[: 4 * nb].view("<f4")
        packed = buf[4 * nb :]
        y = np.empty(min(chunk, padded), dtype=np.float32)
        # Non-finite input is caught once, from the scales, after the loop; until then nan may
        # flow through the casts below, which would warn.
        with np.errstate(invalid="ignore"):
            for lo in range(0, padded, chunk):
                xc = flat[lo : lo + chunk]
                yc = y[: xc.size]
                sc = scales[lo // block : (lo + xc.size) // block]
                np.abs(xc, out=yc)
                # Non-negative floats order like their bit patterns, and an integer reduceat is
                # ~1.5x faster than a float one (which is itself ~2x faster than .max(axis=1)).
                np.maximum.reduceat(yc.view(np.uint32), starts[: sc.size], out=sc.view(np.uint32))
                np.divide(sc, levels, out=sc)
                # A flat multiply by the repeated inverse beats a broadcast (kb, block) one.
                inv = np.float32(1.0) / np.maximum(sc, _TINY)
                np.multiply(xc, np.repeat(inv, block), out=yc)
                _pack(fmt.to_codes(yc), fmt.bits, packed[lo // per : (lo + xc.size) // per])
        require_finite(bool(np.isfinite(scales).all()), name)
        np.maximum(scales, _TINY, out=scales, where=scales > 0)  # the scale encode used; 0 stays 0
        return buf[:size].tobytes(), state

    def decode(payload, shape):
        n, nb, size = sizes(shape)
        buf = buffer(payload, size, name, shape)
        scales = buf[: 4 * nb].view("<f4")
        if not np.all((scales >= 0) & (scales < np.inf)):  # also false for nan
            raise CodecError(f"{name}: block scales must be finite and >= 0")
        padded = nb * block
        packed = buf[4 * nb :]
        if packed.size * per != padded:
            packed = np.concatenate([packed, np.zeros(padded // per - packed.size, np.uint8)])
        out = np.empty(padded, dtype=np.float32)
        for lo in range(0, padded, chunk):
            oc = out[lo : lo + chunk]
            pc = packed[lo // per : (lo + oc.size) // per]
            if per == 1:  # int8: a cast beats a table lookup
                np.copyto(oc, pc.view(np.int8))
            else:  # one lookup yields all the values a byte packs; "clip" skips bounds checks
                np.take(table, pc, out=oc.view(table.dtype), mode="clip")
            with np.errstate(over="ignore"):  # only a forged scale overflows; caught just below
                oc *= np.repeat(scales[lo // block : (lo + oc.size) // block], block)
            require_finite(bool(np.isfinite(oc).all()), name)
        return out[:n].reshape(shape)

    return Codec(f"{name}(block={block})", stateless, encode, decode, lambda shape: sizes(shape)[2])


def int8(block: int = 64) -> Codec:
    """Per-block absmax int8: scale = absmax / 127, code = rint(x / scale), |error| <= scale / 2."""
    return _block_codec("int8", _int_format(8), block)


def int4(block: int = 64) -> Codec:
    """Per-block absmax int4: scale = absmax / 7, code = rint(x / scale), |error| <= scale / 2.

    Codes are 4-bit two's complement, two per byte: 4 + 32 / block bits per value (7.1x < fp32).
    """
    return _block_codec("int4", _int_format(4), block)


def fp4_e3m0(block: int = 64) -> Codec:
    """E3M0 fp4: a sign bit (bit 3) and a 3-bit exponent code e, two codes per byte.

    The scale is the block absmax; e = 0 is 0 and e = 1..7 is scale * 2^(e-7), i.e. magnitudes
    {0, 2^-6, ..., 2^0} * absmax. Values round to the nearest magnitude in linear space (lower
    squared error than log-space rounding), so |x - decoded| <= max(|x| / 3, absmax * 2^-7).
    """
    return _block_codec("fp4", _fp4_format(), block)


def two_bit(block: int = 64) -> Codec:
    """2 bits per value: a uniform 4-level quantizer, codes 0..3 -> {-3, -1, +1, +3} * scale.

    scale = absmax / 3, so all four codes are used and |x - decoded| <= scale. There is no zero
    level, so alone it is crude; `error_feedback(two_bit())` converges (section 5).
    """
    return _block_codec("2bit", _two_bit_format(), block)


def topk(fraction: float = 0.01) -> Codec:
    """Keeps the k = ceil(fraction * n) largest magnitudes: k sorted uint32 indices, k float32 values.

    Kept values are exact, the rest decode to 0; pair it with error feedback.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"topk: fraction must be in (0, 1], got {fraction!r}")
    # Read the float as the simple fraction it was written as, so 0.01 of 300 values is 3, not
    # ceil(3.0000000000000004) = 4.
    ratio = Fraction(fraction).limit_denominator(1 << 30)
    name = f"topk(fraction={fraction})"

    def count(n):
        if n >= 1 << 32:
            raise CodecError(f"topk: {n} values do not fit uint32 indices")
        return math.ceil(ratio * n)

    def encode(x, state):
        flat = flat_f32(x)
        n = flat.size
        k = count(n)
        mag = np.abs(flat)
        require_finite(n == 0 or bool(np.isfinite(mag.max())), name)  # max propagates nan
        idx = np.arange(n) if k == n else np.sort(np.argpartition(mag, n - k)[n - k :])
        return idx.astype("<u4").tobytes() + flat[idx].astype("<f4").tobytes(), state

    def decode(payload, shape):
        n = numel(shape)
        k = count(n)
        buf = buffer(payload, 8 * k, name, shape)
        idx = buf[: 4 * k].view("<u4")
        values = buf[4 * k :].view("<f4")
        # Strictly increasing and in range: no index error, no silent duplicate overwrite.
        if k and (idx[-1] >= n or not np.all(idx[1:] > idx[:-1])):
            raise CodecError(f"{name}: indices must be strictly increasing and < {n}")
        require_finite(bool(np.isfinite(values).all()), name)
        out = np.zeros(n, dtype=np.float32)
        out[idx] = values
        return out.reshape(shape)

    return Codec(name, stateless, encode, decode, lambda shape: 8 * count(numel(shape)))


class ErrorFeedbackState(NamedTuple):
    residual: np.ndarray  # float32, what the wire has not yet delivered
    inner: CodecState


def error_feedback(codec: Codec) -> Codec:
    """Carries each tensor's quantization error into its next encode (EF-SGD, Karimireddy 2019).

    encode(x, e) sends q = encode(x + e) and keeps e' = (x + e) - decode(q), so the sum of what was
    decoded trails the sum of what was sent by exactly the current residual: nothing is lost, only
    delayed. This is what lets 2-bit and top-k converge (section 5). Payloads are the inner codec's.
    """

    def init(shape):
        return ErrorFeedbackState(np.zeros(shape, np.float32), codec.init(shape))

    def encode(x, state):
        x = np.asarray(x, dtype=np.float32)
        if x.shape != state.residual.shape:
            raise ValueError(f"error_feedback: input shape {x.shape} != state shape {state.residual.shape}")
        target = x + state.residual
        payload, inner = codec.encode(target, state.inner)
        return payload, ErrorFeedbackState(target - codec.decode(payload, x.shape), inner)

    return Codec(f"error_feedback({codec.name})", init, encode, codec.decode, codec.payload_bytes)


def zstd(codec: Codec, level: int = 1) -> Codec:
    """Compresses the inner payload into one zstd frame with content size and checksum.

    decode accepts exactly one complete frame whose content size is what the inner codec expects
    for the shape (which also bounds memory), verifies the checksum, then decodes the content.
    """
    if not isinstance(level, (int, np.integer)) or not 1 <= level <= 22:
        raise ValueError(f"zstd: level must be an int in 1..22, got {level!r}")
    name = f"zstd({codec.name},level={level})"

    def encode(x, state):
        payload, state = codec.encode(x, state)
        # A fresh compressor per call: zstd contexts are not thread safe, and codecs are shared.
        cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
        return cctx.compress(payload), state

    def decode(frame, shape):
        expected = codec.payload_bytes(shape)
        dobj = zstandard.ZstdDecompressor().decompressobj()
        try:
            size = zstandard.frame_content_size(frame)
            if size < 0 or (expected is not None and size != expected):
                raise CodecError(f"{name}: frame declares {size} bytes, shape {tuple(shape)} needs {expected}")
            content = dobj.decompress(frame)
        except zstandard.ZstdError as e:
            raise CodecError(f"{name}: corrupt or truncated frame ({len(frame)} bytes): {e}") from e
        if not dobj.eof or dobj.unused_data:
            raise CodecError(f"{name}: truncated frame or {len(dobj.unused_data)} trailing bytes")
        return codec.decode(content, shape)

    return Codec(name, codec.init, encode, decode, lambda shape: None)


CODECS: dict[str, Callable[..., Codec]] = {
    "fp32": fp32, "bf16": bf16, "int8": int8, "int4": int4, "fp4": fp4_e3m0, "2bit": two_bit, "topk": topk,
}

_with_error_feedback = error_feedback  # make_codec's keyword of the same name shadows it


def make_codec(name: str, *, error_feedback: bool = False, zstd_level: int = 0, block: int = 64,
               topk_fraction: float = 0.01) -> Codec:
    """`zstd(error_feedback(CODECS[name](...)))`, each factory given only the options it takes;
    zstd_level 0 means no zstd."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; known: {sorted(CODECS)}")
    factory = CODECS[name]
    options = {"block": block, "fraction": topk_fraction}
    params = inspect.signature(factory).parameters
    codec = factory(**{k: v for k, v in options.items() if k in params})
    if error_feedback:
        codec = _with_error_feedback(codec)
    if zstd_level:
        codec = zstd(codec, zstd_level)
    return codec
