"""Each learner's batch rows (runtime.learner_batch): the same for all, given per learner, or set
from the learners' speeds so that their steps end at about the same time (issue 35 item 4;
docs/algorithm.md#unequal-hardware). One home for the rule: the checks, the memory estimate, the
learner units and the syncer's claim bounds all read `learner_batches`.
"""

from __future__ import annotations

import math

from diloco.config.schema import TrainConfig

AUTO = "auto"


def learner_speeds(cfg: TrainConfig) -> tuple[float, ...]:
    """Each learner's step-time factor as the runtimes apply it: a generated failure tape's
    (chaos.speeds cycled over the learners) replaces runtime.speeds, as in sim, threads and procs;
    () = 1.0 each."""
    r, c = cfg.runtime, cfg.chaos
    given = c.speeds if c.enabled else r.speeds
    return tuple(float(given[m % len(given)]) if given else 1.0 for m in range(r.learners))


def auto_batches(speeds: tuple[float, ...], batch: int, unit: int) -> tuple[int, ...]:
    """Rows per step of learners with these step-time factors: the fleet's len(speeds) x batch rows
    shared in proportion to 1 / speed, in whole multiples of `unit` (a learner's devices), at least
    one each, the rest by largest remainder (ties to the lower learner). A step of b rows at
    factor s takes s x b / batch of a step of `batch` rows at factor 1 (sim's model), so every
    learner's step takes about the same time and the total rows per step stay len(speeds) x batch.
    Equal speeds give `batch` each, exactly."""
    units = len(speeds) * batch // unit
    rates = [1.0 / s for s in speeds]
    ideal = [units * x / sum(rates) for x in rates]
    counts = [max(1, math.floor(x)) for x in ideal]
    while sum(counts) < units:
        m = max(range(len(counts)), key=lambda k: (ideal[k] - counts[k], -k))
        counts[m] += 1
    while sum(counts) > units:  # the floors of 1 took more than their share
        m = max((k for k in range(len(counts)) if counts[k] > 1), key=lambda k: (counts[k] - ideal[k], -k))
        counts[m] -= 1
    return tuple(c * unit for c in counts)


def learner_batches(cfg: TrainConfig) -> tuple[int, ...]:
    """Rows per step of each of the runtime.learners learners with every slice up (a learner added
    later by a tape, beyond these, takes data.batch_size)."""
    r, b = cfg.runtime, cfg.data.batch_size
    if r.learner_batch == AUTO:
        return auto_batches(learner_speeds(cfg), b, r.devices_per_learner)
    return tuple(r.learner_batch) or (b,) * r.learners


def learner_batch_errors(cfg: TrainConfig) -> list[str]:
    """runtime.learner_batch: auto, or M positive counts each a multiple of the learner's devices."""
    r, lb = cfg.runtime, cfg.runtime.learner_batch
    if isinstance(lb, str):
        if lb != AUTO:
            return [f"runtime.learner_batch={lb!r} must be {AUTO} or a list of runtime.learners={r.learners} "
                    "batch sizes"]
        if cfg.chaos.enabled and cfg.chaos.tape_file:
            return [f"runtime.learner_batch=auto takes the learners' speeds from the config; with "
                    f"chaos.tape_file={cfg.chaos.tape_file!r} they come from the tape: give the batches as a list"]
        return []
    if not lb:
        return []
    if len(lb) != r.learners:
        return [f"runtime.learner_batch={list(lb)} has {len(lb)} entries for runtime.learners={r.learners}"]
    bad = [b for b in lb if b < 1 or b % r.devices_per_learner]
    if bad:
        return [f"runtime.learner_batch={list(lb)}: {bad} must be positive multiples of "
                f"runtime.devices_per_learner={r.devices_per_learner} (each learner splits its rows over its devices)"]
    return []
