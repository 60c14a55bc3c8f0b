"""Analytic and compute-utilisation bandwidth model of data parallel, DiLoCo and Decoupled DiLoCo.

Reference: docs/experiments.md#bandwidth; Streaming DiLoCo (arXiv 2501.18512) section 3.1 and Table 4;
Decoupled DiLoCo (arXiv 2604.21428).

analytic: closed-form W_DP, W_DD, their ratio, bytes per step of data parallel and DiLoCo.
blog: what the blog's 198 -> 0.84 Gbit/s implies (formula and simulation).
utilisation: per-layer overlap simulator and the bandwidth that reaches a target utilisation.
table4: Streaming DiLoCo Table 4 and the assumptions that reproduce it.
measured: a training run's byte ledger against the analytic figures.
report: the configurable report written by scripts/bandwidth.py.
"""

from diloco.bandwidth.analytic import (bandwidth_ratio, diloco_bandwidth, diloco_bytes_per_step, dp_bandwidth,
                                       dp_bytes_per_step, payload_bytes, ring_factor, wire_bits)
from diloco.bandwidth.blog import blog_claim
from diloco.bandwidth.measured import measured_vs_analytic
from diloco.bandwidth.utilisation import (Method, Workload, data_parallel, decoupled_diloco, required_bandwidth,
                                          streaming_diloco, utilisation, vanilla_diloco)

__all__ = [
    "Method", "Workload", "bandwidth_ratio", "blog_claim", "data_parallel", "decoupled_diloco",
    "diloco_bandwidth", "diloco_bytes_per_step", "dp_bandwidth", "dp_bytes_per_step", "measured_vs_analytic",
    "payload_bytes", "required_bandwidth", "ring_factor", "streaming_diloco", "utilisation", "vanilla_diloco",
    "wire_bits",
]
