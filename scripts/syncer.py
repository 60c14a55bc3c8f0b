"""Host the syncer of a run whose learners are started apart (docs/cluster.md): this process spawns
and restarts the syncer, evaluates, and writes the run's metrics and summary.

    python scripts/syncer.py runtime.store.url=gs://bucket/run1 run.out_dir=/disk/run1 [overrides]
    python scripts/learner.py runtime.learner_index=0 <the same overrides>   # one per learner

Started again with the same command line (a Kubernetes or Slurm restart), it resumes the run from
its checkpoints and journal. Everything else is scripts/train.py's (options, errors, --describe).
"""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    args = sys.argv[1:]
    picked = [] if any(a.startswith("runtime=") for a in args) else ["runtime=procs"]
    sys.argv[1:] = [*picked, "runtime.launch=external", *args]
    runpy.run_path(str(Path(__file__).with_name("train.py")), run_name="__main__")
