"""The sim runtime: a virtual clock, one process, a modelled link and chaos tapes (docs/design.md#sim)."""

from diloco.runtime.sim.driver import run
from diloco.runtime.sim.runtime import Sim

__all__ = ["Sim", "run"]
