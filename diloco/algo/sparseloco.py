"""SparseLoCo's wire format: chunked top-k with 2-bit values (docs/algorithm.md#sparseloco).

Reference: Sarfi et al., "Communication-Efficient LLM Pre-training with SparseLoCo" (arXiv 2508.15706):
top-k per chunk of a pseudo-gradient, the kept values quantised to 2 bits, decayed error feedback
(codecs.error_feedback's decay). Paired with that error feedback it sends about 14 bits per kept
value where topk sends 64.

Layout of one tensor of n values, cut into nc = ceil(n / chunk) chunks of `chunk` consecutive values
of the flattened tensor (the last one shorter), each keeping k_c = min(k, its length) values:
nc float32 scales, then the kept values' indices within their chunk (log2(chunk) bits each, strictly
increasing per chunk), then their 2-bit codes, both bit streams packed low bits first with zero
padding. A value's 2-bit code is its sign under the chunk's scale, the mean magnitude of its kept
nonzero values: 0 -> 0, 1 -> +scale, 2 -> -scale (3 is refused), so a kept value's error is at most
max(scale, absmax - scale), and a chunk with fewer than k nonzero values decodes its zeros exactly.
"""

from __future__ import annotations

import numpy as np

from diloco.algo.codec_base import Codec, CodecError, buffer, flat_f32, numel, require_finite, stateless

MAX_CHUNK = 1 << 16
_LEVELS = np.array([0.0, 1.0, -1.0, 0.0], np.float32)  # code 3 is not used, and refused
_TINY = np.float32(2.0**-126)  # the smallest normal float32: 1 / scale stays finite (codecs.py's floor)


def _pack(values: np.ndarray, bits: int) -> bytes:
    """Unsigned ints < 2**bits, `bits` each, low bits first, zero-padded to a whole byte."""
    planes = (values.astype(np.uint32)[:, None] >> np.arange(bits, dtype=np.uint32)) & 1
    return np.packbits(planes.astype(np.uint8).reshape(-1), bitorder="little").tobytes()


