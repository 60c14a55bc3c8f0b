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
import threading
from fractions import Fraction
from typing import Callable, NamedTuple

import ml_dtypes
import numpy as np
import zstandard

from diloco.algo import hostpool
from diloco.algo.sparseloco import sparseloco
from diloco.algo.codec_base import (  # noqa: F401  (CodecError and NonFiniteError: the public errors)
    FP4, INT, TWO_BIT, Codec, CodecError, CodecState, NonFiniteError, buffer, flat_f32, numel, require_finite,
    stateless,
)

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
    levels: float  # stored scale = absmax / levels; codes are computed from x / scale in [-levels, levels]
    kind: int  # the code rule: INT, FP4 or TWO_BIT
    classes: np.ndarray  # fp4: uint8 code of each float32 top-10-bit class (unused otherwise)
    lut: np.ndarray  # float32 value of each code, in units of scale


_NO_CLASSES = np.zeros(1, np.uint8)


def _int_format(bits: int) -> _Format:
    # code = rint(x / scale), half to even, as two's complement; the wire keeps the low `bits`
    qmax = 2 ** (bits - 1) - 1
    codes = np.arange(1 << bits)
    lut = np.where(codes > qmax, codes - (1 << bits), codes).astype(np.float32)
    return _Format(bits, float(qmax), INT, _NO_CLASSES, lut)


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
    return _Format(4, 1.0, FP4, by_class, lut)


def _two_bit_format() -> _Format:
    # x / scale in [-3, 3]; levels -3, -1, 1, 3 are codes rint((y + 3) / 2) clipped to 0..3
    return _Format(2, 3.0, TWO_BIT, _NO_CLASSES, np.array([-3.0, -1.0, 1.0, 3.0], dtype=np.float32))


_SCRATCH = threading.local()
_F4 = np.dtype("<f4")  # block scales on the wire
_KERNELS = None


def _kernels():
    """diloco.algo.codec_kernels, imported on first use: importing the codecs does not load numba."""
    global _KERNELS
    if _KERNELS is None:
        from diloco.algo import codec_kernels

        _KERNELS = codec_kernels
    return _KERNELS


