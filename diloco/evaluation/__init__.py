"""Evaluating a model: its loss on text (loss.py) and its scores on downstream tasks read from
local lm-eval YAML or BIG-bench JSON files (tasks.py, harness.py); docs/evaluation.md."""

from diloco.evaluation.loss import (EvaluateConfig, bits_per_byte, mean_loss, parse, run,  # noqa: F401
                                    windows)
