"""Whether the syncer keeps up with its learners: the time of one fragment round on this host,
measured at start-up, against the rate at which the learners hand it rounds
(docs/design.md#does-the-syncer-keep-up).

A learner sends P/H fragments per step, so each fragment's round of M contributions arrives once
every H learner steps and the syncer works sum_p round_p per H steps: its share of the wall is
sum_p round_p / (H x step), (P/H) x round / step for fragments of one size. Above 1 it cannot keep
up: contributions queue, grace windows expire and learners stall.
"""

from __future__ import annotations

import os
import time
from typing import Callable, NamedTuple, Sequence

import numpy as np

from diloco.algo import hostpool, messages, payloads
from diloco.algo import syncer as sync
from diloco.algo.codecs import Codec
from diloco.config import TrainConfig

TOLERANCE = 0.1  # a fragment within 10% of a measured one's size is scaled from it, not measured
BUDGET_S = 2.0  # no further fragment is measured once this much has been spent (the largest always is)
AGAIN_S = 0.1  # a round shorter than this is timed twice
STEPS_PER_LEARNER = 3  # wall-clock runtimes: steps booked per learner before the step time is read


class Plan(NamedTuple):
    """What the check needs from the config (`plan`)."""

    H: int
    step_s: float | None  # the modelled step time (sim); None: read from the learners' first steps
    period_s: float = 0.0  # runtime.step_period_s: no learner's steps end closer together than this


class Rounds(NamedTuple):
    """One round of `learners` contributions per fragment on this host, as `measure` found it."""

    values: tuple[int, ...]  # per fragment
    seconds: tuple[float, ...]  # per fragment: measured, or scaled linearly in values from the nearest measured
    measured: tuple[int, ...]  # the fragments timed
    learners: int
    cost_s: float  # what measuring took, the contributions' encoding included


def plan(cfg: TrainConfig) -> Plan | None:
    """None when syncer.check_pace is off."""
    if not cfg.syncer.check_pace:
        return None
    r = cfg.runtime
    return Plan(cfg.fragments.H, r.step_time if r.kind == "sim" else None, r.step_period_s)


def share(rounds_s: Sequence[float], H: int, step_s: float) -> float:
    """The syncer's share of the wall: each fragment's round once per H learner steps of step_s."""
    return sum(rounds_s) / (H * step_s)


def warning(rounds: Rounds, H: int, step_s: float, up_spec: str, cores: int, threads: int) -> str | None:
    """The line that says the syncer cannot keep up, with its numbers and knobs; None when it can."""
    s = share(rounds.seconds, H, step_s)
    if s <= 1:
        return None
    P, M = len(rounds.values), rounds.learners
    big = max(range(P), key=lambda p: rounds.values[p])
    mean = sum(rounds.seconds) / P
    cap = os.environ.get(hostpool.ENV, "").strip() or "unset"
    return (f"the syncer cannot keep up: a round of M={M} contributions takes {rounds.seconds[big]:.3f} s on this "
            f"host for the largest fragment ({rounds.values[big]:,} values; {mean:.3f} s on average over P={P} "
            f"fragments of {min(rounds.values):,}..{rounds.values[big]:,} values), and the learners hand it P={P} "
            f"rounds every H={H} steps of {step_s:.4g} s: a share of (P/H) x round / step = {s:.2f} > 1 of the "
            f"wall on {cores} cores ({threads} syncer threads, {hostpool.ENV}={cap}). Contributions will queue, "
            f"grace windows expire and learners stall. Knobs: fewer fragments per period (fragments.count={P}, "
            f"or a larger fragments.H={H}), fewer contributions per round (runtime.learners={M}; each one is "
            f"decoded whatever syncer.quorum is), a smaller contribution codec (codec.up={up_spec}), or more "
            f"cores for the syncer host ({hostpool.ENV}); syncer.check_pace=false turns this check off")


def random_payloads(theta: dict, M: int, codec: Codec, rng) -> list[tuple[list, bytes]]:
    """M encoded random pseudo-gradients (N(0, 1e-3) per value) of a fragment shaped like `theta`:
    (the header's tensors, the payload) each."""
    out = []
    for _ in range(M):
        diff = {path: rng.standard_normal(x.shape, np.float32) * 1e-3 for path, x in theta.items()}
        out.append(payloads.pack_fragment(diff, codec)[:2])
    return out


