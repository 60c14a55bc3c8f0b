"""Peak host memory of a procs fine-tune of SmolLM2-135M-Instruct, summed over its processes.

    python benchmarks/procs_memory.py                          # this checkout, 4 learners
    python benchmarks/procs_memory.py --repos /old/checkout .  # two checkouts, one after the other

Runs `scripts/train.py` of each checkout on the same short full fine-tune (runtime.kind=procs,
`--learners` learners of one device each, a few steps of short rows) and samples every process of
the run (supervisor, syncer, learners) every `--every` seconds: the proportional set size (PSS:
pages shared between processes counted once in all) summed over the tree, its peak, and each
process's peak. Writes benchmarks/results/procs_memory.json. Needs `make smollm2`; the run's start-up check
refuses what the machine cannot hold (2 learners are estimated at 23.7 GiB,
docs/design.md#memory-before-a-run). `--setup-only` needs about 2 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def chats(path: Path, n: int = 64) -> Path:
    """`n` short conversations a line, enough rows for a few steps of every learner."""
    lines = [{"prompt": f"What is {a} plus {b}?", "response": f"{a} plus {b} is {a + b}."}
             for a in range(8) for b in range(n // 8)]
    path.write_text("\n".join(map(json.dumps, lines)) + "\n")
    return path


def sample(root: psutil.Process) -> dict[int, int]:
    """pid -> PSS bytes of `root` and every descendant alive now."""
    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            out[p.pid] = p.memory_full_info().pss
        except psutil.Error:
            continue
    return out


def measure(repo: Path, args, data: Path, out_dir: Path) -> dict:
    cmd = [sys.executable, str(repo / "scripts/train.py"), "model.init_from=smollm2", "data=sft",
           f"data.paths=[{data}]", f"data.data_dir={out_dir / 'data'}", f"run.out_dir={out_dir / 'run'}",
           f"run.steps={args.steps}", "inner.warmup_steps=1", "inner.lr=1e-4", "runtime.kind=procs",
           f"runtime.learners={args.learners}", "runtime.devices_per_learner=1", f"data.seq_len={args.seq_len}",
           "data.batch_size=2", "fragments.H=2", "fragments.count=2", "fragments.tau=1", "run.eval_every=0", "run.tensorboard=false", "run.plot=false",
           "run.progress=false"]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    peak_total, peak_pid, samples = 0, {}, 0
    while proc.poll() is None:
        now = sample(root)
        samples += 1
        peak_total = max(peak_total, sum(now.values()))
        for pid, pss in now.items():
            peak_pid[pid] = max(peak_pid.get(pid, 0), pss)
        time.sleep(args.every)
    output = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"{repo}: the run failed (rc {proc.returncode}):\n{output[-3000:]}")
    return {"repo": str(repo), "commit": _commit(repo),
            "wall_s": round(time.monotonic() - t0, 1), "samples": samples,
            "peak_pss_gib": round(peak_total / 2**30, 3),
            "peak_pss_gib_supervisor": round(peak_pid.get(proc.pid, 0) / 2**30, 3),
            # the spawned children (syncer, learners, multiprocessing's helper) are not told apart
            "peak_pss_gib_children": sorted((round(b / 2**30, 3) for pid, b in peak_pid.items() if pid != proc.pid),
                                            reverse=True)}


# One child's start (procs/child.py child_setup) on its own in a fresh process: the store holds
# what the supervisor writes before spawning (the run control, and Theta_0 where the checkout keeps
# it there); the child's peak RSS is what it took to get its Setup, before any step.
CHILD = r"""
import json, resource, sys, time
from diloco import store as bs
from diloco.config import TrainConfig, from_dict, validate
from diloco.runtime.procs import child
cfg = validate(from_dict(TrainConfig, json.loads(sys.argv[1])))
t0 = time.perf_counter()
setup = child.child_setup(cfg, bs.BlobStore(sys.argv[2], sync=False))
print(json.dumps({"child_setup_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
                  "child_setup_s": round(time.perf_counter() - t0, 2)}))
"""

SUPERVISOR = r"""
import json, resource, sys
from diloco import store as bs
from diloco.config import TrainConfig, from_dict, to_dict, validate
from diloco.inputs import load_inputs
from diloco.runtime import build
from diloco.runtime.procs import child
cfg = to_dict(TrainConfig())
for section, values in json.loads(sys.argv[1]).items():
    cfg[section].update(values)
cfg, corpus, model, _ = load_inputs(validate(from_dict(TrainConfig, cfg)))
setup = build.build(cfg, corpus, model)
store = bs.BlobStore(sys.argv[2], sync=False)
try:
    from diloco.runtime.procs import theta0
    theta0.publish(store, setup.theta0)
    fp = theta0.fingerprint(setup.theta0)
except ImportError:  # a checkout from before Theta_0 went through the store
    fp = child.fingerprint(setup.theta0)
bs.write_control(store, "run", {"theta0": fp, "learners": cfg.runtime.learners})
print(json.dumps({"resolved": to_dict(cfg)}))
"""


def setup_only(repo: Path, args, data: Path, out_dir: Path) -> dict:
    """Peak RSS of one procs child getting its Setup, in a fresh process, for checkout `repo`."""
    cfg = {"model": {"init_from": "smollm2"},
           "data": {"source": "sft", "paths": [str(data)], "data_dir": str(out_dir / "data"), "seq_len": args.seq_len,
                    "batch_size": 2},
           "runtime": {"kind": "procs", "learners": args.learners, "devices_per_learner": 1},
           "fragments": {"count": 2, "H": 2, "tau": 1}}
    env = {**os.environ, "PYTHONPATH": str(repo)}
    url = f"file://{out_dir / 'store'}"
    sup = subprocess.run([sys.executable, "-c", SUPERVISOR, json.dumps(cfg), url], cwd=repo, env=env,
                         capture_output=True, text=True)
    if sup.returncode != 0:
        raise SystemExit(f"{repo}: the supervisor's part failed:\n{sup.stderr[-3000:]}")
    resolved = json.loads(sup.stdout.strip().splitlines()[-1])["resolved"]
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(resolved), url], cwd=repo, env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{repo}: the child failed:\n{out.stderr[-3000:]}")
    return {"repo": str(repo), "commit": _commit(repo), **json.loads(out.stdout.strip().splitlines()[-1])}


def _commit(repo: Path) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repos", nargs="+", default=[str(ROOT)], help="checkouts to measure, in order")
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--setup-only", action="store_true", help="one child's start alone, not a whole run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        data = chats(Path(tmp) / "chat.jsonl")
        for i, repo in enumerate(args.repos):
            how = setup_only if args.setup_only else measure
            runs.append(how(Path(repo).resolve(), args, data, Path(tmp) / f"run{i}"))
            print(json.dumps(runs[-1]), flush=True)
    name = "procs_child_memory" if args.setup_only else "procs_memory"
    path = write(name, {"learners": args.learners, "steps": args.steps, "seq_len": args.seq_len, "runs": runs},
                 args.out)
    print(path)


if __name__ == "__main__":
    main()
