"""A run's failure tape (diloco/chaos/tapes.py), and that tape read on a wall clock: `scale` wall
seconds per tape second. The threads and procs learners ask it, at each step boundary, whether the
learner is up, how many batch rows its live slices compute, and when a dead one gets a slice back;
the sim runtime reads the same tape in virtual time."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from diloco.chaos import tapes
from diloco.config import TrainConfig
from diloco.config.learner_batch import learner_batches


def chaos_tape(cfg: TrainConfig) -> tapes.Tape | None:
    """The failure tape of a run, over a horizon long enough for every learner to finish."""
    if not cfg.chaos.enabled:
        return None
    if cfg.chaos.tape_file:  # the same failures in another runtime, or a hand-written drill
        return tapes.from_json(Path(cfg.chaos.tape_file).read_text())
    r = cfg.runtime
    slowest = max([*r.speeds, *cfg.chaos.speeds, 1.0])
    return tapes.generate(cfg.chaos, r.learners, horizon_s=4 * cfg.run.steps * r.step_time * slowest)


def run_tape(cfg: TrainConfig, run_dir: Path | None) -> tapes.Tape | None:
    """chaos_tape (generated, or read from chaos.tape_file), written to <run_dir>/chaos_tape.json."""
    tape = chaos_tape(cfg)
    if tape is not None and run_dir is not None:
        (run_dir / "chaos_tape.json").write_text(tapes.to_json(tape))
    return tape


class WallTape(NamedTuple):
    tape: tapes.Tape
    scale: float  # wall seconds per tape second (chaos.wall_scale)
    batches: tuple[int, ...]  # each learner's rows with every slice up (runtime.learner_batch)
    devices: int  # rows stay a multiple of the learner's devices

    @classmethod
    def of(cls, cfg: TrainConfig, tape: tapes.Tape | None) -> WallTape | None:
        if tape is None:
            return None
        return cls(tape, cfg.chaos.wall_scale, learner_batches(cfg), cfg.runtime.devices_per_learner)

    def alive(self, m: int, wall: float) -> bool:
        return tapes.is_alive(self.tape, m, wall / self.scale)

    def rows(self, m: int, wall: float) -> int:
        return tapes.batch_rows(self.tape, m, wall / self.scale, self.batches[m], self.devices)

    def back_at(self, m: int, wall: float) -> float:
        """Wall time at which learner m, dead at `wall`, has a slice again (inf: never)."""
        return tapes.back_at(self.tape, m, wall / self.scale) * self.scale

    def smaller_batches(self, m: int) -> tuple[int, ...]:
        """Every batch learner m short of slices computes: compile them before the clock starts."""
        options = tapes.rows_options(self.tape, self.batches[m], self.devices)
        return tuple(sorted(set(options) - {self.batches[m]}))
