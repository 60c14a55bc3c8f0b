"""Run one learner of a run whose syncer is hosted by scripts/syncer.py (docs/cluster.md), as its
next incarnation; coupled to the run only through the store and the config.

    python scripts/learner.py runtime.learner_index=3 <the syncer's overrides>

Exits 0 when the learner is done (or the run is), 143 after SIGTERM (it checkpoints first), 75 when
its chaos tape took its slices, 76 when a newer copy of it has started: restart it on non-zero
(Kubernetes restartPolicy: OnFailure, Slurm --requeue) and it rejoins. kill -9 is fine too.
"""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    args = sys.argv[1:]
    if not any(a.startswith("runtime.learner_index=") for a in args) and not {"--describe", "--help", "-h"} & set(args):
        sys.exit("error: scripts/learner.py needs runtime.learner_index=<0..learners-1> (the learner it runs)")
    picked = [] if any(a.startswith("runtime=") for a in args) else ["runtime=procs"]
    sys.argv[1:] = [*picked, "runtime.launch=external", *args]
    runpy.run_path(str(Path(__file__).with_name("train.py")), run_name="__main__")
