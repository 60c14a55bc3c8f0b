"""Small-scale training experiments T1 to T8 of EXPERIMENTS.md section 3: specs, runner, report."""
