"""Small-scale training experiments T1 to T8 of docs/experiments.md#training-experiments-t1-to-t8: specs, runner, report."""
