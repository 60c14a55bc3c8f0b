"""The wall-clock runtimes side by side on this machine with one config: fan-in to the syncer
(contributions and MB a second), start-up (the call until the syncer's clock starts, every learner
compiled), peak memory of each learner's process, and the time from a learner's death to the first
merge that holds its next incarnation's work (procs: kill -9 of its process; ray: ray.kill of its
actor, which Ray restarts).

    python benchmarks/scaleout.py --steps 40 --repeats 2

Ray runs on an instance this script starts, bound to 127.0.0.1. Writes benchmarks/results/scaleout.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray on loopback (read when ray is imported)

import psutil  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import first_merge_of, write  # noqa: E402

from diloco import store as bs  # noqa: E402
from diloco.config import (AuthConfig, DataConfig, FragmentsConfig, InnerConfig, ModelConfig,  # noqa: E402
                           RunConfig, RuntimeConfig, SyncerConfig, TrainConfig, validate)
from diloco.data import load_corpus  # noqa: E402
from diloco.model import build  # noqa: E402
from diloco.runtime import build as build_setup  # noqa: E402
from diloco.runtime import procs, threads  # noqa: E402
from diloco.runtime.runlog import read_decisions, read_inputs  # noqa: E402

TINY = ModelConfig(name="tiny", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64)


def config(root: Path, kind: str, steps: int, learners: int) -> TrainConfig:
    """tests/test_procs.py's tiny model, H = 2 for many contributions, a syncer checkpoint every 4 merges."""
    return validate(TrainConfig(
        model=TINY, data=DataConfig(source="synthetic", seq_len=32, batch_size=8, data_dir=str(root / "data"),
                                    synthetic_vocab=16, synthetic_tokens=40_000, synthetic_branching=2),
        inner=InnerConfig(lr=1e-2, warmup_steps=3),
        run=RunConfig(steps=steps, log_every=2, eval_every=0, out_dir=str(root / "run"), progress=False, plot=False,
                      checkpoint_every=4),
        algo="diloco", fragments=FragmentsConfig(count=2, H=2, tau=1), syncer=SyncerConfig(quorum=1),
        runtime=RuntimeConfig(kind=kind, learners=learners, devices_per_learner=1, restart_s=0.0,
                              learner_checkpoint_every=4, auth=AuthConfig(mode="off"))))


class Sampler:
    """Peak RSS of every process below this one (spawned learners, Ray's workers), sampled."""

    def __init__(self, every: float = 0.2):
        self.peak: dict[int, int] = {}
        self.stop, self.every = threading.Event(), every
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        me = psutil.Process()
        while not self.stop.is_set():
            for p in [me, *me.children(recursive=True)]:
                try:
                    self.peak[p.pid] = max(self.peak.get(p.pid, 0), p.memory_info().rss)
                except psutil.Error:
                    pass
            self.stop.wait(self.every)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def learner_pids(store: bs.BlobStore, kind: str) -> dict[int, int]:
    """learner -> the pid of its current process (procs: the supervisor's record; ray: the actor's)."""
    record = bs.read_control(store, "procs") or {}
    if kind == "procs":
        return {int(m): v["pid"] for m, v in record.get("learners", {}).items() if v.get("pid")}
    import ray
    out = {}
    if not ray.is_initialized():  # before the run connects, or after it shut Ray down: asking would start one
        return out
    for m, v in record.get("learners", {}).items():
        try:
            out[int(m)] = ray.get(ray.get_actor(v["actor"], namespace="diloco").where.remote(), timeout=10)["pid"]
        except Exception:  # noqa: BLE001 - not placed yet, or restarting: sampled again later
            pass
    return out


