"""Studies made of whole training runs: T1 to T8 of docs/experiments.md#training-experiments-t1-to-t8
(specs, runner, measures, tables, plots), the chaos drill of the procs runtime
(docs/experiments.md#chaos-drill) and the fine-tuning study of docs/finetuning.md."""