def _scratch(size: int) -> np.ndarray:
    """This thread's working buffer for a payload of `size` bytes (grown, never shrunk).

    The payload is copied out into immutable bytes anyway, so the buffer it is built in need not
    be fresh, and a fresh one costs a page fault per 4 KB whenever the allocator has handed the
    last one back to the OS (int8 at 64 MB: twice as slow, measured)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < size:
        buf = _SCRATCH.buf = np.empty(size, np.uint8)
    return buf[:size]


def check_block(name: str, fmt: _Format, block) -> None:
    """A block size the format can use: a positive multiple of its codes per byte, at most MAX_BLOCK."""
    per = 8 // fmt.bits
    if not isinstance(block, (int, np.integer)) or not 1 <= block <= MAX_BLOCK or block % per:
        raise ValueError(f"{name}: block must be a positive multiple of {per} up to {MAX_BLOCK}, got {block!r}")


def _block_codec(name: str, fmt: _Format, block: int) -> Codec:
    per = 8 // fmt.bits
    check_block(name, fmt, block)
    block = int(block)
    levels = np.float32(fmt.levels)
    lut_max = np.float32(np.abs(fmt.lut).max())
    rows = max(1, hostpool.CHUNK // block)  # blocks per piece of a parallel encode or decode

    def sizes(shape):
        n = numel(shape)
        nb = -(-n // block)
        return n, nb, 4 * nb + -(-n // per)

    def encode(x, state):
        k = _kernels()
        flat = flat_f32(x)
        n, nb, size = sizes(flat.shape)
        full = n // block
        buf = _scratch(size)
        scales = buf[: 4 * nb].view(_F4)
        packed = buf[4 * nb :]
        xs = flat[: full * block].reshape(full, block)
        us, body = xs.view(np.uint32), packed[: full * block // per].reshape(full, block // per)
        ok = all(hostpool.each(full, lambda lo, hi: k.encode_blocks(
            xs[lo:hi], us[lo:hi], fmt.kind, fmt.bits, levels, fmt.classes, scales[lo:hi], body[lo:hi]), rows))
        if ok and full < nb:  # the last block, zero-padded; its codes past n are not sent
            tail = np.zeros((1, block), np.float32)
            tail[0, : n - full * block] = flat[full * block :]
            codes = np.empty((1, block // per), np.uint8)
            ok = k.encode_blocks(tail, tail.view(np.uint32), fmt.kind, fmt.bits, levels, fmt.classes,
                                 scales[full:], codes)
            packed[full * block // per :] = codes[0, : packed.size - full * block // per]
        require_finite(ok, name)
        return buf.tobytes(), state

    def decode(payload, shape):
        k = _kernels()
        n, nb, size = sizes(shape)
        buf = buffer(payload, size, name, shape)
        scales = buf[: 4 * nb].view(_F4)
        if not k.scales_ok(scales):
            raise CodecError(f"{name}: block scales must be finite and >= 0")
        full = n // block
        packed = buf[4 * nb :]
        out = hostpool.aligned_empty(n)
        body = packed[: full * block // per].reshape(full, block // per)
        values = out[: full * block].reshape(full, block)
        ok = all(hostpool.each(full, lambda lo, hi: k.decode_blocks(
            body[lo:hi], scales[lo:hi], fmt.kind, fmt.bits, fmt.lut, lut_max, values[lo:hi]), rows))
        if ok and full < nb:  # the last block, padded with zero bytes; its padding is checked too
            codes = np.zeros((1, block // per), np.uint8)
            codes[0, : packed.size - full * block // per] = packed[full * block // per :]
            tail = np.empty((1, block), np.float32)
            ok = k.decode_blocks(codes, scales[full:], fmt.kind, fmt.bits, fmt.lut, lut_max, tail)
            out[full * block :] = tail[0, : n - full * block]
        require_finite(ok, name)
        return out.reshape(shape)

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


def error_feedback(codec: Codec, decay: float = 1.0) -> Codec:
    """Carries each tensor's quantization error into its next encode (EF-SGD, Karimireddy 2019).

    encode(x, e) sends q = encode(x + e) and keeps e' = (x + e) - decode(q), so the sum of what was
    decoded trails the sum of what was sent by exactly the current residual: nothing is lost, only
    delayed. This is what lets 2-bit and top-k converge (section 5). Payloads are the inner codec's.
    With decay < 1 the residual shrinks by `decay` before it is added, x + decay * e (SparseLoCo's
    decayed error feedback): an old error no longer pushes the direction the model has moved on from.
    """
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"error_feedback: decay must be in (0, 1], got {decay!r}")
    decay32 = np.float32(decay)

    def init(shape):
        return ErrorFeedbackState(np.zeros(shape, np.float32), codec.init(shape))

    def encode(x, state):
        x = np.asarray(x, dtype=np.float32)
        if x.shape != state.residual.shape:
            raise ValueError(f"error_feedback: input shape {x.shape} != state shape {state.residual.shape}")
        target = x + state.residual if decay == 1.0 else x + decay32 * state.residual
        payload, inner = codec.encode(target, state.inner)
        return payload, ErrorFeedbackState(target - codec.decode(payload, x.shape), inner)

    return Codec(f"error_feedback({codec.name})", init, encode, codec.decode, codec.payload_bytes)


# zstd contexts are not thread safe and codecs are shared between threads, so each thread keeps
# one compressor per level and one decompressor, reused by every zstd codec: a context costs more
# to make than a small payload costs to compress. A frame's bytes do not depend on the reuse.
_ZSTD = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    by_level = _ZSTD.__dict__.setdefault("compressors", {})
    if level not in by_level:
        by_level[level] = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    return by_level[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_ZSTD, "decompressor"):
        _ZSTD.decompressor = zstandard.ZstdDecompressor()
    return _ZSTD.decompressor


def zstd_compress(payload: bytes, level: int) -> bytes:
    """One zstd frame with content size and checksum: the zstd codec's bytes for a payload (the
    device encoder's host stage calls it too)."""
    return _compressor(level).compress(payload)


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
        return zstd_compress(payload, level), state

    def decode(frame, shape):
        expected = codec.payload_bytes(shape)
        try:
            size = zstandard.frame_content_size(frame)
            if size < 0 or (expected is not None and size != expected):
                raise CodecError(f"{name}: frame declares {size} bytes, shape {tuple(shape)} needs {expected}")
            # One shot into a buffer of the declared size (a stream object joins 128 KB pieces,
            # a third slower at 9 MB); zstd refuses a frame whose content is not that size, a
            # truncated frame, a bad checksum and, so asked, any byte after the frame.
            content = _decompressor().decompress(frame, max_output_size=size, allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise CodecError(f"{name}: corrupt, truncated or extended frame ({len(frame)} bytes): {e}") from e
        return codec.decode(content, shape)

    return Codec(name, codec.init, encode, decode, lambda shape: None)


CODECS: dict[str, Callable[..., Codec]] = {
    "fp32": fp32, "bf16": bf16, "int8": int8, "int4": int4, "fp4": fp4_e3m0, "2bit": two_bit, "topk": topk,
    "sparseloco": sparseloco,
}

# The block formats by codec name: their code rules, read by the host encoder above and by the
# device encoder (diloco/algo/device_codecs.py), which must write the same bytes.
BLOCK_FORMATS: dict[str, Callable[[], _Format]] = {
    "int8": lambda: _int_format(8), "int4": lambda: _int_format(4), "fp4": _fp4_format, "2bit": _two_bit_format,
}

_with_error_feedback = error_feedback  # make_codec's keyword of the same name shadows it


def make_codec(name: str, *, error_feedback: bool = False, zstd_level: int = 0, block: int = 64,
               topk_fraction: float = 0.01, chunk: int = 4096, chunk_k: int = 32, ef_decay: float = 1.0) -> Codec:
    """`zstd(error_feedback(CODECS[name](...), ef_decay))`, each factory given only the options it
    takes; zstd_level 0 means no zstd."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; known: {sorted(CODECS)}")
    factory = CODECS[name]
    options = {"block": block, "fraction": topk_fraction, "chunk": chunk, "k": chunk_k}
    params = inspect.signature(factory).parameters
    codec = factory(**{k: v for k, v in options.items() if k in params})
    if error_feedback:
        codec = _with_error_feedback(codec, ef_decay)
    if zstd_level:
        codec = zstd(codec, zstd_level)
    return codec