def one(kind: str, steps: int, learners: int, kill: bool, setup_of) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"scaleout-{kind}-"))
    cfg = config(root, kind, steps, learners)
    setup = setup_of(cfg)
    run_dir = root / "run"
    run_dir.mkdir()
    store = bs.BlobStore(f"file://{run_dir}/store")
    seen: dict[int, set] = {}
    killed: dict = {}
    stop = threading.Event()

    def watch():  # who is a learner, and (kill) learner 1's death once it has trained a third
        while not stop.is_set():
            if kind != "threads":
                try:
                    for m, pid in learner_pids(store, kind).items():
                        seen.setdefault(m, set()).add(pid)
                except (ValueError, KeyError, TypeError):
                    pass
            if kill and not killed and (start := bs.read_control(store, "start")):
                rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] \
                    if (run_dir / "metrics.jsonl").exists() else []
                if any(r.get("kind") == "train" and r.get("learner") == 1 and r["step"] >= steps // 3 for r in rows):
                    killed["at"] = time.time() - start["t0"]
                    if kind == "procs":
                        os.kill(bs.read_control(store, "procs")["learners"]["1"]["pid"], signal.SIGKILL)
                    else:
                        import ray
                        name = bs.read_control(store, "procs")["learners"]["1"]["actor"]
                        ray.kill(ray.get_actor(name, namespace="diloco"), no_restart=False)
            stop.wait(0.1)

    run = {"threads": threads.run, "procs": procs.run, "ray": procs.run}.get(kind)  # ray: procs' launcher_for
    thread = threading.Thread(target=watch, daemon=True)
    t_call = time.time()
    with Sampler() as mem:
        thread.start()
        try:
            rt, summary = run(cfg, setup, run_dir, None)
        finally:
            stop.set()
            thread.join()
    wall = time.time() - t_call
    contributions = [e for e in read_inputs(run_dir / "syncer_inputs.bin") if e.kind == "contribution"]
    up = sum(len(e.data) for e in contributions)
    out = {"runtime": kind, "wall_s": wall, "clock_s": summary["clock_s"], "contributions": len(contributions),
           "contributions_per_s": len(contributions) / summary["clock_s"],
           "mb_up_per_s": up / 1e6 / summary["clock_s"], "merges": summary["merges"],
           "token_ledger_imbalance": summary["token_ledger_imbalance"]}
    start = bs.read_control(store, "start")
    if start is not None:  # the syncer's clock starts once every learner has compiled
        out["startup_s"] = start["t0"] - t_call
    if kind == "threads":
        out["rss_process_mb"] = max(mem.peak.values()) / 1e6
    else:
        pids = {pid for group in seen.values() for pid in group}
        out["rss_per_learner_mb"] = statistics.median(mem.peak[p] / 1e6 for p in pids if p in mem.peak)
    if kill:
        decisions = read_decisions(run_dir / "decisions.jsonl")
        inc = max(r["key"][1] for r in decisions if r["event"] == "arrival" and r["key"][0] == 1)
        out["death_to_merge_s"] = first_merge_of(decisions, 1, inc) - killed["at"]
        out["incarnation"] = inc
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--learners", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--runtimes", default="threads,procs,ray")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    built = {}

    def setup_of(cfg):  # one model and setup per runtime kind (the meshes differ: nothing else)
        if cfg.runtime.kind not in built:
            corpus = load_corpus(cfg.data)
            built[cfg.runtime.kind] = build_setup.build(cfg, corpus, build(cfg.model, corpus.vocab_size, seed=0))
        return built[cfg.runtime.kind]

    rows = []
    kinds = args.runtimes.split(",")
    for r in range(args.repeats):  # interleaved, so drift of the shared machine hits each runtime alike
        for kind in kinds:
            rows.append({"repeat": r, "kill": False, **one(kind, args.steps, args.learners, False, setup_of)})
            print(rows[-1], flush=True)
        for kind in [k for k in kinds if k != "threads"]:
            rows.append({"repeat": r, "kill": True, **one(kind, args.steps, args.learners, True, setup_of)})
            print(rows[-1], flush=True)
    result = {"steps": args.steps, "learners": args.learners, "rows": rows,
              "load_avg": os.getloadavg()}
    print("wrote", write("scaleout", result, args.out))


if __name__ == "__main__":
    main()
