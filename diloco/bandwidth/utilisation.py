"""Compute utilisation of a training step whose syncs overlap compute layer by layer, and its inverse.

Reference: Streaming DiLoCo (Douillard et al., arXiv 2501.18512), section 3.1 and Table 4.

The model, one learner (one site) seen through its inter-site link:
* a step is a forward pass over L equal layers (`forward_share` of the step time) then a backward
  pass in reverse order; each layer holds N/L values;
* a method syncs fragment p (layers p, p + P, p + 2P, ...: Streaming DiLoCo's strided fragments)
  after every step s with s mod H == p * H // P (the offsets of diloco.algo.fragments);
* a layer's message enters the link as soon as that layer's backward is done (communication
  overlaps the rest of the backward pass, per layer); the link carries one message at a time,
  first in first out, 2 (M-1)/M * (N/L) * b bits each (ring all-reduce over M sites), and the
  result arrives 2 (M-1) hop latencies after its last bit left;
* the forward of that layer in step s + 1 + tau cannot start before the result arrived: tau = 0
  is blocking (data parallel, vanilla DiLoCo), tau >= 1 overlaps the sync with tau whole steps,
  and tau >= H, which only eager outer steps allow (docs/algorithm.md#eager-outer-steps), lets a
  sync take longer than the H steps until the same fragment leaves again.
Data parallel is H = P = 1 (every layer every step), vanilla DiLoCo P = 1 and H = 100.
Utilisation = compute time / wall time over the last sync period, once the schedule is periodic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from diloco.bandwidth.analytic import count, positive, ring_factor


@dataclass(frozen=True)
class Workload:
    """One learner's compute and its link to the other sites."""

    params: float  # N, values synchronised (the model size)
    step_time: float  # seconds of compute per inner step, forward + backward
    layers: int  # L, equal layers; communication overlaps compute at this granularity
    datacenters: int = 2  # M, sites in the ring all-reduce
    latency: float = 0.0  # one-way seconds per hop; a ring all-reduce takes 2 (M-1) hops
    forward_share: float = 1 / 3  # forward is 1/3 of a step's FLOPs (2N vs 4N per token)

    def __post_init__(self):
        positive("params", self.params)
        positive("step_time", self.step_time)
        count("layers", self.layers)
        count("datacenters", self.datacenters, minimum=2)
        if not (isinstance(self.latency, (int, float)) and 0 <= self.latency < math.inf):
            raise ValueError(f"latency must be a finite number >= 0, got {self.latency!r}")
        if not 0 < self.forward_share < 1:
            raise ValueError(f"forward_share must lie in (0, 1), got {self.forward_share!r}")


@dataclass(frozen=True)
class Method:
    """When and how precisely a method syncs: P strided layer fragments, each every H steps."""

    name: str
    H: int  # steps between two syncs of the same fragment (1: every step)
    P: int = 1  # fragments; one leaves every H / P steps
    tau: int = 0  # steps a sync may take before its layer's forward needs it (0: blocking)
    bits: float = 16  # bits per value on the wire

    def __post_init__(self):
        count("H", self.H)
        count("P", self.P)
        count("tau", self.tau, minimum=0)
        positive("bits", self.bits)
        if self.P > self.H:
            raise ValueError(f"{self.name}: P={self.P} fragments need P <= H={self.H}")


def data_parallel(bits: float = 16) -> Method:
    """All-reduce every layer's gradient every step, before that layer's next forward."""
    return Method("data parallel", H=1, bits=bits)


def vanilla_diloco(H: int = 100, bits: float = 16) -> Method:
    """The whole model every H steps, blocking (DiLoCo, arXiv 2311.08105)."""
    return Method("vanilla DiLoCo", H=H, bits=bits)


def streaming_diloco(layers: int, H: int = 100, layers_per_fragment: int = 3, tau: int = 1,
                     bits: float = 4) -> Method:
    """Streaming DiLoCo with overlapped FP4: fragments of 3 strided layers, applied 1 step late."""
    P = count("layers", layers) // count("layers_per_fragment", layers_per_fragment)
    if P < 1:
        raise ValueError(f"layers={layers} < layers_per_fragment={layers_per_fragment}: no fragment")
    return Method("streaming + overlapped FP4" if bits == 4 else f"streaming, {bits:g} bits",
                  H=H, P=P, tau=tau, bits=bits)


def decoupled_diloco(H: int = 24, P: int = 24, tau: int = 2, bits: float = 4.5) -> Method:
    """Decoupled DiLoCo's setting: P = H = 24, tau = 2, int4 with a float32 scale per 64 values."""
    return Method("Decoupled DiLoCo", H=H, P=P, tau=tau, bits=bits)


