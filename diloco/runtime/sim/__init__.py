"""The sim runtime: a virtual clock, one process, a modelled link and chaos tapes (docs/design.md#sim)."""

from diloco.runtime.sim.runtime import Sim, run

__all__ = ["Sim", "run"]