def contribution_frame(p: int, version: int, m: int, seq: int, spec: str, tensors: list, payload: bytes,
                       c_steps: int, c_tokens: int, key: bytes | None = None) -> bytes:
    """Learner m's contribution to fragment p against `version` (incarnation 0)."""
    return messages.encode({"kind": "contribution", "learner": m, "incarnation": 0, "seq": seq, "fragment": p,
                            "base_version": version, "version": version, "c_steps": c_steps,
                            "c_tokens": c_tokens, "codec": spec, "delta_against": None, "tensors": tensors},
                           payload, key)


def round_seconds(policy: sync.Policy, fs: sync.FragmentState, M: int, codec: Codec, spec: str, rng,
                  clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of M `on_contribution` calls on a fresh syncer holding a copy of fragment `fs`, with
    quorum M so the M-th merges and publishes; the frames are built between the calls, untimed."""
    # K = M: the round is all M contributions; the norm bounds are off (their norms are still
    # taken), so a strict bound cannot quarantine a synthetic pseudo-gradient, and so is the check
    # of claims against steps reported (the synthetic learners report none).
    pol = policy._replace(grace=policy.grace._replace(K=M), norm_bound=0.0, theta_norm_bound=0.0, claim_slack=None)
    theta = {path: np.array(x, np.float32, copy=True) for path, x in fs.theta.items()}
    st = sync.init(pol, (fs.spec,), (theta,), {m: 0 for m in range(M)}, merges=False)
    ((tensors, payload),) = random_payloads(theta, 1, codec, rng)  # each learner sends the same values
    c_tokens = policy.step_tokens or 1
    seconds, actions = 0.0, ()
    for m in range(M):
        key = None if policy.auth is None else policy.auth.learner_key(m)
        frame = contribution_frame(0, 0, m, 1, spec, tensors, payload, 1, c_tokens, key)
        t = clock()
        st, actions = sync.on_contribution(pol, st, frame, 0.0)
        seconds += clock() - t
    if not any(isinstance(a, sync.Publish) for a in actions):
        raise RuntimeError(f"the synthetic round of fragment {fs.spec.index} did not merge: "
                           f"{st.quarantined or 'nothing quarantined'}")
    return seconds


def measure(policy: sync.Policy, state: sync.SyncerState, M: int, codec: Codec, spec: str, budget_s: float = BUDGET_S,
            clock: Callable[[], float] = time.perf_counter) -> Rounds:
    """Round times for every fragment of `state` (never changed), largest first: a fragment within
    TOLERANCE of a measured size, or any once budget_s is spent, is scaled from the nearest measured."""
    start = clock()
    rng = np.random.default_rng(0)
    values = tuple(fs.spec.size for fs in state.fragments)
    # One untimed round of the smallest fragment first: a process's first round pays one-off costs
    # (the decoder's first calls, the thread pool's start) that would triple a small round's time.
    round_seconds(policy, min(state.fragments, key=lambda fs: fs.spec.size), M, codec, spec, rng, clock)
    timed: dict[int, float] = {}
    for p in sorted(range(len(values)), key=lambda q: -values[q]):
        close = any(abs(values[p] - values[q]) <= TOLERANCE * values[q] for q in timed)
        if timed and (close or clock() - start > budget_s):
            continue
        timed[p] = round_seconds(policy, state.fragments[p], M, codec, spec, rng, clock)
        if timed[p] < AGAIN_S:  # a short round is mostly noise on a busy host: the better of two
            timed[p] = min(timed[p], round_seconds(policy, state.fragments[p], M, codec, spec, rng, clock))

    def scaled(p: int) -> float:
        q = min(timed, key=lambda q: abs(values[q] - values[p]))
        return timed[q] * values[p] / max(values[q], 1)

    seconds = tuple(timed[p] if p in timed else scaled(p) for p in range(len(values)))
    return Rounds(values, seconds, tuple(sorted(timed)), M, clock() - start)
