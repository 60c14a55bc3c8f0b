"""Runtimes deliver events to the pure learner and syncer state machines: sim (virtual clock)."""
