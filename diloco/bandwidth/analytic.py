"""Closed-form link bandwidth and bytes per step of data parallel and (Decoupled) DiLoCo.

Reference: docs/experiments.md#analytic-model; Decoupled DiLoCo (arXiv 2604.21428); Streaming DiLoCo
(arXiv 2501.18512).

Conventions: N values (parameters), M sites, b bits per value on the wire. In a bandwidth-optimal
ring all-reduce every site sends, and receives, 2 (M-1)/M * N values, so each figure here is per
site link and per direction. Rates are bits per second, sizes bytes, times seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco.algo import codecs

BF16_BITS = 16  # data parallel all-reduces bf16 gradients (docs/experiments.md#analytic-model)

# The codecs the model covers: every registered one. Their byte layouts are the codecs' own
# (Codec.payload_bytes), so the model and the wire cannot drift apart.
CODECS = tuple(codecs.CODECS)


def positive(name: str, value: float) -> float:
    """`value` as a float, or a ValueError naming it (bools, nan and inf are refused too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def count(name: str, value: int, minimum: int = 1) -> int:
    """`value` as an int >= minimum, or a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def ring_factor(M: int) -> float:
    """2 (M-1)/M: values each site sends per value all-reduced (0 for one site, -> 2 for many)."""
    M = count("M (sites)", M)
    return 2 * (M - 1) / M


def dp_bandwidth(N: float, M: int, T_window: float, bits: float = BF16_BITS) -> float:
    """W_DP ~ 2 (M-1)/M * N * b / T_window: the all-reduce of every gradient must fit in T_window.

    T_window <= step time: the part of the step the all-reduce can hide behind (the whole step
    at best, the backward pass if it must finish before the next forward needs the layer).
    """
    return ring_factor(M) * positive("N", N) * positive("bits", bits) / positive("T_window", T_window)


def diloco_bandwidth(N: float, M: int, P: int, tau: float, T_step: float, bits: float,
                     grace: float = 0.0, H: int | None = None) -> float:
    """W_DD ~ 2 (M-1)/M * (N/P) * b / (tau * T_step - xi_grace)   (docs/experiments.md#analytic-model).

    One fragment of N/P values leaves per step and may take tau steps to come back, less the
    syncer's grace window (docs/algorithm.md#grace-window, Eq. 3), which spends part of that time waiting.
    Given H, the link must also sustain one fragment per H/P steps, so the window is
    min(tau * T_step - xi, H/P * T_step): with P = H a fragment leaves every step and tau buys
    latency, not throughput (W doubles at tau = 2). H = None is the formula as docs/experiments.md#analytic-model
    writes it, which assumes H/P >= tau.
    """
    window = positive("tau", tau) * positive("T_step", T_step) - grace
    if grace < 0 or window <= 0:
        raise ValueError(f"grace must lie in [0, tau * T_step) = [0, {tau * T_step}), got {grace!r}")
    if H is not None:
        window = min(window, count("H", H) / count("P", P) * T_step)
    return ring_factor(M) * positive("N", N) / count("P", P) * positive("bits", bits) / window


def bandwidth_ratio(P: int, tau: float, bits: float, T_step: float = 1.0, T_window: float = 1.0,
                    grace: float = 0.0, H: int | None = None) -> float:
    """W_DP / W_DD ~ P * tau * (16 / b) * (T_step / T_window), less the grace's share of tau steps.

    48x at bf16 and 192x at 4 bits for P = 24, tau = 2, T_window = T_step, no grace; N and M
    cancel. With H given, tau is capped at H/P (see diloco_bandwidth): 24x and 96x at P = H = 24.
    """
    return (dp_bandwidth(1.0, 2, T_window)
            / diloco_bandwidth(1.0, 2, P, tau, T_step, bits, grace, H))


def wire_bits(codec: str, block: int = 64, topk_fraction: float = 0.01, chunk: int = 4096,
              chunk_k: int = 32) -> float:
    """Bits per value a codec of diloco/algo/codecs.py puts on the wire, block scales included, read
    from the codec's own payload size: of one whole block for a block format (its scale and codes),
    of one whole chunk for sparseloco (its scale, indices and codes), of one value for the others,
    and for top-k of one kept value times the fraction kept.

    zstd is not counted: what it saves depends on the data (a few % on int4 deltas, measured).
    """
    if codec == "topk":
        if not 0 < topk_fraction <= 1:
            raise ValueError(f"topk_fraction must lie in (0, 1], got {topk_fraction!r}")
        return 8 * _codec("topk", block, 1.0, chunk, chunk_k).payload_bytes((1,)) * topk_fraction
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; known: {list(CODECS)}")
    n = (count("block", block) if codec in codecs.BLOCK_FORMATS
         else count("chunk", chunk, 2) if codec == "sparseloco" else 1)
    return 8 * _codec(codec, block, topk_fraction, chunk, chunk_k).payload_bytes((n,)) / n


def payload_bytes(codec: str, n: int, block: int = 64, topk_fraction: float = 0.01, chunk: int = 4096,
                  chunk_k: int = 32) -> int:
    """Exact payload bytes of one tensor of n values: the codec's own layout (Codec.payload_bytes),
    no header, no zstd."""
    n = count("n (values)", n, minimum=0)
    wire_bits(codec, block, topk_fraction, chunk, chunk_k)  # validates the options, naming the bad one
    return _codec(codec, block, topk_fraction, chunk, chunk_k).payload_bytes((n,))


def _codec(codec: str, block: int, topk_fraction: float, chunk: int = 4096, chunk_k: int = 32) -> codecs.Codec:
    """The registered codec, built with only the options it takes (make_codec)."""
    return codecs.make_codec(codec, block=block, topk_fraction=topk_fraction, chunk=chunk, chunk_k=chunk_k)


def dp_bytes_per_step(N: float, M: int, bits: float = BF16_BITS) -> float:
    """Bytes one site sends (and receives) per step in a ring all-reduce: 2 (M-1)/M * N * b/8."""
    return ring_factor(M) * positive("N", N) * positive("bits", bits) / 8


@dataclass(frozen=True)
class StepBytes:
    """Bytes through one learner's link per inner step, each direction."""

    up: float
    down: float


def diloco_bytes_per_step(N: int, H: int, P: int, up: str = "int4", down: str = "int8", block: int = 64,
                          topk_fraction: float = 0.01, merges_per_round: float = 1.0, chunk: int = 4096,
                          chunk_k: int = 32) -> StepBytes:
    """Payload bytes per inner step of one Decoupled DiLoCo learner (headers and zstd not counted).

    Up: each of P fragments of N/P values leaves once per H steps. Down: every merge of a fragment
    is published to every live learner, `merges_per_round` times per fragment round: 1 when one
    merge answers each round (K = M, or a grace window that admits everyone), up to M with K = 1
    and no grace. down = "fp32" is the full-precision broadcast (no down codec).

    M does not appear: learners talk to the syncer, not around a ring, so a learner's link carries
    each fragment once per direction. Against a data-parallel site (dp_bytes_per_step) the up
    direction is therefore 2 (M-1)/M * H * 16 / b smaller, not H * 16 / b.
    """
    N = count("N", int(N) if isinstance(N, float) and N.is_integer() else N)
    H, P = count("H", H), count("P", P)
    if P > H:
        raise ValueError(f"P={P} fragments cannot each be sent once per H={H} steps; need P <= H")
    fragment = -(-N // P)
    per_round = P / H  # fragment sends per inner step
    return StepBytes(
        up=per_round * payload_bytes(up, fragment, block, topk_fraction, chunk, chunk_k),
        down=per_round * positive("merges_per_round", merges_per_round)
        * payload_bytes(down, fragment, block, topk_fraction, chunk, chunk_k))