def _unpack(buf: np.ndarray, count: int, bits: int, name: str) -> np.ndarray:
    """_pack's inverse; the padding bits must be zero (one payload per message)."""
    planes = np.unpackbits(buf, bitorder="little")
    if planes[count * bits:].any():
        raise CodecError(f"{name}: nonzero padding bits after {count} {bits}-bit fields")
    planes = planes[: count * bits].reshape(count, bits).astype(np.uint32)
    return (planes << np.arange(bits, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)


def sparseloco(chunk: int = 4096, k: int = 32) -> Codec:
    """Keeps the k largest magnitudes of every chunk of `chunk` values, as chunk-relative indices
    and 2-bit sign codes under a float32 scale per chunk: (log2(chunk) + 2) * k + 32 bits per chunk,
    14 + 1 bits per kept value at the defaults (4096, 32), 0.12 bits per parameter."""
    if not isinstance(chunk, (int, np.integer)) or not 2 <= chunk <= MAX_CHUNK or chunk & (chunk - 1):
        raise ValueError(f"sparseloco: chunk must be a power of two in [2, {MAX_CHUNK}], got {chunk!r}")
    if not isinstance(k, (int, np.integer)) or not 1 <= k <= chunk:
        raise ValueError(f"sparseloco: k must be an int in [1, chunk={chunk}], got {k!r}")
    chunk, k = int(chunk), int(k)
    bits = chunk.bit_length() - 1  # log2(chunk): a chunk-relative index
    name = f"sparseloco(chunk={chunk},k={k})"

    def layout(n: int) -> tuple[int, int, int, int, int]:
        """(full chunks, the last chunk's length if short else 0, kept values, index bytes, total bytes)."""
        full, tail = divmod(n, chunk)
        kept = full * k + min(k, tail)
        nc = full + (tail > 0)
        index_bytes = -(-kept * bits // 8)
        return full, tail, kept, index_bytes, 4 * nc + index_bytes + -(-kept * 2 // 8)

    def top(rows: np.ndarray, kk: int) -> np.ndarray:
        """Sorted column indices of each row's kk largest magnitudes."""
        if kk == rows.shape[1]:
            return np.broadcast_to(np.arange(kk), rows.shape).copy()
        idx = np.argpartition(-np.abs(rows), kk - 1, axis=1)[:, :kk]
        return np.sort(idx, axis=1)

    def quantise(vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(per-row scales, codes) of kept values [rows, kk]: 0 for 0, 1 for +scale, 2 for -scale,
        scale = the mean magnitude of the row's nonzero kept values (the least-squares magnitude of
        a sign code). Kept magnitudes are the chunk's largest, so they lie close together and a
        sign per value loses little; a zero level keeps a sparse chunk's zeros exact."""
        mag = np.abs(vals)
        nonzero = (mag > 0).sum(axis=1)
        mean = mag.sum(axis=1, dtype=np.float64) / np.maximum(nonzero, 1)
        scale = np.where(nonzero > 0, np.maximum(mean, _TINY), 0.0).astype(np.float32)
        codes = np.where(vals > 0, 1, np.where(vals < 0, 2, 0)).astype(np.uint8)
        return scale, codes

    def encode(x, state):
        flat = flat_f32(x)
        n = flat.size
        require_finite(n == 0 or bool(np.isfinite(flat).all()), name)
        full, tail, kept, _, _ = layout(n)
        scales, indices, codes = [], [], []
        for rows, kk in ((flat[: full * chunk].reshape(full, chunk), k),
                         (flat[full * chunk:].reshape(1 if tail else 0, tail), min(k, tail))):
            if rows.shape[0] == 0 or kk == 0:
                continue
            idx = top(rows, kk)
            s, c = quantise(np.take_along_axis(rows, idx, axis=1))
            scales.append(s), indices.append(idx.reshape(-1)), codes.append(c.reshape(-1))
        if not scales:
            return b"", state
        return (np.concatenate(scales).astype("<f4").tobytes() + _pack(np.concatenate(indices), bits)
                + _pack(np.concatenate(codes), 2)), state

    def decode(payload, shape):
        n = numel(shape)
        full, tail, kept, index_bytes, size = layout(n)
        buf = buffer(payload, size, name, shape)
        nc = full + (tail > 0)
        scales = buf[: 4 * nc].view("<f4").astype(np.float32)
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise CodecError(f"{name}: chunk scales must be finite and >= 0")
        idx = _unpack(buf[4 * nc: 4 * nc + index_bytes], kept, bits, name)
        codes = _unpack(buf[4 * nc + index_bytes:], kept, 2, name)
        if (codes == 3).any():
            raise CodecError(f"{name}: value code 3 is not a code (0: zero, 1: +scale, 2: -scale)")
        out = np.zeros(n, np.float32)
        for start, rows, kk, length, first in ((0, full, k, chunk, 0), (full * k, 1 if tail else 0, min(k, tail), tail, full)):
            if rows == 0 or kk == 0:
                continue
            r = idx[start: start + rows * kk].reshape(rows, kk)
            # strictly increasing within each chunk and inside it: no silent overwrite, no index error
            if (kk > 1 and not (r[:, 1:] > r[:, :-1]).all()) or (r[:, -1] >= length).any():
                raise CodecError(f"{name}: indices must be strictly increasing and < {length} within each chunk")
            at = (np.arange(first, first + rows)[:, None] * chunk + r).reshape(-1)
            values = _LEVELS[codes[start: start + rows * kk]].reshape(rows, kk) * scales[first: first + rows, None]
            out[at] = values.reshape(-1)
        require_finite(bool(np.isfinite(out).all()), name)  # a scale near float32's max times 3
        return out.reshape(shape)

    return Codec(name, stateless, encode, decode, lambda shape: layout(numel(shape))[4])


def bits_per_kept_value(chunk: int = 4096, k: int = 32) -> float:
    """Wire bits per kept value of a whole chunk, its scale's share included: log2(chunk) + 2 + 32 / k."""
    return 8 * sparseloco(chunk, k).payload_bytes((chunk,)) / k
