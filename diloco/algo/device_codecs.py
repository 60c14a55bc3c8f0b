"""The block codecs' encode on a learner's own devices: a fragment's pseudo-gradient, its
error-feedback residual and its packed payload in one jitted function, so that only the payload
crosses to the host (docs/design.md#encoding-on-the-device).

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), section 5; the wire format is
codecs.py's docstring and these are its rules, operation for operation, in float32:

* a block's absmax is the largest |x| as an integer over the float's bits (so a nan or inf is
  found by the same max), its scale absmax / levels floored at 2^-126 (0 for an all-zero block),
  and each code is computed from x * (1 / scale), rounded half to even;
* int8 and int4 keep the low 8 or 4 bits of the two's complement code, fp4 looks the code up by
  the float's top 10 bits, 2-bit codes are rint((y + 3) / 2) clipped to 0..3; codes are packed
  low bits first, the last block zero-padded and cut after the tensor's last value.

So the payload is byte for byte the host encoder's (tests/test_device_codecs.py), with one
exception: the CPU backend of XLA flushes subnormal floats to zero, so a block whose absmax is
below about 3e-36 may round differently there (it decodes within 1e-35 of the host's either
way), as may an fp4 or 2-bit block whose absmax is above 2^126 (1 / scale is subnormal). A block holding inf or nan gets a nan scale: the host finds
it in the scales alone and refuses the contribution, as the host encoder
does. zstd, the checksum and the frame stay on the host: they are byte streams, not arrays.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from diloco.algo import codec_specs, codecs, messages
from diloco.algo.codec_base import FP4, INT

_TINY = np.float32(2.0**-126)
_ABS = np.uint32(0x7FFFFFFF)
_EXP = np.uint32(0x7F800000)
_NORMAL = np.uint32(0x00800000)  # the bits of 2^-126: below it a float is subnormal


class DeviceCodec(NamedTuple):
    """A contribution codec whose value transform runs on the learner's devices.

    `encode(anchor, local, residuals)` takes a fragment's tensors (tuples in sorted path order, as
    the wire carries them) and returns (each tensor's (scales, packed codes), cut by `layout` so
    that each device quantises its own shard; the new residuals, () without error feedback).
    `to_wire` makes the payloads of them once they are on the host; `sizes(shapes)` gives each
    tensor's payload bytes; `zstd_level` is the host's stage after it (0: none)."""

    spec: str
    block: int
    error_feedback: bool
    zstd_level: int
    encode: Any
    sizes: Any
    lower: Any  # encode's arguments -> its lowered jitted function (to read the compiled program)


def for_spec(spec: str) -> DeviceCodec | None:
    """The device encoder of a contribution codec spec ("int4+ef+zstd1"), or None for a codec
    that has none (fp32, bf16, topk: they encode on the host)."""
    kw = codec_specs.parse_spec(spec)
    fmt = codecs.BLOCK_FORMATS.get(kw["name"])
    if fmt is None:
        return None
    return _build(spec, kw["name"], kw.get("block", 64), bool(kw.get("error_feedback")), kw.get("zstd_level", 0))


def layout(shape: tuple[int, ...], sharding, block: int) -> tuple[int, int, int]:
    """How a tensor's blocks are cut so that each device quantises its own shard: (outer, parts,
    run), the flattened tensor seen as outer x parts runs of `run` values, the parts being the
    shards of its one sharded dimension. It applies when every run is whole blocks, so no block
    spans two shards; otherwise (1, 1, n), and XLA gathers the tensor before it is cut. Either
    way the blocks, hence the bytes, are the same: only where they are computed changes."""
    n = math.prod(shape)
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
        return 1, 1, n
    split = [(d, math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e)))
             for d, e in enumerate(tuple(spec)[:len(shape)]) if e is not None]
    split = [(d, k) for d, k in split if k > 1]
    if len(split) != 1:
        return 1, 1, n
    d, parts = split[0]
    if shape[d] % parts:
        return 1, 1, n
    run = shape[d] // parts * math.prod(shape[d + 1:])
    if run % block:
        return 1, 1, n
    return math.prod(shape[:d]), parts, run


@functools.lru_cache(maxsize=32)
def _build(spec: str, name: str, block: int, error_feedback: bool, zstd_level: int) -> DeviceCodec:
    fmt = codecs.BLOCK_FORMATS[name]()
    wire = codecs.make_codec(name, block=block)  # refuses a bad block; its payload sizes are the wire's

    def sizes(shapes):
        return tuple(wire.payload_bytes(tuple(shape)) for shape in shapes)

    def encode(anchor, local, residuals, zero, layouts):
        pieces, targets, decodes, finite = [], [], [], []
        for t, (a, x) in enumerate(zip(anchor, local)):
            # the pseudo-gradient, as merge.pseudo_gradient computes it on the host
            diff = jnp.asarray(a, jnp.float32) - jnp.asarray(x, jnp.float32)
            target = diff + residuals[t] if error_feedback else diff
            scales, packed, decoded, ok = _encode_tensor(target, fmt, block, zero, layouts[t], error_feedback)
            pieces.append((scales, packed))
            targets.append(target)
            decodes.append(decoded)
            finite.append(ok)
        if not error_feedback:
            return tuple(pieces), ()
        # A refused contribution (any tensor) leaves every residual as it was, as the host's
        # pack_fragment does when one tensor's encode raises.
        ok = jnp.all(jnp.stack(finite))
        return tuple(pieces), tuple(jnp.where(ok, t - d, r) for t, d, r in zip(targets, decodes, residuals))

    jitted = jax.jit(encode, static_argnums=4)

    def args(anchor, local, residuals):
        layouts = tuple(layout(tuple(x.shape), getattr(x, "sharding", None), block) for x in local)
        return anchor, local, residuals, np.uint32(0), layouts

    return DeviceCodec(spec, block, error_feedback, zstd_level, lambda *a: jitted(*args(*a)), sizes,
                       lambda *a: jitted.lower(*args(*a)))


def _rounded(x, zero):
    """x, rounded to float32 where it stands. XLA (and LLVM under it) may contract a multiply and
    the add after it into one fused multiply-add, rounding once where numpy rounds twice; passing
    the product's bits through an xor with a zero only known at run time keeps them apart."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) ^ zero
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _encode_tensor(x, fmt, block: int, zero, cut: tuple[int, int, int], decodes: bool = False):
    """(scales float32, packed codes uint8, decoded values in x's shape, all finite) of one
    tensor, cut as `layout` says: scales (outer, parts, blocks) and codes (outer, parts, blocks,
    block * bits / 8), which read in row-major order are the wire's; a tensor of one part whose
    last block is partial is padded with zeros, and its codes cut after the last value.
    `decodes` (error feedback): a block whose decoded values overflow is refused too, as the
    host's error feedback refuses it when it decodes its own payload."""
    n = math.prod(x.shape)
    per = 8 // fmt.bits
    outer, parts, run = cut
    nb = -(-run // block)
    if parts == 1 and run % block:
        xb = jnp.pad(x.reshape(-1), (0, nb * block - n)).reshape(1, 1, nb, block)
    else:
        xb = x.reshape(outer, parts, nb, block)
    m = jnp.max(jax.lax.bitcast_convert_type(xb, jnp.uint32) & _ABS, axis=-1)
    finite = m < _EXP
    # XLA turns a division by a broadcast scalar into a multiplication by its reciprocal, which
    # rounds differently; a divisor array behind a barrier keeps it a true division, as numpy's.
    levels = jax.lax.optimization_barrier(jnp.full(m.shape, np.float32(fmt.levels)))
    s = jax.lax.bitcast_convert_type(m, jnp.float32) / levels
    # The host keeps s > 0 as it computed it, subnormal or not; XLA on the CPU flushes a subnormal
    # s to 0, so whether it is positive is read off the integer absmax instead (levels is odd, so
    # m / levels never ties at half the smallest subnormal).
    positive = (m >= _NORMAL) | (2 * m > np.uint32(fmt.levels))
    floor = jnp.maximum(s, _TINY)
    scales = jnp.where(positive, floor, np.float32(0.0))
    scales = jnp.where(finite, scales, np.float32(np.nan))
    y = _rounded(xb * (np.float32(1.0) / floor)[..., None], zero)
    if fmt.kind == INT:
        code = jax.lax.round(y, jax.lax.RoundingMethod.TO_NEAREST_EVEN).astype(jnp.int32) & ((1 << fmt.bits) - 1)
        sign = 1 << (fmt.bits - 1)
        value = (code - ((code & sign) << 1)).astype(jnp.float32)
    elif fmt.kind == FP4:
        top = jax.lax.bitcast_convert_type(y, jnp.uint32) >> np.uint32(22)
        code = jnp.asarray(fmt.classes)[top].astype(jnp.int32)
        value = jnp.asarray(fmt.lut)[code]
    else:  # 2-bit: levels -3, -1, 1, 3 at u = (y + 3) / 2 = 0..3
        u = jax.lax.round((y + np.float32(3.0)) * np.float32(0.5), jax.lax.RoundingMethod.TO_NEAREST_EVEN)
        code = jnp.clip(u, 0, 3).astype(jnp.int32)
        value = jnp.asarray(fmt.lut)[code]
    decoded = _rounded(value * scales[..., None], zero)
    if decodes:  # e.g. absmax = float32 max: 127 x (max / 127) rounds up to inf
        whole = jnp.all(jnp.isfinite(decoded), axis=-1)
        scales = jnp.where(whole, scales, np.float32(np.nan))
        finite = finite & whole
    decoded = (decoded.reshape(-1)[:n] if decoded.size != n else decoded).reshape(x.shape)
    lanes = code.astype(jnp.uint8).reshape(*code.shape[:-1], block // per, per)
    packed = lanes[..., 0]
    for k in range(1, per):  # low bits first
        packed = packed | (lanes[..., k] << np.uint8(k * fmt.bits))
    if packed.size * per != n:  # a partial last block: its codes past the tensor are not sent
        packed = packed.reshape(-1)[: -(-n // per)]
    return scales, packed, decoded, jnp.all(finite)


def to_wire(dc: DeviceCodec, pieces, shapes) -> list[bytes]:
    """Each tensor's wire bytes from its (scales, packed codes) on the host: the scales checked
    (a nan scale is a block that held inf or nan: NonFiniteError, as the host encoder raises),
    then zstd when the spec has it."""
    out = []
    for (scales, packed), shape in zip(pieces, shapes):
        scales = np.asarray(scales, "<f4").reshape(-1)
        if not np.isfinite(scales).all():  # one float per block: a small pass
            raise codecs.NonFiniteError(f"{dc.spec}: non-finite values (nan or inf) cannot be encoded")
        payload = scales.tobytes() + np.asarray(packed, np.uint8).tobytes()
        out.append(codecs.zstd_compress(payload, dc.zstd_level) if dc.zstd_level else payload)
    return out


class DeviceDecoder(NamedTuple):
    """A broadcast codec decoded on the learner's devices (docs/design.md#encoding-on-the-device):
    `apply(base, payload)` returns the fragment's tensors, base + decode(payload) for a delta and
    the decoded values themselves for a full copy (base None); `check(header, payload, shapes)`
    refuses on the host, as the host decoder would, a payload whose sizes or scales are wrong and
    returns it as a uint8 array, the one thing that crosses to the devices (None: the host decoder
    must decide, for a block scale so large that only its codes say if a value overflows)."""

    spec: str
    check: Any
    apply: Any
    sizes: Any  # shapes -> each tensor's payload bytes


def decoder_for(spec: str) -> DeviceDecoder | None:
    """The device decoder of a broadcast spec: fp32 full copies and the zstd-free block formats
    (the run's down codecs); None for the rest, which decode on the host."""
    codec_specs.codec_from_spec(spec)  # a spec the host decoder refuses (a block of 0 or 2^20) is refused here
    kw = codec_specs.parse_spec(spec)
    if kw.get("zstd_level") or (kw["name"] != "fp32" and kw["name"] not in codecs.BLOCK_FORMATS):
        return None
    return _decoder(spec, kw["name"], 1 if kw["name"] == "fp32" else kw.get("block", 64))


@functools.lru_cache(maxsize=32)
def _decoder(spec: str, name: str, block: int) -> DeviceDecoder:
    fmt = None if name == "fp32" else codecs.BLOCK_FORMATS[name]()
    per = 1 if fmt is None else 8 // fmt.bits
    wire = codecs.make_codec(name, block=block)  # the host codec: its payload sizes are the wire's

    def layout(shape):
        n = math.prod(shape)
        return n, 0 if fmt is None else -(-n // block), wire.payload_bytes(tuple(shape))

    def check(header, payload: bytes, shapes) -> np.ndarray | None:
        raw = np.frombuffer(payload, np.uint8)
        start = 0
        for t, shape in zip(header["tensors"], shapes):
            n, nb, size = layout(shape)
            if t["nbytes"] != size:
                raise messages.MessageError("codec_error", f"{t['path']}: {t['nbytes']} bytes, shape {shape} needs {size}")
            if fmt is None:
                if not np.isfinite(raw[start:start + size].view("<f4")).all():
                    raise messages.MessageError("non_finite", f"{t['path']}: non-finite values")
            else:
                scales = raw[start:start + 4 * nb].view("<f4")
                if not ((scales >= 0) & (scales < np.inf)).all():  # codec_kernels.scales_ok's rule
                    raise messages.MessageError("codec_error", f"{t['path']}: block scales must be finite and >= 0")
                with np.errstate(over="ignore"):
                    if not np.isfinite(scales * np.float32(np.abs(fmt.lut).max())).all():
                        # Whether its largest code overflows depends on the codes: the host decoder
                        # reads them (a forged frame only; an honest scale is an absmax / levels).
                        return None
            start += size
        return raw

    def apply(base, payload, zero, shapes):
        out, start = [], 0
        for t, shape in enumerate(shapes):
            n, nb, size = layout(shape)
            chunk = payload[start:start + size]
            start += size
            if fmt is None:
                values = jax.lax.bitcast_convert_type(chunk.reshape(n, 4), jnp.float32)
            else:
                scales = jax.lax.bitcast_convert_type(chunk[: 4 * nb].reshape(nb, 4), jnp.float32)
                codes = jnp.pad(chunk[4 * nb:], (0, nb * block // per - (size - 4 * nb))).reshape(nb, block // per)
                lanes = [(codes >> np.uint8(k * fmt.bits)) & np.uint8((1 << fmt.bits) - 1) for k in range(per)]
                code = jnp.stack(lanes, axis=-1).reshape(nb, block).astype(jnp.int32)
                if fmt.kind == INT:
                    value = (code - ((code & (1 << (fmt.bits - 1))) << 1)).astype(jnp.float32)
                else:
                    value = jnp.asarray(fmt.lut)[code]
                values = _rounded(value * scales[:, None], zero).reshape(-1)[:n]
            values = values.reshape(shape)
            out.append(values if base is None else base[t] + values)
        return tuple(out)

    jitted = jax.jit(apply, static_argnums=3)

    def run(base, payload, shapes):
        return jitted(base, payload, np.uint32(0), tuple(tuple(s) for s in shapes))

    return DeviceDecoder(spec, check, run, lambda shapes: tuple(layout(s)[2] for s in shapes))
