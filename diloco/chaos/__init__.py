"""Chaos: the chip-failure model, the failure tapes training runtimes replay, and the million-chip
goodput simulator calibrated on the paper's data-parallel rows (docs/experiments.md#goodput-at-millions-of-chips)."""