def eager_diloco(H: int = 24, P: int = 24, tau: int = 48, bits: float = 4.5) -> Method:
    """Decoupled DiLoCo with eager outer steps: as decoupled_diloco, each merge applied tau steps late."""
    return Method(f"eager, tau = {tau}", H=H, P=P, tau=tau, bits=bits)


def by_depth(w: Workload, gbps: float, depths: tuple[int, ...], H: int = 24, P: int = 24,
             bits: float = 4.5) -> dict[int, float]:
    """Utilisation of Decoupled DiLoCo's schedule at each overlap depth tau (the overlapped rows of
    docs/experiments.md#t11-eager-outer-steps): tau < H is today's overlap, tau >= H needs eager steps.
    """
    return {tau: utilisation(w, eager_diloco(H, P, tau, bits), gbps) for tau in depths}


def utilisation(w: Workload, m: Method, gbps: float, periods: int = 4) -> float:
    """Compute time / wall time of `m` on `w` over a link of `gbps` Gbit/s, in steady state.

    Simulates `periods` sync periods of H steps and measures the last: the schedule repeats every
    H steps and a backlog cannot outgrow tau + 1 steps (each forward waits for its own layer), so
    a few periods reach the periodic regime (4 and 12 agree to machine precision in the tests).
    With tau >= H (eager steps) a stall can shift the next period's sends past their own gates, so
    the regime may repeat only every q + 1 periods (q = tau // H): the last lcm(1..q+1) periods are
    measured, after 5 (q + 1) periods to settle (a link too slow for the bytes fills a backlog of up
    to tau steps first: 2 Gbit/s and tau = 96 below read 0.491 after 7 periods, 0.4876 after 20).
    """
    L, H = w.layers, m.H
    if m.P > L:
        raise ValueError(f"{m.name}: P={m.P} fragments need at least as many layers, got layers={L}")
    count("periods", periods, minimum=2)
    fwd = w.forward_share * w.step_time / L
    bwd = (1 - w.forward_share) * w.step_time / L
    per_layer = ring_factor(w.datacenters) * w.params / L * m.bits / (positive("gbps", gbps) * 1e9)
    delay = 2 * (w.datacenters - 1) * w.latency
    # phase (step mod H) -> layers sent after that step, in the order the backward frees them.
    sends: dict[int, list[int]] = {}
    for p in range(m.P):
        sends.setdefault(p * H // m.P, []).extend(range(p, L, m.P))
    sends = {phase: sorted(layers, reverse=True) for phase, layers in sends.items()}
    layer = np.arange(L)
    gates: dict[int, np.ndarray] = {}  # step -> per layer, when its forward may start
    t = link = measured_from = 0.0
    q = m.tau // H
    window = math.lcm(*range(1, q + 2)) * H
    steps = periods * H if q == 0 else max(periods * H, 5 * (q + 1) * H + window)
    for s in range(1, steps + 1):
        if s == steps - window + 1:
            measured_from = t
        gate = gates.pop(s, None)
        # Forward of layer l starts at max(end of layer l - 1, gate[l]); unrolled, the pass ends
        # at max_l(max(gate[l], t) - l * fwd) + L * fwd.
        fwd_end = t + L * fwd if gate is None else float(np.max(np.maximum(gate, t) - layer * fwd)) + L * fwd
        for l in sends.get(s % H, ()):
            ready = fwd_end + (L - l) * bwd  # layer l's backward is done
            link = max(ready, link) + per_layer
            due = gates.setdefault(s + 1 + m.tau, np.full(L, -np.inf))
            due[l] = max(due[l], link + delay)
        t = fwd_end + L * bwd
    return window * w.step_time / (t - measured_from)


def required_bandwidth(w: Workload, m: Method, target: float, lo: float = 1e-4, hi: float = 1e7,
                       rel_tol: float = 1e-4) -> float:
    """Smallest Gbit/s with utilisation >= target: bisection on log(bandwidth).

    Utilisation only grows with bandwidth (every arrival is a max-plus function of message
    times), so bisection is exact up to rel_tol. Returns inf where even `hi` falls short, which
    latency causes: a blocking sync always costs at least 2 (M-1) hop latencies.
    """
    if not 0 < target < 1:
        raise ValueError(f"target utilisation must lie in (0, 1), got {target!r}")
    if not 0 < positive("lo", lo) < positive("hi", hi):
        raise ValueError(f"need 0 < lo < hi, got lo={lo!r}, hi={hi!r}")
    if utilisation(w, m, hi) < target:
        return math.inf
    if utilisation(w, m, lo) >= target:
        return lo
    a, b = math.log(lo), math.log(hi)
    while b - a > rel_tol:
        mid = (a + b) / 2
        if utilisation(w, m, math.exp(mid)) >= target:
            b = mid
        else:
            a = mid
    return math.exp(b)
