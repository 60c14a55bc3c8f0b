"""The pieces benchmarks/syncer_round.py builds and times its rounds from: a layer-like fragment, the
run's default syncer policy, encoded contributions and their frames, one timed round, roundsum's
passes swapped for a baseline's, and the memcpy and memory readings a round is set against.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from pathlib import Path

import numpy as np

from diloco.algo import codec_specs, quorum, roundsum
from diloco.algo import syncer as sync
from diloco.algo.outer import make_outer
from diloco.runtime import keepup

WIDTH = 768  # the rows of a d_model = 768 layer


def fragment_values(n: int, rng) -> dict:
    """A layer-like fragment of about n values: three matrices of WIDTH columns and a vector."""
    rows = max(1, n // WIDTH)
    split = (max(1, rows // 2), max(1, rows * 3 // 10), max(1, rows - rows // 2 - rows * 3 // 10))
    shapes = {("layer", "attn"): (split[0], WIDTH), ("layer", "mlp"): (split[1], WIDTH),
              ("layer", "out"): (split[2], WIDTH), ("layer", "norm"): (WIDTH,)}
    return {p: (rng.standard_normal(s, np.float32) * 0.02) for p, s in shapes.items()}


def policy(M: int, up: str, down: str, outer_stats: bool = False) -> sync.Policy:
    return sync.Policy(quorum.GraceConfig(K=M, gamma=0.0), make_outer("nesterov"), merge="rda",
                       down_codec=codec_specs.codec_from_spec(down), down_spec=down, up_spec=up,
                       outer_stats=outer_stats)


def payloads_for(st, p: int, M: int, codec, rng) -> list[tuple[list, bytes]]:
    """M encoded contributions to fragment p: (tensors, payload) each."""
    return keepup.random_payloads(st.fragments[p].theta, M, codec, rng)


def frames_of(st, p: int, payloads, seq: int, spec: str) -> list[bytes]:
    """One frame per payload, learner m sending the m-th, against fragment p's current version."""
    version = st.fragments[p].version
    return [keepup.contribution_frame(p, version, m, seq, spec, tensors, payload, 24, 24 * 4096 * (1 + m % 3))
            for m, (tensors, payload) in enumerate(payloads)]


def frames_for(st, p: int, M: int, seq: int, codec, spec: str, rng) -> list[bytes]:
    return frames_of(st, p, payloads_for(st, p, M, codec, rng), seq, spec)


PASSES = ("delta", "_axpy", "norm", "delta_of_local")  # what roundsum's fold and the syncer call per contribution


def passes_of(path: str | None) -> tuple[dict, dict | None]:
    """(the current roundsum passes, those of the roundsum file at `path`, or None)."""
    current = {name: getattr(roundsum, name) for name in PASSES}
    if path is None:
        return current, None
    spec = importlib.util.spec_from_file_location("roundsum_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return current, {name: getattr(module, name) for name in PASSES}


def use(passes: dict) -> None:
    for name, f in passes.items():
        setattr(roundsum, name, f)


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def one_round(pol, st, frames) -> tuple[object, float, float]:
    t0 = time.perf_counter()
    for fr in frames[:-1]:
        st, _ = sync.on_contribution(pol, st, fr, 1.0)
    t1 = time.perf_counter()
    st, actions = sync.on_contribution(pol, st, frames[-1], 1.0)
    t2 = time.perf_counter()
    assert any(isinstance(a, sync.Publish) for a in actions), "the round did not merge"
    return st, t2 - t0, t2 - t1


def memcpy(dst, src, times: int) -> float:
    """Seconds to copy src to dst `times` times: the round's fp32 bytes, without holding M copies."""
    t = time.perf_counter()
    for _ in range(times):
        np.copyto(dst, src)
    return time.perf_counter() - t


def memory_mb() -> tuple[float, float]:
    """(resident, peak resident since the last reset_peak) of this process, MB (Linux)."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
