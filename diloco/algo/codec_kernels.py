"""The block codecs' loops, compiled with numba: one pass over the input per encode and one over
the payload per decode (docs/algorithm.md#codecs; the wire format is codecs.py's docstring).

numpy needed about ten passes per chunk (abs, block max, divide, repeat, multiply, round, cast,
mask, shift, or): about 2 GB/s of float32 on one core, against 7-11 GB/s for memcpy. Here each
block of `block` values is read once into L1, its absmax found, and its codes computed and packed
while it is still there. The arithmetic is numpy's, operation for operation, in float32 (numba
does not reassociate or fuse float operations unless asked to, and nothing here asks), so the
bytes are the same as the numpy codecs': tests/test_codecs.py::test_golden_wire_bytes pins them.

Imported on the first encode or decode, so importing the codecs does not load numba. cache=True
keeps the compiled code in __pycache__, so a process after the first loads it instead of compiling.
nogil=True: learner threads encode in parallel.

The syncer's per-contribution passes (diloco/algo/roundsum.py) are here too: the delta and its two
norms in one pass, and the running-sum update. Their float32 arithmetic is numpy's, operation for
operation, so the deltas and sums are bit-identical; the norms are float64 sums of exact float64
squares, accumulated in independent lanes so the loop vectorises without fastmath.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from diloco.algo.codec_base import FP4, INT

_TINY = np.float32(2.0**-126)  # smallest normal float32: floor for nonzero block scales
_ABS = np.uint32(0x7FFFFFFF)
_EXP = np.uint32(0x7F800000)  # |x| bits at or above this: inf or nan
# y + 1.5 * 2^23 rounds y to an integer, half to even, as np.rint does, for |y| < 2^22 (here
# |y| <= 127 and a little): the float's low mantissa bits are then that integer, two's complement.
_MAGIC = np.float32(12582912.0)
_MAGIC_BITS = np.int32(0x4B400000)


@njit(inline="always")
def _int_code(y):
    return np.uint8(np.float32(y + _MAGIC).view(np.uint32) & np.uint32(0xFF))


@njit(inline="always")
def _two_bit_code(y):
    # levels -3, -1, 1, 3 sit at u = (y + 3) / 2 = 0, 1, 2, 3; rint, then clip to the four codes
    u = np.float32((y + np.float32(3.0)) * np.float32(0.5) + _MAGIC).view(np.int32) - _MAGIC_BITS
    return np.uint8(min(max(u, 0), 3))


@njit(inline="always")
def _fp4_class(y):
    # codecs._fp4_format: the code depends only on a float's top 10 bits
    return np.float32(y).view(np.uint32) >> np.uint32(22)


@njit(cache=True, nogil=True)
def encode_blocks(x, u, kind, bits, levels, classes, scales, packed):
    """Fills scales (nb,) and packed (nb, block * bits / 8) from x (nb, block) float32 and its
    uint32 view u; False (and the outputs part-written) at the first block holding inf or nan."""
    nb, block = x.shape
    for b in range(nb):
        # Non-negative floats order like their bit patterns, and nan's bits sit above inf's, so
        # one integer max finds the absmax and any non-finite value at once.
        m = np.uint32(0)
        for i in range(block):
            m = max(m, u[b, i] & _ABS)
        if m >= _EXP:
            return False
        s = np.uint32(m).view(np.float32) / levels
        floor = max(s, _TINY)
        inv = np.float32(1.0) / floor
        scales[b] = floor if s > np.float32(0.0) else s  # an all-zero block stores 0
        if bits == 8:
            for i in range(block):
                packed[b, i] = _int_code(x[b, i] * inv)
        elif kind == INT:  # int4: first code in the low nibble
            for j in range(block // 2):
                packed[b, j] = ((_int_code(x[b, 2 * j] * inv) & 15)
                                | ((_int_code(x[b, 2 * j + 1] * inv) & 15) << 4))
        elif kind == FP4:
            for j in range(block // 2):
                packed[b, j] = (classes[_fp4_class(x[b, 2 * j] * inv)]
                                | (classes[_fp4_class(x[b, 2 * j + 1] * inv)] << 4))
        else:  # 2-bit, four codes a byte
            for j in range(block // 4):
                packed[b, j] = (_two_bit_code(x[b, 4 * j] * inv)
                                | (_two_bit_code(x[b, 4 * j + 1] * inv) << 2)
                                | (_two_bit_code(x[b, 4 * j + 2] * inv) << 4)
                                | (_two_bit_code(x[b, 4 * j + 3] * inv) << 6))
    return True


@njit(cache=True, nogil=True)
def scales_ok(scales):
    """Every block scale finite and >= 0 (a nan fails both comparisons)."""
    for b in range(scales.size):
        if not (scales[b] >= np.float32(0.0) and scales[b] < np.float32(np.inf)):
            return False
    return True


@njit(cache=True, nogil=True)
def decode_blocks(packed, scales, kind, bits, lut, lut_max, out):
    """Fills out (nb, block) with lut[code] * scale from packed (nb, block * bits / 8); False if
    any value is not finite (only a forged scale overflows)."""
    nb, block = out.shape
    for b in range(nb):
        s = scales[b]
        if bits == 8:  # int8: the code is the value, two's complement
            for i in range(block):
                c = np.int32(packed[b, i])
                out[b, i] = np.float32(c - ((c & 128) << 1)) * s
        elif kind == INT:  # int4: sign-extend each nibble (lut[c] is exactly this small integer)
            for j in range(block // 2):
                lo = np.int32(packed[b, j] & 15)
                hi = np.int32(packed[b, j] >> 4)
                out[b, 2 * j] = np.float32(lo - ((lo & 8) << 1)) * s
                out[b, 2 * j + 1] = np.float32(hi - ((hi & 8) << 1)) * s
        elif bits == 4:
            for j in range(block // 2):
                out[b, 2 * j] = lut[packed[b, j] & 15] * s
                out[b, 2 * j + 1] = lut[packed[b, j] >> 4] * s
        else:
            for j in range(block // 4):
                for k in range(4):
                    out[b, 4 * j + k] = lut[(packed[b, j] >> (2 * k)) & 3] * s
        # Rounding is monotone, so when the largest |code| times the scale is finite every value
        # of the block is; otherwise each value is checked, as np.isfinite would.
        if not np.isfinite(lut_max * s):
            for i in range(block):
                if not np.isfinite(out[b, i]):
                    return False
    return True


# Independent float64 partial sums per norm: without fastmath LLVM keeps a float sum in program
# order, so a single accumulator is one serial add per value (the first numba delta was slower
# than numpy for it, docs/experiments.md#syncer-round); sixteen lanes are one vector add per lane
# group. The square of a float32 in float64 is exact and at most 1.2e77, so no sum of fewer than
# 2^200 of them overflows or underflows: the norm is finite whenever every value is, and no slice
# needs the 2^-+80 rescaling the float32 dots did.
_LANES = 16


@njit(cache=True, nogil=True)
def delta_sumsq(anchor, ref, d):
    """d = anchor - (ref - d) over d (1-D float32; numpy's two subtractions, in order), and the
    float64 sums of squares of d before and after: (wire, delta). A non-finite value makes its sum
    inf or nan."""
    n = d.size
    m = n - n % _LANES
    wl = np.zeros(_LANES, np.float64)
    dl = np.zeros(_LANES, np.float64)
    for i in range(0, m, _LANES):
        for j in range(_LANES):
            w = d[i + j]
            x = anchor[i + j] - (ref[i + j] - w)
            d[i + j] = x
            wl[j] += np.float64(w) * np.float64(w)
            dl[j] += np.float64(x) * np.float64(x)
    for i in range(m, n):
        w = d[i]
        x = anchor[i] - (ref[i] - w)
        d[i] = x
        wl[0] += np.float64(w) * np.float64(w)
        dl[0] += np.float64(x) * np.float64(x)
    return wl.sum(), dl.sum()


@njit(cache=True, nogil=True)
def sumsq(x):
    """The float64 sum of squares of a 1-D float32 array (inf or nan if a value is not finite)."""
    n = x.size
    m = n - n % _LANES
    acc = np.zeros(_LANES, np.float64)
    for i in range(0, m, _LANES):
        for j in range(_LANES):
            acc[j] += np.float64(x[i + j]) * np.float64(x[i + j])
    for i in range(m, n):
        acc[0] += np.float64(x[i]) * np.float64(x[i])
    return acc.sum()


@njit(cache=True, nogil=True)
def axpy(d, old, a, old_scaled):
    """d = d + a old (old_scaled) or d = a d + old, over d (1-D float32, a float32): numpy's
    multiply then add, rounded apart (no fused multiply-add without fastmath)."""
    if old_scaled:
        for i in range(d.size):
            d[i] = d[i] + old[i] * a
    else:
        for i in range(d.size):
            d[i] = d[i] * a + old[i]
